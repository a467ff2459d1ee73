"""The inter-engine policies of paper §6.1, as plain functions over the core records.

No I/O and no clock: the :class:`~dualpath.scheduler.core.scheduler.Scheduler` calls
these inside a fetch and does the bookkeeping (queues, leases, counters) around them.
Each function says which paper rule it implements; where the paper is silent the choice
is marked "[ours]".
"""

from __future__ import annotations

from collections import deque
from heapq import heapify, heapreplace

from dualpath.kv import cost
from dualpath.kv.profiles import ModelProfile
from dualpath.scheduler.core.model import Engine, Group, Node, Params, ReadSide, Request, Stage

# ---------------------------------------------------------------- thresholds (A.4)


def derive_alpha(read_bytes_per_s: float, kv_bytes_per_token: int, window_s: float = 3.0) -> int:
    """α: tokens a node's storage NIC reads in ``window_s`` seconds (paper A.4: 3 s)."""
    return int(read_bytes_per_s * window_s / kv_bytes_per_token)


def derive_beta(profile: ModelProfile, window_s: float = 5.0, context_tokens: int = 32721,
                append_tokens: int = 429) -> int:
    """β: prompt tokens one GPU prefills in ``window_s`` seconds (paper A.4: 5 s).

    tok_e counts whole prompts, most of which is read rather than computed, so the rate is
    that of a typical agentic turn: the defaults are the paper's 64K trace (Table 2: mean
    context 32,721 tokens, mean append 429) [ours: the paper does not say which shape]."""
    return int(window_s * cost.prompt_tokens_per_s(profile, context_tokens, append_tokens))


# ---------------------------------------------------------------- PE scheduling


def pick_prefill_engine(engines: list[Engine], alpha: int, beta: int) -> Engine | None:
    """The PE for the head request (paper §6.1, PE scheduling).

    Engines with tok_e > β are overloaded and get nothing; among the rest, those whose
    node has read_q <= α (category 2) are preferred over the others (category 3); within
    the chosen category the minimum tok_e wins, ties to the lower rank [ours]. None when
    both categories are empty, which ends the fetch."""
    best: Engine | None = None
    best_short = False
    best_tok = 0
    for e in engines:
        tok = e.tok
        if tok > beta or e.drained:
            continue
        short = e.node.read_q <= alpha
        if best is None or (short and not best_short) or (short == best_short and tok < best_tok):
            best, best_short, best_tok = e, short, tok
    return best


def avoids(r: Request, g: Group, now: float) -> bool:
    """Whether ``r`` keeps away from group ``g``: it failed there under the same lease
    less than ``peer_avoid_s`` ago [ours: the paper has no failures]."""
    a = r.avoid.get(g.group_id) if r.avoid else None
    return a is not None and a[0] == g.lease_id and now < a[1]


def assign_prefill(queue: deque[Request], engines: list[Engine], params: Params,
                   limit: int, group: Group | None = None, now: float = 0.0,
                   shares: tuple[int, int] = (1, 1)) -> list[Request]:
    """Pop requests FIFO from ``queue`` and give each a PE and a read side, updating tok_e,
    seq_e and the read queues after each one so that categories are re-evaluated. A
    request that avoids ``group`` is passed over and keeps its place for other groups.
    Stops at ``limit`` requests or when the next would take the reply past
    ``params.max_fetch_reply_bytes``. ``shares``: the up (PE nodes, DE nodes), which
    weigh a split (:func:`choose_read_side`)."""
    out: list[Request] = []
    alpha, beta = params.alpha_tokens, params.beta_tokens
    split, align = params.split_read, params.split_align_tokens
    saving = params.split_min_saving_s
    room = params.max_fetch_reply_bytes
    passed: list[Request] = []
    while queue and len(out) < limit and queue[0].wire_bytes <= room:
        if queue[0].avoid and group is not None and avoids(queue[0], group, now):
            passed.append(queue.popleft())
            continue
        e = pick_prefill_engine(engines, alpha, beta)
        if e is None:
            break
        r = queue.popleft()
        room -= r.wire_bytes
        e.tok += r.prompt_tokens
        e.seq += 1
        e.assigned_total += 1
        r.pe = e
        r.stage = Stage.PREFILLING
        de_node = r.de.node  # type: ignore[union-attr]  # DE is chosen before the PE
        side, pe_part, de_part = choose_read_side(r.hit_tokens, e.node, de_node, split, align,
                                                  saving, shares)
        e.node.read_q += pe_part
        de_node.read_q += de_part
        e.node.read_tokens_total += pe_part
        de_node.read_tokens_total += de_part
        r.read_side, r.prefill_read_tokens, r.decode_read_tokens = side, pe_part, de_part
        out.append(r)
    if passed:
        queue.extendleft(reversed(passed))
    return out


