#!/usr/bin/env bash
# Put DualPath's KV lane (DSCP 24 = traffic_class 96 >> 2) on its own low-priority
# hardware queue of a ConnectX RoCE port. Prints the commands; runs them with --apply.
#   deploy/qos/roce-dscp.sh IFACE [--dscp 24] [--prio 2] [--apply]
set -euo pipefail
iface=${1:?usage: roce-dscp.sh IFACE [--dscp N] [--prio P] [--apply]}; shift
dscp=24 prio=2 apply=0
while [ $# -gt 0 ]; do
  case $1 in
    --dscp) dscp=$2; shift 2 ;;
    --prio) prio=$2; shift 2 ;;
    --apply) apply=1; shift ;;
    *) echo "roce-dscp.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[[ $dscp =~ ^[0-9]+$ && $dscp -le 63 ]] || { echo "roce-dscp.sh: --dscp must be 0..63" >&2; exit 2; }
[[ $prio =~ ^[0-7]$ ]] || { echo "roce-dscp.sh: --prio must be 0..7" >&2; exit 2; }
cmds=(
  "mlnx_qos -i $iface --trust dscp"
  "mlnx_qos -i $iface --dscp2prio set,$dscp,$prio"
  # ETS: the KV priority gets a small share; priority 3 (inference RDMA) keeps PFC.
  "mlnx_qos -i $iface --pfc 0,0,0,1,0,0,0,0 --tsa ets,ets,ets,ets,ets,ets,ets,ets --tcbw 10,10,5,65,10,0,0,0"
)
for c in "${cmds[@]}"; do
  if [ "$apply" = 1 ]; then echo "+ $c"; $c; else echo "$c"; fi
done
[ "$apply" = 1 ] || echo "# dry run: add --apply to run these (needs mlnx_qos and root)"
