"""`dualpath scheduler`, `dualpath ctl engines|groups|stats|drain|set|requests|cancel|top|
check`, `dualpath submit`.

Tables by default, ``--json`` for scripts. Exit codes (dualpath.cli, from the typed
error :func:`dualpath.scheduler.client.rpc_error` makes of a gRPC status): 0 ok, 1 the
scheduler refused the operation (e.g. unknown engine), 2 bad usage or config, 3 the
scheduler is unreachable or refused the caller (TLS, token).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
from collections.abc import Awaitable, Callable

import grpc

from dualpath.errors import EXIT_FAIL, EXIT_OK, EXIT_USAGE, UsageError
from dualpath.scheduler.render import msg_dict, table

TOKEN_ENV = "DUALPATH_ADMIN_TOKEN"

# `ctl set` names -> SetParams fields (short forms for operators, full names for scripts).
_SET_KEYS = {"alpha": "alpha_tokens", "alpha_tokens": "alpha_tokens",
             "beta": "beta_tokens", "beta_tokens": "beta_tokens",
             "quota": "compute_quota_ms", "quota_ms": "compute_quota_ms",
             "compute_quota_ms": "compute_quota_ms", "split_read": "split_read"}


def register(sub) -> None:
    p = sub.add_parser("scheduler", help="run the scheduler daemon (gRPC)")
    p.add_argument("--config", help="TOML config file ([scheduler] section)")
    p.add_argument("--listen", help="host:port to listen on (overrides scheduler.listen)")
    p.add_argument("--metrics-listen", help="host:port for /metrics ('' = off; overrides "
                   "scheduler.metrics_listen)")
    p.set_defaults(func=_run_scheduler)

    conn = argparse.ArgumentParser(add_help=False)
    conn.add_argument("--config", help="TOML config file ([scheduler_client] section)")
    conn.add_argument("--scheduler", metavar="ADDR", help="scheduler host:port (overrides "
                      "scheduler_client.address)")
    conn.add_argument("--token-file", help=f"admin token file (else ${TOKEN_ENV}, else "
                      "scheduler_client.admin_token_file)")
    conn.add_argument("--json", action="store_true", help="print JSON instead of a table")

    ctl = sub.add_parser("ctl", help="inspect and steer a running scheduler")
    csub = ctl.add_subparsers(dest="ctl_cmd", metavar="ACTION", required=True)
    csub.add_parser("engines", parents=[conn], help="list engines and their load") \
        .set_defaults(func=_cmd(_engines))
    csub.add_parser("groups", parents=[conn], help="list engine groups and leases") \
        .set_defaults(func=_cmd(_groups))
    csub.add_parser("stats", parents=[conn], help="queues, counters and parameters") \
        .set_defaults(func=_cmd(_stats))
    d = csub.add_parser("drain", parents=[conn], help="stop giving new requests to an engine")
    d.add_argument("engine")
    d.add_argument("--undo", action="store_true", help="accept new requests again")
    d.set_defaults(func=_cmd(_drain))
    s = csub.add_parser("set", parents=[conn], help="change alpha/beta/quota/split_read, "
                        "e.g. `set alpha=4000000 quota=250`")
    s.add_argument("assignments", nargs="+", metavar="KEY=VALUE",
                   help="keys: " + ", ".join(sorted(_SET_KEYS)))
    s.set_defaults(func=_cmd(_set))
    q = csub.add_parser("requests", parents=[conn], help="failed requests and stuck ones "
                        "(live, stage unchanged for --stuck-after seconds)")
    q.add_argument("--stuck-after", type=float, default=None, metavar="S",
                   help="seconds in one stage that make a live request stuck (default: "
                   "the scheduler's scheduler.stuck_after_ms, 60 s unless configured)")
    q.add_argument("--all", action="store_true", help="every live request too")
    q.add_argument("--limit", type=_int_in(1, _U32_MAX), default=100)
    q.set_defaults(func=_cmd(_requests))
    c = csub.add_parser("cancel", parents=[conn], help="cancel queued or running requests")
    c.add_argument("request_ids", nargs="+", metavar="REQUEST_ID")
    c.set_defaults(func=_cmd(_cancel))
    t = csub.add_parser("top", parents=[conn], help="live view: groups, queues, per-node "
                        "storage reads and read queues, request rates",
                        description="Poll the admin API every --interval seconds and redraw "
                        "one screen: queues, running requests and parameters; each group "
                        "(lease state, engines, load); each node's storage reads as the "
                        "scheduler ordered them (MB/s; write-back is in the node's own "
                        "/metrics) and its read queue in tokens; and requests submitted, "
                        "completed and failed per second (deltas between two polls). "
                        "Ctrl-C or SIGTERM ends it (exit 0). With --json: one JSON object "
                        "per poll, a line each.")
    t.add_argument("--interval", type=_float_in(INTERVAL_MIN_S, INTERVAL_MAX_S), default=1.0,
                   metavar="S", help=f"seconds between polls, {INTERVAL_MIN_S:g}.."
                   f"{INTERVAL_MAX_S:g} (default 1)")
    t.add_argument("--once", action="store_true", help="poll twice, --interval apart, print "
                   "one plain-text screen (one JSON object with --json) and exit")
    t.set_defaults(func=_cmd(_top))
    ck = csub.add_parser("check", parents=[conn], help="the idle invariant: an idle cluster's "
                         "nodes hold nothing (exit 1 when one does, or when not idle)",
                         description="Ask the scheduler whether the cluster is idle (nothing "
                         "queued, running, backing off or recovering), then every node it "
                         "knows (Node.Holdings, with this config's TLS identity) what it "
                         "holds: every buffer pool's free slots must equal its capacity, no "
                         "reservation waits, no memory is fenced, the read queue is empty and "
                         "no request keeps state. A node that breaks it leaked. Exit 0 when "
                         "the invariant holds, 1 when the cluster is busy or a node holds "
                         "something (a decode node's write-back drains for a few seconds "
                         "after the last request: ask again).")
    ck.set_defaults(func=_cmd(_check))

    sm = sub.add_parser("submit", parents=[conn], help="submit requests to the scheduler")
    # uint64 on the wire; what the scheduler accepts beyond that it checks itself.
    sm.add_argument("--prompt-tokens", type=_int_in(0, _U64_MAX), required=True)
    sm.add_argument("--hit-tokens", type=_int_in(0, _U64_MAX), default=0, help="prefix "
                    "tokens whose KV is in storage")
    sm.add_argument("--max-new-tokens", type=_int_in(1, _U64_MAX), default=128)
    sm.add_argument("--count", type=_int_in(1, 1_000_000), default=1,
                    help="submit this many alike")
    sm.add_argument("--id", dest="request_id", default="", help="request id (count 1 "
                    "only); submitting an id again is a safe retry")
    sm.add_argument("--trajectory", default="", help="the token stream the requests extend "
                    "(default: a new one per run); --hit-tokens N is a real hit only when "
                    "an earlier request of the same trajectory covered N tokens")
    sm.add_argument("--model-profile", default="", help="profile whose KV block size the "
                    "hit is aligned to (default: the config's engine.model_profile)")
    sm.add_argument("--wait", action="store_true", help="wait until every request ended; "
                    "exit 1 when one failed or was cancelled")
    sm.set_defaults(func=_cmd(_submit, admin=False))


_U32_MAX, _U64_MAX = 2**32 - 1, 2**64 - 1
INTERVAL_MIN_S, INTERVAL_MAX_S = 0.1, 60.0   # ctl top --interval


def _number_in(kind: type, low, high) -> Callable[[str], int | float]:
    """An argparse type: an int or float in [low, high] (nan and inf are outside; a
    negative uint64 would raise a bare ValueError in protobuf, after the connection)."""
    what = "an integer" if kind is int else "a number"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text} is outside {low:g}..{high:g}"
                                             if kind is float else
                                             f"{value} is outside {low}..{high}")
        return value

    return parse


def _int_in(low: int, high: int) -> Callable[[str], int]:
    return _number_in(int, low, high)


def _float_in(low: float, high: float) -> Callable[[str], float]:
    return _number_in(float, low, high)


# ---------------------------------------------------------------- the daemon


def _run_scheduler(args) -> int:
    from dualpath import config as _config
    from dualpath.scheduler.service import serve

    full = _config.load(args.config)
    over = {}
    if args.listen is not None:
        over["listen"] = args.listen
    if args.metrics_listen is not None:
        over["metrics_listen"] = args.metrics_listen
    cfg = dataclasses.replace(full.scheduler, **over)
    _run(serve(cfg, full.tls, config_path=args.config, limits=full.grpc))
    return EXIT_OK


def _run(coro: Awaitable) -> object:
    """Run on uvloop when it is installed (it is a dependency), else asyncio's loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a declared dependency
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


