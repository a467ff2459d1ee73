"""Buffers and cores of a vLLM P/D cluster, derived from the model and the host."""

from __future__ import annotations

import json

import pytest

from dualpath import cpus
from dualpath.errors import UsageError
from dualpath.vllm import sizing

SMOLLM2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "hidden_size": 576}


def test_kv_bytes_per_token_from_the_config():
    assert sizing.kv_bytes_per_token(SMOLLM2) == 46080          # 2 x 30 x 3 x 64 x 4
    assert sizing.kv_bytes_per_token({**SMOLLM2, "head_dim": 32}) == 23040
    mha = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256}
    assert sizing.kv_bytes_per_token(mha, "bfloat16") == 2 * 2 * 4 * 64 * 2
    with pytest.raises(UsageError, match="KV geometry"):
        sizing.kv_bytes_per_token({"num_hidden_layers": 2})


def test_the_default_buffers_hold_the_context_for_each_concurrent_request(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    plan = sizing.plan_buffers(tmp_path, 8192, 4)
    assert plan.block_bytes == 46080 * 128                         # page aligned already
    assert plan.request_blocks == 65
    # The pool cut from that many MiB holds 4 requests of a full context.
    slots = (plan.mib << 20) // plan.block_bytes
    assert slots >= 4 * 65 and slots < 4 * 65 + 1 + (1 << 20) // plan.block_bytes
    assert "4 requests x 65 blocks" in plan.describe()
    # The 256 MiB that used to be the default held fewer blocks than one 5,800-token
    # prompt needs.
    assert (256 << 20) // plan.block_bytes < -(-5800 // 128)
    with pytest.raises(UsageError, match="concurrency"):
        sizing.plan_buffers(tmp_path, 8192, 0)
    with pytest.raises(UsageError, match="config.json"):
        sizing.plan_buffers(tmp_path / "nope", 8192, 1)


@pytest.mark.parametrize("instances,cores,want", [
    (2, [0, 1], ["0", "1"]),
    (2, [0, 1, 2, 3], ["0-1", "2-3"]),
    (3, [0, 1, 2, 3, 4, 5, 6], ["0-2", "3-4", "5-6"]),
    (4, [0, 1], ["0", "1", "0", "1"]),
    (2, [0, 2, 4, 6], ["0,2", "4,6"]),
    (1, [5], ["5"]),
])
def test_each_instance_gets_its_own_cores(instances, cores, want):
    got = sizing.core_slices(instances, cores)
    assert got == want
    if instances <= len(cores):         # no core is given to two instances
        used = [c for part in got for c in _expand(part)]
        assert len(used) == len(set(used))


@pytest.mark.parametrize("prefill,decode,cores,instances,control", [
    # No core to spare: the control processes run on any (confined to the prefill
    # instance's core, they starved there: see sizing.py).
    (1, 1, [0, 1], ("0", "1"), (0, 1)),
    (1, 1, [0], ("0", "0"), (0,)),
    (1, 2, [0, 1], ("0", "1", "0"), (0, 1)),
    # Spare cores: the control processes get their own (one per 8 cores).
    (1, 1, [0, 1, 2], ("1", "2"), (0,)),
    (1, 1, list(range(16)), ("2-8", "9-15"), (0, 1)),
    (2, 2, [4, 5, 6, 7, 8], ("5", "6", "7", "8"), (4,)),
])
def test_control_processes_get_cores_of_their_own_when_the_host_has_them(prefill, decode, cores,
                                                               instances, control):
    plan = sizing.plan_cores(prefill, decode, cores)
    assert (plan.instances, plan.control) == (instances, control)
    computing = {c for part in plan.instances for c in cpus.parse_cpus(part)}
    if len(cores) > prefill + decode:
        assert not computing & set(plan.control)
    assert set(plan.control) <= set(cores)
    with pytest.raises(UsageError, match="no CPU cores"):
        sizing.plan_cores(prefill, decode, [])


def test_cpu_lists_round_trip():
    assert cpus.cpu_list([5, 0, 1, 2, 2]) == "0-2,5"
    assert cpus.parse_cpus("0-2,5") == [0, 1, 2, 5]
    assert cpus.parse_cpus(cpus.cpu_list([3, 9, 10])) == [3, 9, 10]
    assert cpus.on_cpus([]) == []
    assert cpus.on_cpus([1, 0]) == ["taskset", "-c", "0-1"]


def _expand(part: str) -> list[int]:
    if "-" in part:
        a, b = map(int, part.split("-"))
        return list(range(a, b + 1))
    return [int(c) for c in part.split(",")]


def test_the_cores_a_user_gives_are_checked_against_this_processs():
    import os

    mine = sorted(os.sched_getaffinity(0))
    assert cpus.allowed_cpus(cpus.cpu_list(mine)) == mine
    assert cpus.allowed_cpus(f"{mine[0]},{mine[0]}") == [mine[0]]
    for bad in ("", "x", "3-", "-1"):
        with pytest.raises(UsageError, match="not a CPU list"):
            cpus.allowed_cpus(bad)
    with pytest.raises(UsageError, match=f"cores {max(mine) + 1} are not among"):
        cpus.allowed_cpus(str(max(mine) + 1))


def test_an_instances_cores_are_cut_for_its_tensor_parallel_ranks():
    from dualpath.vllm.sizing import rank_binds

    assert rank_binds("0-3", 2) == "0-1|2-3"
    assert rank_binds("0-1", 2) == "0|1"
    assert rank_binds("2,5", 2) == "2|5"
    assert rank_binds("0", 2) == "0|0"          # fewer cores than ranks: shared
    assert rank_binds("0-2", 1) == "0-2"
