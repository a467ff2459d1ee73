"""DualPathConnector's scheduler role as bookkeeping (dualpath/vllm/scheduler_side.py),
driven with small stand-ins for vLLM's Request and SchedulerOutput.

Expected values follow vLLM's contract as the module states it: a hit never covers the
last prompt token (at most (len - 1) // T blocks), loads go into the engine blocks
after vLLM's local hit, and every block is saved once, when it becomes full, unless it
was loaded (or went back to being computed after a failed load)."""

from types import SimpleNamespace

from dualpath.kv.prefix import ROOT_KEY, block_keys, chain_key
from dualpath.vllm.scheduler_side import SchedulerSide

T = 4


class Store:
    def __init__(self):
        self.keys: set[bytes] = set()
        self.calls = 0

    def __call__(self, keys):
        self.calls += 1
        self.last = list(keys)
        n = 0
        for k in keys:
            if k not in self.keys:
                break
            n += 1
        return n


def _req(rid, tokens):
    return SimpleNamespace(request_id=rid, prompt_token_ids=list(tokens),
                           all_token_ids=list(tokens))


def _new(rid, block_ids, computed):
    return SimpleNamespace(req_id=rid, block_ids=(list(block_ids),),
                           num_computed_tokens=computed)


def _cached(entries, resumed=()):
    return SimpleNamespace(req_ids=[e[0] for e in entries], resumed_req_ids=set(resumed),
                           new_block_ids=[(list(e[1]),) if e[1] is not None else None
                                          for e in entries],
                           num_computed_tokens=[e[2] for e in entries])


def test_a_hit_never_covers_the_last_prompt_token():
    store = Store()
    tokens = list(range(100, 108))                      # exactly 2 blocks
    store.keys.update(block_keys(tokens, T))
    s = SchedulerSide(store, T)
    assert s.matched_tokens(_req("r", tokens), 0) == T  # block 1 holds the last token
    tokens9 = tokens + [7]
    assert s.matched_tokens(_req("q", tokens9), 0) == 2 * T


def test_hits_start_after_the_local_prefix_and_stop_at_a_hole():
    store = Store()
    tokens = list(range(50, 50 + 5 * T + 1))
    keys = block_keys(tokens, T)
    store.keys.update(keys[:2] + keys[3:])             # a hole at block 2
    s = SchedulerSide(store, T)
    assert s.matched_tokens(_req("r", tokens), 0) == 2 * T
    assert s.matched_tokens(_req("r", tokens), T) == T  # vLLM has block 0 locally
    assert s.matched_tokens(_req("r", tokens), 2 * T) == 0
    assert s.matched_tokens(_req("r", tokens), 3) == 0  # a local hit inside a block


def test_a_block_vllm_holds_itself_need_not_be_stored():
    """The lookup asks only past vLLM's local hit: a P/D decode instance's own prefix
    cache holds the leading blocks its node was not sent (nor stored, perhaps)."""
    store = Store()
    tokens = list(range(50, 50 + 5 * T + 1))
    keys = block_keys(tokens, T)
    store.keys.update(keys[:2] + keys[3:])             # a hole at block 2
    s = SchedulerSide(store, T)
    assert s.matched_tokens(_req("r", tokens), 3 * T) == 2 * T    # blocks 3 and 4
    store.keys.clear()
    assert s.matched_tokens(_req("r", tokens), 3 * T) == 0


def test_a_plan_loads_into_the_allocated_blocks_and_saves_what_becomes_full():
    store = Store()
    prompt = list(range(10, 10 + 3 * T + 2))            # 3 full blocks + 2 tokens
    keys = block_keys(prompt, T)
    store.keys.update(keys[:2])
    s = SchedulerSide(store, T)
    r = _req("r", prompt)
    assert s.matched_tokens(r, 0) == 2 * T
    s.after_alloc(r, [7, 3, 9, 4], 2 * T)
    plan = s.build([_new("r", [7, 3, 9, 4], 2 * T)], _cached([]), {"r": len(prompt) - 2 * T})
    (load,) = plan.loads
    assert (load.keys, load.units) == (keys[:2], [7, 3])
    (save,) = plan.saves                                # block 2 becomes full; 0, 1 loaded
    assert (save.keys, save.units) == (keys[2:3], [9])
    # Decode: 2 tokens generated fill block 3 at the step whose KV covers token 16.
    r.all_token_ids += [1, 2]
    n = len(prompt)
    assert not s.build([], _cached([("r", None, n)]), {"r": 1}).saves    # 15 tokens
    plan = s.build([], _cached([("r", None, n + 1)]), {"r": 1})          # 16 tokens
    (save,) = plan.saves
    assert (save.keys, save.units) == (block_keys(r.all_token_ids, T)[3:4], [4])
    assert not s.build([], _cached([("r", [8], n + 2)]), {"r": 1}).saves  # nothing new


