"""TOML configuration: one dataclass per section, validated field by field.

Each section is a frozen dataclass whose fields carry ``doc`` (and optionally
``choices``, ``min``, ``max``) in their metadata, declared with :func:`key`. A bad value
raises :class:`ConfigError` naming the dotted key, the value and what is allowed; an
unknown key is an error too (a typo must not silently fall back to a default), and a key
that moved (a section's ``MOVED_KEYS``: old name -> new dotted name) is refused with a
message naming its replacement. A float
must be finite (TOML's ``nan`` and ``inf`` compare false with every bound, so they
would slip past ``min``/``max``); an integer without a ``max`` is still bounded by
TOML's own range (int64), and fields that travel in a narrower wire field declare it
as their ``max``.

Sections live next to the code they configure and are listed in :data:`SECTIONS`;
``dualpath config docs`` prints every key with its default and meaning.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from dualpath.errors import ConfigError

# section name -> "module:Class". Each module is imported lazily by load().
SECTIONS: dict[str, str] = {
    "tls": "dualpath.tls:TlsConfig",
    "transport": "dualpath.config_sections:TransportConfig",
    "kv_lane": "dualpath.config_sections:KvLaneConfig",
    "grpc": "dualpath.config_sections:GrpcConfig",
    "transfer": "dualpath.transfer.config:TransferConfig",
    "scheduler": "dualpath.scheduler.config:SchedulerConfig",
    "scheduler_client": "dualpath.scheduler.config:SchedulerClientConfig",
    "storage": "dualpath.storage.config:StorageConfig",
    "buffers": "dualpath.buffers.config:BuffersConfig",
    "engine": "dualpath.node.config:EngineConfig",
    "cluster": "dualpath.node.config:ClusterConfig",
    "frontend": "dualpath.frontend.config:FrontendConfig",
}


#: TOML integers are 64-bit signed; Python's parser takes any size.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
U32_MAX = 2**32 - 1


def key(default: Any, doc: str, *, choices: tuple | None = None,
        min: float | None = None, max: float | None = None) -> Any:
    """Declare a config field with its documentation and constraints."""
    meta = {"doc": doc, "choices": choices, "min": min, "max": max}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _section_class(name: str) -> type:
    mod, _, cls = SECTIONS[name].partition(":")
    return getattr(importlib.import_module(mod), cls)


def _bounds(f: dataclasses.Field) -> str:
    """``>= min, <= max`` from a key's metadata ("" when unbounded)."""
    m = f.metadata
    return ", ".join(f"{op} {m[k]}" for k, op in (("min", ">="), ("max", "<="))
                     if m.get(k) is not None)


def _allowed(f: dataclasses.Field, typ: Any) -> str:
    m = f.metadata
    if m.get("choices"):
        return "one of " + ", ".join(repr(c) for c in m["choices"])
    return " ".join(p for p in (getattr(typ, "__name__", str(typ)), _bounds(f)) if p)


def _coerce(path: str, f: dataclasses.Field, typ: Any, value: Any) -> Any:
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if value is None:
            return None
        typ = args[0]
        origin = typing.get_origin(typ)
    ok = True
    if typ is bool:
        ok = isinstance(value, bool)
    elif typ is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif typ is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
        if ok and not math.isfinite(value):
            raise ConfigError(f"config key {path} = {value!r}: must be a finite number"
                              + (f" ({_bounds(f)})" if _bounds(f) else ""))
    elif typ is str:
        ok = isinstance(value, str)
    elif origin in (list, tuple):
        ok = isinstance(value, list)
        if ok:
            value = tuple(value) if origin is tuple else list(value)
    elif origin is dict:               # a table of str -> scalar, each value checked
        if not isinstance(value, dict):
            raise ConfigError(f"config key {path} = {value!r}: expected a table")
        kt, vt = typing.get_args(typ)
        out = {}
        for k, v in value.items():
            if not isinstance(k, kt):
                raise ConfigError(f"config key {path}: key {k!r} is not a {kt.__name__}")
            out[k] = _coerce(f"{path}.{k}" if k else f'{path}.""', f, vt, v)
        return out
    if not ok:
        raise ConfigError(f"config key {path} = {value!r}: expected {_allowed(f, typ)}")
    m = f.metadata
    if m.get("choices") and value not in m["choices"]:
        raise ConfigError(f"config key {path} = {value!r}: allowed values are {_allowed(f, typ)}")
    if (m.get("min") is not None and value < m["min"]) or (
            m.get("max") is not None and value > m["max"]):
        raise ConfigError(f"config key {path} = {value!r}: must be {_bounds(f)}")
    if typ is int and not INT64_MIN <= value <= INT64_MAX:
        raise ConfigError(f"config key {path} = {value!r}: outside TOML's integer range "
                          f"({INT64_MIN}..{INT64_MAX})")
    return value


