"""The PE side of a node whose engine is a vLLM prefill instance (``kv_producer``).

The node fetched an assignment (PE, DE, read side); its prefill (docs/vllm.md, "Prefill
and decode", has the message sequence):

    PrepareRequest -> the DE reserves DE-buffer slots for every prompt block
    stage the hit (dualpath/engines/vllm/stage.py) in a PE-buffer reservation, at once:
      blocks [0, local)    this node reads them from storage, layer by layer (PE read),
                           and sends each layer on to the DE buffer as it lands
      blocks [local, hit)  a LOAD_HIT_KV order: the DE reads them into its buffer and
                           WRITEs each layer here (DE read; both parts: a split read)
    one /v1/completions request to the prefill instance (the prompt's token ids,
    max_tokens 1, kv_transfer_params naming the request and a one-time ticket):
      its connector's lookup and load find the stage by the ticket; vLLM's forward
      waits for layer l only until layer l is staged (``wait_for_layer_load``)
      its saves (every prompt block it computes, layer by layer into PE-buffer slots)
      are sent on to the same blocks of the DE buffer, never persisted here
    -> PrefillDone(kv_blocks: the leading prompt blocks now whole in the DE buffer) ->
       PREFILL_DONE

Task management (attempts, cancel, stop, claims, completions) is PrefillPath's. A hit
block missing or corrupt on either side ends the hit there: vLLM computes from it (its
load reports it failed) and the DE gets the recomputed block from the saves. Memory a DE
may still write into is fenced when it did not confirm its writes ended.

Threads: the node's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

from dualpath import clock
from dualpath.aio import retrieved
from dualpath.buffers.pool import Reservation
from dualpath.engines.vllm.engine import VllmEngine
from dualpath.engines.vllm.instance import InstanceError, VllmInstance
from dualpath.engines.vllm.stage import AllAtOnce, Stage
from dualpath.errors import DualPathError, TransferError
from dualpath.paths.assignment import Assignment, split_blocks
from dualpath.paths.errors import PeerUnavailable
from dualpath.paths.kvplan import PrefillPlan
from dualpath.paths.layers import BothReady, LayerSource, LocalArrivals, RemoteWatch
from dualpath.paths.peers import LoadOrder, PrefillReport, PrepareJob
from dualpath.paths.prefill import PrefillPath
from dualpath.paths.ranks import EngineRank
from dualpath.roles import ReadSide
from dualpath.transfer.kvio import write_layers

log = logging.getLogger("dualpath.node")


class VllmPrefillPath(PrefillPath):
    """PrefillPath whose :meth:`prefill` drives the vLLM instance at ``instance``."""

    def __init__(self, node, engine: VllmEngine, instance: VllmInstance):
        super().__init__(node, None)   # its KV space: once the worker attached (kind.py)
        self.vllm = engine
        self.instance = instance

    async def prefill(self, e: EngineRank, a: Assignment, plan: PrefillPlan) -> None:
        assigned = clock.unix_now()              # the request's queueing ends here
        n, eng, space = self.node, self.vllm, self.vllm.space
        fmt = space.fmt
        T, k = fmt.block_tokens, fmt.units
        p = a.payload
        rid, prompt, de = a.request_id, a.prompt_tokens, a.decode_address
        ids = plan.token_ids
        spans, keys = plan.spans, plan.full_keys
        # The partial last block: the instance saves its tokens too, and they go to the
        # DE with the rest, so the decode instance computes the first token only, not
        # the prompt's last block again (docs/vllm.md, "The partial last block").
        tail = plan.tail_keys
        if self._in_instance(keys[:plan.hit_blocks], p.cache_salt):
            # The instance's own prefix cache holds the whole hit: stage none of it. Its
            # saves send the prompt blocks on to the DE (those its instance does not hold:
            # the connector saves past the staged and the unsent blocks); where the hint
            # was wrong, vLLM computes.
            n.metrics.instance_cache_blocks.inc(plan.hit_blocks)
            self.space.read_queue.forget(rid)      # the reads expected since assign()
            plan = plan.with_parts(0, 0)
        planned = plan.hit_blocks
        if plan.local and plan.remote:
            plan = plan.with_parts(*await self._split_stored(keys[:planned], plan.local,
                                                             plan.remote))
        elif plan.local and p.read_policy in ("scheduler", "round_robin"):
            # (A forced read side, an ablation's, is kept as it was asked.)
            plan = plan.with_parts(*await self._tail_to_decode(keys[:plan.local]))
        local, remote, hit = plan.local, plan.remote, plan.hit_blocks
        prep = stage = res = reader = out = None
        watch: RemoteWatch | None = None
        finished = False
        read_end = [0.0]                # when this node's own read ended
        try:
            prep = await n.peers.prepare(de, PrepareJob(
                rid, a.decode_engine_id, n.address, prompt, a.hit_tokens,
                a.payload_bytes, a.attempt, plan.decode_read_tokens))
            if prep.buffer is None or prep.base + len(prep.slots) != len(spans):
                raise PeerUnavailable(f"{rid}: the DE prepared {len(prep.slots)} blocks "
                                      f"from block {prep.base}, {len(spans)} needed")
            out = _ToDecode(n, space, rid, de, prep, keys + tail)
            ticket = secrets.token_hex(16)
            # The hit's slots and those of the blocks the instance computes and saves
            # (not those its DE holds: prep.held), taken whole (vllm_stage.py): the saves
            # then need no reservation of their own.
            saved = max(hit, prep.held)
            slots = hit + len(keys) + len(tail) - saved
            res = await space.pool.reserve(slots) if slots else None
            allocated = clock.unix_now()
            t_read = time.time()
            sources: list[LayerSource] = []
            first_parts: list = []
            usable_parts: list = []
            if local:                   # expected since assign(); again for a retry
                space.read_queue.expect(rid, local * T)
                arrivals = LocalArrivals()
                ok0, reader = await eng.read_layered(rid, keys[:local], res, arrivals)

                def read_done(_) -> None:
                    space.read_queue.forget(rid)
                    read_end[0] = time.time()
                reader.add_done_callback(read_done)
                sources.append(arrivals)
                first_parts.append(_const(ok0))
                usable_parts.append(reader)
                out.push(res, 0, ok0, source=arrivals, done=asyncio.shield(reader))
            if remote:
                await n.transfer.connect(de)
                watch = n.peers.watch(de, rid, a.attempt)
                watch.scope = space.grant(n.transfer, a.decode_identity, res, local, hit)
                await n.peers.order_load(de, LoadOrder(
                    rid, keys[local:hit], n.address,
                    space.buffer, space.buffer_units(res)[local * k:hit * k], a.attempt,
                    first_block=local))
                sources.append(watch)
                first_parts.append(_remote_usable(watch))
                usable_parts.append(_remote_usable(watch))
            source = (BothReady(sources) if len(sources) > 1 else
                      sources[0] if sources else LocalArrivals())
            if not (p.layerwise and n.cfg.engine.layerwise):
                source = AllAtOnce(source, fmt.layers)
            stage = Stage(rid, ticket, keys[:hit], res, source,
                          _combine(first_parts, local), _combine(usable_parts, local),
                          release=lambda r: r is None or r.release(),
                          on_saved=out.on_saved, computed=keys[saved:] + tail,
                          salt=p.cache_salt, unsent=prep.held)
            eng.stages[rid] = stage
            try:
                # Oracle: the instance's own prefix cache holds the hit; every prompt
                # block still goes to the DE (save_all), as if its HBM had it too.
                first = await self.instance.complete(
                    [int(t) for t in ids], 1, request_id=rid, ticket=ticket,
                    save_all=p.oracle, cache_salt=p.cache_salt, tenant=p.tenant,
                    temperature=p.temperature, top_p=p.top_p, seed=p.seed,
                    ignore_eos=p.ignore_eos, sampling=first_token_sampling(p.sampling))
            except InstanceError as err:
                if err.unreachable:
                    self.instance.mark_down(str(err))
                raise DualPathError(f"prefill instance: {err}") from None
            usable = await stage.usable if hit else 0
            await out.wait()
            if remote:                  # what the DE read intact is in its buffer already
                out.arrived(local, usable - local)
            read_span = (t_read, read_end[0] or time.time()) if local else (0.0, 0.0)
            if usable < planned:
                self._usable(rid, usable, planned, T)
            report = PrefillReport(rid, e.engine_id, n.node_id, 0.0,
                                   min(local, usable) * space.layout.full_bytes, read_span,
                                   a.attempt, usable * T, out.whole_prefix(),
                                   (first.token_ids[0], first.logprobs[0],
                                    first.finish_reason == "stop"),
                                   first.top[0] if first.top else None,
                                   # (the hit is read while vLLM computes, layer by
                                   # layer: no staging phase of its own)
                                   phases=(assigned, allocated, allocated))
            await self._done(de, report)
            finished = True
        finally:
            await self._end_attempt(de, rid, a.attempt, prep is not None, finished,
                                    lambda tell: self.request_finished(de, rid, a.attempt, tell,
                                                              stage, res, reader, out,
                                                              watch))

    def _in_instance(self, keys: list[bytes], salt: str) -> bool:
        """Whether the instance's prefix cache likely holds all of ``keys`` (a hint:
        dualpath/engines/vllm/instance_cache.py)."""
        cache = self.vllm.instance_cache
        return bool(keys) and cache is not None and cache.leading(salt, keys) == len(keys)

    async def request_finished(self, de: str, rid: str, attempt: int, tell: bool, stage, res,
                      reader, out, watch) -> None:
        """The end of an attempt here: the pushes and reads settled, the DE told (when
        it did not finish), the stage's slots released, or fenced while the DE's load
        may still write into them (it did not say it ended)."""
        n, eng = self.node, self.vllm
        if stage is not None and eng.stages.get(rid) is stage:
            del eng.stages[rid]
        if out is not None:
            await out.settle()          # their WRITEs read our slots: let them end
        if reader is not None and not reader.done():
            reader.cancel()             # it waits for its reads in flight
            await asyncio.gather(reader, return_exceptions=True)
        told = False
        if tell:
            told = await n.peers.cancel(de, rid, attempt)
        fence = watch is not None and not watch.complete and not told
        if watch is not None:
            watch.close()
        if res is not None:
            def release(r: Reservation) -> None:
                if fence:               # the DE may still be writing into it
                    n.fences.hold(de, rid, attempt, r)
                else:
                    r.release()
            if stage is not None:
                stage._release = release
                stage.unref()           # the last load's reference lets the slots go
            else:
                release(res)
        elif stage is not None:
            stage.unref()

    async def _tail_to_decode(self, keys: list[bytes]) -> tuple[int, int]:
        """A PE read's (local, remote) parts: the leading ``keys`` stored now are read
        here, the rest by the DE. An agent's next turn often comes while its last turn's
        blocks are still in the decode node's write-back (they reach the store at the
        storage NIC's pace): this node would find them missing and compute them (a
        6,144-token SmolLM2 hit: 23 of 48 blocks, 18 s), the DE copies them from its
        DRAM."""
        store = self.space.store
        # Blocks reach the store in prompt order: when the last is there, the rest is
        # (one metadata call, not one per block; a hole found later is recomputed).
        if await store.arun(store.contains, keys[-1]):
            return len(keys), 0
        stored = await store.arun(store.leading, keys)
        return stored, len(keys) - stored

    async def _split_stored(self, keys: list[bytes], local: int, remote: int
                            ) -> tuple[int, int]:
        """A split read's (local, remote) parts over the leading ``keys`` stored now, in
        the scheduler's proportions. The newest blocks of a hit (the tail: the DE's part)
        may still be in a decode node's write-back; a DE that found them missing would
        read less than its share and leave this node the busiest storage NIC. The blocks
        cut off are computed, as a missing block always is."""
        store = self.space.store
        stored = await store.arun(store.leading, keys)
        if stored == len(keys):
            return local, remote
        # The scheduler's split of ``stored`` blocks, as _parts cut the whole hit (the
        # parts, in blocks, are the ratio; the rounding is the same).
        return split_blocks("scheduler", ReadSide.SPLIT, stored, local, remote, 1)


def first_token_sampling(s: dict) -> dict:
    """The request's sampling for the prefill instance, which samples its first token
    only (max_tokens 1): min_tokens counts that one."""
    if s.get("min_tokens"):
        return {**s, "min_tokens": 1}
    return s


class _ToDecode:
    """A request's prompt blocks on their way from PE-buffer slots to the same blocks of
    the DE buffer (``prep``'s slots), and which of them arrived whole there. The leading
    ``prep.held`` blocks are not sent: the decode instance holds them in its own prefix
    cache (they count as there). ``keys``: the prompt's blocks, its partial last block
    too when it has one (sent whole, like the others: on vLLM's CPU backend a block's K
    plane is stored element-major, [head_size, block_size], so a range of its tokens is
    no range of bytes; the bytes past its tokens are never read)."""

    def __init__(self, n, space, rid: str, de: str, prep, keys: list[bytes]):
        self.n, self.space, self.rid, self.de, self.prep = n, space, rid, de, prep
        self.keys = keys
        self.index = {key: i for i, key in enumerate(keys)}
        self.units = prep.buffer.units_of_slots(prep.slots)
        self.pushes: list[asyncio.Future] = []
        self.held, self.base = prep.held, prep.base       # units[i]: block base + i
        self.sent: set[int] = set(range(self.held))

    def push(self, src: Reservation, first: int, nblocks: int, source=None,
             done=None) -> asyncio.Future:
        """Blocks [first, first + nblocks) of the prompt, in ``src``'s slots, to the same
        blocks of the DE buffer (each layer once ``source`` has it); ``done``: how many
        of them turned out usable (a read that ended short), else all."""
        k, T = self.space.fmt.units, self.space.fmt.block_tokens
        skip = min(nblocks, max(0, self.held - first))     # the DE's instance has them

        async def go() -> None:
            if skip == nblocks:
                return
            try:
                await write_layers(self.n.transfer, self.de, self.space.buffer,
                                   self.space.buffer_units(src)[skip * k:nblocks * k],
                                   self.prep.buffer,
                                   self.units[(first + skip - self.base) * k:
                                              (first + nblocks - self.base) * k], 0,
                                   (nblocks - skip) * T, source=source)
            except TransferError as err:
                raise PeerUnavailable(f"sending KV of {self.rid} to {self.de}: {err}") \
                    from err
            self.arrived(first, nblocks if done is None else min(nblocks, await done))
        # Retrieved: a save the instance ends after the attempt settled its pushes
        # starts one nobody gathers (bench/vllm_faults.py: its DE killed meanwhile).
        f = retrieved(asyncio.ensure_future(go()))
        self.pushes.append(f)
        return f

    def on_saved(self, saved: list[bytes], slots: Reservation) -> None:
        """The instance saved ``saved`` (consecutive prompt blocks) into ``slots``."""
        first = self.index.get(saved[0], -1) if saved else -1
        if first < 0 or self.keys[first:first + len(saved)] != saved:
            log.warning("%s: vLLM saved blocks that are not this prompt's; dropped",
                        self.rid)
            slots.release()
            return
        f = self.push(slots, first, len(saved))
        f.add_done_callback(lambda _: slots.release())

    def arrived(self, first: int, count: int) -> None:
        self.sent.update(range(first, first + max(0, count)))

    def whole_prefix(self) -> int:
        """The leading prompt blocks whole in the DE buffer (PrefillDone.kv_blocks)."""
        n = 0
        while n in self.sent:
            n += 1
        return n

    async def wait(self) -> None:
        await asyncio.gather(*self.pushes)

    async def settle(self) -> None:
        """Let every push end (a failed one's error retrieved): none reads our slots."""
        pending = [f for f in self.pushes if not f.done()]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        for f in self.pushes:
            if f.done() and not f.cancelled():
                f.exception()


async def _const(v: int) -> int:
    return v


async def _remote_usable(watch: RemoteWatch) -> int:
    await watch.ready(0)
    return watch.loaded_blocks


async def _combine(parts: list, local: int) -> int:
    """Usable leading hit blocks of a hit staged in parts: the local part [0, local)
    first, the DE's part after it (counted only when the local part is whole)."""
    got = [await p for p in parts]
    if not got:
        return 0
    if local and len(got) == 1:
        return got[0]
    if not local:
        return got[0]
    return got[0] if got[0] < local else local + got[1]
