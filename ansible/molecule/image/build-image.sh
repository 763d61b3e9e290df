#!/bin/bash
# Build the Debian VM image the molecule scenarios boot under qemu TCG.
#
#   build-image.sh [CACHE_ROOT]      prints the image directory on stdout (last line)
#
# BISTOURI_IMAGE_SUITE picks the release: bookworm (Debian 12, the default: kernel 6.1) or
# bullseye (Debian 11, its own userspace and its 5.10 kernel: the kernel-5.10 scenario).
#
# The image is a debootstrap of Debian's own packages (kernel included), turned into
# a raw ext4 file system without partitions so qemu can boot the kernel directly
# (-kernel/-initrd, "psi=1" on the command line). It is cached under
# CACHE_ROOT/<hash>/ where the hash covers this script: change the package list or
# the configuration below and a new image is built. Each run boots a throwaway
# qcow2 overlay on top of base.raw, so the cached image is never modified.
#
# Needs root, debootstrap, e2fsprogs (mkfs.ext4 -d) and ssh-keygen. About 2-4 min.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cache_root=${1:-$(cd "$here/../../.." && pwd)/.cache/vm-image}
mirror=${BISTOURI_IMAGE_MIRROR:-http://deb.debian.org/debian}
suite=${BISTOURI_IMAGE_SUITE:-bookworm}

die() { echo "build-image: $*" >&2; exit 1; }

# What the image holds. Runtime dependencies of the bistouri packages are baked in
# so converge does not depend on the mirror; apt still checks them when it
# installs the .deb. llvm-19 is left out (optional, ~250 MB): names still resolve.
packages=(
    systemd-sysv udev dbus linux-image-amd64 openssh-server python3 python3-apt
    iproute2 procps kmod less ca-certificates libcap2-bin util-linux
    libelf1 zlib1g python3-msgpack python3-requests python3-yaml python3-prometheus-client
    gunicorn python3-werkzeug
)
case "$suite" in
    bookworm) packages+=(libbpf1 python3-psycopg) ;;
    # No libbpf1 (the package's private copy serves) nor psycopg 3 in Debian 11.
    # xz-utils: Debian's xz (frameless, stripped) is what verify-kernel.yml records.
    bullseye) packages+=(xz-utils) ;;
    *) die "BISTOURI_IMAGE_SUITE=$suite: bookworm or bullseye" ;;
esac

[ "$(id -u)" = 0 ] || die "must run as root (debootstrap and mkfs need it)"
for tool in debootstrap mkfs.ext4 ssh-keygen sha256sum; do
    command -v "$tool" >/dev/null || die "$tool not found: apt-get install debootstrap e2fsprogs openssh-client"
done

key=$( { cat "$0"; echo "$mirror $suite"; } | sha256sum | cut -c1-16)
out="$cache_root/$key"
if [ -f "$out/.complete" ]; then
    echo "build-image: cached image $out" >&2
    echo "$out"
    exit 0
fi

# Build into a temporary directory next to the final one, then rename: an interrupted
# build never leaves a half image that looks complete.
mkdir -p "$cache_root"
work=$(mktemp -d "$cache_root/.build-XXXXXX")
trap 'rm -rf "$work"' EXIT
rootfs="$work/rootfs"

echo "build-image: debootstrap $suite from $mirror into $rootfs" >&2
include=$(IFS=,; echo "${packages[*]}")
debootstrap --variant=minbase --include="$include" "$suite" "$rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 \
    || { tail -n 30 "$work/debootstrap.log" >&2; die "debootstrap failed (full log above)"; }

echo "build-image: configuring the tree" >&2
echo bistouri-vm >"$rootfs/etc/hostname"
printf '127.0.0.1 localhost\n127.0.1.1 bistouri-vm\n' >"$rootfs/etc/hosts"
echo '/dev/vda / ext4 rw,relatime 0 1' >"$rootfs/etc/fstab"
cat >"$rootfs/etc/apt/sources.list" <<EOF
deb $mirror $suite main
deb $mirror $suite-updates main
deb http://deb.debian.org/debian-security $suite-security main
EOF
# slirp user networking: fixed addresses, no DHCP wait.
mkdir -p "$rootfs/etc/systemd/network"
cat >"$rootfs/etc/systemd/network/10-eth0.network" <<'EOF'
[Match]
Name=eth0

[Network]
Address=10.0.2.15/24
Gateway=10.0.2.2
DNS=10.0.2.3
EOF
chroot "$rootfs" systemctl enable systemd-networkd.service >/dev/null 2>&1
chroot "$rootfs" systemctl mask systemd-networkd-wait-online.service >/dev/null 2>&1
echo 'nameserver 10.0.2.3' >"$rootfs/etc/resolv.conf"
# Faster boot under TCG: no getty on tty1, no timers that run apt or man-db.
chroot "$rootfs" systemctl mask getty@tty1.service apt-daily.timer apt-daily-upgrade.timer \
    man-db.timer e2scrub_all.timer fstrim.timer >/dev/null 2>&1 || true

ssh-keygen -q -t ed25519 -N '' -C bistouri-molecule -f "$work/id_ed25519"
install -d -m 0700 "$rootfs/root/.ssh"
install -m 0600 "$work/id_ed25519.pub" "$rootfs/root/.ssh/authorized_keys"
cat >"$rootfs/etc/ssh/sshd_config.d/molecule.conf" <<'EOF'
PermitRootLogin prohibit-password
PasswordAuthentication no
UseDNS no
EOF
# Host keys are generated once here; the image is a test fixture, not a template for real hosts.
chroot "$rootfs" ssh-keygen -A >/dev/null

cp "$rootfs"/boot/vmlinuz-* "$work/vmlinuz"
cp "$rootfs"/boot/initrd.img-* "$work/initrd.img"
rm -rf "$rootfs"/var/cache/apt/archives/*.deb

echo "build-image: mkfs.ext4 -d (3 GiB sparse)" >&2
truncate -s 3G "$work/base.raw"
mkfs.ext4 -q -F -L root -d "$rootfs" "$work/base.raw"
# Keep the tree too: tests/deploy boots it with systemd-nspawn for the rpm checks.
ls "$rootfs"/boot/vmlinuz-* | sed 's|.*/vmlinuz-||' >"$work/kernel-release"
printf '%s\n' "${packages[@]}" >"$work/packages"
touch "$work/.complete"

rm -rf "$out"
mv "$work" "$out"
trap - EXIT
echo "build-image: built $out" >&2
echo "$out"
