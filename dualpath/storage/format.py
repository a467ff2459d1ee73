"""The on-disk format of one block file (pure code: pack and check a header).

A block file is a 4096-byte header followed by the Full Block payload, nothing else::

    offset  size  field
    0       8     magic            b"DPKVBLK\\0"
    8       2     format version   2
    10      2     header bytes     4096 (payload offset; keeps the payload O_DIRECT-aligned)
    12      4     flags            bit 0: TAGGED (a nonce and an integrity tag follow)
    16      32    profile name     UTF-8, NUL padded (e.g. "ds660b")
    48      4     layers           \\
    52      4     tokens            > the block layout (dualpath.kv.layout.BlockLayout)
    56      4     token bytes      /  (KV bytes of one token in one layer)
    60      4     reserved         0
    64      8     payload bytes    layers * tokens * token bytes
    72      8     payload hash     XXH3-64 (seed 0) of the payload
    80      16    block key        the chained prefix key (dualpath.kv.prefix)
    96      8     header hash      XXH3-64 (seed 0) of bytes 0..95
    104     8     reserved         0
    112     16    nonce            TAGGED only: random, drawn for every write; else zero
    128     16    integrity tag    TAGGED only: Poly1305 of bytes 0..127 and the payload
                                   under BLAKE2b-256(cluster key, label || nonce); else zero
    144..4095     zero

All integers are little-endian. A reader accepts a file only when every field matches
what it expects, both hashes match (with a cluster key: the header hash and the tag, which
checks the payload in place of its hash) and the file is exactly header + payload bytes
long.
Format 1 (a keyed BLAKE2b tag at 104) is read as corrupt: a miss, computed again.

Why XXH3-64 and not zlib's CRC-32: the check runs on every block read, and a node reads
at its storage NICs' speed. On one core XXH3 hashes tens of GB/s and zlib.crc32 a few
(measured on the dev VM: 48 against 3-7 GB/s; bench/storage.py prints both), so the
check costs a sliver of a core instead of limiting the read.

The XXH3 digests catch accidents, not an adversary: anyone who can write the shared
mount can forge a block whose hashes match. With a cluster key (storage.integrity_key_
file) every block carries a keyed tag over its header and payload, which only a holder
of the key can make; a reader with the key accepts only tagged blocks whose tag
verifies. The tag is Poly1305 under a one-time key derived from the cluster key and the
block's own random nonce (csrc/block_tag.c): each one-time key authenticates the one
write that drew its nonce, as Poly1305 requires, and libcrypto runs it at several GB/s
per core (keyed BLAKE2b, format 1's tag, ran at ~1 and cost a core per GB read). A
keyed reader checks the tag instead of the payload's XXH3 digest: it catches every
accident the digest would, in one pass over the bytes; the batched read path
(csrc/store_io.c) checks it as each block lands.
"""

from __future__ import annotations

import hmac
import os
import struct

import xxhash

from dualpath._native import ffi, lib
from dualpath.kv.layout import BlockLayout

MAGIC = b"DPKVBLK\0"
VERSION = 2
HEADER_BYTES = 4096
_FIELDS = struct.Struct("<8sHHI32sIIIIQQ16s")
_HASH = struct.Struct("<Q")
PROFILE_NAME_BYTES = 32
FLAG_TAGGED = 1
NONCE_BYTES = lib.DP_TAG_NONCE
TAG_OFFSET, TAG_BYTES = lib.DP_TAG_HEAD, lib.DP_TAG_BYTES
NONCE_OFFSET = TAG_OFFSET - NONCE_BYTES
MIN_KEY_BYTES = 32

payload_hash = xxhash.xxh3_64_intdigest   # (buffer) -> int; releases the GIL on big inputs


def integrity_tag(secret: bytes, head: bytes, payload) -> bytes:
    """The tag of a header's first 128 bytes (its nonce included) and the payload
    (csrc/block_tag.c; the GIL is released while it runs)."""
    out = ffi.new("uint8_t[]", TAG_BYTES)
    view = memoryview(payload).cast("B")
    rc = lib.dp_block_tag(secret, len(secret), ffi.from_buffer(head[:TAG_OFFSET]),
                          ffi.from_buffer(view), view.nbytes, out)
    if rc:
        raise OSError(-rc, f"block tag: {os.strerror(-rc)}")
    return bytes(ffi.buffer(out))


def pack_header(profile: str, layout: BlockLayout, key: bytes, payload_digest: int,
                secret: bytes | None = None, payload=None) -> bytes:
    """The 4096-byte header of a block file; with ``secret`` (the cluster key) it is
    TAGGED and carries the integrity tag of itself and ``payload``."""
    name = profile.encode()
    if len(name) > PROFILE_NAME_BYTES:
        raise ValueError(f"profile name {profile!r} is longer than {PROFILE_NAME_BYTES} bytes")
    flags = FLAG_TAGGED if secret is not None else 0
    fields = _FIELDS.pack(MAGIC, VERSION, HEADER_BYTES, flags, name, layout.layers,
                          layout.tokens, layout.token_bytes, 0, layout.full_bytes,
                          payload_digest, key)
    head = fields + _HASH.pack(payload_hash(fields))
    if secret is not None:
        head += bytes(NONCE_OFFSET - len(head)) + os.urandom(NONCE_BYTES)
        head += integrity_tag(secret, head, payload)
    return head + bytes(HEADER_BYTES - len(head))


def check_tag(buf, secret: bytes, payload, checked: int = 0) -> str | None:
    """None when the header is TAGGED and its tag verifies under ``secret``.
    ``checked``: the read loop's verdict when it computed the tag (1 equal, -1 not;
    0: compute it here)."""
    head = bytes(buf[:TAG_OFFSET + TAG_BYTES])
    (flags,) = struct.unpack_from("<I", head, 12)
    if not flags & FLAG_TAGGED:
        return "no integrity tag (written without the cluster key)"
    ok = checked > 0 if checked else hmac.compare_digest(
        head[TAG_OFFSET:], integrity_tag(secret, head, payload))
    return None if ok else "integrity tag mismatch (not written with this cluster key)"


def check_header(buf, profile: str, layout: BlockLayout, key: bytes) -> tuple[str | None, int]:
    """``(problem, payload_digest)``: ``problem`` is None when the header is as expected.

    ``buf`` holds at least the first ``_FIELDS.size + 8`` bytes of the file.
    """
    raw = bytes(buf[:_FIELDS.size + _HASH.size])
    if len(raw) < _FIELDS.size + _HASH.size:
        return "header truncated", 0
    (magic, version, header_bytes, _flags, name, layers, tokens, token_bytes, _res,
     payload_bytes, payload_digest, file_key) = _FIELDS.unpack_from(raw)
    if magic != MAGIC:
        return f"bad magic {magic!r}", 0
    if version != VERSION:
        return f"format version {version}, this build reads {VERSION}", 0
    (digest,) = _HASH.unpack_from(raw, _FIELDS.size)
    if digest != payload_hash(raw[:_FIELDS.size]):
        return "header hash mismatch", 0
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
    return None, payload_digest
