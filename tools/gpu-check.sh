#!/usr/bin/env bash
# Everything that needs a GPU, in one go (issue 39 item 5), on a GPU machine:
#   1. the GPU tests the host tier skips (dma-buf export and registration, CUDA KV
#      tensors, the save's wait on the model's stream), which must run, not skip;
#   2. bench/gpu_copy.py: cudaMemcpyAsync per block against one copy, 4 KiB - 4 MiB,
#      and the CNIC-assisted copy (RDMA WRITEs into the GPU's MR) where an RDMA device
#      has an ACTIVE port;
#   3. whether a CUDA vLLM is importable here (the connector's run on it is not built).
# Prints one table and writes OUT/gpu-check.json (OUT: $1, default .cache/gpu-check)
# with a "summary". Exit 0 when every part that can run here passed (a part that cannot
# run says why, in the table and the JSON); 1 when one failed; 2 on usage.
# Bounded: the parts' timeouts add up to 8.5 minutes.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
[ $# -le 1 ] || { echo "usage: tools/gpu-check.sh [OUT_DIR]" >&2; exit 2; }
OUT=${1:-.cache/gpu-check}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
[ -x "$PY" ] || { echo "gpu-check: no $PY: run 'make install' first" >&2; exit 2; }

gpus=$( { nvidia-smi -L 2>/dev/null || true; } | grep -c '^GPU' || true)
rdma=$( { ibv_devinfo 2>/dev/null || true; } | grep -c PORT_ACTIVE || true)

# 1. The GPU tests: with a GPU every one must run; a skip there says what this GPU host
#    lacks (cupy, dma-buf support, ...) and counts as a failure.
timeout 240 "$PY" -m pytest -q -p no:cacheprovider -rs tests/unit/test_gpu.py \
  tests/unit/test_vllm_connector_parts.py tests/unit/test_vllm_gpu_order.py \
  >"$OUT/tests.log" 2>&1
tests_rc=$?
gpu_skips=$(grep -c 'SKIPPED' "$OUT/tests.log" || true)

# 2. Copies: the bench says itself what it lacks (exit 1 without cupy or a GPU).
bench_args=(--sizes 4K,16K,64K,256K,1M,4M --json "$OUT/gpu_copy.json")
[ "$rdma" -gt 0 ] && bench_args+=(--rdma)
timeout 240 "$PY" bench/gpu_copy.py "${bench_args[@]}" >"$OUT/gpu_copy.log" 2>&1
bench_rc=$?

# 3. A CUDA vLLM: whether one is importable here and sees a GPU ("found"; running the
#    connector's tests on it is not built: the vLLM tier pins the CPU build).
timeout 30 "$PY" - >"$OUT/vllm.log" 2>&1 <<'EOF'
import sys
try:
    import torch
    import vllm
except Exception as e:
    print(f"no vLLM with torch importable: {e}"); sys.exit(3)
if not torch.cuda.is_available():
    print(f"vLLM {vllm.__version__} here is not a CUDA build (torch sees no GPU)"); sys.exit(3)
print(f"vLLM {vllm.__version__} on {torch.cuda.get_device_name(0)}")
EOF
vllm_rc=$?

"$PY" - "$OUT" "$gpus" "$rdma" "$tests_rc" "$gpu_skips" "$bench_rc" "$vllm_rc" <<'EOF'
import json, sys
from pathlib import Path
out, gpus, rdma, tests_rc, gpu_skips, bench_rc, vllm_rc = sys.argv[1:]
out, gpus, rdma = Path(out), int(gpus), int(rdma)
tests_rc, gpu_skips, bench_rc, vllm_rc = map(int, (tests_rc, gpu_skips, bench_rc, vllm_rc))
tail = lambda name: (out / name).read_text().strip().splitlines()[-1:] or [""]
parts = {}
if gpus == 0:
    parts["tests"] = ("not run here", "no GPU (nvidia-smi lists none)")
elif tests_rc or gpu_skips:
    parts["tests"] = ("FAILED", f"pytest exit {tests_rc}, {gpu_skips} skipped on a GPU "
                                f"host (see {out / 'tests.log'})")
else:
    parts["tests"] = ("passed", tail("tests.log")[0])
bench = {}
if bench_rc == 0 and (out / "gpu_copy.json").exists():
    bench = json.loads((out / "gpu_copy.json").read_text()).get("summary", {})
    parts["copies"] = ("measured", f"RDMA too: {rdma > 0}")
else:
    parts["copies"] = ("not run here" if gpus == 0 else "FAILED", tail("gpu_copy.log")[0])
parts["vllm"] = (("found" if vllm_rc == 0 else "not run here" if vllm_rc == 3 else "FAILED"),
                 tail("vllm.log")[0])
print(f"{'part':<8} {'result':<13} detail")
for k, (res, why) in parts.items():
    print(f"{k:<8} {res:<13} {why}")
for k, v in bench.items():
    print(f"  {k}: {v}")
record = {"gpus": gpus, "rdma_active_ports": rdma,
          "parts": {k: {"result": r, "detail": d} for k, (r, d) in parts.items()},
          "summary": {"gpus": gpus, "failed": [k for k, (r, _) in parts.items()
                                                if r == "FAILED"], **bench}}
(out / "gpu-check.json").write_text(json.dumps(record, indent=1) + "\n")
print(f"written {out / 'gpu-check.json'}")
sys.exit(1 if record["summary"]["failed"] else 0)
EOF