# ---------------------------------------------------------------- client commands


def _cmd(action: Callable, admin: bool = True) -> Callable[[argparse.Namespace], int]:
    """Wrap an async action(client, args) -> (json-able, table text) with connection set-up
    and the exit-code mapping. An action that printed for itself returns None."""

    def run(args) -> int:
        from dualpath import config as _config
        from dualpath.scheduler.client import SchedulerClient, rpc_error
        from dualpath.tls import read_token

        full = _config.load(args.config)
        cfg = full.scheduler_client
        token = None
        if admin:
            if args.token_file:
                token = read_token(args.token_file, "--token-file")
            else:
                token = os.environ.get(TOKEN_ENV) or None

        async def go():
            async with SchedulerClient.from_config(cfg, full.tls, args.scheduler,
                                                   token) as client:
                client.tls_config = full.tls        # for actions that ask the nodes too
                return await action(client, args)

        try:
            result = _run(go())
        except grpc.aio.AioRpcError as e:
            raise rpc_error(e, args.scheduler or cfg.address) from None
        except SubmitRejected as e:
            print(json.dumps(e.data, indent=2, sort_keys=True) if args.json else e.text)
            return EXIT_USAGE if e.usage else EXIT_FAIL
        if result is not None:
            data, text, *code = result
            print(json.dumps(data, indent=2, sort_keys=True) if args.json else text)
            return code[0] if code else EXIT_OK
        return EXIT_OK

    return run