def build_section(cls: type, data: dict, prefix: str) -> Any:
    """Validate ``data`` against dataclass ``cls``; keys are reported as ``prefix.key``."""
    if not isinstance(data, dict):
        raise ConfigError(f"config section [{prefix}] must be a table, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    moved = getattr(cls, "MOVED_KEYS", {})
    for name in sorted(set(data) & set(moved)):
        raise ConfigError(f"config key {prefix}.{name} is gone: use {moved[name]} instead")
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown config key {prefix}.{unknown[0]}; keys of [{prefix}] are: "
            + ", ".join(sorted(fields))
        )
    kwargs = {}
    for name, value in data.items():
        f = fields[name]
        typ = hints[name]
        if dataclasses.is_dataclass(typ):
            kwargs[name] = build_section(typ, value, f"{prefix}.{name}")
        else:
            kwargs[name] = _coerce(f"{prefix}.{name}", f, typ, value)
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if validate is not None:
        validate()
    return obj


@dataclasses.dataclass(frozen=True)
class Config:
    """The whole configuration: a mapping of section name to section object."""

    sections: dict[str, Any]
    path: str | None = None

    def __getattr__(self, name: str) -> Any:
        try:
            return self.sections[name]
        except KeyError:
            raise AttributeError(name) from None

    def to_dict(self) -> dict:
        return {k: dataclasses.asdict(v) for k, v in self.sections.items()}


def from_dict(data: dict, path: str | None = None) -> Config:
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        raise ConfigError(
            f"unknown config section [{unknown[0]}]; sections are: " + ", ".join(sorted(SECTIONS))
        )
    sections = {}
    for name in SECTIONS:
        sections[name] = build_section(_section_class(name), data.get(name, {}), name)
    return Config(sections=sections, path=path)


def load(path: str | Path | None = None, overrides: dict | None = None) -> Config:
    """Load a TOML file (or only the embedded defaults when ``path`` is None)."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        try:
            with p.open("rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"config file {p} does not exist") from None
        except OSError as e:  # a directory, no permission: still the operator's input
            raise ConfigError(f"config file {p}: cannot read ({e.strerror})") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p} is not valid TOML: {e}") from None
        except UnicodeDecodeError as e:  # a binary file: TOML is UTF-8 text
            raise ConfigError(f"config file {p} is not a UTF-8 text file (byte "
                              f"{e.start}: {e.reason})") from None
    for dotted, value in (overrides or {}).items():
        sec, _, k = dotted.partition(".")
        data.setdefault(sec, {})[k] = value
    return from_dict(data, str(path) if path else None)


def docs() -> str:
    """Every config key with its type, default and meaning, as Markdown."""
    lines = ["# Configuration keys", ""]
    for name in SECTIONS:
        cls = _section_class(name)
        lines += [f"## [{name}]", "", (cls.__doc__ or "").strip(), ""]
        hints = typing.get_type_hints(cls)
        lines.append("| key | type | default | meaning |")
        lines.append("|---|---|---|---|")
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else "")
            typ = getattr(hints[f.name], "__name__", str(hints[f.name]))
            doc = f.metadata.get("doc", "")
            if f.metadata.get("choices"):
                doc += " Allowed: " + ", ".join(repr(c) for c in f.metadata["choices"]) + "."
            bounds = _bounds(f)
            if bounds:
                doc += f" Allowed: {bounds}."
            lines.append(f"| `{name}.{f.name}` | {typ} | `{default!r}` | {doc} |")
        lines.append("")
    return "\n".join(lines)
