"""The connector's settings, version gate, stats and metrics, and its GPU path.

Settings: every key of kv_connector_extra_config is read or refused (a typo must not be
silently ignored). Stats aggregate over workers as vLLM does (aggregate, reduce). The
Prometheus metrics land in the registry vLLM hands them (here a real one). GPU: a CUDA
KV tensor is described with its device and needs the verbs provider (dma-buf); where no
GPU exists the GPU registration test says so in its skip reason."""

import prometheus_client
import pytest
import torch

from dualpath.errors import UsageError
from dualpath.transfer.tcp_provider import TcpProvider
from dualpath.vllm import check_vllm_version
from dualpath.vllm.settings import ConnectorSettings


def test_settings_refuse_unknown_keys_and_bad_values():
    s = ConnectorSettings.from_extra_config({"node_address": "127.0.0.1:7001",
                                             "block_units": 2, "load_timeout_s": 5})
    assert (s.node_address, s.block_units, s.load_timeout_s) == ("127.0.0.1:7001", 2, 5.0)
    with pytest.raises(UsageError, match="unknown key.*node_adress.*knows node_address"):
        ConnectorSettings.from_extra_config({"node_adress": "127.0.0.1:1"})
    with pytest.raises(UsageError, match="node_address is required"):
        ConnectorSettings.from_extra_config({})
    with pytest.raises(UsageError, match="node_address.*host:port"):
        ConnectorSettings.from_extra_config({"node_address": "nowhere"})
    with pytest.raises(UsageError, match="block_units must be 1..64"):
        ConnectorSettings.from_extra_config({"node_address": "h:1", "block_units": 0})
    with pytest.raises(UsageError, match="load_timeout_s must be a number"):
        ConnectorSettings.from_extra_config({"node_address": "h:1", "load_timeout_s": "x"})


def test_settings_read_the_node_config_for_the_data_plane(tmp_path):
    cfg = tmp_path / "node.toml"
    cfg.write_text('[transport]\nkind = "tcp"\n[transfer]\nconnections_per_peer = 3\n')
    s = ConnectorSettings.from_extra_config({"node_address": "h:1", "config": str(cfg)})
    assert s.config.transport.kind == "tcp" and s.config.transfer.connections_per_peer == 3


def test_vllm_version_gate():
    assert check_vllm_version("0.32.0") == ""
    assert check_vllm_version("0.32.5+cpu") == ""
    for v in ("0.31.9", "0.2.0"):
        with pytest.raises(UsageError, match="supports vLLM >=0.32,<0.33.*older"):
            check_vllm_version(v)
    for v in ("0.33.0", "0.34.0", "1.0.0"):       # newer: loads, with a warning
        assert f"vLLM {v} is newer" in check_vllm_version(v)
    with pytest.raises(UsageError, match="cannot read"):
        check_vllm_version("dev")


def test_stats_aggregate_and_metrics_land_in_vllms_registry():
    from dualpath.vllm.connector import DualPathConnector, DualPathStats

    a = DualPathConnector.build_kv_connector_stats(
        {"loads": 1, "loaded_tokens": 256, "loaded_bytes": 1000, "failed_blocks": 0,
         "saved_blocks": 2, "layer_wait_s": [0.002]})
    b = DualPathStats(data={"loads": 2, "loaded_tokens": 128, "loaded_bytes": 500,
                            "failed_blocks": 1, "saved_blocks": 0, "layer_wait_s": [0.004]})
    r = a.aggregate(b).reduce()
    assert r == {"loads": 3, "loaded_tokens": 384, "loaded_bytes": 1500, "failed_blocks": 1,
                 "saved_blocks": 2, "layer_wait_ms_mean": 3.0}
    assert DualPathStats().is_empty() and not a.is_empty()

    reg = prometheus_client.CollectorRegistry()

    def bind(cls):
        class Bound(cls):
            def __init__(self, *args, **kw):
                super().__init__(*args, registry=reg, **kw)
        return Bound

    types = {prometheus_client.Gauge: bind(prometheus_client.Gauge),
             prometheus_client.Counter: bind(prometheus_client.Counter),
             prometheus_client.Histogram: bind(prometheus_client.Histogram)}
    m = DualPathConnector.build_prom_metrics(
        type("Cfg", (), {"kv_transfer_config": None})(), types, ["model_name", "engine"],
        {0: ["tiny", "0"]})
    m.observe(a.data, 0)
    v = reg.get_sample_value
    assert v("dualpath_connector_loaded_tokens_total", {"model_name": "tiny",
                                                        "engine": "0"}) == 384
    assert v("dualpath_connector_layer_wait_seconds_count", {"model_name": "tiny",
                                                             "engine": "0"}) == 2


def test_gpu_kv_needs_a_provider_that_reaches_gpu_memory():
    p = TcpProvider()
    try:
        with pytest.raises(UsageError, match="tcp provider cannot register GPU memory"):
            p.register_gpu(0x7f0000000000, 1 << 20, 0)
    finally:
        p.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU (torch sees none) for dma-buf registration of "
                    "KV tensors")
def test_cuda_kv_tensors_register_by_dmabuf():
    from dualpath import verbs
    from dualpath.transfer.verbs_provider import VerbsProvider
    from dualpath.vllm.kv_tensors import describe_kv_caches

    if not verbs.list_devices():
        pytest.skip("a CUDA GPU but no RDMA device: dma-buf needs both")
    big = torch.zeros(2, 16, 2, 128, 64, device="cuda")
    kv = describe_kv_caches({f"l{i}": big[:, :, :, :, :] for i in range(2)}, 128, 64, 2)
    (r,) = kv.ranges
    assert r.gpu_device == 0
    p = VerbsProvider()
    try:
        region = p.register_gpu(r.addr, r.length, r.gpu_device)
        assert region.kind in ("dmabuf", "peermem") and region.addr == r.addr
        region.close()
    finally:
        p.close()


def test_a_load_stream_that_ends_before_its_last_layer_fails_every_block():
    from dualpath.vllm.agent import LoadHandle

    cut = LoadHandle("r-cut", 3)
    cut._update(2, (), False, 0)
    cut._end()
    assert cut.error == "load stream ended after 2 layers, before its last"
    assert cut.failed == {0, 1, 2}
    whole = LoadHandle("r-whole", 3)
    whole._update(4, (2,), True, 100)
    whole._end()
    assert not whole.error and whole.failed == {2} and whole.ready == 4
