"""JSONL traces: bad input names its line and field; writer -> loader round trip."""

import io
import json

import numpy as np
import pytest

from dualpath.trace.generator import generate
from dualpath.trace.loader import TraceFormatError, read_jsonl, write_jsonl
from dualpath.trace.model import Round, Trajectory

GOOD = '{"id": "a", "rounds": [{"append_tokens": 612, "gen_tokens": 140}]}'


def load(text):
    return read_jsonl(io.StringIO(text), name="t.jsonl")


def test_reads_the_documented_format():
    text = (GOOD + "\n"
            '{"id": "b", "rounds": [{"append_tokens": 3, "gen_tokens": 1},'
            ' {"append_tokens": 0, "gen_tokens": 2}]}\n')
    tr = load(text)
    assert [t.id for t in tr.trajectories] == ["a", "b"]
    assert tr.trajectories[1].rounds == (Round(3, 1), Round(0, 2))
    assert tr.context_scale == 1.0 and tr.meta["path"] == "t.jsonl"


@pytest.mark.parametrize("line, field", [
    ('{"id": "x", "rounds": [', "invalid JSON"),
    ('[1, 2]', "expected a JSON object"),
    ('{"rounds": [{"append_tokens": 1, "gen_tokens": 1}]}', "id: must be a non-empty"),
    ('{"id": "x"}', "rounds: missing"),
    ('{"id": "x", "rounds": []}', "rounds: must be a non-empty list"),
    ('{"id": "x", "rounds": [{"gen_tokens": 1}]}', r"rounds\[0\].append_tokens: missing"),
    ('{"id": "x", "rounds": [{"append_tokens": 5}]}', r"rounds\[0\].gen_tokens: missing"),
    ('{"id": "x", "rounds": [{"append_tokens": 5, "gen_tokens": -3}]}',
     r"rounds\[0\].gen_tokens: must be an integer >= 1, got -3"),
    (('{"id": "x", "rounds": [{"append_tokens": 5, "gen_tokens": 1},'
     ' {"append_tokens": -1, "gen_tokens": 1}]}'),
     r"rounds\[1\].append_tokens: must be an integer >= 0, got -1"),
    ('{"id": "x", "rounds": [{"append_tokens": 0, "gen_tokens": 1}]}',
     r"rounds\[0\].append_tokens: must be an integer >= 1"),
    ('{"id": "x", "rounds": [{"append_tokens": 2.5, "gen_tokens": 1}]}',
     r"append_tokens: must be an integer"),
    ('{"id": "x", "rounds": [{"append_tokens": 2, "gen_token": 1}]}', "unknown field 'gen_token'"),
    (('{"id": "x", "rounds": [{"append_tokens": 2, "gen_tokens": 1,'
     ' "append_token_ids": [1, 2]}]}'), "give both append_token_ids and gen_token_ids"),
    (('{"id": "x", "rounds": [{"append_tokens": 2, "gen_tokens": 1,'
     ' "append_token_ids": [1], "gen_token_ids": [3]}]}'),
     r"rounds\[0\].append_token_ids: must be a list of 2 token ids, got 1"),
    (('{"id": "x", "rounds": [{"append_tokens": 1, "gen_tokens": 1,'
     ' "append_token_ids": [-4], "gen_token_ids": [3]}]}'),
     r"append_token_ids\[0\]: token id must be"),
    ('{"meta": {}}', "must be alone and on line 1"),
])
def test_bad_line_names_line_number_and_field(line, field):
    # the bad line is line 3, after a valid trajectory and a blank line
    with pytest.raises(TraceFormatError, match=field) as e:
        load(GOOD + "\n\n" + line + "\n")
    assert e.value.line == 3
    assert str(e.value).startswith("t.jsonl:3: ")


def test_duplicate_ids_and_empty_files_are_errors():
    with pytest.raises(TraceFormatError, match="t.jsonl:2: id: 'a' already used on line 1"):
        load(GOOD + "\n" + GOOD + "\n")
    with pytest.raises(TraceFormatError, match="no trajectories"):
        load('{"meta": {"context_scale": 0.5}}\n\n')


def test_ids_for_some_rounds_only_is_an_error():
    line = ('{"id": "x", "rounds": [{"append_tokens": 1, "gen_tokens": 1,'
            ' "append_token_ids": [1], "gen_token_ids": [2]},'
            ' {"append_tokens": 1, "gen_tokens": 1}]}')
    with pytest.raises(TraceFormatError, match=r"1: rounds\[1\]: token ids must be given"):
        load(line)


def test_unsupported_format_version():
    with pytest.raises(TraceFormatError, match="format_version"):
        load('{"meta": {"format_version": 99}}\n' + GOOD)


def test_round_trip_generated_trace(tmp_path):
    tr = generate(25, "48k", seed=3, context_scale=0.05)
    path = tmp_path / "trace.jsonl"
    write_jsonl(path, tr.trajectories, tr.meta)
    back = read_jsonl(path)
    assert back.trajectories == tr.trajectories
    assert back.context_scale == 0.05
    assert back.meta["seed"] == 3 and back.meta["table"] == "48k"
    lines = path.read_text().splitlines()
    assert len(lines) == 26 and json.loads(lines[0])["meta"]["format_version"] == 1


def test_round_trip_explicit_token_ids():
    t = Trajectory("ids", (Round(3, 2), Round(1, 1)), np.array([5, 6, 7, 8, 9, 10, 11]))
    buf = io.StringIO()
    write_jsonl(buf, [t])
    line = json.loads(buf.getvalue().splitlines()[1])
    assert line["rounds"][0] == {"append_tokens": 3, "gen_tokens": 2,
                                 "append_token_ids": [5, 6, 7], "gen_token_ids": [8, 9]}
    back = load(buf.getvalue())
    assert back.trajectories == (t,)
    assert back.trajectories[0].token_ids.tolist() == [5, 6, 7, 8, 9, 10, 11]