def _role(value: int) -> str:
    return {1: "prefill", 2: "decode"}.get(value, "?")


async def _engines(client, args):
    r = await client.list_engines()
    rows = [[e.engine_id, e.group_id, e.node_id, _role(e.role), e.rank, e.unfinished_requests,
             e.unfinished_tokens, e.read_queue_tokens, e.free_hbm_bytes >> 20,
             "yes" if e.drained else "no", "up" if e.group_state == 1 else "down",
             e.assigned_requests] for e in r.engines]
    text = table(["ENGINE", "GROUP", "NODE", "ROLE", "RANK", "SEQ", "TOK", "READ_Q_TOK",
                  "FREE_HBM_MIB", "DRAINED", "GROUP_STATE", "ASSIGNED"], rows)
    return msg_dict(r), text


async def _groups(client, args):
    r = await client.list_groups()
    rows = [[g.group_id, _role(g.role), "up" if g.state == 1 else "down", g.engines,
             g.unfinished_tokens, g.private_queue_requests, g.ms_since_fetch, g.lease_id]
            for g in r.groups]
    text = table(["GROUP", "ROLE", "STATE", "ENGINES", "TOK", "QUEUED", "MS_SINCE_FETCH",
                  "LEASE"], rows)
    return msg_dict(r), text


async def _stats(client, args):
    r = await client.stats()
    d = msg_dict(r)
    params = d.pop("params")
    rows = [[k, v] for k, v in sorted(d.items())] + [[f"params.{k}", v]
                                                     for k, v in sorted(params.items())]
    return msg_dict(r), table(["STAT", "VALUE"], rows)


#: StatsResponse fields that are not 0 while a cluster has work.
_BUSY_STATS = ("global_queue_requests", "group_queue_requests", "prefill_queue_requests",
               "prefilling_requests", "decoding_requests", "backoff_requests",
               "recovering_requests")


