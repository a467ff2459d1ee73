"""`dualpath up` and `dualpath replay`."""

from __future__ import annotations


def register(sub) -> None:
    pass
