"""A DE engine's decode batch: every request joins every step, a step's time is the cost
model's for the whole batch, joiners wait for the next step, leavers go at once."""

import asyncio

import pytest

from dualpath.engines.emulated.decode_batch import DecodeBatch
from dualpath.kv import cost
from dualpath.kv.profiles import get_profile


class Steps:
    """A sleep that records each step's duration and returns at the next loop turn."""

    def __init__(self):
        self.slept: list[float] = []

    async def __call__(self, s: float) -> None:
        self.slept.append(s)
        await asyncio.sleep(0)


def test_requests_share_steps_and_each_step_costs_the_whole_batch():
    async def main():
        steps = Steps()
        seen: list[list[int]] = []
        batch = DecodeBatch(lambda ctx: (seen.append(list(ctx)), sum(ctx))[1], steps)
        made: dict[str, list[int]] = {"a": [], "b": []}
        a = asyncio.ensure_future(batch.generate(100, 3, made["a"].append))
        b = asyncio.ensure_future(batch.generate(10, 1, made["b"].append))
        await asyncio.gather(a, b)
        return batch, steps, seen, made

    batch, steps, seen, made = asyncio.run(main())
    # Both in the first step; b leaves after its one token, a goes on alone, its
    # context one longer per step.
    assert seen == [[100, 10], [101], [102]]
    assert steps.slept == [110, 101, 102]
    assert made == {"a": [1, 2, 3], "b": [1]}
    assert batch.steps == 3 and batch.largest == 2 and len(batch) == 0


def test_a_request_joins_at_the_next_step_and_a_cancelled_one_leaves():
    async def main():
        steps = Steps()
        seen: list[int] = []
        batch = DecodeBatch(lambda ctx: (seen.append(len(ctx)), 1.0)[1], steps)
        a = asyncio.ensure_future(batch.generate(5, 4))
        await asyncio.sleep(0)                 # a's first step has begun
        b = asyncio.ensure_future(batch.generate(5, 10))
        await asyncio.sleep(0)
        await a
        b.cancel()
        with pytest.raises(asyncio.CancelledError):
            await b
        for _ in range(5):
            await asyncio.sleep(0)
        return batch, seen

    batch, seen = asyncio.run(main())
    assert seen[0] == 1                        # b was not in the step under way
    assert 2 in seen                           # then both
    assert len(batch) == 0                     # b left; the loop ended
    assert batch._loop.done()


def test_more_requests_on_a_decode_engine_make_its_steps_slower():
    """The cost model the emulated DE steps by: the Z rule's choice shows in TPOT."""
    p = get_profile("demo")
    one = cost.decode_step_s(p, [4096])
    eight = cost.decode_step_s(p, [4096] * 8)
    assert eight > one > p.decode_s_per_token