async def _check(client, args):
    from dualpath import tls
    from dualpath.node.holdings import Holdings, idle_violations
    from dualpath.v1 import node_pb2, node_pb2_grpc

    stats = await client.stats()
    busy = {k: getattr(stats, k) for k in _BUSY_STATS if getattr(stats, k)}
    engines = (await client.list_engines()).engines
    nodes = sorted({(e.node_id, e.control_address) for e in engines if e.control_address})
    rows, found, out = [], [], []
    for node_id, addr in nodes:
        try:
            async with tls.channel(addr, client.tls_config, expect=f"node/{node_id}") as ch:
                h = Holdings.from_pb(await node_pb2_grpc.NodeStub(ch).Holdings(
                    node_pb2.HoldingsRequest(), timeout=10))
        except grpc.aio.AioRpcError as e:
            found.append(f"{node_id}: no answer from {addr}: {e.code().name} {e.details()}")
            continue
        v = idle_violations(h)
        found += v
        out.append({**msg_dict(h.to_pb()), "control_address": addr, "violations": v})
        rows.append([node_id, addr, " ".join(f"{p.name}={p.free}/{p.capacity}"
                                             for p in h.pools) or "-",
                     h.fenced_blocks, h.read_queue_tokens, h.requests,
                     "ok" if not v else "HOLDS"])
    lines = [table(["NODE", "ADDRESS", "FREE/CAPACITY", "FENCED", "READ_Q_TOK", "REQUESTS",
                    "IDLE"], rows)]
    if busy:
        lines.append("not idle: " + ", ".join(f"{k} {v}" for k, v in busy.items())
                     + " (the invariant applies to an idle cluster)")
    lines += found
    ok = not busy and not found
    lines.append("idle invariant holds" if ok else "idle invariant does not hold")
    data = {"idle": not busy, "busy": busy, "nodes": out, "violations": found, "ok": ok}
    return data, "\n".join(lines), EXIT_OK if ok else EXIT_FAIL


async def _drain(client, args):
    r = await client.drain(args.engine, args.undo)
    verb = "undrained" if args.undo else "drained"
    return msg_dict(r), f"engine {r.engine.engine_id} {verb}"


def parse_set(assignments: list[str]) -> dict[str, int | bool]:
    """`KEY=VALUE` words -> SetParams fields; UsageError names the bad word."""
    out: dict[str, int | bool] = {}
    for word in assignments:
        k, sep, v = word.partition("=")
        field = _SET_KEYS.get(k.strip())
        if not sep or field is None:
            raise UsageError(f"ctl set: {word!r}: expected KEY=VALUE with KEY one of "
                             + ", ".join(sorted(_SET_KEYS)))
        v = v.strip().lower()
        if field == "split_read":
            if v not in ("true", "false", "1", "0", "on", "off"):
                raise UsageError(f"ctl set: {word!r}: split_read takes true or false")
            out[field] = v in ("true", "1", "on")
        else:
            # The wire field's width bounds the value (compute_quota_ms is uint32): past
            # it, or a digit int() refuses ('²'), protobuf raised a bare ValueError.
            high = _U32_MAX if field == "compute_quota_ms" else _U64_MAX
            try:
                out[field] = _int_in(0, high)(v)
            except argparse.ArgumentTypeError:
                raise UsageError(f"ctl set: {word!r}: {k} takes an integer in "
                                 f"0..{high}") from None
    return out


async def _set(client, args):
    r = await client.set_params(**parse_set(args.assignments))
    d = msg_dict(r)
    return d, table(["PARAM", "VALUE"], [[k, v] for k, v in sorted(d["params"].items())])


def _state(value: int) -> str:
    from dualpath.v1 import scheduler_pb2

    try:
        return scheduler_pb2.RequestState.Name(value).removeprefix("REQUEST_STATE_").lower()
    except ValueError:
        return str(value)


async def _requests(client, args):
    stuck_ms = 0 if args.stuck_after is None else max(1, int(args.stuck_after * 1000))
    r = await client.list_requests(stuck_after_ms=stuck_ms,
                                   all=args.all, limit=args.limit)
    rows = [[v.request_id, _state(v.state), v.stage, v.attempt,
             v.failed_attempts, round(v.ms_in_stage / 1000, 1),
             v.prefill_engine_id or "-", v.decode_engine_id or "-", v.error or "-"]
            for v in r.requests]
    text = table(["REQUEST", "STATE", "STAGE", "ATTEMPT", "FAILED", "S_IN_STAGE", "PE", "DE",
                  "ERROR"], rows)
    if r.matched > len(r.requests):
        text += f"\n({r.matched - len(r.requests)} more; --limit)"
    return msg_dict(r), text


async def _cancel(client, args):
    r = await client.cancel(args.request_ids)
    rows = [[x.request_id, _state(x.state)] for x in r.results]
    return msg_dict(r), table(["REQUEST", "STATE"], rows)


async def _top(client, args):
    from dualpath.scheduler import top

    address = args.scheduler or client.address
    if args.once:
        f = await top.once(client, address, args.interval)
        return f, top.render(f)
    await top.live(client, address, args.interval, as_json=args.json)
    return None


