"""`dualpath ctl top`: a live view of a scheduler from its admin API.

Two layers: :func:`figures` (two polls in, one plain dict of figures out: header, groups,
nodes, request rates as deltas between the polls) and :func:`render` (figures in, text
out) are pure; :func:`poll`, :func:`once` and :func:`live` are the thin shell that calls
ListEngines, ListGroups and Stats and prints.

Storage-NIC use: per node, the storage reads the scheduler ordered (its admin API's
node_read_bytes_total, as MB/s between two polls: both read paths and split parts) and
its read queue (read_q in tokens, as the node's leader last reported it). Write-back is
not the scheduler's to see: a node's own /metrics has both (docs/metrics.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import sys
import time
from typing import TextIO

CLEAR = "\x1b[H\x1b[2J"   # cursor home, erase the screen
NIC_NOTE = ("storage NIC: READ_MB/S is the reads the scheduler ordered on the node; "
            "write-back is in the node's /metrics")

# Counters whose per-second rates the header shows: figure name -> StatsResponse field.
RATES = {"submitted": "submitted_requests_total", "completed": "completed_requests_total",
         "failed": "failed_requests_total", "failed_attempts": "failed_attempts_total",
         "lost_attempts": "lost_attempts_total",
         "requeued": "requeued_requests_total", "cancelled": "cancelled_requests_total"}


@dataclasses.dataclass(frozen=True)
class Poll:
    """One poll of the admin API, as plain dicts (dualpath.scheduler.render.msg_dict)."""

    t: float      # monotonic seconds, for rates
    wall: float   # epoch seconds, for the header
    stats: dict
    groups: list[dict]
    engines: list[dict]


def _short(enum_name: str, prefix: str) -> str:
    return str(enum_name).removeprefix(prefix).lower()


def _rate(now: int, before: int, dt: float) -> float | None:
    """Per-second rate of a counter; None when it went backwards (a scheduler restarted
    without its journal) or no time passed."""
    if dt <= 0 or now < before:
        return None
    return (now - before) / dt


def figures(prev: Poll | None, cur: Poll, address: str, interval_s: float) -> dict:
    """What one screen shows. Rates are deltas from ``prev`` to ``cur`` (None without a
    previous poll)."""
    s = cur.stats
    dt = cur.t - prev.t if prev is not None else 0.0
    queue = {"global": s["global_queue_requests"], "group": s["group_queue_requests"],
             "prefill": s["prefill_queue_requests"]}
    running = {"prefilling": s["prefilling_requests"], "decoding": s["decoding_requests"]}
    rates = {f"{k}_per_s": (_rate(s[f], prev.stats[f], dt) if prev is not None else None)
             for k, f in RATES.items()}

    by_group: dict[str, list[dict]] = {}
    by_node: dict[str, list[dict]] = {}
    for e in cur.engines:
        by_group.setdefault(e["group_id"], []).append(e)
        by_node.setdefault(e["node_id"], []).append(e)
    before = {e["engine_id"]: e["assigned_requests"] for e in prev.engines} if prev else {}
    read_before = {e["node_id"]: e["node_read_bytes_total"] for e in prev.engines} \
        if prev else {}

    groups = []
    for g in cur.groups:
        mine = by_group.get(g["group_id"], [])
        groups.append({
            "group_id": g["group_id"], "role": _short(g["role"], "ENGINE_ROLE_"),
            "state": _short(g["state"], "GROUP_STATE_"), "lease_id": g["lease_id"],
            "ms_since_fetch": g["ms_since_fetch"], "engines": g["engines"],
            "drained_engines": sum(1 for e in mine if e["drained"]),
            "unfinished_requests": sum(e["unfinished_requests"] for e in mine),
            "unfinished_tokens": g["unfinished_tokens"],
            "queued_requests": g["private_queue_requests"]})

    nodes = []
    for node_id in sorted(by_node):
        mine = by_node[node_id]
        seen = [e for e in mine if e["engine_id"] in before]
        assigned = None
        if seen and dt > 0:
            deltas = [e["assigned_requests"] - before[e["engine_id"]] for e in seen]
            assigned = sum(deltas) / dt if min(deltas) >= 0 else None
        nodes.append({
            "node_id": node_id,
            "groups": sorted({e["group_id"] for e in mine}),
            "roles": sorted({_short(e["role"], "ENGINE_ROLE_") for e in mine}),
            "engines": len(mine),
            # Every engine of a node carries the node's one read_q; max() is that value.
            "read_queue_tokens": max(e["read_queue_tokens"] for e in mine),
            "assigned_per_s": assigned,
            # Every engine of a node carries the node's one total.
            "read_bytes_per_s": _rate(max(e["node_read_bytes_total"] for e in mine),
                                      read_before[node_id], dt)
            if node_id in read_before else None})

    return {
        "scheduler": address,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(cur.wall)),
        "interval_s": interval_s,
        "rates_over_s": round(dt, 3) if prev is not None else None,
        "model_profile": s["model_profile"],
        "journal": s["journal"],
        "params": dict(s["params"]),
        "groups_up": s["groups_up"], "groups_down": s["groups_down"],
        "queued_requests": sum(queue.values()), "queue": queue,
        "backoff_requests": s["backoff_requests"],
        "recovering_requests": s["recovering_requests"],
        "running_requests": sum(running.values()), "running": running,
        "totals": {k: s[f] for k, f in RATES.items()},
        "rates": rates,
        "groups": groups,
        "nodes": nodes,
        "storage_nic_note": NIC_NOTE,
    }


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def render(f: dict) -> str:
    """One screen of plain text (no terminal codes) from :func:`figures`."""
    from dualpath.scheduler.render import table

    p, q, r, rate = f["params"], f["queue"], f["running"], f["rates"]
    over = "" if f["rates_over_s"] is None else f"  (over {f['rates_over_s']:.2f} s)"
    head = (f"dualpath top  {f['scheduler']}  {f['time']}  every {f['interval_s']:g} s  "
            f"model {f['model_profile']}  journal {'on' if f['journal'] else 'off'}")
    params = (f"alpha {p['alpha_tokens']}  beta {p['beta_tokens']}  "
              f"quota {p['compute_quota_ms']} ms  "
              f"split_read {'on' if p['split_read'] else 'off'}  "
              f"groups {f['groups_up']} up, {f['groups_down']} down")
    queues = (f"queued {f['queued_requests']} (global {q['global']}, group {q['group']}, "
              f"prefill {q['prefill']})  running {f['running_requests']} "
              f"(prefilling {r['prefilling']}, decoding {r['decoding']})  "
              f"backoff {f['backoff_requests']}  recovering {f['recovering_requests']}")
    rates = "  ".join(f"{k} {_num(rate[f'{k}_per_s'])}" for k in RATES) + over
    lines = [head, f"params    {params}", f"requests  {queues}", f"per s     {rates}", ""]
    if f["groups"]:
        lines.append(table(
            ["GROUP", "ROLE", "LEASE", "LEASE_ID", "FETCH_AGO_S", "ENGINES", "DRAINED", "SEQ",
             "TOK", "QUEUED"],
            [[g["group_id"], g["role"], g["state"], g["lease_id"],
              round(g["ms_since_fetch"] / 1000, 1), g["engines"], g["drained_engines"],
              g["unfinished_requests"], g["unfinished_tokens"], g["queued_requests"]]
             for g in f["groups"]]))
    else:
        lines.append("(no engine groups registered)")
    if f["nodes"]:
        lines += ["", table(
            ["NODE", "ROLES", "GROUPS", "ENGINES", "READ_MB/S", "READ_Q_TOK", "ASSIGNED/S"],
            [[n["node_id"], ",".join(n["roles"]), ",".join(n["groups"]), n["engines"],
              "-" if n["read_bytes_per_s"] is None else round(n["read_bytes_per_s"] / 1e6, 1),
              n["read_queue_tokens"],
              "-" if n["assigned_per_s"] is None else round(n["assigned_per_s"], 1)]
             for n in f["nodes"]]),
            f"({f['storage_nic_note']})"]
    return "\n".join(lines)


# ---------------------------------------------------------------- the polling shell


async def poll(client) -> Poll:
    from dualpath.scheduler.render import msg_dict

    stats, groups, engines = await asyncio.gather(
        client.stats(), client.list_groups(), client.list_engines())
    return Poll(t=time.monotonic(), wall=time.time(), stats=msg_dict(stats),
                groups=[msg_dict(g) for g in groups.groups],
                engines=[msg_dict(e) for e in engines.engines])


async def once(client, address: str, interval_s: float) -> dict:
    """Two polls ``interval_s`` apart (so the rates are real): one screen's figures."""
    first = await poll(client)
    await asyncio.sleep(interval_s)
    return figures(first, await poll(client), address, interval_s)


