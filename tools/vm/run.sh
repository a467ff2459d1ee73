#!/usr/bin/env bash
# Run a command inside the SoftRoCE qemu guest (`make vm CMD='...'`).
#
#   tools/vm/run.sh 'ibv_devinfo | grep state'   one argument: a bash command string
#   tools/vm/run.sh ibv_devinfo -d rxe0          several: a command and its arguments
#
# The guest (tools/vm/build.sh) shares the host's root over 9p and chroots into it, so the
# command runs with the host's tools, .venv and repository at the same paths, in the
# same working directory, with DUALPATH_* passed through and rxe0/rxe1 up (see
# tools/vm/guest.sh for what is set up and exported). Output streams to stdout as it comes.
#
# Exit status: the command's own; 124 when DUALPATH_VM_TIMEOUT (seconds, default 3000)
# ran out; 125 when the guest ended without reporting a status (a boot failure).
# Other knobs: DUALPATH_VM_MEM (default 4G), DUALPATH_VM_SMP (default 2),
# DUALPATH_VM_VERBOSE=1 shows all kernel messages.
set -euo pipefail

VM_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$VM_DIR/../.." && pwd)
CACHE=${DUALPATH_VM_CACHE:-$ROOT/.cache/vm}
TIMEOUT=${DUALPATH_VM_TIMEOUT:-3000}
die() { echo "vm: ERROR: $*" >&2; exit 125; }

case $# in
  0) die "usage: tools/vm/run.sh 'COMMAND' (or: make vm CMD='COMMAND')";;
  1) CMD=$1;;
  *) CMD=$(printf '%q ' "$@");;
esac
[ -n "${CMD// /}" ] || die "empty command; usage: make vm CMD='COMMAND'"
[[ $TIMEOUT =~ ^[0-9]+$ ]] && [ "$TIMEOUT" -gt 0 ] ||
  die "DUALPATH_VM_TIMEOUT must be a positive number of seconds, not '$TIMEOUT'"
command -v qemu-system-x86_64 >/dev/null ||
  die "qemu-system-x86_64 not found; run tools/install-system-packages.sh"

mkdir -p "$CACHE" && CACHE=$(cd "$CACHE" && pwd)
# Kernel command-line values (the run folder, guest.sh) cannot hold whitespace.
[[ $CACHE$VM_DIR != *[[:space:]]* ]] ||
  die "the repository and DUALPATH_VM_CACHE paths must not contain whitespace: $CACHE"
# The guest mounts its own /tmp and /run. A checkout under /tmp (a CI clone, a
# `mktemp -d` clone) stays visible: each top-level /tmp folder holding the repository,
# the cache or the working directory is bound into the guest's /tmp (dualpath.keeptmp).
[[ $CACHE/ != /run/* ]] ||
  die "DUALPATH_VM_CACHE must not be under /run (the guest has its own): $CACHE"
keeptmp=
for p in "$ROOT" "$CACHE" "$(pwd)"; do
  if [[ $p == /tmp/?* ]]; then
    top=${p#/tmp/}; top=${top%%/*}
    [[ ,$keeptmp, == *,$top,* ]] || keeptmp=${keeptmp:+$keeptmp,}$top
  fi
done

GUEST=$(DUALPATH_VM_CACHE=$CACHE "$VM_DIR/build.sh") ||
  die "building the guest failed (tools/vm/build.sh)"

# The run directory is on the shared root: the guest reads the command and environment
# from it and writes its readiness and exit status back (qemu itself always exits 0).
RUN=$(mktemp -d "$CACHE/run-XXXXXX")

pwd >"$RUN/cwd"
printf '%s\n' "$CMD" >"$RUN/cmd"
{
  printf 'export PATH=%q\n' "$PATH:/usr/local/sbin:/usr/sbin:/sbin"
  printf 'export HOME=%q\n' "${HOME:-/root}"
  printf 'export LANG=%q\n' "${LANG:-C.UTF-8}"
  printf 'export PYTHONUNBUFFERED=1\n'
  # The command's stdout is the guest's serial console, a tty: without this, programs
  # would colour output that goes to a pipe or a CI log on the host.
  if [ -t 1 ]; then printf 'export TERM=%q\n' "${TERM:-vt100}"; else echo 'export TERM=dumb'; fi
  while IFS= read -r name; do
    [[ $name == DUALPATH_* ]] && printf 'export %s=%q\n' "$name" "${!name}"
  done < <(compgen -e)
} >"$RUN/env"

append="console=ttyS0 panic=-1 dualpath.run=$RUN dualpath.stage2=$VM_DIR/guest.sh"
[ -z "$keeptmp" ] || append="$append dualpath.keeptmp=$keeptmp"
[ "${DUALPATH_VM_VERBOSE:-0}" = 1 ] || append="quiet loglevel=3 $append"

start=$(date +%s.%N)
elapsed() { awk -v a="$start" -v b="$1" 'BEGIN { printf "%.1f", b - a }'; }
# timeout puts qemu in its own process group; forward INT/TERM so nothing outlives us.
timeout -k 10 "$TIMEOUT" qemu-system-x86_64 \
  -nodefaults -no-user-config -display none -no-reboot \
  -accel tcg,thread=multi -cpu max -smp "${DUALPATH_VM_SMP:-2}" -m "${DUALPATH_VM_MEM:-4G}" \
  -kernel "$GUEST/vmlinuz" -initrd "$GUEST/initrd.gz" -append "$append" \
  -virtfs local,path=/,mount_tag=hostroot,security_model=passthrough,multidevs=remap \
  -serial stdio </dev/null &
qemu=$!
interrupted=
trap 'interrupted=1; kill -TERM $qemu 2>/dev/null' INT TERM
# Report boot-to-ready once the guest creates RUN/ready; 9p creates files on the host at
# once, so the file's mtime (host clock) is the moment the command started.
(
  until [ -e "$RUN/ready" ]; do
    kill -0 $qemu 2>/dev/null || [ -e "$RUN/ready" ] || exit 0
    sleep 0.2
  done
  echo "vm: ready in $(elapsed "$(stat -c %.3Y "$RUN/ready")") s" >&2
) &
watcher=$!
qrc=0
wait $qemu || qrc=$?
# A trapped signal interrupts `wait`; wait again for qemu to be gone before cleaning up.
while kill -0 $qemu 2>/dev/null; do wait $qemu || qrc=$?; done
wait $watcher || true

if [ -f "$RUN/status" ]; then
  rc=$(cat "$RUN/status")
  rm -rf "$RUN"
  [[ $rc =~ ^[0-9]+$ ]] || die "the guest reported a malformed exit status '$rc'"
  exit "$rc"
fi
rm -rf "$RUN"
[ -z "$interrupted" ] || die "interrupted; the guest was stopped"
if [ "$qrc" = 124 ]; then
  echo "vm: ERROR: the guest was stopped after DUALPATH_VM_TIMEOUT=$TIMEOUT s" \
    "($(elapsed "$(date +%s.%N)") s since start); the command did not finish" >&2
  exit 124
fi
die "the guest ended without reporting an exit status (qemu exit $qrc, after" \
  "$(elapsed "$(date +%s.%N)") s); rerun with DUALPATH_VM_VERBOSE=1 for kernel messages"
