"""dualpath.aio: a cancelled waiter waits for the work writing into its memory, a
second cancel included."""

import asyncio
import threading

import pytest

from dualpath.aio import to_the_end, waited_out


async def _cancel_twice(task: asyncio.Task) -> None:
    for _ in range(2):
        await asyncio.sleep(0.01)
        task.cancel()


def test_to_the_end_waits_out_two_cancels():
    release = threading.Event()
    ended = []

    def work():
        release.wait(5)
        ended.append(True)
        return 7

    async def main():
        async def caller():
            try:
                return await to_the_end(asyncio.to_thread(work))
            finally:
                seen.append(bool(ended))    # the work had ended when the caller unwound
        seen: list[bool] = []
        t = asyncio.ensure_future(caller())
        await _cancel_twice(t)
        await asyncio.sleep(0.05)
        assert not t.done()                 # still waiting for the thread, after 2 cancels
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert seen == [True]

    asyncio.run(main())


def test_to_the_end_returns_the_result():
    async def main():
        return await to_the_end(asyncio.sleep(0, result=3))
    assert asyncio.run(main()) == 3


def test_waited_out_says_whether_it_was_cancelled():
    async def main():
        a = asyncio.get_running_loop().create_future()
        b = asyncio.get_running_loop().create_future()
        w = asyncio.ensure_future(waited_out(a, b))
        await asyncio.sleep(0)
        w.cancel()
        await asyncio.sleep(0)
        a.set_result(1)
        await asyncio.sleep(0)
        assert not w.done()                 # b is still running
        b.set_result(2)
        return await w
    assert asyncio.run(main()) is True
