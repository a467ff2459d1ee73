"""A scripted scheduler client for tests that run callers in other network namespaces:
``python -m tests.sched_calls JSON`` with {"address", "tls": [ca, cert, key] or
"plaintext" or ["ca-only", ca], "calls": [[op, ...], ...]} prints one JSON list: per call
"OK:<value>" or the gRPC status code name.

Ops: ["register", group_id, node_id] (value: lease id), ["fetch", group_id, lease_id],
["report", group_id, lease_id], ["stats"] (an admin call, no token), ["submit", n].
"""

import asyncio
import json
import sys
from pathlib import Path

import grpc

from dualpath import tls
from dualpath.scheduler.client import SchedulerClient
from dualpath.v1 import scheduler_pb2 as pb


def credentials(spec):
    if spec == "plaintext":
        return None
    if spec[0] == "ca-only":   # verifies the server, presents no certificate
        return grpc.ssl_channel_credentials(Path(spec[1]).read_bytes())
    ca, cert, key = spec
    return tls.channel_credentials(tls.TlsConfig(ca_file=ca, cert_file=cert, key_file=key))


async def one(c: SchedulerClient, op):
    if op[0] == "register":
        r = await c.register_group(op[1], pb.ENGINE_ROLE_DECODE, [pb.EngineInfo(
            engine_id=f"{op[2]}/e0", rank=0, node_id=op[2], hbm_bytes=1 << 30)])
        return r.lease_id
    if op[0] == "fetch":
        return len((await c.fetch(op[1], op[2], [])).assignments)
    if op[0] == "report":
        return (await c.report(op[1], op[2], [])).accepted
    if op[0] == "stats":
        return (await c.stats()).groups_up
    if op[0] == "submit":
        return len((await c.submit([pb.RequestSpec(prompt_tokens=10)] * op[1])).request_ids)
    raise ValueError(op)


async def main(spec):
    out = []
    async with SchedulerClient(spec["address"], credentials=credentials(spec["tls"]),
                               timeout_s=20) as c:
        for op in spec["calls"]:
            try:
                out.append(f"OK:{await one(c, op)}")
            except grpc.aio.AioRpcError as e:
                out.append(e.code().name)
    print(json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
