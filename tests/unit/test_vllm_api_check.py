"""The connector's API check (dualpath/vllm/api_check.py) on the installed vLLM's own
sources, edited in memory into releases that drifted: each drift is found and named.
(tests/integration/test_vllm_release.py runs it on the installed and the newest release.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dualpath.vllm import api_check, releases

OURS = (Path(__file__).parents[2] / "dualpath" / "vllm" / "connector.py").read_text()
BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"


@pytest.fixture(scope="module")
def installed():
    return releases.installed()[1]


def edited(installed, module: str, old: str, new: str):
    src = installed(module)
    assert old in src, f"{module} no longer has {old!r}: update this test"

    def sources(m):
        return src.replace(old, new, 1) if m == module else installed(m)
    return sources


def drifts(sources) -> list[str]:
    return [str(d) for d in api_check.check(OURS, sources)]


def test_the_installed_release_fits(installed):
    assert drifts(installed) == []


def test_a_new_abstract_method_is_named(installed):
    src = edited(installed, BASE, "    @abstractmethod\n    def wait_for_save(self):",
                 "    @abstractmethod\n    def flush_everything(self, deadline):\n"
                 "        pass\n\n    @abstractmethod\n    def wait_for_save(self):")
    assert drifts(src) == [("DualPathConnector.flush_everything: abstract in "
                            "KVConnectorBase_V1, not implemented")]


@pytest.mark.parametrize("old, new, why", [
    ("def wait_for_layer_load(self, layer_name: str)",
     "def wait_for_layer_load(self, layer: str)", "parameter 1 is 'layer_name', not 'layer'"),
    ("def wait_for_layer_load(self, layer_name: str)",
     "def wait_for_layer_load(self, layer_name: str, stream)",
     "lacks parameter 'stream'"),
    ("def wait_for_save(self):", "def wait_for_save(self, **kwargs):", "takes no **kwargs"),
    ("def wait_for_save(self):", "@classmethod\n    def wait_for_save(cls):",
     "is a method, the release's is a classmethod"),
])
def test_a_changed_signature_is_named(installed, old, new, why):
    out = drifts(edited(installed, BASE, old, new))
    assert len(out) == 1 and why in out[0], out


def test_a_moved_import_and_an_unanswered_access_are_named(installed):
    gone = edited(installed, BASE, "class KVConnectorRole", "class KVConnectorRoleMoved")
    assert "import vllm.distributed.kv_transfer.kv_connector.v1.base.KVConnectorRole: " \
           f"{BASE} has no KVConnectorRole" in drifts(gone)
    # A release that asks how the KV cache is reached (0.34): ours says REGISTERS...
    asks = edited(installed, BASE, "    def __init__(", "    @classmethod\n"
                  "    def kv_cache_access(cls, kv_transfer_config):\n"
                  "        return 1\n\n    def __init__(")
    assert drifts(asks) == []
    # ...and a connector that did not would be named.
    mute = OURS.replace("return KVCacheAccess.REGISTERS", "return KVCacheAccess.IN_PROCESS")
    assert [str(d) for d in api_check.check(mute, asks)] == [
        ("DualPathConnector.kv_cache_access: not answered: KVConnectorBase_V1"
         ".kv_cache_access must return REGISTERS for this connector")]


def test_a_renamed_hook_and_a_reexported_base_are_named(installed):
    # The release renamed a hook we override: ours would never be called.
    renamed = edited(installed, BASE, "def get_block_ids_with_load_errors(self)",
                     "def get_failed_block_ids(self)")
    assert ("DualPathConnector.get_block_ids_with_load_errors: overrides nothing in the "
            "release's KVConnectorBase_V1 (renamed or removed: never called)") in drifts(renamed)
    # The base class moved to another module and is re-exported: not silently skipped.
    moved = edited(installed, BASE, "class KVConnectorBase_V1(", "class _Moved(")

    def reexport(m):
        src = moved(m)
        return src + "\nfrom elsewhere import KVConnectorBase_V1\n" if m == BASE else src
    assert any("does not define class KVConnectorBase_V1" in d for d in drifts(reexport))


def test_an_answer_in_a_docstring_is_not_an_answer(installed):
    asks = edited(installed, BASE, "    def __init__(", "    @classmethod\n"
                  "    def kv_cache_access(cls, kv_transfer_config):\n"
                  "        return 1\n\n    def __init__(")
    mute = OURS.replace("return KVCacheAccess.REGISTERS",
                        "# not REGISTERS: KVCacheAccess.REGISTERS\n"
                        "        return KVCacheAccess.IN_PROCESS")
    assert "KVCacheAccess.REGISTERS" in mute         # (named, not returned)
    assert any("not answered" in str(d) for d in api_check.check(mute, asks))
