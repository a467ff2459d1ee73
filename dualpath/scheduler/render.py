"""Admin answers as text and plain data, pure: a protobuf message as JSON types, a
fixed-width table (`dualpath ctl` and `ctl top`)."""

from __future__ import annotations


def msg_dict(msg) -> dict:
    """A protobuf message as plain JSON types: every field present, 64-bit integers as
    numbers (protobuf's own JSON mapping writes them as strings), enums by name."""
    out = {}
    for f in msg.DESCRIPTOR.fields:
        value = getattr(msg, f.name)
        items = list(value) if f.is_repeated else [value]
        if f.message_type is not None:
            items = [msg_dict(v) for v in items]
        elif f.enum_type is not None:
            names = f.enum_type.values_by_number
            items = [names[v].name if v in names else v for v in items]
        elif f.type == f.TYPE_BYTES:
            items = [v.hex() for v in items]
        out[f.name] = items if f.is_repeated else items[0]
    return out


def table(headers: list[str], rows: list[list[object]]) -> str:
    """A fixed-width table; numbers right-aligned."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [all(isinstance(r[i], (int, float)) for r in rows) and bool(rows)
               for i in range(len(headers))]

    def fmt(r: list[str]) -> str:
        return "  ".join(c.rjust(w) if num else c.ljust(w)
                         for c, w, num in zip(r, widths, numeric, strict=True)).rstrip()

    return "\n".join([fmt(headers)] + [fmt(r) for r in cells])
