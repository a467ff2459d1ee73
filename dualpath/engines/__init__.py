"""The model engines a node can serve, one package each, by ``engine.kind``.

The node daemon sees them through dualpath/engines/protocol.py only. To add one, write
its package (a ``kind.py`` whose :class:`~dualpath.engines.protocol.EngineKind` opens a
:class:`~dualpath.engines.protocol.NodeEngine`) and register it below.
"""

from __future__ import annotations

from dualpath.engines.emulated.kind import EmulatedKind
from dualpath.engines.protocol import EngineKind
from dualpath.engines.vllm.kind import VllmKind

KINDS: dict[str, EngineKind] = {k.name: k for k in (EmulatedKind(), VllmKind())}