def submit_payload(trajectory: str, prompt: int, hit: int, gen: int, block_tokens: int
                   ) -> tuple[int, bytes]:
    """A payload the engines can run (dualpath.paths.payload.Payload: round 0 of
    ``trajectory``) and the hit it claims: at most prompt - 1, whole KV blocks."""
    from dualpath.paths.payload import Payload

    hit = min(hit, prompt - 1)
    hit -= hit % block_tokens
    return hit, Payload(trajectory, 0, prompt, hit, gen).encode()


async def _submit(client, args):
    import uuid

    from dualpath import config as _config
    from dualpath.kv.profiles import get_profile
    from dualpath.v1 import scheduler_pb2

    if args.request_id and args.count != 1:
        raise UsageError("submit: --id needs --count 1")
    if args.prompt_tokens < 1:
        raise UsageError("submit: --prompt-tokens must be >= 1")
    profile = get_profile(args.model_profile or _config.load(args.config).engine.model_profile)
    traj = args.trajectory or f"submit-{uuid.uuid4().hex[:12]}"
    hit, payload = submit_payload(traj, args.prompt_tokens, args.hit_tokens,
                                  args.max_new_tokens, profile.block_tokens)
    specs = [scheduler_pb2.RequestSpec(request_id=args.request_id,
                                       prompt_tokens=args.prompt_tokens, hit_tokens=hit,
                                       max_new_tokens=args.max_new_tokens, payload=payload)
             for _ in range(args.count)]
    r = await client.submit(specs)
    data = msg_dict(r)
    lines = list(r.request_ids) + [
        f"rejected: {x.request_id or f'#{x.index}'}: {_REASON.get(x.reason, x.reason)}: "
        f"{x.detail}" for x in r.rejected] + [f"queued: {r.queued_requests}"]
    if r.resubmitted_request_ids:
        lines.append(f"already submitted (not queued again): "
                     f"{', '.join(r.resubmitted_request_ids)}")
    if r.waiting_for_engines:
        lines.append("waiting for engines: no prefill or no decode group is up")
    if r.rejected:
        # Some were refused: exit 2 when the input was at fault, else 1 (queue full,
        # another request under the id). The accepted ones are not waited for.
        raise SubmitRejected("\n".join(lines), data, usage=any(
            x.reason in (scheduler_pb2.REJECT_REASON_INVALID, scheduler_pb2.REJECT_REASON_TOO_LARGE)
            for x in r.rejected))
    if args.wait:
        ends = await wait_results(client, list(r.request_ids))
        data["results"] = [msg_dict(x) for x in ends]
        lines += [f"{x.request_id}: {_state(x.state)}"
                  + (f" ({x.error})" if x.error else "") for x in ends]
        bad = [x for x in ends if x.state not in (scheduler_pb2.REQUEST_STATE_DECODE_DONE,
                                                  scheduler_pb2.REQUEST_STATE_REPORTED)]
        if bad:
            print(json.dumps(data, indent=2, sort_keys=True) if args.json
                  else "\n".join(lines))
            from dualpath.errors import DualPathError

            raise DualPathError(f"submit: {len(bad)} of {len(ends)} requests did not finish")
    return data, "\n".join(lines)


_REASON = {1: "invalid", 2: "too large", 3: "duplicate", 4: "queue full"}


class SubmitRejected(Exception):
    """Some submitted requests were rejected; carries what to print and the exit code."""

    def __init__(self, text: str, data: dict, usage: bool):
        super().__init__(text)
        self.text, self.data, self.usage = text, data, usage


async def wait_results(client, ids: list[str]) -> list:
    """Long-poll GetResults until every request in ``ids`` ended; acknowledges them."""
    from dualpath.v1 import scheduler_pb2

    left, ended, ack = list(ids), {}, []
    while left:
        r = await client.get_results(left, acknowledged=ack, wait_ms=5000)
        ack = []
        for x in r.results:
            if x.state >= scheduler_pb2.REQUEST_STATE_DECODE_DONE or \
                    x.state == scheduler_pb2.REQUEST_STATE_UNKNOWN:
                ended[x.request_id] = x
                ack.append(x.request_id)
        left = [rid for rid in left if rid not in ended]
    if ack:
        await client.get_results([], acknowledged=ack)
    return [ended[rid] for rid in ids]
