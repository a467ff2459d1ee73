#!/usr/bin/env bash
# A GlusterFS volume on this host for the shared-filesystem tier (make test-shared-fs):
#   gluster.sh up MOUNTPOINT     glusterd, volume dualpath-test (one brick, this host's
#                                name), started, mounted at MOUNTPOINT (FUSE); idempotent
#   gluster.sh down MOUNTPOINT   unmount, stop and delete the volume, wipe its brick
#   gluster.sh spec              the volume as a client names it (HOST:/VOLUME)
# Needs root, glusterfs-server and glusterfs-client (tools/install-system-packages.sh).
set -euo pipefail
VOL=dualpath-test
BRICK=/var/lib/dualpath-gluster/brick
HOST=$(hostname)
g() { gluster --mode=script "$@"; }

case "${1:-}" in
up)
  mnt=${2:?usage: gluster.sh up MOUNTPOINT}
  pgrep -x glusterd >/dev/null || glusterd
  for _ in $(seq 50); do g volume list >/dev/null 2>&1 && break; sleep 0.2; done
  if ! g volume info "$VOL" >/dev/null 2>&1; then
    rm -rf "$BRICK"; mkdir -p "$BRICK"
    # force: the brick is on the root filesystem (a test volume, not a deployment).
    g volume create "$VOL" "$HOST:$BRICK" force >/dev/null
  fi
  g volume status "$VOL" >/dev/null 2>&1 || g volume start "$VOL" force >/dev/null
  mkdir -p "$mnt"
  if ! mountpoint -q "$mnt"; then
    for _ in $(seq 20); do
      mount -t glusterfs "$HOST:/$VOL" "$mnt" && break; sleep 0.5
    done
  fi
  mountpoint -q "$mnt"
  echo "gluster: $HOST:/$VOL mounted at $mnt ($(glusterfs --version | head -1))"
  ;;
down)
  mnt=${2:?usage: gluster.sh down MOUNTPOINT}
  mountpoint -q "$mnt" && umount -l "$mnt" || true
  g volume stop "$VOL" force >/dev/null 2>&1 || true
  g volume delete "$VOL" >/dev/null 2>&1 || true
  rm -rf "$BRICK"
  ;;
spec)
  echo "$HOST:/$VOL"
  ;;
*)
  echo "usage: gluster.sh up|down MOUNTPOINT | spec" >&2; exit 2 ;;
esac
