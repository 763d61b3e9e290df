#!/bin/bash
# Build the variant of the VM image that also holds a 6.12 kernel, for the kernel-6.12 molecule
# scenario (make molecule-all). kernel-5.10 boots Debian 11 whole instead (build-image.sh with
# BISTOURI_IMAGE_SUITE=bullseye).
#
#   build-kernels-image.sh [BASE_IMAGE_DIR]    prints the variant's directory on stdout (last line)
#
# Userspace stays Debian 12's; only the kernel is added:
#   6.12  linux-image-6.12.*+deb12-amd64 of bookworm-backports
# installed into a copy of the base image's tree (modules in /lib/modules, an initrd from
# bookworm's initramfs-tools) and booted with -kernel/-initrd like the base one:
# vmlinuz-6.12/initrd.img-6.12 sit beside vmlinuz/initrd.img (6.1). A separate image so
# `make test`'s default scenario does not pay for another kernel. Cached under
# CACHE_ROOT/<base key>-kernels-<hash of this script>.
#
# Needs root and e2fsprogs; the base image (build-image.sh) is built first if missing. ~3 min.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
base=$(cd "${1:-$("$here/build-image.sh")}" && pwd)
mirror=${BISTOURI_IMAGE_MIRROR:-http://deb.debian.org/debian}

die() { echo "build-kernels-image: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (chroot and mkfs need it)"
[ -f "$base/.complete" ] && [ -d "$base/rootfs" ] || die "$base is not a built base image (with its rootfs)"

key=$( { cat "$0"; echo "$mirror"; } | sha256sum | cut -c1-16)
out="$(dirname "$base")/$(basename "$base")-kernels-$key"
if [ -f "$out/.complete" ]; then
    echo "build-kernels-image: cached image $out" >&2
    echo "$out"
    exit 0
fi

work=$(mktemp -d "$(dirname "$base")/.build-kernels-XXXXXX")
rootfs="$work/rootfs"
cleanup() {
    umount "$rootfs/proc" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

echo "build-kernels-image: copying the base tree" >&2
cp -a "$base/rootfs" "$rootfs"
cp "$base/id_ed25519" "$base/id_ed25519.pub" "$base/vmlinuz" "$base/initrd.img" "$base/kernel-release" "$work/"

# The suite is added for this install only; the image keeps bookworm's sources.
sources="$rootfs/etc/apt/sources.list.d/kernels.list"
cat >"$sources" <<EOF
deb $mirror bookworm-backports main
EOF
mount -t proc proc "$rootfs/proc"
in_root() { chroot "$rootfs" env DEBIAN_FRONTEND=noninteractive LC_ALL=C "$@"; }
in_root apt-get -q update >"$work/apt.log" 2>&1 || { tail -n 20 "$work/apt.log" >&2; die "apt-get update failed"; }

# The suite's linux-image-amd64 names its current kernel: install that one, not the
# meta package (which would replace bookworm's 6.1 as the default kernel).
kernel_of() {
    in_root apt-cache show "linux-image-amd64/$1" \
        | sed -n 's/^Depends: .*\(linux-image-[0-9][^ ,]*-amd64\).*/\1/p' | head -n 1
}
k612=$(kernel_of bookworm-backports)
case "$k612" in linux-image-6.12.*) ;; *) die "no 6.12 kernel in bookworm-backports: '$k612'" ;; esac
echo "build-kernels-image: installing $k612 and xz-utils" >&2
# xz-utils: Debian's xz (frameless, stripped) is what verify-kernel.yml records.
in_root apt-get -q install -y --no-install-recommends "$k612" xz-utils >>"$work/apt.log" 2>&1 \
    || { tail -n 30 "$work/apt.log" >&2; die "kernel install failed (log above)"; }
umount "$rootfs/proc"
rm -f "$sources"
in_root apt-get -q update >/dev/null 2>&1 || true

for label in 6.12; do
    release=$(cd "$rootfs/boot" && ls vmlinuz-"$label".* | sed 's/^vmlinuz-//')
    # The agent needs the kernel's BTF: a kernel without it is not a kernel these scenarios test.
    grep -q '^CONFIG_DEBUG_INFO_BTF=y' "$rootfs/boot/config-$release" || die "$release has no CONFIG_DEBUG_INFO_BTF"
    cp "$rootfs/boot/vmlinuz-$release" "$work/vmlinuz-$label"
    cp "$rootfs/boot/initrd.img-$release" "$work/initrd.img-$label"
    echo "$release" >"$work/kernel-release-$label"
done
rm -rf "$rootfs"/var/cache/apt/archives/*.deb

echo "build-kernels-image: mkfs.ext4 -d (3 GiB sparse)" >&2
truncate -s 3G "$work/base.raw"
mkfs.ext4 -q -F -L root -d "$rootfs" "$work/base.raw"
rm -rf "$rootfs"
touch "$work/.complete"

rm -rf "$out"
mv "$work" "$out"
trap - EXIT
echo "build-kernels-image: built $out" >&2
echo "$out"
