"""Fault injection for negative controls in tests: a bug DualPath must be able to see.

``DUALPATH_FAULTS`` (comma-separated names, read once at import) turns on faults that
no configuration can: they exist so that a test can prove its comparison would catch a
broken data path. Unknown names are refused, so a typo cannot make a control vacuous.

- ``load_skip_layer``: a node daemon serving a vLLM load reports layer 0 done without
  writing it (a load skipped).
- ``load_flip_byte``: the daemon flips one bit of every hit block in its buffer (the sign
  of its second float32: the value stays finite, as a NaN would poison the engine's
  later requests) after the checksum passed and before it WRITEs the block (a byte
  flipped in transit).
- ``tp_swap_ranks``: a node gives each tensor-parallel rank of its vLLM instance the next
  rank's heads of the canonical block (rank r's view is rank r+1's, mod t): every head
  lands in the wrong rank.
"""

from __future__ import annotations

import logging
import os

from dualpath.errors import UsageError

KNOWN = frozenset({"load_skip_layer", "load_flip_byte", "tp_swap_ranks"})

log = logging.getLogger("dualpath.fault_injection")


def _parse(text: str) -> frozenset[str]:
    names = frozenset(n.strip() for n in text.split(",") if n.strip())
    unknown = names - KNOWN
    if unknown:
        raise UsageError(f"DUALPATH_FAULTS: unknown fault {', '.join(sorted(unknown))}; "
                         f"known: {', '.join(sorted(KNOWN))}")
    return names


ACTIVE = _parse(os.environ.get("DUALPATH_FAULTS", ""))
if ACTIVE:
    log.warning("FAULT INJECTION ON: %s (DUALPATH_FAULTS; tests only)", ", ".join(sorted(ACTIVE)))


def active(name: str) -> bool:
    if name not in KNOWN:
        raise UsageError(f"unknown fault {name!r}")
    return name in ACTIVE