# ---------------------------------------------------------------- read side


def choose_read_side(hit: int, pe_node: Node, de_node: Node, split: bool,
                     align: int, min_saving_s: float = 0.0,
                     shares: tuple[int, int] = (1, 1)) -> tuple[ReadSide, int, int]:
    """Which node reads ``hit`` tokens: ``(side, prefill_part, decode_part)``.

    Paper §6.1: the node with the shorter read queue (a tie goes to the PE [ours]: the
    PE read path needs no extra PE<-DE hop). With ``split`` (the paper's future work,
    [ours]) the hit is divided so that both queues would drain together if each node's
    read rate counted its role's share of the cluster: with ``shares`` = (P, D) up PE
    and DE nodes, (q_p + x) / (P r_p) = (q_d + hit - x) / (D r_d). A PE node's NIC
    serves the requests of D/P decode nodes (and a DE node's those of P/D prefill
    nodes), so where the queues are equal each role reads its share of the hit: in
    1P2D the PE node a third, and each node a third of all, however requests arrive.
    (Weighing the two nodes alone gave the PE node half of every hit that found the
    queues empty, 36-42% of all reads in bench/vllm_pd.py's 1P2D.) x is rounded to a
    multiple of ``align`` (a KV block); a part that rounds to nothing makes it a
    one-sided read, and so does a split that would end the reads less than
    ``min_saving_s`` sooner than the better one side [ours]: a split costs a second
    set of reads and a PE<-DE hop, which an idle, fast storage NIC (a compute-bound
    cluster) never pays back."""
    if hit <= 0:
        return ReadSide.NONE, 0, 0
    qp, qd = pe_node.read_q, de_node.read_q
    if split:
        rp, rd = pe_node.read_tokens_per_s, de_node.read_tokens_per_s
        wp, wd = rp * max(1, shares[0]), rd * max(1, shares[1])
        x = (wp * (qd + hit) - wd * qp) / (wp + wd)
        x = round(x / align) * align
        if x <= 0:
            return ReadSide.DECODE, 0, hit
        if x >= hit:
            return ReadSide.PREFILL, hit, 0
        on_pe, on_de = (qp + hit) / rp, (qd + hit) / rd
        both = max((qp + x) / rp, (qd + hit - x) / rd)
        if min(on_pe, on_de) - both >= min_saving_s:
            return ReadSide.SPLIT, x, hit - x
        return (ReadSide.PREFILL, hit, 0) if on_pe <= on_de else (ReadSide.DECODE, 0, hit)
    if qp <= qd:
        return ReadSide.PREFILL, hit, 0
    return ReadSide.DECODE, 0, hit


# ---------------------------------------------------------------- DE scheduling