def test_blocks_recomputed_after_a_failed_load_are_saved_again():
    store = Store()
    prompt = list(range(3 * T + 1))
    keys = block_keys(prompt, T)
    store.keys.update(keys)
    s = SchedulerSide(store, T)
    r = _req("r", prompt)
    assert s.matched_tokens(r, 0) == 3 * T
    s.after_alloc(r, [1, 2, 3, 4], 3 * T)
    plan = s.build([_new("r", [1, 2, 3, 4], 3 * T)], _cached([]), {"r": 1})
    assert plan.loads and not plan.saves
    # vLLM found block 1 invalid: its computed tokens went back to T, it recomputes.
    plan = s.build([], _cached([("r", None, T)]), {"r": 2 * T + 1})
    (save,) = plan.saves
    assert (save.keys, save.units) == (keys[1:3], [2, 3])


def test_a_resumed_request_takes_its_new_blocks_and_a_failed_lookup_is_no_hit():
    s = SchedulerSide(lambda keys: 0, T)
    r = _req("r", list(range(2 * T + 1)))
    assert s.matched_tokens(r, 0) == 0
    s.after_alloc(r, [5, 6, 7], 0)
    s.build([_new("r", [5, 6, 7], 0)], _cached([]), {"r": T})            # block 0 full
    # Preempted, resumed with other blocks: saves name the new ones.
    plan = s.build([], _cached([("r", [8, 9, 10], T)], resumed=["r"]), {"r": T + 1})
    (save,) = plan.saves
    assert save.units == [9]
    s.finished("r")
    assert "r" not in s.reqs


def test_block_units_make_one_dualpath_block_of_several_engine_blocks():
    store = Store()
    prompt = list(range(4 * T + 1))                     # 2 DualPath blocks of 2 units
    keys = block_keys(prompt, 2 * T)
    store.keys.update(keys[:1])
    s = SchedulerSide(store, T, block_units=2)
    r = _req("r", prompt)
    assert s.matched_tokens(r, 0) == 2 * T
    assert s.matched_tokens(r, T) == 0                  # not aligned to a DualPath block
    s.matched_tokens(r, 0)
    s.after_alloc(r, [4, 5, 6, 7, 8], 2 * T)
    plan = s.build([_new("r", [4, 5, 6, 7, 8], 2 * T)], _cached([]), {"r": 2 * T + 1})
    assert plan.loads[0].units == [4, 5] and plan.saves[0].units == [6, 7]


class Staged(Store):
    """A node's answer for a staged P/D prefill: (staged hit blocks, blocks not sent)."""

    def __init__(self, staged: int, unsent: int):
        super().__init__()
        self.answer = (staged, unsent)

    def staged(self, keys, request_id, ticket):
        assert ticket == "t"
        return self.answer


def _ticketed(rid, tokens):
    r = _req(rid, tokens)
    r.kv_transfer_params = {"dualpath": {"request_id": rid, "ticket": "t"}}
    return r


def _first_saves(unsent: int) -> list:
    """A P/D prefill whose instance holds 4 of its 5 full blocks itself (nothing
    staged) and whose DE is not sent ``unsent`` of them: the blocks it saves."""
    tokens = list(range(10, 10 + 5 * T + 1))
    s = SchedulerSide(Staged(0, unsent), T)
    r = _ticketed("r", tokens)
    assert s.matched_tokens(r, 4 * T) == 0
    s.after_alloc(r, list(range(6)), 0)
    plan = s.build([_new("r", range(6), 4 * T)], _cached([]), {"r": T + 1})
    keys = block_keys(tokens, T)
    tail = chain_key(keys[-1], tokens[5 * T:])       # (saved too: the DE's as well)
    return [[keys.index(k) if k != tail else "tail" for k in sv.keys]
            for sv in plan.saves]


def test_a_pd_prefill_saves_every_block_its_decode_node_needs_and_no_other():
    assert _first_saves(0) == [[0, 1, 2, 3, 4], ["tail"]]   # local hits too: the DE's
    assert _first_saves(3) == [[3, 4], ["tail"]]            # its instance holds 0..2


