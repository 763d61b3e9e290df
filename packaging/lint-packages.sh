#!/bin/bash
# lintian and rpmlint on the packages in dist/ (of one version: the newest pyproject one).
# Fails on any error or warning that is not overridden (packaging/lintian/*, rpmlint.toml).
set -euo pipefail
DIST=${DIST:-dist}
version=${BISTOURI_VERSION:-$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml)}
debs=("$DIST"/bistouri*_"$version"-*.deb)
rpms=("$DIST"/bistouri*-"$version"-*.rpm)
[ -e "${debs[0]}" ] && [ -e "${rpms[0]}" ] || { echo "lint-packages: no packages for $version in $DIST: run 'make package'" >&2; exit 1; }
command -v lintian >/dev/null && command -v rpmlint >/dev/null \
    || { echo "lint-packages: lintian or rpmlint missing: apt-get install lintian rpmlint" >&2; exit 1; }
status=0
echo "== lintian ${debs[*]}"
# --fail-on warning: warnings fail the build too; info (I:) tags only inform.
lintian --fail-on error,warning --suppress-tags package-contains-documentation-outside-usr-share-doc \
    "${debs[@]}" || status=1
echo "== rpmlint ${rpms[*]}"
rpmlint -c packaging/rpmlint.toml "${rpms[@]}" || status=1
# rpmlint exits 0 on warnings: make them fail as well.
if rpmlint -c packaging/rpmlint.toml "${rpms[@]}" 2>&1 | grep -E '^[^ ]+: [EW]: '; then status=1; fi
exit $status
