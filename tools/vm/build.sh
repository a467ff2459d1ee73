#!/usr/bin/env bash
# Build (or reuse) the SoftRoCE guest: a Debian kernel and a small initramfs holding
# busybox-static, the kernel modules of tools/vm/modules.txt and tools/vm/init.
#
# Everything comes from Debian packages: the kernel version is resolved through
# `apt-cache depends linux-image-amd64` at build time, its .deb is fetched with
# `apt-get download` and unpacked with `dpkg -x` (never installed).
# Artefacts live under .cache/vm/ (gitignored):
#   debs/linux-image-VERSION_*.deb    the downloaded kernel package, kept for rebuilds
#   VERSION-KEY/{vmlinuz,initrd.gz}   one build; KEY hashes init, modules.txt and this file
# A build is reused while the resolved kernel version and KEY are unchanged.
#
# Usage: tools/vm/build.sh     prints the build directory on stdout; progress on stderr.
set -euo pipefail

VM_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$VM_DIR/../.." && pwd)
CACHE=${DUALPATH_VM_CACHE:-$ROOT/.cache/vm}
say() { echo "vm-build: $*" >&2; }
die() { echo "vm-build: ERROR: $*" >&2; exit 1; }

for tool in apt-cache apt-get dpkg depmod gzip sha256sum flock; do
  command -v "$tool" >/dev/null ||
    die "'$tool' not found; run tools/install-system-packages.sh (needs kmod, busybox-static)"
done
BUSYBOX=/bin/busybox   # from busybox-static: the initramfs has no libc to link against
[ -x "$BUSYBOX" ] || die "$BUSYBOX missing; install the Debian package busybox-static"

mkdir -p "$CACHE/debs"
exec 9>"$CACHE/.build.lock"
flock 9   # one builder at a time; concurrent run.sh calls wait here, then reuse the build

# The package linux-image-amd64 depends on exactly one versioned kernel image.
resolve_kernel() {
  apt-cache depends linux-image-amd64 2>/dev/null |
    sed -n 's/^ *Depends: linux-image-\([0-9][^ ]*-amd64\)$/\1/p' | head -1
}
KVER=$(resolve_kernel || true)
if [ -z "$KVER" ]; then
  say "apt-cache knows no linux-image-amd64; running apt-get update"
  apt-get update -q >&2 || die "apt-get update failed"
  KVER=$(resolve_kernel || true)
  [ -n "$KVER" ] || die "apt-cache depends linux-image-amd64 names no linux-image-*-amd64"
fi

KEY=$(cat "$VM_DIR/init" "$VM_DIR/modules.txt" "$VM_DIR/build.sh" | sha256sum | cut -c1-12)
OUT=$CACHE/$KVER-$KEY
if [ -s "$OUT/vmlinuz" ] && [ -s "$OUT/initrd.gz" ]; then
  echo "$OUT"
  exit 0
fi

PKG=linux-image-$KVER
DEB=$(ls "$CACHE/debs/${PKG}"_*_amd64.deb 2>/dev/null | tail -1 || true)
if [ -z "$DEB" ]; then
  say "downloading $PKG (about 70 MB)"
  # apt-get download writes into the current directory, which apt's _apt sandbox user
  # may not be able to write: as root, download as root.
  sandbox=(); [ "$(id -u)" -ne 0 ] || sandbox=(-o APT::Sandbox::User=root)
  (cd "$CACHE/debs" && apt-get download -q "${sandbox[@]}" "$PKG" >&2) ||
    { say "download failed; running apt-get update and retrying";
      apt-get update -q >&2 &&
      (cd "$CACHE/debs" && apt-get download -q "${sandbox[@]}" "$PKG" >&2); } ||
    die "apt-get download $PKG failed"
  DEB=$(ls "$CACHE/debs/${PKG}"_*_amd64.deb | tail -1)
fi

say "building the guest for kernel $KVER (key $KEY)"
WORK=$(mktemp -d "$CACHE/.work.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
dpkg -x "$DEB" "$WORK/pkg"
depmod -b "$WORK/pkg" "$KVER"
MODDIR=$WORK/pkg/lib/modules/$KVER
[ -s "$WORK/pkg/boot/vmlinuz-$KVER" ] || die "$DEB holds no boot/vmlinuz-$KVER"

# Resolve each listed module to its file and check that everything it depends on is
# listed before it: insmod loads exactly what it is given, so the order must be right.
mods=()
while read -r name; do
  case $name in ''|'#'*) continue;; esac
  mods+=("$name")
done <"$VM_DIR/modules.txt"
modfile() {  # name -> path relative to MODDIR, from modules.dep; '-' and '_' are the same
  local pat=${1//[-_]/[-_]}
  grep -E "(^|/)${pat}\.ko(\.xz|\.zst)?:" "$MODDIR/modules.dep" | head -1 | cut -d: -f1
}
mkdir -p "$WORK/initrd/lib/modules" "$WORK/initrd/bin"
declare -A loaded=()
: >"$WORK/initrd/lib/modules/order"
for name in "${mods[@]}"; do
  rel=$(modfile "$name" || true)
  [ -n "$rel" ] || die "module $name is not in kernel $KVER (tools/vm/modules.txt)"
  for dep in $(grep -E "^${rel//./\\.}:" "$MODDIR/modules.dep" | cut -d: -f2-); do
    depname=$(basename "$dep"); depname=${depname%%.ko*}; depname=${depname//-/_}
    [ -n "${loaded[$depname]:-}" ] ||
      die "module $name needs $depname loaded first; add it above $name in tools/vm/modules.txt"
  done
  src=$MODDIR/$rel
  dst=$WORK/initrd/lib/modules/${name//-/_}.ko
  case $src in
    *.ko.xz) xz -dc "$src" >"$dst";;
    *.ko.zst) zstd -qdc "$src" >"$dst";;
    *) cp "$src" "$dst";;
  esac
  echo "${name//-/_}" >>"$WORK/initrd/lib/modules/order"
  loaded[${name//-/_}]=1
done

cp "$BUSYBOX" "$WORK/initrd/bin/busybox"
install -m 0755 "$VM_DIR/init" "$WORK/initrd/init"
mkdir -p "$WORK/initrd"/{dev,proc,sys,host,tmp}
# No cpio binary on the host: busybox has one. newc is the format the kernel unpacks.
(cd "$WORK/initrd" && find . | LC_ALL=C sort | "$BUSYBOX" cpio -o -H newc 2>/dev/null) |
  gzip -6 >"$WORK/initrd.gz"

mkdir -p "$OUT.tmp"
cp "$WORK/pkg/boot/vmlinuz-$KVER" "$OUT.tmp/vmlinuz"
mv "$WORK/initrd.gz" "$OUT.tmp/initrd.gz"
echo "$KVER" >"$OUT.tmp/kernel-version"
rm -rf "$OUT"
mv "$OUT.tmp" "$OUT"
# Older builds are dead weight once a new one exists; the .deb stays for quick rebuilds.
for old in "$CACHE"/*-amd64-*; do
  [ "$old" = "$OUT" ] || [ ! -d "$old" ] || rm -rf "$old"
done
find "$CACHE/debs" -name 'linux-image-*.deb' ! -name "${PKG}_*" -delete
say "guest ready in $OUT ($(du -sh "$OUT" | cut -f1))"
echo "$OUT"
