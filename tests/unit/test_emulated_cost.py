"""The emulated engine's own work is counted apart from the data path: its CPU seconds
by kind (what bench/pipeline.py subtracts), and the DE's byte check sampled at
engine.verify_fraction by a stable hash of the request id."""

import numpy as np
from prometheus_client import CollectorRegistry

from dualpath import metrics as m
from dualpath.engines.emulated.engine import EmulatedEngine
from dualpath.kv.layout import BlockLayout
from dualpath.kv.prefix import block_keys
from dualpath.kv.profiles import get_profile
from dualpath.kv.synth import SyntheticKV

PROFILE = get_profile("demo", 16)


def test_verify_fraction_samples_requests_stably():
    ids = [f"a{i}-r{j}" for i in range(40) for j in range(10)]
    every = EmulatedEngine(PROFILE, 1.0)
    none = EmulatedEngine(PROFILE, 1.0, verify_fraction=0.0)
    half = EmulatedEngine(PROFILE, 1.0, verify_fraction=0.5)
    assert all(every.verifies(r) for r in ids)
    assert not any(none.verifies(r) for r in ids)
    picked = [r for r in ids if half.verifies(r)]
    assert 0.4 < len(picked) / len(ids) < 0.6
    assert picked == [r for r in ids if EmulatedEngine(PROFILE, 1.0, 0.5).verifies(r)]


def test_synthesis_cpu_is_counted_by_kind():
    reg = CollectorRegistry()
    counter = m.counter(reg, "dualpath_test_emulator_cpu_seconds_total", "test", ("work",))
    eng = EmulatedEngine(PROFILE, 1.0)
    layout = BlockLayout.of(PROFILE)
    eng.bind(None, SyntheticKV(layout))
    eng.cpu_counter = counter
    out = np.empty(layout.full_bytes, np.uint8)
    for key in block_keys(list(range(64 * 16)), 16):
        eng.fill_block(out, key)
    synth = reg.get_sample_value("dualpath_test_emulator_cpu_seconds_total",
                                 {"work": "synth"})
    assert synth is not None and synth > 0
    assert reg.get_sample_value("dualpath_test_emulator_cpu_seconds_total",
                                {"work": "verify"}) is None
