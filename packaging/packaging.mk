# Included by the top Makefile. `make package` builds the .deb and .rpm packages into dist/;
# `make package-lint` runs lintian and rpmlint on them (packaging/lint-packages.sh).
# x86-64 (amd64) by default; `make package-arm64` builds the arm64 ones beside them (the
# bistouri package holds the arm64 BPF object; the service packages are the same "all" ones).
.PHONY: package package-arm64 package-lint package-lint-arm64

package: bpf venv
	packaging/build-packages.sh

package-arm64: bpf venv
	BISTOURI_ARCH=arm64 packaging/build-packages.sh

package-lint: package
	packaging/lint-packages.sh

package-lint-arm64: package-arm64
	packaging/lint-packages.sh
