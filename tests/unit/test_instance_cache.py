"""The hint of what a vLLM instance's prefix cache holds (dualpath/engines/vllm/instance_cache.py)."""

from __future__ import annotations

from dualpath.engines.vllm.instance_cache import InstanceCache

K = [bytes([i]) * 16 for i in range(8)]


def test_a_hit_is_the_leading_blocks_held():
    c = InstanceCache(8)
    c.add("", K[:4])
    assert c.leading("", K[:4]) == 4
    assert c.leading("", K[:6]) == 4
    assert c.leading("", K[1:4]) == 3
    assert c.leading("", K[4:]) == 0


def test_a_salt_is_a_cache_of_its_own():
    c = InstanceCache(8)
    c.add("alice", K[:4])
    assert c.leading("alice", K[:4]) == 4
    assert c.leading("", K[:4]) == 0
    assert c.leading("bob", K[:4]) == 0


def test_the_least_recently_added_go_first_past_the_capacity():
    c = InstanceCache(4)
    c.add("", K[:4])
    c.add("", K[0:1])               # used again: the newest now
    c.add("", K[4:6])               # two more: K[1] and K[2] make room
    assert len(c) == 4
    assert c.leading("", [K[0]]) == 1
    assert c.leading("", K[1:3]) == 0
    assert c.leading("", K[3:6]) == 3


def test_cleared_when_the_instance_starts_again():
    c = InstanceCache(4)
    c.add("", K[:2])
    c.clear()
    assert c.leading("", K[:2]) == 0
    assert InstanceCache(0).leading("", []) == 0
