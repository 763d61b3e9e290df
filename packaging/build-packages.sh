#!/bin/bash
# Build the bistouri, bistouri-agent and bistouri-symbolizer packages (.deb and .rpm) into
# dist/ with nfpm. Called by `make package`; run from the top of the work tree.
#
# Environment: NFPM (default .venv/bin/nfpm), PYTHON (default .venv/bin/python),
# BISTOURI_VERSION (default: pyproject.toml), BISTOURI_RELEASE (default 1),
# DIST (default dist), BISTOURI_ARCH (amd64 by default, or arm64: `make package-arm64`). The version can be overridden to build an "older" package for the
# upgrade scenario.
set -euo pipefail

NFPM=${NFPM:-.venv/bin/nfpm}
PYTHON=${PYTHON:-.venv/bin/python}
DIST=${DIST:-dist}
stage=build/package
# The bistouri package holds the BPF object of its architecture only (bistouri/bpf/loader.py
# object_name); bistouri-agent and bistouri-symbolizer are "all".
export BISTOURI_ARCH=${BISTOURI_ARCH:-amd64}
case $BISTOURI_ARCH in
    amd64) bpf_name=bistouri.bpf.o ;;
    arm64) bpf_name=bistouri.arm64.bpf.o ;;
    *) echo "build-packages: BISTOURI_ARCH=$BISTOURI_ARCH: amd64 or arm64" >&2; exit 1 ;;
esac
bpf_obj=bistouri/bpf/_bpfobj/$bpf_name

# The private libbpf of the .deb (/usr/lib/bistouri/libbpf/, bistouri/bpf/_libbpf.py): Debian
# 12's own libbpf1 1.1.2, unchanged, for the hosts whose system has no libbpf >= 1.0 (Debian 11
# has libbpf0 0.3). Its symbols need GLIBC <= 2.28 (objdump -T), Debian 11 has 2.31. Taken from
# the archive's .deb, pinned by checksum; a bump is a new version and two new sums.
libbpf_deb=libbpf1_1.1.2-0+deb12u1_$BISTOURI_ARCH.deb
libbpf_url=${BISTOURI_LIBBPF_MIRROR:-http://deb.debian.org/debian}/pool/main/libb/libbpf/$libbpf_deb
case $BISTOURI_ARCH in
    amd64) libbpf_sha256=5e7505ef77ebc84ad0203411e4afdeb8a98f40fb7f78f013aa4dd8710e49f8ed ;;
    arm64) libbpf_sha256=c9929839798e7d8e66b212f345ecf1653ba7f1a9e1b753d0eb67bd521b0b5511 ;;
esac

die() { echo "build-packages: $*" >&2; exit 1; }

[ -f pyproject.toml ] && [ -d packaging/nfpm ] || die "run from the top of the bistouri work tree"
[ -x "$NFPM" ] || die "nfpm not found at $NFPM: run 'make venv' (requirements/dev.txt pins nfpm)"
[ -f "$bpf_obj" ] || die "$bpf_obj is missing: run 'make bpf' first (needs clang)"

version=${BISTOURI_VERSION:-$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml)}
[ -n "$version" ] || die "cannot read the version from pyproject.toml"
export BISTOURI_VERSION=$version BISTOURI_RELEASE=${BISTOURI_RELEASE:-1}

rm -rf "$stage"
mkdir -p "$stage/scripts" "$DIST"

# The Python package into a private prefix, without dependencies (Debian provides them)
# and without byte code (postinst compiles it on the target's Python).
"$PYTHON" -m pip install --quiet --no-deps --no-compile --no-build-isolation --no-warn-script-location \
    --target "$stage/python" . >"$stage/pip.log" 2>&1 || { cat "$stage/pip.log" >&2; die "pip install --target failed"; }
rm -rf "$stage/python/bin"
find "$stage/python" -name __pycache__ -type d -prune -exec rm -rf {} +
# dist-info/RECORD and INSTALLER/direct_url.json describe a pip install; dpkg/rpm own these files.
rm -f "$stage"/python/*.dist-info/{RECORD,INSTALLER,REQUESTED,direct_url.json}
[ -f "$stage/python/bistouri/bpf/_bpfobj/$bpf_name" ] \
    || die "the BPF object did not land in the package (pyproject.toml package-data)"
find "$stage/python/bistouri/bpf/_bpfobj" -name '*.o' ! -name "$bpf_name" -delete  # the other architectures'

gzip -9n <packaging/doc/bistouri.1 >"$stage/bistouri.1.gz"

# Downloaded once into .cache/ (kept across builds), checked on every build.
libbpf_cache=.cache/libbpf/$libbpf_deb
if [ ! -f "$libbpf_cache" ]; then
    mkdir -p "$(dirname "$libbpf_cache")"
    curl -fsSL -o "$libbpf_cache.part" "$libbpf_url" || die "cannot download $libbpf_url"
    mv "$libbpf_cache.part" "$libbpf_cache"
fi
echo "$libbpf_sha256  $libbpf_cache" | sha256sum -c --quiet - \
    || { rm -f "$libbpf_cache"; die "$libbpf_deb does not match its pinned sha256 (removed: rerun to download again)"; }
mkdir -p "$stage/libbpf-deb" "$stage/libbpf"
dpkg-deb -x "$libbpf_cache" "$stage/libbpf-deb"
cp "$stage"/libbpf-deb/usr/lib/*-linux-gnu/libbpf.so.1.1.2 "$stage/libbpf/libbpf.so.1"
cp "$stage/libbpf-deb/usr/share/doc/libbpf1/copyright" "$stage/libbpf/copyright"

if [ -f bistouri/data/trigger.example.yaml ]; then
    cp bistouri/data/trigger.example.yaml "$stage/trigger.yaml"
else
    echo "build-packages: WARNING bistouri/data/trigger.example.yaml missing, shipping packaging/trigger.placeholder.yaml" >&2
    cp packaging/trigger.placeholder.yaml "$stage/trigger.yaml"
fi

# One set of maintainer-script templates for both services.
render() {  # render PKG USER HOME STATE
    local pkg=$1 user=$2 home=$3 state=$4 hook
    for hook in postinst prerm postrm; do
        sed -e "s|@PKG@|$pkg|g" -e "s|@USER@|$user|g" -e "s|@HOME@|$home|g" -e "s|@STATE@|$state|g" \
            "packaging/scripts/service.$hook.in" >"$stage/scripts/$pkg.$hook"
    done
}
render bistouri-agent bistouri /var/lib/bistouri /var/lib/bistouri
render bistouri-symbolizer bistouri-symbolizer /var/lib/bistouri-symbolizer \
    "/var/lib/bistouri-symbolizer /var/cache/bistouri-symbolizer"

# The changelog (chglog format) carries the version-release being built.
sed "s/@VERSION@/$version-$BISTOURI_RELEASE/" packaging/changelog.yaml >"$stage/changelog.yaml"

for pkg in bistouri bistouri-agent bistouri-symbolizer; do
    for fmt in deb rpm; do
        "$NFPM" package --config "packaging/nfpm/$pkg.yaml" --packager "$fmt" --target "$DIST/" >"$stage/nfpm-$pkg-$fmt.log" 2>&1 \
            || { cat "$stage/nfpm-$pkg-$fmt.log" >&2; die "nfpm failed for $pkg ($fmt)"; }
    done
done
ls -1 "$DIST"/bistouri*"$version"* >&2
