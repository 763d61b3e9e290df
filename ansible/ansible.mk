# Included by the top Makefile.
#   make ansible-lint     lint the roles, playbooks and scenarios
#   make molecule         the default scenario (one qemu TCG VM, ~10 min on 2 busy cores)
#   make molecule-all     default, preflight, upgrade, kernel-5.10 and kernel-6.12, one after the
#                         other (never two VMs at once)
# The VM image is built once by ansible/molecule/image/build-image.sh and cached under
# .cache/vm-image/<hash of the script>; the kernel-* scenarios boot its variant with Debian 11's
# 5.10 and a 6.12 kernel added (build-kernels-image.sh, built by run-scenario.sh when needed).
MOLECULE_SCENARIOS ?= default preflight upgrade kernel-5.10 kernel-6.12

.PHONY: ansible-lint molecule molecule-all molecule-image

ansible-lint: venv
	cd ansible && ../$(VENV)/bin/ansible-lint

molecule-image: | deps
	ansible/molecule/image/build-image.sh >/dev/null

molecule: package molecule-image
	ansible/molecule/run-scenario.sh default

molecule-all: package molecule-image
	set -e; for s in $(MOLECULE_SCENARIOS); do ansible/molecule/run-scenario.sh $$s; done
