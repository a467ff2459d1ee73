"""The [engine] and [cluster] config sections: PE/DE node daemons and `dualpath up`."""

from __future__ import annotations

from dataclasses import dataclass

from dualpath.config import key
from dualpath.engines import KINDS
from dualpath.errors import ConfigError
from dualpath.kv.profiles import PROFILES
from dualpath.rpc import check_listen


@dataclass(frozen=True)
class EngineConfig:
    """A PE or DE node daemon (`dualpath node`): its engines, HBM and emulated compute."""

    kind: str = key("emulated", "The model engine this node serves: 'emulated' (the cost "
                    "model; PE or DE role, for benchmarks at scale) or 'vllm' (a vLLM "
                    "instance beside the node, running dualpath.vllm.connector: role "
                    "'both' without a scheduler, or a prefill / decode node whose "
                    "instance it drives at vllm_url).", choices=tuple(KINDS))
    engines_per_node: int = key(1, "Engines (one per real or emulated GPU) in this node's "
                                "group; rank 0 is the leader that fetches from the scheduler.",
                                min=1, max=64)
    model_profile: str = key("demo", "dualpath.kv.profiles name; must match the scheduler's "
                             "scheduler.model_profile (checked at registration).",
                             choices=tuple(sorted(PROFILES)))
    speed_scale: float = key(1.0, "Emulated GPU speed relative to the profile's (prefill "
                             "FLOP/s and HBM bandwidth x scale, decode step / scale). Model "
                             "execution is emulated by the cost model.", min=1e-6)
    control_listen: str = key("127.0.0.1:0", "gRPC address of this node's Engine and Node "
                              "services (port 0 = any free port).")
    advertise: str = key("", "host peers and the scheduler use to reach control_listen; "
                         "empty = its host.")
    metrics_listen: str = key("", "Prometheus /metrics host:port; empty = off.")
    prefill_hbm_mib: int = key(512, "HBM per PE engine for the prompts it prefills (MiB).",
                               min=1, max=1 << 24)
    decode_hbm_mib: int = key(256, "HBM per DE engine for the requests it decodes (MiB); "
                              "reported to the scheduler as hbm_bytes.", min=1, max=1 << 24)
    max_prefills_per_engine: int = key(16, "Requests one PE engine works on at once "
                                       "(staging their hit in the PE buffer, or queued "
                                       "for and in its forward batches).", min=1)
    fetch_interval_ms: int = key(0, "Leader fetch period; 0 = what the scheduler suggests.",
                                 min=0)
    verify_fraction: float = key(1.0, "Emulated engine, decode node: the fraction of "
                                 "requests whose prompt KV is checked byte by byte against "
                                 "the generator (chosen by a hash of the request id; the "
                                 "rest are counted unverified). 1 = all (tests); benchmarks "
                                 "of the data path may sample.", min=0.0, max=1.0)
    layerwise: bool = key(True, "Layerwise prefill on this node (HBM a layer at a time, "
                          "layer l+1 moving in while layer l computes) for requests whose "
                          "payload asks for it (every mode but basic); false: none.")

    vllm_url: str = key("", "engine.kind = 'vllm', role prefill or decode: the OpenAI "
                        "HTTP address of the vLLM instance this node drives (its "
                        "/v1/completions), e.g. http://127.0.0.1:8100.")
    vllm_request_timeout_s: float = key(600.0, "Bound on one request to that vLLM "
                                        "instance (a prefill, or a whole decode).", min=1.0)
    prepare_ttl_s: float = key(30.0, "Decode node: how long a request prepared here "
                               "(Node.PrepareRequest) waits for the scheduler's "
                               "assignment of it to this node; past it, its buffer slots "
                               "are let go (a prepare the scheduler never assigned here).",
                               min=1.0, max=3600.0)

    def validate(self) -> None:
        check_listen("engine", ("metrics_listen",), control_listen=self.control_listen,
                     metrics_listen=self.metrics_listen)
        if self.vllm_url and not self.vllm_url.startswith(("http://", "https://")):
            raise ConfigError(f"engine.vllm_url = {self.vllm_url!r}: an http:// or https:// "
                              "URL")


@dataclass(frozen=True)
class ClusterConfig:
    """`dualpath up`: a scheduler and P prefill + D decode node processes on this host."""

    prefill_nodes: int = key(1, "Prefill (PE) node processes.", min=1, max=64)
    decode_nodes: int = key(2, "Decode (DE) node processes.", min=1, max=64)
    work_dir: str = key("", "Directory for the block store, logs and the generated node "
                        "config; empty = a new temporary directory, removed at exit.")
    start_timeout_s: float = key(60.0, "Bound on the scheduler and every node becoming "
                                 "ready.", min=1.0)
