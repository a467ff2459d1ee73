"""A forward step's pushes and loads that fail after the forward closed (the node
stopping while a decode node died mid-push) must not leave asyncio to log "Future
exception was never retrieved" with a traceback (bench/faults.py counted 3 in a soak)."""

import asyncio
import gc

from dualpath.engine.forward import _retrieved


def _unretrieved_reports(wrap) -> list:
    seen: list = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: seen.append(ctx))

        async def push():
            raise ConnectionError("the decode node died mid-push")
        f = wrap(asyncio.ensure_future(push()))
        await asyncio.sleep(0.01)            # it failed; nobody gathers it (closed)
        del f
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(main())
    return [c for c in seen if "never retrieved" in c.get("message", "")]


def test_a_failed_push_nobody_gathers_is_not_reported_as_unretrieved():
    assert _unretrieved_reports(lambda f: f) != []        # the control: asyncio reports it
    assert _unretrieved_reports(_retrieved) == []
