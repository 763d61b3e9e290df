# Included by the top Makefile.
#   make ansible-lint     lint the roles, playbooks and scenarios
#   make molecule         the default scenario (one qemu TCG VM, ~10 min on 2 busy cores)
#   make molecule-all     default, preflight, upgrade, kernel-5.10 and kernel-6.12, one after the
#                         other (never two VMs at once)
#   make molecule-arm64   the arm64 scenario alone: qemu-system-aarch64 (TCG), the arm64 packages; its
#                         image by ansible/molecule/arm64/build-image-arm64.sh (debootstrap's second stage
#                         under qemu-user in a private user namespace), cached under .cache/vm-image-arm64
# The VM image is built once by ansible/molecule/image/build-image.sh and cached under
# .cache/vm-image/<hash of the script>; kernel-5.10 boots its Debian 11 twin (BISTOURI_IMAGE_SUITE=bullseye)
# and kernel-6.12 its variant with a 6.12 kernel added (build-kernels-image.sh); run-scenario.sh builds
# either when needed.
MOLECULE_SCENARIOS ?= default preflight upgrade kernel-5.10 kernel-6.12

.PHONY: ansible-lint molecule molecule-all molecule-image molecule-arm64

ansible-lint: venv
	cd ansible && ../$(VENV)/bin/ansible-lint

molecule-image: | deps
	ansible/molecule/image/build-image.sh >/dev/null

molecule: package molecule-image
	ansible/molecule/run-scenario.sh default

molecule-all: package molecule-image
	set -e; for s in $(MOLECULE_SCENARIOS); do ansible/molecule/run-scenario.sh $$s; done

# run-scenario.sh with the arm64 image (it checks that the amd64 packages exist: `package` builds them).
molecule-arm64: package package-arm64 | deps
	BISTOURI_VM_IMAGE=$$(ansible/molecule/arm64/build-image-arm64.sh) ansible/molecule/run-scenario.sh arm64
