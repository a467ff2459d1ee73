#!/usr/bin/env bash
# Run the RDMA test suite (tests/rdma) against real verbs (`make test-rdma`).
#
#   - on a host with an ACTIVE verbs port (a real RDMA NIC, or SoftRoCE set up by hand):
#     directly on the host;
#   - otherwise inside the SoftRoCE qemu guest (tools/vm/run.sh);
#   - DUALPATH_SKIP_RDMA=1 skips it with a loud warning (for a laptop; never in CI).
# Exits with pytest's status; fails when the suite can run nowhere.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PYTEST=(.venv/bin/python -m pytest tests/rdma -q -p no:cacheprovider -rs)

if [ "${DUALPATH_SKIP_RDMA:-0}" = 1 ]; then
  cat >&2 <<'EOF'

##########################################################################
##  WARNING: the RDMA suite (tests/rdma) was NOT run: DUALPATH_SKIP_RDMA=1.
##  Nothing about the verbs data path has been tested by this run.
##  Unset DUALPATH_SKIP_RDMA to run it (on an RDMA device or in the
##  SoftRoCE qemu guest).
##########################################################################

EOF
  exit 0
fi
[ -x .venv/bin/python ] || { echo "rdma-suite: ERROR: no .venv; run 'make install'" >&2; exit 1; }

# A port in state PORT_ACTIVE means there is a device the suite can use right here.
if command -v ibv_devinfo >/dev/null && ibv_devinfo 2>/dev/null | grep -q PORT_ACTIVE; then
  echo "rdma-suite: running tests/rdma on this host's verbs device(s):" \
    "$(ibv_devinfo -l 2>/dev/null | tail -n +2 | xargs)" >&2
  DUALPATH_RDMA_REQUIRED=1 exec "${PYTEST[@]}"
fi

if ! command -v qemu-system-x86_64 >/dev/null; then
  cat >&2 <<'EOF'
rdma-suite: ERROR: the RDMA suite cannot run: this host has no ACTIVE verbs device and
  qemu-system-x86_64 is missing, so the SoftRoCE guest cannot start either.
  Fix: run tools/install-system-packages.sh (installs qemu-system-x86), or configure
  SoftRoCE by hand (docs/softroce.md), or, to skip the suite knowingly, set
  DUALPATH_SKIP_RDMA=1.
EOF
  exit 1
fi
echo "rdma-suite: no ACTIVE verbs device on this host; running tests/rdma in the" \
  "SoftRoCE guest (tools/vm/run.sh)" >&2
exec tools/vm/run.sh "${PYTEST[@]}"
