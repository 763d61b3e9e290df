#!/bin/bash
# Run one molecule scenario against the cached VM image and the packages in dist/.
#   ansible/molecule/run-scenario.sh SCENARIO [molecule test options]
# Sets what the scenario playbooks read (BISTOURI_VM_IMAGE, BISTOURI_DIST, ...), keeps
# molecule's and ansible's state inside the work tree, and kills the VM by its pidfile
# whatever happens.
set -euo pipefail
scenario=${1:?usage: run-scenario.sh SCENARIO}
shift
top=$(cd "$(dirname "$0")/../.." && pwd)
cd "$top"

case "$scenario" in
    # Debian 11 whole: its userspace and its own 5.10 kernel (build-image.sh's bullseye image).
    kernel-5.10) BISTOURI_VM_IMAGE=${BISTOURI_VM_BULLSEYE_IMAGE:-$(BISTOURI_IMAGE_SUITE=bullseye ansible/molecule/image/build-image.sh)} ;;
    *) BISTOURI_VM_IMAGE=${BISTOURI_VM_IMAGE:-$(ansible/molecule/image/build-image.sh)} ;;
esac
case "$scenario" in
    # A 6.12 kernel beside the base image's tree (build-kernels-image.sh).
    kernel-6.12) BISTOURI_VM_IMAGE=${BISTOURI_VM_KERNELS_IMAGE:-$(ansible/molecule/image/build-kernels-image.sh "$BISTOURI_VM_IMAGE")} ;;
esac
export BISTOURI_VM_IMAGE
export BISTOURI_DIST=${BISTOURI_DIST:-$top/dist}
export BISTOURI_PKG_VERSION=${BISTOURI_PKG_VERSION:-$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml)-1}
export BISTOURI_VM_RUN_DIR=$top/.cache/molecule-run/$scenario
export MOLECULE_EPHEMERAL_DIRECTORY=$top/.cache/molecule/$scenario
export ANSIBLE_HOME=$top/.cache/ansible-home
export ANSIBLE_LOCAL_TEMP=$top/.cache/ansible-home/tmp
export NO_COLOR=1 ANSIBLE_NOCOLOR=1 PY_COLORS=0 ANSIBLE_FORCE_COLOR=0
export PATH=$top/.venv/bin:$PATH
[ -f "$BISTOURI_DIST/bistouri_${BISTOURI_PKG_VERSION}_amd64.deb" ] \
    || { echo "run-scenario: $BISTOURI_DIST/bistouri_${BISTOURI_PKG_VERSION}_amd64.deb missing: run 'make package'" >&2; exit 1; }

if [ "$scenario" = upgrade ]; then
    # The "previous version": this tree packaged under an older version number, so the
    # scenario exercises dpkg's upgrade path (conffiles, prerm upgrade, postinst configure OLD).
    export BISTOURI_PREV_VERSION=${BISTOURI_PREV_VERSION:-0.0.9-1}
    export BISTOURI_DIST_PREV=${BISTOURI_DIST_PREV:-$top/.cache/dist-prev}
    if [ ! -f "$BISTOURI_DIST_PREV/bistouri_${BISTOURI_PREV_VERSION}_amd64.deb" ]; then
        BISTOURI_VERSION=${BISTOURI_PREV_VERSION%-*} BISTOURI_RELEASE=${BISTOURI_PREV_VERSION##*-} \
            DIST=$BISTOURI_DIST_PREV packaging/build-packages.sh
    fi
fi

cleanup() {
    # molecule destroys on failure too; this is the last line of defence against a stray qemu.
    local p pid
    for p in "$BISTOURI_VM_RUN_DIR"/*/qemu.pid; do
        [ -f "$p" ] || continue
        pid=$(cat "$p")
        if grep -q qemu-system "/proc/$pid/cmdline" 2>/dev/null; then
            echo "run-scenario: killing leftover qemu $pid" >&2
            kill "$pid" 2>/dev/null || true
        fi
    done
}
trap cleanup EXIT

start=$(date +%s)
cd ansible
status=0
molecule test -s "$scenario" "$@" || status=$?
echo "run-scenario: $scenario finished with status $status in $(( $(date +%s) - start )) s" >&2
exit $status
