"""A P/D decode's partial last prompt block is loaded before the forward starts
(dualpath/vllm/worker_side.py start_loads): vLLM's CPU backend writes the next token's
KV into that engine block (its KV cache update) before the attention waits for the
layer's load, and a block moves whole, so a layer-by-layer load of it would overwrite
that token's KV. The other blocks still load layer by layer. A stand-in agent records
the calls (policy only; the real loads run in tests/vllm/test_pd.py)."""

from types import SimpleNamespace

from dualpath.vllm.scheduler_side import LoadSpec, StepPlan
from dualpath.vllm.worker_side import WorkerSide

LAYERS = 4


class Handle:
    def __init__(self, log, keys, ok=True):
        self.log, self.keys, self.ok = log, keys, ok
        self.request_id = "r"
        self.given_up = ""

    def wait_layer(self, layer, timeout):
        self.log.append(("wait", tuple(self.keys), layer))
        return self.ok

    def give_up(self, why):
        self.given_up = why


class Agent:
    def __init__(self, ok=True):
        self.log: list = []
        self.ok = ok
        self.fenced = 0

    def load(self, rid, keys, units, ticket=""):
        self.log.append(("load", tuple(keys), tuple(units)))
        return Handle(self.log, keys, self.ok if len(keys) == 1 else True)

    def fence(self):
        self.fenced += 1


def _side(agent):
    w = WorkerSide(SimpleNamespace(load_timeout_s=5.0), "m")
    w.agent = agent
    w.kv = SimpleNamespace(placement=SimpleNamespace(fmt=SimpleNamespace(units=1,
                                                                          layers=LAYERS)))
    return w


def test_the_partial_last_block_lands_before_the_forward_and_the_rest_layer_by_layer():
    agent = Agent()
    w = _side(agent)
    w.start_loads(StepPlan(loads=[LoadSpec("r", [b"a", b"b", b"t"], [5, 6, 7], "", True),
                                  LoadSpec("q", [b"c"], [9])]))
    assert agent.log == [("load", (b"t",), (7,)),          # the tail first, alone
                         ("load", (b"a", b"b"), (5, 6)),
                         ("load", (b"c",), (9,)),
                         ("wait", (b"t",), LAYERS - 1)]   # every layer of it, now
    assert [units for _, units in w._loads] == [[7], [5, 6], [9]]


def test_a_partial_last_block_that_does_not_load_is_fenced_and_recomputed():
    agent = Agent(ok=False)
    w = _side(agent)
    w.start_loads(StepPlan(loads=[LoadSpec("r", [b"t"], [7], "", True)]))
    assert agent.fenced == 1
    (h, units), = w._loads
    assert h.given_up == "timed out" and units == [7]
