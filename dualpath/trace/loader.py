"""JSONL traces: one trajectory per line (format in docs/traces.md), a loader that refuses
bad input with the line number and field, and a writer for generated traces.

Nothing is silently dropped: every non-blank line must be a valid trajectory (or, on
line 1 only, the optional ``{"meta": {...}}`` header), unknown keys are errors (a typo
such as ``gen_token`` would otherwise lose data), and ids must be unique.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import IO

import numpy as np

from dualpath.errors import UsageError
from dualpath.trace.model import Round, Trace, Trajectory

FORMAT_VERSION = 1
_ROUND_KEYS = {"append_tokens", "gen_tokens", "append_token_ids", "gen_token_ids"}
_TRAJ_KEYS = {"id", "rounds"}
_INT32_MAX = (1 << 31) - 1


class TraceFormatError(UsageError):
    """A trace file is malformed. ``.line`` is 1-based; the message names the field."""

    def __init__(self, source: str, line: int, what: str):
        super().__init__(f"{source}:{line}: {what}")
        self.source = source
        self.line = line


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _count(obj: Mapping, key: str, where: str, minimum: int, err) -> int:
    if key not in obj:
        raise err(f"{where}.{key}: missing")
    v = obj[key]
    if not _is_int(v) or v < minimum:
        raise err(f"{where}.{key}: must be an integer >= {minimum}, got {v!r}")
    return v


def _ids(obj: Mapping, key: str, where: str, length: int, err) -> list[int]:
    v = obj[key]
    if not isinstance(v, list) or len(v) != length:
        n = len(v) if isinstance(v, list) else type(v).__name__
        raise err(f"{where}.{key}: must be a list of {length} token ids, got {n}")
    for j, t in enumerate(v):
        if not _is_int(t) or not 0 <= t <= _INT32_MAX:
            raise err(f"{where}.{key}[{j}]: token id must be an integer in [0, 2**31), "
                      f"got {t!r}")
    return v


def parse_trajectory(obj, err) -> Trajectory:
    """One decoded JSON line -> Trajectory; ``err(what)`` builds the exception to raise."""
    if not isinstance(obj, dict):
        raise err(f"expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - _TRAJ_KEYS)
    if unknown:
        raise err(f"unknown field {unknown[0]!r} (allowed: {sorted(_TRAJ_KEYS)})")
    tid = obj.get("id")
    if not isinstance(tid, str) or not tid:
        raise err(f"id: must be a non-empty string, got {tid!r}")
    rounds_obj = obj.get("rounds")
    if not isinstance(rounds_obj, list) or not rounds_obj:
        raise err("rounds: must be a non-empty list" if "rounds" in obj else "rounds: missing")
    rounds, ids, explicit = [], [], None
    for k, r in enumerate(rounds_obj):
        where = f"rounds[{k}]"
        if not isinstance(r, dict):
            raise err(f"{where}: expected an object, got {type(r).__name__}")
        unknown = sorted(set(r) - _ROUND_KEYS)
        if unknown:
            raise err(f"{where}: unknown field {unknown[0]!r} (allowed: {sorted(_ROUND_KEYS)})")
        a = _count(r, "append_tokens", where, 1 if k == 0 else 0, err)
        g = _count(r, "gen_tokens", where, 1, err)
        has = ("append_token_ids" in r, "gen_token_ids" in r)
        if has[0] != has[1]:
            raise err(f"{where}: give both append_token_ids and gen_token_ids, or neither")
        if explicit is None:
            explicit = has[0]
        elif explicit != has[0]:
            raise err(f"{where}: token ids must be given for every round or for none")
        if explicit:
            ids += _ids(r, "append_token_ids", where, a, err)
            ids += _ids(r, "gen_token_ids", where, g, err)
        rounds.append(Round(a, g))
    token_ids = np.asarray(ids, dtype=np.int64) if explicit else None
    try:
        return Trajectory(tid, tuple(rounds), token_ids)
    except UsageError as e:  # defensive: the checks above should already have said it
        raise err(str(e)) from None


def read_jsonl(source: str | os.PathLike | IO[str], *, name: str | None = None) -> Trace:
    """Load a JSONL trace from a path or an open text file."""
    if isinstance(source, str | os.PathLike):
        with open(source, encoding="utf-8") as f:
            return read_jsonl(f, name=name or os.fspath(source))
    name = name or getattr(source, "name", "<trace>")
    meta: dict = {}
    trajs: list[Trajectory] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(source, start=1):
        def err(what, _n=lineno):
            return TraceFormatError(name, _n, what)

        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise err(f"invalid JSON: {e.msg} at column {e.colno}") from None
        if isinstance(obj, dict) and "meta" in obj:
            if lineno != 1 or len(obj) != 1 or not isinstance(obj["meta"], dict):
                raise err('meta: {"meta": {...}} must be alone and on line 1')
            meta = dict(obj["meta"])
            version = meta.get("format_version", FORMAT_VERSION)
            if version != FORMAT_VERSION:
                raise err(f"meta.format_version: {version!r} is not supported "
                          f"(this reader knows {FORMAT_VERSION})")
            continue
        t = parse_trajectory(obj, err)
        if t.id in seen:
            raise err(f"id: {t.id!r} already used on line {seen[t.id]}")
        seen[t.id] = lineno
        trajs.append(t)
    if not trajs:
        raise TraceFormatError(name, 0, "no trajectories")
    meta.setdefault("source", "file")
    meta["path"] = name
    return Trace(tuple(trajs), meta)


def trajectory_to_json(t: Trajectory) -> dict:
    rounds = []
    pos = 0
    for r in t.rounds:
        d = {"append_tokens": r.append_tokens, "gen_tokens": r.gen_tokens}
        if t.token_ids is not None:
            mid = pos + r.append_tokens
            d["append_token_ids"] = t.token_ids[pos:mid].tolist()
            d["gen_token_ids"] = t.token_ids[mid:mid + r.gen_tokens].tolist()
            pos = mid + r.gen_tokens
        rounds.append(d)
    return {"id": t.id, "rounds": rounds}


def write_jsonl(dest: str | os.PathLike | IO[str], trajectories: Iterable[Trajectory],
                meta: Mapping | None = None) -> None:
    """Write the header line (``meta`` plus the format version) and one line per
    trajectory; :func:`read_jsonl` reads it back unchanged."""
    if isinstance(dest, str | os.PathLike):
        with open(dest, "w", encoding="utf-8") as f:
            write_jsonl(f, trajectories, meta)
        return
    header = {**(meta or {}), "format_version": FORMAT_VERSION}
    dest.write(json.dumps({"meta": header}, sort_keys=True) + "\n")
    for t in trajectories:
        dest.write(json.dumps(trajectory_to_json(t), separators=(",", ":")) + "\n")
