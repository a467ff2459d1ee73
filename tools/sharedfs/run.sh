#!/usr/bin/env bash
# The shared-filesystem tier (make test-shared-fs): a GlusterFS volume on this host
# (gluster.sh), then
#   1. the store's own test modules, crash tests included, with every test's directory on
#      the volume's FUSE mount (pytest --basetemp there);
#   2. tests/sharedfs: a P/D replay whose nodes sit in network namespaces of their own,
#      each with its own GlusterFS client of the volume, the store bounded (eviction on).
# The volume is taken down at the end, pass or fail. Needs root.
set -euo pipefail
cd "$(dirname "$0")/../.."
VPY=${VPY:-.venv/bin/python}
MNT=${DUALPATH_SHARED_FS_MOUNT:-/mnt/dualpath-shared-fs}
tools/sharedfs/gluster.sh up "$MNT"
trap 'tools/sharedfs/gluster.sh down "$MNT"' EXIT
export DUALPATH_SHARED_FS=$MNT
DUALPATH_SHARED_FS_VOLUME=$(tools/sharedfs/gluster.sh spec)
export DUALPATH_SHARED_FS_VOLUME
rm -rf "$MNT/pytest"
"$VPY" -m pytest tests/unit/test_storage_store.py tests/unit/test_storage_crash.py \
  tests/unit/test_storage_evict.py tests/unit/test_storage_security.py \
  tests/unit/test_storage_cli.py tests/unit/test_storage_backend.py \
  --basetemp="$MNT/pytest" -q -p no:cacheprovider
"$VPY" -m pytest tests/sharedfs -q -p no:cacheprovider
