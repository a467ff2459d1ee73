"""The out-of-band messages and the in-process channel."""

from __future__ import annotations

import asyncio
import errno

import pytest

from dualpath.errors import TransferError, UsageError
from dualpath.tcp import Credential
from dualpath.transfer.oob import (
    ConnectReply,
    ConnectRequest,
    InProcessChannel,
    decode,
    encode,
)
from dualpath.transfer.provider import RegionInfo, status_name
from dualpath.transfer.tcp_provider import decode_address, encode_address


def test_messages_round_trip_through_bytes():
    req = ConnectRequest("pe0", "verbs", (0, 3), (b"\x00\x01" * 16, b""))
    rep = ConnectReply("verbs", (b"\xff" * 32,), {"kv": RegionInfo(1 << 47, 4096, 0xabcdef)})
    assert decode(encode(req)) == req
    assert decode(encode(rep)) == rep


@pytest.mark.parametrize("data", [b"not json", b'{"type": "x", "endpoints": []}',
                                  b'{"type": "connect_request"}'])
def test_malformed_messages_are_usage_errors(data):
    with pytest.raises(UsageError):
        decode(data)


def test_in_process_channel_routes_by_name_and_refuses_strangers():
    seen = []

    async def handler(req):
        seen.append(req)
        return ConnectReply(req.transport, tuple(e + b"!" for e in req.endpoints), {})

    async def main():
        ch = InProcessChannel()
        ch.serve("de0", handler)
        with pytest.raises(UsageError, match="already served"):
            ch.serve("de0", handler)
        rep = await ch.request("de0", ConnectRequest("pe0", "tcp", (0,), (b"ep",)))
        assert rep.endpoints == (b"ep!",)
        ch.unserve("de0")
        with pytest.raises(TransferError) as ei:
            await ch.request("de0", ConnectRequest("pe0", "tcp", (0,), (b"ep",)))
        assert ei.value.errno == errno.ECONNREFUSED

    asyncio.run(main())
    assert seen == [ConnectRequest("pe0", "tcp", (0,), (b"ep",))]


def test_tcp_addresses_round_trip_including_ipv6():
    assert decode_address(encode_address("127.0.0.1", 4791)) == ("127.0.0.1", 4791, None)
    assert decode_address(encode_address("::1", 80)) == ("::1", 80, None)
    cred = Credential(0x10002, bytes(range(16)))
    assert decode_address(encode_address("::1", 80, cred)) == ("::1", 80, cred)
    for bad in (b"h:1#zz:00", b"h:1#1:abcd", b"\xff:1"):
        with pytest.raises(UsageError, match="not a TCP provider endpoint"):
            decode_address(bad)
    with pytest.raises(UsageError):
        decode_address(b"nohostport")


def test_status_names_follow_ibv_numbering():
    assert status_name(10) == "REM_ACCESS_ERR (10)"
    assert status_name(5) == "WR_FLUSH_ERR (5)"
    assert status_name(99) == "status 99"


def test_a_reply_carries_the_windows_of_a_region_scoped_by_key():
    """verbs' scope: the peer learns one rkey per granted run; an unscoped region keeps
    the three-field form older engines read."""
    scoped = RegionInfo(0x1000, 1 << 20, 7, ((0, 4096, 11), (65536, 8192, 12)), True)
    plain = RegionInfo(0x2000, 4096, 9)
    reply = decode(encode(ConnectReply("verbs", (b"e",), {"a": scoped, "b": plain})))
    assert reply.regions == {"a": scoped, "b": plain}
    assert b'"b":[8192,4096,9]' in encode(ConnectReply("verbs", (), {"b": plain}))
    empty = RegionInfo(0, 4096, 7, (), True)        # scoped, nothing granted yet
    assert decode(encode(ConnectReply("verbs", (), {"a": empty}))).regions["a"] == empty
