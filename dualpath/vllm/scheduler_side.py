"""DualPathConnector's scheduler role (vLLM's scheduler process): hits and step plans.

Hit length comes from DualPath's own deterministic chained token-id keys
(dualpath/kv/prefix.py), never from vLLM's process-seeded block hashes, so a block any
process stored is found from any other: the node daemon answers how many leading keys
of the prompt its store holds. As vLLM's own prefix cache does, the hit never covers the
last prompt token (its logits must be computed), so at most ``(len - 1) // T`` blocks.

Per step, :meth:`SchedulerSide.build_meta` tells the worker role

- which blocks to load: the hit blocks past vLLM's locally cached prefix, into the
  engine blocks vLLM allocated for them (:class:`LoadSpec`);
- which blocks to save: every DualPath block that becomes full in this step and is not
  stored yet, prompt blocks and blocks the generated tokens fill alike
  (:class:`SaveSpec`). A request whose computed tokens went back (a failed load made
  vLLM recompute) saves those blocks again once recomputed.

Pure bookkeeping over vLLM's objects; the only I/O is the lookup RPC (:class:`Lookup`).
Threads: vLLM's scheduler thread.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field

import grpc

from dualpath import tls
from dualpath.errors import UsageError
from dualpath.kv.prefix import chain_key, tenant_root
from dualpath.rpc import CHANNEL_OPTIONS
from dualpath.tls import TlsConfig
from dualpath.v1 import connector_pb2, connector_pb2_grpc

log = logging.getLogger("dualpath.vllm")


@dataclass(frozen=True)
class LoadSpec:
    request_id: str                  # DualPath's id when the request names one, else vLLM's
    keys: list[bytes]
    units: list[int]                 # engine block ids, block_units per key
    ticket: str = ""                 # the node's ticket for that request (P/D)
    # The last block is the prompt's partial last block. vLLM writes the next token's KV
    # into its engine block before the forward waits for a layer's load, and a block's
    # bytes are moved whole: the worker loads that block before the forward starts.
    tail: bool = False


@dataclass(frozen=True)
class SaveSpec:
    request_id: str
    keys: list[bytes]
    units: list[int]
    ticket: str = ""


def key_root(request) -> bytes:
    """The root of ``request``'s block keys: its tenant's (dualpath/kv/prefix.py). The
    tenant a node daemon names in ``kv_transfer_params`` (P/D, from the request's
    payload; "" the default tenant) wins; else vLLM's own ``cache_salt``, which is how a
    user of vLLM separates tenants (its prefix cache shares no blocks across salts, and
    neither does the store); else the default tenant."""
    params = getattr(request, "kv_transfer_params", None) or {}
    dp = params.get("dualpath") if isinstance(params, dict) else None
    tenant = dp.get("tenant") if isinstance(dp, dict) else None
    if not isinstance(tenant, str):
        tenant = getattr(request, "cache_salt", None) or ""
    try:
        return tenant_root(tenant)
    except UsageError:               # longer than any tenant: its own root all the same
        return tenant_root(hashlib.sha256(tenant.encode()).hexdigest())


def dualpath_params(request) -> tuple[str, str, bool]:
    """(DualPath request id, ticket, save_all) a node daemon gave this request in its
    ``kv_transfer_params`` (P/D: the node drives the instance), or ("", "", False).
    ``save_all``: save every full prompt block, vLLM's local hits too (the oracle mode:
    the hit is in vLLM's own prefix cache, and the decode side needs it all)."""
    params = getattr(request, "kv_transfer_params", None) or {}
    dp = params.get("dualpath") if isinstance(params, dict) else None
    if not isinstance(dp, dict):
        return "", "", False
    rid, ticket = dp.get("request_id"), dp.get("ticket")
    if not isinstance(rid, str) or not isinstance(ticket, str) or len(rid) > 256 \
            or len(ticket) > 64:
        return "", "", False
    return rid, ticket, dp.get("save_all") is True


