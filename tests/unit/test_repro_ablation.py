"""fig12's ablation cluster (dualpath/repro/figures.py: ablation_settings): the PE's HBM
holds the trace's largest prompt without layerwise prefill, but not two of them, so
that layerwise prefill (DEPTH of the layers per request) is what lets batches grow; the
compute quota is the paper's 300 ms on the slowed clock."""

import numpy as np
import pytest

from dualpath.buffers.pool import BlockPool
from dualpath.engines.emulated.forward import DEPTH
from dualpath.kv.layout import BlockLayout
from dualpath.kv.profiles import get_profile
from dualpath.repro.figures import FULL, QUICK, ablation_settings, scale_trace
from dualpath.trace.model import plan_rounds


@pytest.mark.parametrize("scale", [FULL, QUICK], ids=["full", "quick"])
def test_the_pe_holds_one_largest_prompt_without_layerwise_and_several_with(scale):
    trace = scale_trace(scale)
    settings, pe, quota_ms = ablation_settings(scale, trace)
    prof = get_profile(scale.ablation_profile)
    assert settings["engine"]["model_profile"] == scale.ablation_profile
    # The PE's HBM as the node makes it: a pool of Layer Block slots (node/daemon.py).
    layout = BlockLayout.of(prof).one_layer()
    slots = BlockPool("hbm", np.zeros(pe["engine"]["prefill_hbm_mib"] << 20, np.uint8),
                      layout).capacity
    largest = max(-(-p.prompt_tokens // prof.block_tokens)
                  for t in trace.trajectories for p in plan_rounds(t, prof.block_tokens))
    assert largest * prof.layers <= slots < 2 * largest * prof.layers
    assert slots // (largest * DEPTH) >= prof.layers // DEPTH   # layerwise: many at once
    assert quota_ms == round(300 / scale.ablation_speed)
    assert pe["engine"]["speed_scale"] == scale.ablation_speed < 1
