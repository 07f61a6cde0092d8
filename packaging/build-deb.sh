#!/usr/bin/env bash
# Builds target/debian/zonewatch_<version>_<arch>.deb with dpkg-deb from the release binary.
# Usage: packaging/build-deb.sh [--no-build]
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${1:-}" = "--no-build" ] || cargo build --release --locked
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
ARCH=$(dpkg --print-architecture)
OUT=target/debian
ROOT=$(mktemp -d)
trap 'rm -rf "$ROOT"' EXIT
install -d "$ROOT/DEBIAN" "$ROOT/usr/bin" "$ROOT/etc/zonewatch" "$ROOT/lib/systemd/system" "$ROOT/usr/share/doc/zonewatch"
install -m 0755 target/release/zonewatch "$ROOT/usr/bin/zonewatch"
strip --strip-unneeded "$ROOT/usr/bin/zonewatch"
install -m 0644 packaging/zonewatch.toml "$ROOT/etc/zonewatch/zonewatch.toml"
install -m 0644 packaging/zonewatch.service "$ROOT/lib/systemd/system/zonewatch.service"
install -m 0644 packaging/debian/copyright "$ROOT/usr/share/doc/zonewatch/copyright"
install -m 0644 README.md "$ROOT/usr/share/doc/zonewatch/README.md"
printf 'zonewatch (%s) stable; urgency=medium\n\n  * Release %s.\n\n -- zonewatch maintainers <maintainers@zonewatch.invalid>  %s\n' \
  "$VERSION" "$VERSION" "$(date -R -u -d @"${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || date +%s)}")" \
  | gzip -9n > "$ROOT/usr/share/doc/zonewatch/changelog.gz"
for f in postinst prerm postrm; do install -m 0755 "packaging/debian/$f" "$ROOT/DEBIAN/$f"; done
sed -i '/#DEBHELPER#/d' "$ROOT/DEBIAN/postinst"
echo /etc/zonewatch/zonewatch.toml > "$ROOT/DEBIAN/conffiles"
SIZE=$(du -sk --exclude=DEBIAN "$ROOT" | cut -f1)
DEPENDS=$(dpkg-shlibdeps -O -e "$ROOT/usr/bin/zonewatch" 2>/dev/null | sed -n 's/^shlibs:Depends=//p' || true)
cat > "$ROOT/DEBIAN/control" <<CONTROL
Package: zonewatch
Version: $VERSION
Architecture: $ARCH
Maintainer: zonewatch maintainers <maintainers@zonewatch.invalid>
Installed-Size: $SIZE
Depends: ${DEPENDS:-libc6}, adduser
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
mkdir -p "$OUT"
DEB="$OUT/zonewatch_${VERSION}_${ARCH}.deb"
dpkg-deb --root-owner-group --build "$ROOT" "$DEB" >/dev/null
echo "$DEB"