def test_a_pd_prefill_saves_its_partial_last_block_in_the_step_that_computes_it():
    """The prompt's partial last block (3 tokens) is saved under the key of its own
    tokens, into its engine block, once: in the step whose tokens reach the prompt's
    end, not before (a chunked prefill) and not again."""
    tokens = list(range(10, 10 + 3 * T + 3))
    keys = block_keys(tokens, T)
    tail = chain_key(keys[-1], tokens[3 * T:])
    s = SchedulerSide(Staged(0, 0), T)
    r = _ticketed("r", tokens)
    assert s.matched_tokens(r, 0) == 0
    s.after_alloc(r, [4, 5, 6, 7], 0)
    plan = s.build([_new("r", [4, 5, 6, 7], 0)], _cached([]), {"r": 2 * T})   # a chunk
    assert [sv.keys for sv in plan.saves] == [keys[:2]]
    plan = s.build([], _cached([("r", None, 2 * T)]), {"r": T + 3})           # the rest
    assert [(sv.keys, sv.units) for sv in plan.saves] == [(keys[2:3], [6]), ([tail], [7])]
    r.all_token_ids += [1]                               # decoded: block 3 fills
    plan = s.build([], _cached([("r", None, 3 * T + 3)]), {"r": 1})
    assert [sv.keys for sv in plan.saves] == [block_keys(r.all_token_ids, T)[3:]]
    # Not a P/D prefill (no ticket): no partial block is ever saved.
    s = SchedulerSide(Store(), T)
    r = _req("q", tokens)
    s.matched_tokens(r, 0)
    s.after_alloc(r, [4, 5, 6, 7], 0)
    plan = s.build([_new("q", [4, 5, 6, 7], 0)], _cached([]), {"q": len(tokens)})
    assert [sv.keys for sv in plan.saves] == [keys]


def test_a_pd_decode_loads_the_partial_last_block_its_node_holds():
    """The decode instance's prompt is the prefill's and its first token: when the node
    holds the prefill's partial last block (all but that token), the hit covers it too
    and the load takes it into the request's next engine block; vLLM computes the last
    token only. Without it, the full blocks as before."""
    prefill = list(range(10, 10 + 3 * T + 2))            # 3 full blocks and 2 tokens
    keys = block_keys(prefill, T)
    tail = chain_key(keys[-1], prefill[3 * T:])
    tokens = prefill + [99]                               # + the first token
    store = Store()
    store.keys.update(keys + [tail])
    plain = SchedulerSide(store, T)                       # not a decode instance
    assert plain.matched_tokens(_req("p", tokens), 0) == 3 * T and tail not in store.last
    store.calls = 0
    s = SchedulerSide(store, T, partial_tails=True)
    r = _req("r", tokens)
    assert s.matched_tokens(r, T) == 2 * T + 2            # vLLM holds block 0 itself
    assert store.calls == 1                               # one lookup, tail and all
    s.after_alloc(r, [4, 5, 6, 7], 2 * T + 2)
    plan = s.build([_new("r", [4, 5, 6, 7], 3 * T + 2)], _cached([]), {"r": 1})
    (load,) = plan.loads
    assert (load.keys, load.units, load.tail) == (keys[1:] + [tail], [5, 6, 7], True)
    assert not plan.saves                                 # block 3 is not full yet
    store.keys.discard(tail)
    q = _req("q", tokens)
    assert s.matched_tokens(q, 0) == 3 * T                # the full blocks only
    s.after_alloc(q, [1, 2, 3, 8], 3 * T)
    (load,) = s.build([_new("q", [1, 2, 3, 8], 3 * T)], _cached([]), {"q": 3}).loads
    assert load.keys == keys and not load.tail
    # vLLM holds every full block itself: the tail alone.
    store.keys.add(tail)
    assert s.matched_tokens(_req("w", tokens), 3 * T) == 2
    # A tail never follows a hole, nor goes with DualPath blocks of several units.
    store.keys.discard(keys[1])
    assert s.matched_tokens(_req("x", tokens), 0) == T
    store.keys.update(keys)
    assert SchedulerSide(store, T // 2, block_units=2, partial_tails=True).matched_tokens(
        _req("y", tokens), 0) == 3 * T
    assert chain_key(ROOT_KEY, prefill[:T]) == keys[0]


def test_vllm_taking_fewer_external_tokens_than_the_tail_loads_no_tail():
    prefill = list(range(10, 10 + 2 * T + 2))
    keys = block_keys(prefill, T)
    store = Store()
    store.keys.update(keys + [chain_key(keys[-1], prefill[2 * T:])])
    s = SchedulerSide(store, T, partial_tails=True)
    r = _req("r", prefill + [5])
    assert s.matched_tokens(r, 0) == 2 * T + 2
    s.after_alloc(r, [1, 2, 3], 2 * T)                    # vLLM cut it to whole blocks
    (load,) = s.build([_new("r", [1, 2, 3], 2 * T)], _cached([]), {"r": 3}).loads
    assert load.keys == keys
