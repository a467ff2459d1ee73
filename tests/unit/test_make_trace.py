"""`dualpath replay --trace FILE --agents N` (cluster/run.make_trace): the file's first N
trajectories, and past what the file holds, extra agents by the paper's rule (A.3):
a sampled trajectory behind a new first round, so its KV is new."""

from __future__ import annotations

from dualpath.cluster.run import make_trace
from dualpath.trace.generator import generate
from dualpath.trace.loader import write_jsonl


def test_more_agents_than_the_file_holds_are_made_by_the_papers_rule(tmp_path):
    path = tmp_path / "t.jsonl"
    base = generate(2, "32k", seed=3, context_scale=0.01).trajectories
    write_jsonl(path, base)
    got = make_trace(5, path=str(path), seed=1)
    ts = got.trajectories
    assert len(ts) == 5
    assert [t.rounds for t in ts[:2]] == [t.rounds for t in base]
    for t in ts[2:]:
        src = next(b for b in base if t.id.startswith(f"{b.id}+x"))
        assert t.rounds[1:] == src.rounds and t.rounds[0].gen_tokens == 1
    assert got.meta["extended_from"] == 2
    assert make_trace(5, path=str(path), seed=1).trajectories == ts     # by its seed


def test_as_many_agents_as_the_file_holds_or_fewer_take_its_first(tmp_path):
    path = tmp_path / "t.jsonl"
    base = generate(3, "32k", seed=3, context_scale=0.01).trajectories
    write_jsonl(path, base)
    assert [t.id for t in make_trace(2, path=str(path)).trajectories] == \
        [t.id for t in base[:2]]
    got = make_trace(3, path=str(path))
    assert len(got.trajectories) == 3 and "extended_from" not in got.meta
