#!/usr/bin/env bash
# Install the Debian packages DualPath builds and tests with; a no-op when all are present.
# Needs root (or sudo) only when something is missing.
set -euo pipefail
PKGS=(
  libibverbs-dev librdmacm-dev rdma-core ibverbs-utils ibverbs-providers  # verbs build + tools
  libssl-dev                                       # libcrypto: the TCP provider's HMAC
  libxxhash-dev                                    # XXH3 of blocks read (csrc/store_io.c)
  python3-pyverbs                                  # rdma-core's own bindings: our cross-check
  qemu-system-x86 busybox-static kmod              # the SoftRoCE guest (tools/vm)
  perftest ucx-utils fio iperf3 tcpdump iproute2   # peers for the benches, packet capture
  openssl libcap2-bin                              # test PKI (TLS tests), capsh (memlock test)
  systemd                                          # systemd-analyze verify (the units' test)
  prometheus                                       # scrape + promtool (the monitoring test)
  glusterfs-server glusterfs-client                # the shared-filesystem tier (tools/sharedfs)
)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# The Python that makes .venv (PY, as the Makefile passes it) needs venv/ensurepip and its
# headers (cffi compiles the extension against Python.h). A Debian python3 splits them
# into packages; a source-built Python (pyenv) has both.
PY=${PY:-python3}
if [ "$(command -v "$PY")" = /usr/bin/python3 ] || [ "$(command -v "$PY")" = /usr/bin/"$PY" ]; then
  "$PY" -c 'import ensurepip' 2>/dev/null || missing+=(python3-venv)
  inc=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
  [ -f "$inc/Python.h" ] || missing+=(python3-dev)
fi
[ ${#missing[@]} -eq 0 ] && exit 0
echo "install-system-packages: installing ${missing[*]}"
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
