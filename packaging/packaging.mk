# Included by the top Makefile. `make package` builds the .deb and .rpm packages into dist/;
# `make package-lint` runs lintian and rpmlint on them (packaging/lint-packages.sh).
.PHONY: package package-lint

package: bpf venv
	packaging/build-packages.sh

package-lint: package
	packaging/lint-packages.sh
