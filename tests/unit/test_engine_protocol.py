"""Each registered engine gives the node daemon everything engines/protocol.py names,
so the daemon never needs to know which one it runs (a member missing shows up here,
not as an AttributeError in a running node)."""

import inspect

import pytest

from dualpath.engines import KINDS, open_kind
from dualpath.engines.emulated.decode import EmulatedDecoder
from dualpath.engines.emulated.kind import EmulatedNode
from dualpath.engines.emulated.prefill import EmulatedPrefillPath
from dualpath.engines.protocol import EngineKind, NodeEngine
from dualpath.engines.vllm.decode import VllmDecoder
from dualpath.engines.vllm.kind import VllmNode
from dualpath.engines.vllm.prefill import VllmPrefillPath
from dualpath.paths.decode import Decoder
from dualpath.paths.prefill import PrefillPath


def _members(proto) -> set[str]:
    names = set(getattr(proto, "__annotations__", {}))
    names |= {n for n, v in vars(proto).items()
              if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    return names


def _has(obj, name: str) -> bool:
    return hasattr(obj, name) or name in getattr(obj, "__annotations__", {}) or \
        any(name in getattr(c, "__annotations__", {}) for c in inspect.getmro(obj))


def test_the_registry_names_each_kind_by_its_name():
    assert sorted(KINDS) == ["emulated", "vllm"]
    for name in KINDS:
        kind = open_kind(name)
        assert kind.name == name
        missing = {m for m in _members(EngineKind) if not hasattr(kind, m)}
        assert not missing, (name, missing)
    with pytest.raises(KeyError):
        open_kind("sglang")


def test_the_config_and_the_clis_take_the_registered_kinds():
    from dualpath import config as _config
    from dualpath.node.config import EngineConfig

    assert set(KINDS) == {"emulated", "vllm"}
    assert EngineConfig().kind in KINDS
    with pytest.raises(Exception, match="engine.kind"):
        _config.load(None, {"engine.kind": "sglang"})


@pytest.mark.parametrize("cls", [EmulatedNode, VllmNode])
def test_an_opened_engine_has_every_member_the_daemon_uses(cls):
    # instance attributes are set in __init__: read its source for them
    src = inspect.getsource(cls)
    missing = {m for m in _members(NodeEngine)
               if not (_has(cls, m) or f"self.{m} =" in src or f"self.{m}: " in src)}
    assert not missing, (cls.__name__, missing)


@pytest.mark.parametrize("cls", [EmulatedDecoder, VllmDecoder])
def test_each_decoder_is_a_decoder(cls):
    missing = {m for m in _members(Decoder) if not callable(getattr(cls, m, None))}
    assert not missing, (cls.__name__, missing)


@pytest.mark.parametrize("cls", [EmulatedPrefillPath, VllmPrefillPath])
def test_each_prefill_fills_in_the_skeletons_prefill(cls):
    assert issubclass(cls, PrefillPath) and cls.prefill is not PrefillPath.prefill
    assert inspect.signature(cls.prefill).parameters.keys() == \
        inspect.signature(PrefillPath.prefill).parameters.keys()
