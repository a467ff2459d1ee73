"""The model engines a node can serve, one package each, by ``engine.kind``.

The node daemon sees them through dualpath/engines/protocol.py only. To add one, write
its package (a ``kind.py`` whose :class:`~dualpath.engines.protocol.EngineKind` opens a
:class:`~dualpath.engines.protocol.NodeEngine`) and register it below: ``engine.kind``'s
accepted values and the CLIs' ``--engine`` choices come from this table. Its modules are
imported only when a node opens that kind (reading a config imports none of them).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dualpath.engines.protocol import EngineKind

#: ``engine.kind`` -> its EngineKind, as "module:Class".
KINDS: dict[str, str] = {
    "emulated": "dualpath.engines.emulated.kind:EmulatedKind",
    "vllm": "dualpath.engines.vllm.kind:VllmKind",
}


def open_kind(name: str) -> EngineKind:
    """The EngineKind registered as ``name`` (KeyError for one that is not)."""
    module, _, cls = KINDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)()
