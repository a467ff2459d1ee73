"""The one index of blocks on their way to disk: the first holder of a key serves it, the
next takes over when it lets go, and the index is gone once nobody holds it."""

import numpy as np

from dualpath.paths.pending import PendingBlocks


class _Holder:
    def __init__(self, *blocks):
        self.blocks = [np.full(4, b, np.uint8) for b in blocks]

    def flat(self, i):
        return self.blocks[i]


def test_the_first_holder_serves_and_the_next_takes_over():
    a, b = _Holder(1, 2), _Holder(9)
    p = PendingBlocks()
    p.add(b"k1", a, 0)
    p.add(b"k2", a, 1)
    p.add(b"k1", b, 0)               # a second request holding the same prefix block
    assert len(p) == 2 and b"k1" in p and b"k3" not in p
    assert p.get(b"k1")[0] == 1 and p.get(b"k2")[0] == 2 and p.get(b"k3") is None
    assert p.serving(b"k2") == (a, 1)
    assert [id(h) for h in p.servers()] == [id(a)]
    p.remove(b"k1", a)
    assert p.get(b"k1")[0] == 9 and p.serving(b"k1") == (b, 0)
    p.remove(b"k1", a)               # idempotent
    p.remove(b"k1", b)
    assert b"k1" not in p and len(p) == 1
    p.remove(b"k2", a)
    assert len(p) == 0 and list(p.servers()) == []
