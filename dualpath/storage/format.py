"""The on-disk format of one block file (pure code: pack and check a header).

A block file is a 4096-byte header followed by the Full Block payload, nothing else::

    offset  size  field
    0       8     magic            b"DPKVBLK\\0"
    8       2     format version   1
    10      2     header bytes     4096 (payload offset; keeps the payload O_DIRECT-aligned)
    12      4     flags            0 (reserved)
    16      32    profile name     UTF-8, NUL padded (e.g. "ds660b")
    48      4     layers           \\
    52      4     tokens            > the block layout (dualpath.kv.layout.BlockLayout)
    56      4     token bytes      /  (KV bytes of one token in one layer)
    60      4     reserved         0
    64      8     payload bytes    layers * tokens * token bytes
    72      4     payload CRC-32   zlib.crc32 of the payload
    76      16    block key        the chained prefix key (dualpath.kv.prefix)
    92      4     header CRC-32    zlib.crc32 of bytes 0..91
    96..4095      zero

All integers are little-endian. A reader accepts a file only when every field matches
what it expects, both CRCs match and the file is exactly header + payload bytes long.
"""

from __future__ import annotations

import struct
import zlib

from dualpath.kv.layout import BlockLayout

MAGIC = b"DPKVBLK\0"
VERSION = 1
HEADER_BYTES = 4096
_FIELDS = struct.Struct("<8sHHI32sIIIIQI16s")
_CRC = struct.Struct("<I")
PROFILE_NAME_BYTES = 32


def pack_header(profile: str, layout: BlockLayout, key: bytes, payload_crc: int) -> bytes:
    """The 4096-byte header of a block file."""
    name = profile.encode()
    if len(name) > PROFILE_NAME_BYTES:
        raise ValueError(f"profile name {profile!r} is longer than {PROFILE_NAME_BYTES} bytes")
    fields = _FIELDS.pack(MAGIC, VERSION, HEADER_BYTES, 0, name, layout.layers, layout.tokens,
                          layout.token_bytes, 0, layout.full_bytes, payload_crc, key)
    head = fields + _CRC.pack(zlib.crc32(fields))
    return head + bytes(HEADER_BYTES - len(head))


def check_header(buf, profile: str, layout: BlockLayout, key: bytes) -> tuple[str | None, int]:
    """``(problem, payload_crc)``: ``problem`` is None when the header is the one expected.

    ``buf`` holds at least the first ``_FIELDS.size + 4`` bytes of the file.
    """
    raw = bytes(buf[:_FIELDS.size + _CRC.size])
    if len(raw) < _FIELDS.size + _CRC.size:
        return "header truncated", 0
    (magic, version, header_bytes, _flags, name, layers, tokens, token_bytes, _res,
     payload_bytes, payload_crc, file_key) = _FIELDS.unpack_from(raw)
    if magic != MAGIC:
        return f"bad magic {magic!r}", 0
    if version != VERSION:
        return f"format version {version}, this build reads {VERSION}", 0
    (crc,) = _CRC.unpack_from(raw, _FIELDS.size)
    if crc != zlib.crc32(raw[:_FIELDS.size]):
        return "header checksum mismatch", 0
    if header_bytes != HEADER_BYTES:
        return f"header size {header_bytes}, expected {HEADER_BYTES}", 0
    got_name = name.rstrip(b"\0").decode(errors="replace")
    if got_name != profile:
        return f"profile {got_name!r}, expected {profile!r}", 0
    if (layers, tokens, token_bytes) != (layout.layers, layout.tokens, layout.token_bytes):
        return (f"layout {layers}x{tokens}x{token_bytes}, expected "
                f"{layout.layers}x{layout.tokens}x{layout.token_bytes}"), 0
    if payload_bytes != layout.full_bytes:
        return f"payload {payload_bytes} bytes, expected {layout.full_bytes}", 0
    if file_key != key:
        return f"holds block {file_key.hex()}", 0
    return None, payload_crc
