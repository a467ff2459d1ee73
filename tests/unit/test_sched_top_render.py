"""`dualpath ctl top`'s pure half: figures from two polls (rates as deltas, per-node read
queues and assignment rates, groups) and the screen rendered from them."""

from __future__ import annotations

import json

from dualpath.scheduler import top
from dualpath.scheduler.render import msg_dict
from dualpath.v1 import admin_pb2 as apb
from dualpath.v1 import scheduler_pb2 as pb

UP, DOWN = apb.GROUP_STATE_UP, apb.GROUP_STATE_DOWN


def _poll(t: float, *, submitted: int, completed: int, assigned: tuple[int, int, int],
          de_state: int = UP, read: tuple[int, int] = (0, 0)) -> top.Poll:
    """A poll shaped exactly as the admin API's replies are (through msg_dict)."""
    stats = apb.StatsResponse(
        params=apb.Params(alpha_tokens=4000000, beta_tokens=1500000, compute_quota_ms=250,
                          split_read=True),
        global_queue_requests=5, group_queue_requests=2, prefill_queue_requests=1,
        prefilling_requests=3, decoding_requests=4, submitted_requests_total=submitted,
        completed_requests_total=completed, failed_requests_total=1, failed_attempts_total=2,
        groups_up=2 if de_state == UP else 1, groups_down=0 if de_state == UP else 1,
        model_profile="ds27b", backoff_requests=1, journal=True)
    groups = [apb.GroupView(group_id="de1", role=pb.ENGINE_ROLE_DECODE, state=de_state,
                            engines=2, unfinished_tokens=9000, private_queue_requests=2,
                            ms_since_fetch=40, lease_id=7),
              apb.GroupView(group_id="pe1", role=pb.ENGINE_ROLE_PREFILL, state=UP, engines=1,
                            unfinished_tokens=3000, ms_since_fetch=1250, lease_id=3)]
    engines = [
        apb.EngineView(engine_id="de1.0", group_id="de1", node_id="n2",
                       role=pb.ENGINE_ROLE_DECODE, unfinished_requests=3,
                       read_queue_tokens=500, assigned_requests=assigned[0],
                       node_read_bytes_total=read[1]),
        apb.EngineView(engine_id="de1.1", group_id="de1", node_id="n2",
                       role=pb.ENGINE_ROLE_DECODE, unfinished_requests=1, drained=True,
                       read_queue_tokens=500, assigned_requests=assigned[1],
                       node_read_bytes_total=read[1]),
        apb.EngineView(engine_id="pe1.0", group_id="pe1", node_id="n1",
                       role=pb.ENGINE_ROLE_PREFILL, unfinished_requests=3,
                       read_queue_tokens=64000, assigned_requests=assigned[2],
                       node_read_bytes_total=read[0])]
    return top.Poll(t=t, wall=1_700_000_000.0 + t, stats=msg_dict(stats),
                    groups=[msg_dict(g) for g in groups],
                    engines=[msg_dict(e) for e in engines])


SCREEN = """\
dualpath top  sched:7000  2023-11-14T22:15:02Z  every 2 s  model ds27b  journal on
params    alpha 4000000  beta 1500000  quota 250 ms  split_read on  groups 2 up, 0 down
requests  queued 8 (global 5, group 2, prefill 1)  running 7 (prefilling 3, decoding 4)  \
backoff 1  recovering 0
per s     submitted 3.0  completed 0.5  failed 0.0  failed_attempts 0.0  \
lost_attempts 0.0  requeued 0.0  cancelled 0.0  (over 2.00 s)

GROUP  ROLE     LEASE  LEASE_ID  FETCH_AGO_S  ENGINES  DRAINED  SEQ   TOK  QUEUED
de1    decode   up            7          0.0        2        1    4  9000       2
pe1    prefill  up            3          1.2        1        0    3  3000       0

NODE  ROLES    GROUPS  ENGINES  READ_MB/S  READ_Q_TOK  ASSIGNED/S
n1    prefill  pe1           1      150.0       64000         0.5
n2    decode   de1           2       25.0         500         2.5
(storage NIC: READ_MB/S is the reads the scheduler ordered on the node; write-back is in \
the node's /metrics)"""


def test_two_polls_render_the_whole_screen():
    prev = _poll(100.0, submitted=10, completed=4, assigned=(1, 2, 3), read=(10**9, 0))
    cur = _poll(102.0, submitted=16, completed=5, assigned=(4, 4, 4),
                read=(10**9 + 300_000_000, 50_000_000))
    f = top.figures(prev, cur, "sched:7000", 2.0)
    assert f["rates"]["submitted_per_s"] == 3.0 and f["rates"]["completed_per_s"] == 0.5
    assert f["queued_requests"] == 8 and f["running_requests"] == 7
    assert [(n["node_id"], n["read_queue_tokens"], n["assigned_per_s"],
             n["read_bytes_per_s"]) for n in f["nodes"]] \
        == [("n1", 64000, 0.5, 150e6), ("n2", 500, 2.5, 25e6)]
    text = top.render(f)
    assert text == SCREEN, "\n" + text
    assert "\x1b" not in text
    json.dumps(f)   # the --json object is plain JSON types


def test_first_poll_has_no_rates_and_a_counter_going_back_shows_none():
    cur = _poll(5.0, submitted=3, completed=0, assigned=(0, 0, 0), de_state=DOWN)
    f = top.figures(None, cur, "s:1", 1.0)
    assert set(f["rates"].values()) == {None} and f["rates_over_s"] is None
    text = top.render(f)
    assert "submitted -  completed -" in text and "(over" not in text
    assert "groups 1 up, 1 down" in text
    assert [ln.split()[:3] for ln in text.splitlines() if ln.startswith("de1")] == \
        [["de1", "decode", "down"]]
    # A scheduler restarted without its journal: totals start again from 0.
    restarted = _poll(6.0, submitted=0, completed=0, assigned=(0, 0, 0))
    g = top.figures(_poll(5.0, submitted=9, completed=2, assigned=(5, 5, 5)), restarted,
                    "s:1", 1.0)
    assert g["rates"]["submitted_per_s"] is None and g["rates"]["failed_per_s"] == 0.0
    assert [n["assigned_per_s"] for n in g["nodes"]] == [None, None]


def test_no_groups_and_the_three_output_modes():
    empty = top.Poll(t=1.0, wall=0.0, stats=_poll(1.0, submitted=0, completed=0,
                                                  assigned=(0, 0, 0)).stats,
                     groups=[], engines=[])
    f = top.figures(None, empty, "s:1", 1.0)
    text = top.render(f)
    assert "(no engine groups registered)" in text and "NODE" not in text
    assert top.screen(f, as_json=False, tty=True) == top.CLEAR + text + "\n"
    assert top.screen(f, as_json=False, tty=False) == text + "\n\n"
    line = top.screen(f, as_json=True, tty=False)
    assert line.count("\n") == 1 and json.loads(line)["scheduler"] == "s:1"
