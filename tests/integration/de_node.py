"""A real DE node daemon in process for the tests that play its PE themselves:
emulated engine, TCP data plane, plaintext, small buffers."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from dualpath import config
from dualpath.node.daemon import NodeDaemon


@contextlib.asynccontextmanager
async def decode_node(tmp_path: Path) -> AsyncIterator[tuple[NodeDaemon, config.Config]]:
    """A started decode node ``d0`` with its store under ``tmp_path``, and its config."""
    cfg = config.from_dict({
        "transport": {"kind": "tcp"}, "tls": {"plaintext": True},
        "buffers": {"de_buffer_mib": 16, "mlock": False, "huge_pages": "off"},
        "engine": {"decode_hbm_mib": 16}, "storage": {"dir": str(tmp_path / "kv")}})
    de = NodeDaemon(cfg, "decode", "d0", "127.0.0.1:1")
    await de.start()
    try:
        yield de, cfg
    finally:
        await de.close()
