#!/usr/bin/env bash
# Builds target/debian/zonewatch_<version>_<arch>.deb with dpkg-deb from the release binary.
# Usage: packaging/build-deb.sh [--no-build]
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${1:-}" = "--no-build" ] || cargo build --release --locked
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
ARCH=$(dpkg --print-architecture)
OUT=target/debian
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# The tree is built where dpkg-shlibdeps expects a package's files: debian/<package>.
ROOT="$WORK/src/debian/zonewatch"
# The package's own root entry ("./" in data.tar): 0755, not mktemp's 0700.
install -d -m 0755 "$WORK/src/debian" "$ROOT"
# Changelog date and file times: SOURCE_DATE_EPOCH, else the last commit's time, else the
# mtime of Cargo.toml (a source tarball without .git keeps it), never "now": the same
# source builds the same package.
if [ -z "${SOURCE_DATE_EPOCH:-}" ]; then
  SOURCE_DATE_EPOCH=$(git log -1 --format=%ct 2>/dev/null || true)
  [ -n "$SOURCE_DATE_EPOCH" ] || SOURCE_DATE_EPOCH=$(stat -c %Y Cargo.toml)
fi
export SOURCE_DATE_EPOCH
install -d "$ROOT/DEBIAN" "$ROOT/usr/bin" "$ROOT/etc/zonewatch" "$ROOT/lib/systemd/system" "$ROOT/usr/share/doc/zonewatch"
install -m 0755 target/release/zonewatch "$ROOT/usr/bin/zonewatch"
strip --strip-unneeded "$ROOT/usr/bin/zonewatch"
# 0640: operators put subscriber secrets in it; postinst gives it group zonewatch (the
# service's group) so the daemon can read it.
install -m 0640 packaging/zonewatch.toml "$ROOT/etc/zonewatch/zonewatch.toml"
install -m 0644 packaging/zonewatch.service "$ROOT/lib/systemd/system/zonewatch.service"
install -m 0644 packaging/debian/copyright "$ROOT/usr/share/doc/zonewatch/copyright"
install -m 0644 README.md "$ROOT/usr/share/doc/zonewatch/README.md"
# What the README links to, at the same relative paths (a package user had broken links).
install -d "$ROOT/usr/share/doc/zonewatch/docs" "$ROOT/usr/share/doc/zonewatch/fixtures"
install -m 0644 docs/ARCHITECTURE.md docs/CHANGES.md docs/PERFORMANCE.md "$ROOT/usr/share/doc/zonewatch/docs/"
install -m 0644 fixtures/README.md "$ROOT/usr/share/doc/zonewatch/fixtures/README.md"
printf 'zonewatch (%s) stable; urgency=medium\n\n  * Release %s.\n\n -- zonewatch maintainers <maintainers@zonewatch.invalid>  %s\n' \
  "$VERSION" "$VERSION" "$(date -R -u -d @"$SOURCE_DATE_EPOCH")" \
  | gzip -9n > "$ROOT/usr/share/doc/zonewatch/changelog.gz"
for f in postinst prerm postrm; do install -m 0755 "packaging/debian/$f" "$ROOT/DEBIAN/$f"; done
sed -i '/#DEBHELPER#/d' "$ROOT/DEBIAN/postinst"
echo /etc/zonewatch/zonewatch.toml > "$ROOT/DEBIAN/conffiles"
SIZE=$(du -sk --exclude=DEBIAN "$ROOT" | cut -f1)
# dpkg-shlibdeps needs a debian/control in its working directory: a minimal one in a
# scratch folder. No fallback: a package without its libraries' versions must not be built.
printf 'Source: zonewatch\n\nPackage: zonewatch\nArchitecture: any\n' > "$WORK/src/debian/control"
if ! SHLIBS=$(cd "$WORK/src" && dpkg-shlibdeps -O -edebian/zonewatch/usr/bin/zonewatch); then
  echo "build-deb: dpkg-shlibdeps failed: cannot compute the package's library dependencies" >&2
  exit 1
fi
DEPENDS=$(printf '%s\n' "$SHLIBS" | sed -n 's/^shlibs:Depends=//p')
if [ -z "$DEPENDS" ]; then
  echo "build-deb: dpkg-shlibdeps gave no shlibs:Depends (output: $SHLIBS)" >&2
  exit 1
fi
cat > "$ROOT/DEBIAN/control" <<CONTROL
Package: zonewatch
Version: $VERSION
Architecture: $ARCH
Maintainer: zonewatch maintainers <maintainers@zonewatch.invalid>
Installed-Size: $SIZE
Depends: $DEPENDS, adduser
Section: net
Priority: optional
Homepage: https://example.invalid/zonewatch
Description: municipal zoning change alerts, exactly once
 zonewatch watches county and city zoning and parcel layers, detects real
 zoning changes parcel by parcel and sends signed webhooks to the
 subscribers whose areas they touch, once. Everything it remembers lives in
 one redb file; an HTTP control port on localhost lets an operator see and
 steer it.
CONTROL
# md5sums for `dpkg --verify` (conffiles left out: dpkg keeps their hashes itself).
(cd "$ROOT" && find . -path ./DEBIAN -prune -o -type f -print | sed 's|^\./||' \
  | grep -vxF -f <(sed 's|^/||' DEBIAN/conffiles) | LC_ALL=C sort | xargs -r md5sum) > "$ROOT/DEBIAN/md5sums"
chmod 0644 "$ROOT/DEBIAN/md5sums"
mkdir -p "$OUT"
DEB="$OUT/zonewatch_${VERSION}_${ARCH}.deb"
dpkg-deb --root-owner-group --build "$ROOT" "$DEB" >/dev/null
echo "$DEB"
