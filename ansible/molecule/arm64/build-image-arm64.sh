#!/bin/bash
# Build the Debian bookworm arm64 VM image the arm64 molecule scenario boots under
# qemu-system-aarch64 (TCG: software emulation, several times slower than the x86 VM).
#
#   build-image-arm64.sh [CACHE_ROOT]      prints the image directory on stdout (last line)
#
# As ../image/build-image.sh for x86-64, with one difference: debootstrap's second stage and the
# configuration run arm64 programs. They run here under qemu-user (qemu-user-static), through a
# binfmt_misc handler registered in a private user namespace (Linux >= 6.7 gives each user
# namespace its own binfmt_misc): the host's kernel-wide handlers are left alone, and a
# container, which has none, can do it. (Running the second stage in the emulated machine
# instead took ~15 s a package: an hour for the image.) The namespace maps uids and gids
# 0-65535 to themselves, so the files keep their owners.
# Cached under CACHE_ROOT/<hash of this script>; each run boots a qcow2 overlay of base.raw.
# Needs root, Linux >= 6.7, debootstrap, e2fsprogs, qemu-user-static, qemu-system-arm, ssh-keygen.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cache_root=${1:-$(cd "$here/../../.." && pwd)/.cache/vm-image-arm64}
mirror=${BISTOURI_IMAGE_MIRROR:-http://deb.debian.org/debian}
suite=bookworm
binfmt=/usr/lib/binfmt.d/qemu-aarch64.conf # qemu-user-static's handler (flag F: opened at once)

# What the image holds: the agent's runtime dependencies baked in (converge does not depend
# on the mirror) and xz-utils for the frameless workload; no symbolizer service (the scenario
# records with `bistouri record`).
packages=(
    systemd-sysv udev dbus linux-image-arm64 openssh-server python3 python3-apt
    iproute2 procps kmod ca-certificates util-linux libcap2-bin xz-utils
    libbpf1 python3-msgpack python3-requests python3-yaml python3-prometheus-client
)

die() { echo "build-image-arm64: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (debootstrap and mkfs need it)"
for tool in debootstrap mkfs.ext4 unshare ssh-keygen sha256sum qemu-system-aarch64; do
    command -v "$tool" >/dev/null \
        || die "$tool not found: apt-get install debootstrap e2fsprogs qemu-user-static qemu-system-arm openssh-client"
done
[ -f "$binfmt" ] || die "$binfmt missing: apt-get install qemu-user-static"

# Run "$@" as root of a new user namespace (uids and gids 0-65535 mapped to themselves), with
# its own mount, pid and network namespaces and an aarch64 binfmt_misc handler of its own.
in_arm64_namespace() {
    local pid status=0
    (exec unshare --user --mount --pid --net --fork --propagation private -- /bin/sh -c '
        while [ -z "$(cat /proc/self/uid_map)" ]; do sleep 0.1; done
        mount -t proc proc /proc
        mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
        cat "$0" >/proc/sys/fs/binfmt_misc/register
        exec "$@"' "$binfmt" "$@") &
    pid=$!
    # Mapped once unshare has made the namespace (the process's user namespace is no longer ours).
    while [ "$(readlink "/proc/$pid/ns/user")" = "$(readlink /proc/self/ns/user)" ]; do sleep 0.05; done
    echo "0 0 65536" >"/proc/$pid/uid_map"
    echo "0 0 65536" >"/proc/$pid/gid_map"
    wait "$pid" || status=$?
    return $status
}

key=$( { cat "$0"; echo "$mirror $suite"; } | sha256sum | cut -c1-16)
out="$cache_root/$key"
if [ -f "$out/.complete" ]; then
    echo "build-image-arm64: cached image $out" >&2
    echo "$out"
    exit 0
fi

# Build into a temporary directory next to the final one, then rename: an interrupted build
# never leaves a half image that looks complete.
mkdir -p "$cache_root"
work=$(mktemp -d "$cache_root/.build-XXXXXX")
trap 'rm -rf "$work"' EXIT
rootfs="$work/rootfs"
[ -n "$work" ] && [ -d "$work" ] || die "no work directory"

echo "build-image-arm64: debootstrap --foreign --arch=arm64 $suite into $rootfs" >&2
include=$(IFS=,; echo "${packages[*]}")
debootstrap --foreign --arch=arm64 --variant=minbase --include="$include" "$suite" "$rootfs" "$mirror" \
    >"$work/debootstrap.log" 2>&1 || { tail -n 30 "$work/debootstrap.log" >&2; die "debootstrap failed"; }
# The initramfs holds only what this VM's root needs (virtio disk on the virt machine's PCI bus,
# ext4) and is made once, at the end: Debian's default (MODULES=most, made when the kernel is
# configured and again by initramfs-tools' trigger) copies hundreds of modules through
# qemu-user: most of the ~48 min the build took. The files are new, owned by no package (no conffile
# question); INITRD=No makes the kernel's postinst hook skip its run.
[ -d "$rootfs/etc" ] || die "no first-stage tree at $rootfs"
mkdir -p "$rootfs/etc/initramfs-tools/conf.d" "$rootfs/usr/share/initramfs-tools/modules.d"
echo 'MODULES=list' >"$rootfs/etc/initramfs-tools/conf.d/bistouri-vm"
printf '%s\n' virtio_pci virtio_mmio virtio_blk ext4 >"$rootfs/usr/share/initramfs-tools/modules.d/bistouri-vm"

echo "build-image-arm64: second stage under qemu-user" >&2
# container=lxc: no device node can be made in a user namespace; the first stage made them.
in_arm64_namespace env container=lxc INITRD=No chroot "$rootfs" /debootstrap/debootstrap --second-stage \
    >>"$work/debootstrap.log" 2>&1 \
    || { tail -n 30 "$work/debootstrap.log" >&2; die "debootstrap --second-stage failed"; }

echo "build-image-arm64: configuring the tree" >&2
echo bistouri-arm64 >"$rootfs/etc/hostname"
printf '127.0.0.1 localhost\n127.0.1.1 bistouri-arm64\n' >"$rootfs/etc/hosts"
echo '/dev/vda / ext4 rw,relatime 0 1' >"$rootfs/etc/fstab"
printf 'deb %s %s main\ndeb %s %s-updates main\ndeb http://deb.debian.org/debian-security %s-security main\n' \
    "$mirror" "$suite" "$mirror" "$suite" "$suite" >"$rootfs/etc/apt/sources.list"
# slirp user networking: fixed addresses, no DHCP wait.
mkdir -p "$rootfs/etc/systemd/network"
printf '[Match]\nName=eth0\n\n[Network]\nAddress=10.0.2.15/24\nGateway=10.0.2.2\nDNS=10.0.2.3\n' \
    >"$rootfs/etc/systemd/network/10-eth0.network"
echo 'nameserver 10.0.2.3' >"$rootfs/etc/resolv.conf"
ssh-keygen -q -t ed25519 -N '' -C bistouri-molecule -f "$work/id_ed25519"
install -d -m 0700 "$rootfs/root/.ssh"
install -m 0600 "$work/id_ed25519.pub" "$rootfs/root/.ssh/authorized_keys"
printf 'PermitRootLogin prohibit-password\nPasswordAuthentication no\nUseDNS no\n' \
    >"$rootfs/etc/ssh/sshd_config.d/molecule.conf"
# Faster boot under TCG: no getty on tty1, no timers that run apt or man-db. Host keys once:
# the image is a test fixture, not a template for real hosts.
in_arm64_namespace chroot "$rootfs" /bin/sh -c '
    systemctl enable systemd-networkd.service
    systemctl mask systemd-networkd-wait-online.service getty@tty1.service apt-daily.timer \
        apt-daily-upgrade.timer man-db.timer e2scrub_all.timer fstrim.timer
    ssh-keygen -A
    ls /boot/initrd.img-* >/dev/null 2>&1 || update-initramfs -c -k all' \
    >>"$work/debootstrap.log" 2>&1 || { tail -n 30 "$work/debootstrap.log" >&2; die "configuring the tree failed"; }

cp "$rootfs"/boot/vmlinuz-* "$work/vmlinuz"
cp "$rootfs"/boot/initrd.img-* "$work/initrd.img"
rm -rf "$rootfs"/var/cache/apt/archives/*.deb

echo "build-image-arm64: mkfs.ext4 -d (3 GiB sparse)" >&2
truncate -s 3G "$work/base.raw"
mkfs.ext4 -q -F -L root -d "$rootfs" "$work/base.raw"
ls "$rootfs"/boot/vmlinuz-* | sed 's|.*/vmlinuz-||' >"$work/kernel-release"
printf '%s\n' "${packages[@]}" >"$work/packages"
rm -rf "$rootfs"
touch "$work/.complete"

rm -rf "$out"
mv "$work" "$out"
trap - EXIT
echo "build-image-arm64: built $out" >&2
echo "$out"