def screen(f: dict, *, as_json: bool, tty: bool) -> str:
    if as_json:
        return json.dumps(f, sort_keys=True) + "\n"   # one object per line
    if tty:
        return CLEAR + render(f) + "\n"
    return render(f) + "\n\n"


async def live(client, address: str, interval_s: float, *, as_json: bool = False,
               out: TextIO | None = None) -> None:
    """Poll every ``interval_s`` and print a screen each time (cleared and redrawn on a
    terminal, appended otherwise; JSON lines with ``as_json``) until SIGINT or SIGTERM,
    then return (exit 0). The first screen comes at once, without rates."""
    out = out or sys.stdout
    tty = out.isatty() and not as_json
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    restore = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
            before = signal.getsignal(sig)   # not the main thread: no handlers, no stop
            loop.add_signal_handler(sig, stop.set)
            restore.append((sig, before))
    stopped = asyncio.ensure_future(stop.wait())
    try:
        prev = None
        while not stop.is_set():
            polled = asyncio.ensure_future(poll(client))
            await asyncio.wait([polled, stopped], return_when=asyncio.FIRST_COMPLETED)
            if not polled.done():
                polled.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await polled
                break
            cur = polled.result()
            try:
                out.write(screen(figures(prev, cur, address, interval_s), as_json=as_json,
                                 tty=tty))
                out.flush()
            except BrokenPipeError:
                # `ctl top | head`: the reader left. Point stdout at /dev/null so the
                # interpreter's own flush at exit does not complain, and stop quietly.
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, out.fileno())
                os.close(devnull)
                return
            prev = cur
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(stopped), interval_s)
    finally:
        stopped.cancel()
        for sig, before in restore:
            loop.remove_signal_handler(sig)
            signal.signal(sig, before)
