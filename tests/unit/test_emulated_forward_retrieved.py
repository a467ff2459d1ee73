"""A forward step's pushes and loads that fail after the forward closed (the node
stopping while a decode node died mid-push) must not leave asyncio to log "Future
exception was never retrieved" with a traceback (bench/faults.py counted 3 in a soak);
nor a vLLM prefill's stage let go before its instance asked for the hit while the DE's
part of it failed (bench/vllm_faults.py counted 2: the prefill instance killed while
the DE dropped the request)."""

import asyncio
import gc

from dualpath.aio import retrieved
from dualpath.engines.vllm.stage import Stage


def _unretrieved_reports(make) -> list:
    """asyncio's "never retrieved" reports once what ``make()`` returns (made inside the
    loop) failed and was dropped without anyone awaiting it."""
    seen: list = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: seen.append(ctx))
        f = make()
        await asyncio.sleep(0.01)            # it failed; nobody gathers it (closed)
        del f
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(main())
    return [c for c in seen if "never retrieved" in c.get("message", "")]


async def _failed() -> int:
    raise ConnectionError("the decode node died mid-push")


def test_a_failed_push_nobody_gathers_is_not_reported_as_unretrieved():
    # the control: asyncio reports it
    assert _unretrieved_reports(lambda: asyncio.ensure_future(_failed())) != []
    assert _unretrieved_reports(lambda: retrieved(asyncio.ensure_future(_failed()))) == []


def test_a_stage_let_go_with_a_failed_remote_part_is_not_reported():
    """The DE dropped the request (its part of the hit failed) and the prefill instance
    died before it asked for the hit: nobody awaits the stage's figures."""
    def stage():
        s = Stage("r", "t", [], None, None, _failed(), _failed(), release=lambda r: None,
                  on_saved=lambda *a: None)
        s.usable.add_done_callback(lambda _: s.refs and s.unref())
        return s
    assert _unretrieved_reports(stage) == []