def distribute_to_groups(queue: deque[Request], groups: list[Group], now: float = 0.0
                         ) -> int:
    """Group phase (paper §6.1): drain the global queue, each request to the DE group
    with the minimum total tok_e. A group's load includes what already waits in its
    private queue [ours], else one drain would send everything to the same group. A
    request that avoids groups goes to the least loaded other one, or stays in the global
    queue when it avoids them all [ours]. Returns how many were placed."""
    if not groups or not queue:
        return 0
    loads = [g.tok_sum + g.private_tokens for g in groups]      # Group.total_tok, inline
    if len(queue) == 1 and not queue[0].avoid:
        # One request (the usual drain after a submit): the first least loaded group,
        # as the heap's (load, index) order would pick it, without building the heap.
        _place(queue.popleft(), groups[loads.index(min(loads))])
        return 1
    heap = [(load, i, g) for i, (load, g) in enumerate(zip(loads, groups))]
    heapify(heap)
    n = 0
    left: list[Request] = []
    while queue:
        r = queue.popleft()
        load, i, g = heap[0]
        k = 0
        if r.avoid and avoids(r, g, now):
            ok = [j for j, (_, _, h) in enumerate(heap) if not avoids(r, h, now)]
            if not ok:
                left.append(r)
                continue
            k = min(ok, key=lambda j: heap[j][:2])
            load, i, g = heap[k]
        _place(r, g)
        n += 1
        if k == 0:
            heapreplace(heap, (load + r.prompt_tokens, i, g))
        else:
            heap[k] = (load + r.prompt_tokens, i, g)
            heapify(heap)
    queue.extend(left)
    return n


def _place(r: Request, g: Group) -> None:
    g.private_queue.append(r)
    g.private_tokens += r.prompt_tokens
    r.de_group = g
    r.stage = Stage.GROUP_QUEUE


def z_target(group_queue: deque[Request], engines: list[Engine], slack: float,
             limit: int) -> float | None:
    """Z of the in-group phase, or None when not even the head request fits.

    R = the longest head of the private queue whose HBM needs fit in the group's summed
    free HBM (no fragmentation assumed; at most ``limit`` requests);
    Z = slack × (Σ_{r∈R} len(r) + Σ_{e∈E} tok_e) / |E|."""
    free_total = sum(e.free_hbm_tokens for e in engines)
    used = r_tokens = count = 0
    for r in group_queue:
        need = r.hbm_tokens
        if count >= limit or used + need > free_total:
            break
        used += need
        r_tokens += r.prompt_tokens
        count += 1
    if count == 0:
        return None
    return slack * (r_tokens + sum(e.tok for e in engines)) / len(engines)


def pick_decode_engine(engines: list[Engine], need_hbm: int, length: int,
                       z: float) -> Engine | None:
    """The DE for request r within the group (paper §6.1, in-group phase, step 3).

    Among DEs with free HBM >= r's need: those with tok_e + len(r) <= Z are preferred and
    the minimum seq_e wins; otherwise the "high-token" DE with the minimum tok_e. Ties to
    the lower rank [ours]. None when no DE has the HBM (the fetch ends)."""
    low: Engine | None = None
    high: Engine | None = None
    for e in engines:
        if e.free_hbm_tokens < need_hbm:
            continue
        if e.tok + length <= z:
            if low is None or e.seq < low.seq:
                low = e
        elif high is None or e.tok < high.tok:
            high = e
    return low if low is not None else high


def assign_in_group(group: Group, params: Params, limit: int) -> list[Request]:
    """In-group phase (paper §6.1): take the private queue's head repeatedly, place it on
    a DE and reserve its HBM, until the queue is empty, ``limit`` is reached, the reply
    would pass ``params.max_fetch_reply_bytes`` or no DE has the HBM for the head."""
    engines = [e for e in group.engines if not e.drained]
    q = group.private_queue
    if not engines or not q:
        return []
    z = z_target(q, engines, params.z_slack, limit)
    if z is None:
        return []
    out: list[Request] = []
    room = params.max_fetch_reply_bytes
    while q and len(out) < limit and q[0].wire_bytes <= room:
        r = q[0]
        need = r.hbm_tokens
        e = pick_decode_engine(engines, need, r.prompt_tokens, z)
        if e is None:
            break
        q.popleft()
        room -= r.wire_bytes
        group.private_tokens -= r.prompt_tokens
        e.tok += r.prompt_tokens
        e.seq += 1
        e.free_hbm_tokens -= need
        e.assigned_total += 1
        r.de = e
        r.stage = Stage.PREFILL_QUEUE
        out.append(r)
    return out