@dataclass
class StepPlan:
    """What the worker does this step (vLLM's KVConnectorMetadata carries it)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


class Lookup:
    """The hit lookup RPC; a failure means "no hit" (vLLM computes), logged at most
    every 10 s."""

    def __init__(self, node_address: str, model_id: str, timeout_s: float,
                 tls_config: TlsConfig):
        self.model_id = model_id
        self.timeout_s = timeout_s
        self.channel = tls.sync_channel(node_address, tls_config, options=CHANNEL_OPTIONS)
        self.stub = connector_pb2_grpc.KvConnectorStub(self.channel)
        self.node_address = node_address
        self._warned = 0.0

    def __call__(self, keys: list[bytes]) -> int:
        """Leading ``keys`` the node holds (stored or in its DRAM)."""
        return self.staged(keys, "", "")[0]

    def staged(self, keys: list[bytes], request_id: str, ticket: str) -> tuple[int, int]:
        """A P/D prefill's (``ticket``) leading staged hit blocks, and the leading prompt
        blocks its decode node is not sent (not to be saved)."""
        if not keys:
            return 0, 0
        try:
            r = self.stub.Lookup(connector_pb2.LookupRequest(
                model_id=self.model_id, block_keys=keys, request_id=request_id,
                ticket=ticket), timeout=self.timeout_s)
            return r.hit_blocks, r.unsent_blocks
        except grpc.RpcError as e:
            now = time.monotonic()
            if now - self._warned > 10:
                self._warned = now
                log.warning("DualPath: hit lookup at node %s failed (%s %s); computing "
                            "instead", self.node_address, e.code().name, e.details())
            return 0, 0

    def close(self) -> None:
        self.channel.close()


@dataclass
class _Req:
    request: object                  # vLLM's Request (its all_token_ids grow)
    keys: list[bytes] = field(default_factory=list)    # chained keys of its full blocks
    units: list[int] = field(default_factory=list)     # its engine blocks, in order
    stored: int = -1                 # leading blocks known stored (-1: not scheduled yet)
    load: tuple[int, int] | None = None   # blocks [a, b) to load at its next schedule
    local: int = 0                   # vLLM's local hit tokens at the last lookup
    tag: str = ""                    # DualPath's request id (kv_transfer_params) or vLLM's
    ticket: str = ""
    save_all: bool = False
    staged: int = 0                  # P/D prefill (ticket): leading blocks its node staged
    unsent: int = 0                  # P/D prefill: leading blocks its DE is not sent
    tail: bytes = b""                # the partial last prompt block's key, when it loads
    root: bytes = b""                # the root of its keys: its tenant's (key_root)
    tail_saved: bool = False         # P/D prefill: its partial last block was saved

    def __post_init__(self):
        rid, self.ticket, self.save_all = dualpath_params(self.request)
        self.tag = rid or self.request.request_id


class SchedulerSide:
    """See the module docstring. ``unit_tokens`` = vLLM's block size; ``block_units``
    engine blocks per DualPath block; ``partial_tails``: a P/D decode instance's (vLLM's
    ``kv_consumer``), whose node may hold a prompt's partial last block, sent by the
    prefill node; no other instance looks for one (no store holds them)."""

    def __init__(self, lookup, unit_tokens: int, block_units: int = 1,
                 partial_tails: bool = False):
        self.lookup = lookup
        self.unit_tokens = unit_tokens
        self.units = block_units
        self.partial_tails = partial_tails and block_units == 1
        self.block_tokens = unit_tokens * block_units
        self.reqs: dict[str, _Req] = {}
        self.hit_tokens_total = 0

    def _tail_key(self, st: _Req, stop: int) -> tuple[bytes, int]:
        """(key, tokens) of the partial block of tokens ``[stop // T * T, stop)`` (its
        key chains its own tokens only, so it names exactly that prompt's partial last
        block), or (b"", 0) when ``stop`` ends a block."""
        T = self.block_tokens
        full, tail = divmod(stop, T)
        if not tail:
            return b"", 0
        keys = self._keys(st, full * T)
        parent = keys[-1] if keys else self._root(st)
        return chain_key(parent, st.request.all_token_ids[full * T:stop]), tail

    @staticmethod
    def _root(st: _Req) -> bytes:
        if not st.root:
            st.root = key_root(st.request)
        return st.root

    def _keys(self, st: _Req, tokens: int) -> list[bytes]:
        """Keys of the request's first ``tokens // T`` blocks (extending the chain)."""
        T = self.block_tokens
        want = tokens // T
        ids = st.request.all_token_ids
        while len(st.keys) < want:
            i = len(st.keys)
            parent = st.keys[-1] if st.keys else self._root(st)
            st.keys.append(chain_key(parent, ids[i * T:(i + 1) * T]))
        return st.keys[:want]

    # ------------------------------------------------------------ vLLM's hooks

    def matched_tokens(self, request, num_computed_tokens: int) -> int:
        """External hit tokens beyond the ``num_computed_tokens`` vLLM has locally."""
        st = self.reqs.get(request.request_id)
        if st is None:
            st = self.reqs[request.request_id] = _Req(request)
        T = self.block_tokens
        st.local = num_computed_tokens
        prompt = len(request.prompt_token_ids or ())
        cap = max(prompt - 1, 0) // T
        keys = self._keys(st, cap * T)
        if st.ticket:
            # A P/D prefill: its node staged the hit and sends the DE every block from
            # the staged ones on, so its saves start there even where vLLM's own prefix
            # cache had more (below, _plan); asked even when vLLM has it all.
            st.staged, st.unsent = (self.lookup.staged(keys, st.tag, st.ticket) if keys
                                    else (0, 0))
        st.tail = b""
        if num_computed_tokens % T:
            return 0             # a local hit ending inside a DualPath block: none of ours
        first = num_computed_tokens // T
        # Past vLLM's local hit only: the blocks it holds need not be stored or in the
        # node's DRAM (a P/D decode instance's own prefix cache holds the leading blocks
        # its node was not sent).
        if st.ticket:
            return max(0, (st.staged - first) * T) if first < cap else 0
        # A P/D decode: its node may hold the prompt's partial last block (all but the
        # last token, which vLLM computes), which the prefill sent with the rest; asked
        # for in the same lookup, after the full blocks.
        tail, extra = self._tail_key(st, prompt - 1) if self.partial_tails else (b"", 0)
        if first >= cap and not tail:
            return 0
        found = self.lookup(keys[first:] + ([tail] if tail else []))
        hit = first + min(found, cap - first)
        if tail and found > cap - first:
            st.tail = tail
            return (hit - first) * T + extra
        return max(0, (hit - first) * T)

    def after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        """vLLM allocated ``block_ids`` (all of the request's); load the external hit,
        which starts where the local hit of the last lookup ends."""
        st = self.reqs.setdefault(request.request_id, _Req(request))
        if num_external_tokens <= 0:
            st.load = None
            return
        T = self.block_tokens
        a = st.local // T
        b = a + num_external_tokens // T
        if not num_external_tokens % T:
            st.tail = b""                # (vLLM took less than the tail: none of it)
        st.load = (a, b)
        st.units = list(block_ids)
        self.hit_tokens_total += num_external_tokens

    def build(self, new_reqs, cached, num_scheduled: dict[str, int]) -> StepPlan:
        """The step plan for vLLM's SchedulerOutput (its new and cached requests)."""
        plan = StepPlan()
        for r in new_reqs:
            st = self.reqs.get(r.req_id)
            if st is None:
                continue
            st.units = list(r.block_ids[0])
            self._plan(st, r.req_id, r.num_computed_tokens, num_scheduled.get(r.req_id, 0),
                       plan)
        for i, rid in enumerate(cached.req_ids):
            st = self.reqs.get(rid)
            if st is None:
                continue
            new = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                st.units = list(new[0]) if new is not None else []
            elif new is not None:
                st.units.extend(new[0])
            self._plan(st, rid, cached.num_computed_tokens[i], num_scheduled.get(rid, 0), plan)
        return plan

    def _plan(self, st: _Req, rid: str, computed: int, scheduled: int, plan: StepPlan) -> None:
        T, k = self.block_tokens, self.units
        base = computed // T
        if st.load is not None:
            a, b = st.load
            st.load = None
            keys = self._keys(st, b * T)[a:b]
            tail = bool(st.tail)
            if tail:                     # the partial last block after them
                keys, b = keys + [st.tail], b + 1
            plan.loads.append(LoadSpec(st.tag, keys, st.units[a * k:b * k], st.ticket,
                                       tail))
        if st.stored < 0 or base < st.stored:
            # First schedule, or computed tokens went back: save from there (or, asked
            # to save all, from the first block, vLLM's local hits too).
            st.stored = 0 if st.stored < 0 and st.save_all and st.ticket else base
            if st.ticket and not st.save_all:
                # vLLM's local hits past the staged blocks are the DE's too: save them;
                # not those its DE is not sent (its decode instance holds them).
                st.stored = max(min(st.stored, st.staged), st.unsent)
        full = (computed + scheduled) // T
        if full > st.stored:
            keys = self._keys(st, full * T)[st.stored:full]
            plan.saves.append(SaveSpec(st.tag, keys, st.units[st.stored * k:full * k],
                                       st.ticket))
            st.stored = full
        if st.ticket and k == 1 and not st.tail_saved:
            # A P/D prefill: the step that computes the prompt's last tokens saves its
            # partial last block too, for the DE (its node sends that block's own tokens
            # on; the decode instance then computes the first token only).
            prompt = len(st.request.prompt_token_ids or ())
            tail, _ = self._tail_key(st, prompt)
            if tail and computed + scheduled >= prompt and len(st.units) > prompt // T:
                st.tail_saved = True
                plan.saves.append(SaveSpec(st.tag, [tail],
                                           st.units[prompt // T:prompt // T + 1], st.ticket))

    def finished(self, request_id: str) -> None:
        self.reqs.pop(request_id, None)
