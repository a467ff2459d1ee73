#!/bin/bash
# Stage two of the SoftRoCE guest: runs with the host's own bash, chrooted into the host's
# root (mounted over 9p by tools/vm/init), so the host's iproute2, rdma-core, Python and
# .venv are used unchanged. Read from the host at every boot: editing it needs no rebuild.
#
# Usage (by tools/vm/init only): guest.sh RUNDIR
#   RUNDIR/env    shell `export` lines written by tools/vm/run.sh (DUALPATH_*, PATH, ...)
#   RUNDIR/cwd    the working directory to run in (the host's, same path)
#   RUNDIR/cmd    the command, as one bash command string
#   RUNDIR/ready  created here when the rxe devices are up, just before the command starts
#   RUNDIR/status created here with the command's exit status, the last thing written
set -u
RUN=$1
read -r t_stage2 _ </proc/uptime
fail() { echo "vm-guest: ERROR: $*" >&2; exit 1; }
# This rewires routing and sysctls: never let it run anywhere but in the guest.
[[ " $(</proc/cmdline) " == *" dualpath.run=$RUN "* ]] ||
  fail "not booted by tools/vm/run.sh; refusing"

# Two rxe devices, one on each end of a veth pair, carrying real packets over the veth.
# The recipe is the one verified in ../shared/softroce.md ("Two rxe devices ...").
# Every program started here is read over 9p under emulation, so the set-up runs few
# processes (`ip -batch`, bash builtins).
IP_A=10.99.0.1 IP_B=10.99.0.2
setup_net() {
  local ifc
  # MTU 9000 lets rxe use a 4096-byte active MTU.
  ip -batch - <<EOF || return 1
link set lo up
link add veth0 type veth peer name veth1
addr add $IP_A/24 dev veth0
addr add $IP_B/24 dev veth1
link set veth0 mtu 9000 up
link set veth1 mtu 9000 up
EOF
  # Each end receives packets from an address local to the same host.
  for ifc in all veth0 veth1; do
    echo 1 >"/proc/sys/net/ipv4/conf/$ifc/accept_local" &&
    echo 0 >"/proc/sys/net/ipv4/conf/$ifc/rp_filter" || return 1
  done
  # Force locally generated A->B traffic out of veth0 and B->A out of veth1. `iif lo`
  # keeps the rules off arriving packets: without it the kernel forwards them instead of
  # delivering them and rxe receives nothing. The local table moves after these rules.
  ip -batch - <<EOF || return 1
rule add pref 10 from $IP_A to $IP_B iif lo lookup 10
route add $IP_B dev veth0 src $IP_A table 10
rule add pref 11 from $IP_B to $IP_A iif lo lookup 11
route add $IP_A dev veth1 src $IP_B table 11
rule add pref 100 lookup local
rule del pref 0 lookup local
EOF
  rdma -b - <<EOF
link add rxe0 type rxe netdev veth0
link add rxe1 type rxe netdev veth1
EOF
}
setup_net || fail "network/rxe set-up failed (see the messages above)"

port_active() {
  local state=
  read -r state <"/sys/class/infiniband/$1/ports/1/state" 2>/dev/null
  [[ $state == *ACTIVE* ]]
}
for _ in {1..100}; do
  port_active rxe0 && port_active rxe1 && break
  sleep 0.1
done
port_active rxe0 && port_active rxe1 || fail "rxe0/rxe1 ports did not become ACTIVE in 10 s"

# shellcheck disable=SC1091
. "$RUN/env" || fail "cannot read $RUN/env"
export DUALPATH_IN_VM=1 DUALPATH_RDMA_REQUIRED=1
export DUALPATH_RDMA_DEV_A=rxe0 DUALPATH_RDMA_DEV_B=rxe1
export DUALPATH_RDMA_IP_A=$IP_A DUALPATH_RDMA_IP_B=$IP_B
cwd=$(<"$RUN/cwd") && cmd=$(<"$RUN/cmd") || fail "cannot read $RUN/cwd or $RUN/cmd"
cd "$cwd" || fail "cannot cd to $cwd (the guest has its own empty /tmp and /run)"

: >"$RUN/ready"
read -r t_ready _ </proc/uptime
[ "${DUALPATH_VM_VERBOSE:-0}" != 1 ] ||
  echo "vm-guest: kernel uptime ${t_stage2} s at stage two, ${t_ready} s when ready" >&2
/bin/bash -c "$cmd" </dev/null
rc=$?
sync
echo "$rc" >"$RUN/status.tmp" && mv "$RUN/status.tmp" "$RUN/status"
sync
