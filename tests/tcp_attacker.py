"""An attacker of the TCP provider's data port, run inside its own network namespace by
tests/integration/test_tcp_attacks.py: ``python -m tests.tcp_attacker JSON`` prints one
JSON object.

Modes:
- {"mode": "write", "host", "port", "rkey", "addr", "length"}: connect, send a WRITE
  header aimed at a leaked (rkey, address) and its payload, then a hello with a guessed
  credential; report every byte the target sent back.
- {"mode": "credential", "host", "port", "id", "secret_hex"}: connect with the real
  TcpConnection code presenting a credential (wrong or already used); report the errno.
- {"mode": "flood", "host", "port", "n"}: open n TCP connections and hold them idle,
  print {"held": n} and wait for stdin to close.
- {"mode": "storm", "host", "port", "n"}: keep n unauthenticated connections open,
  opening a new one for each the target closes, until stdin closes; print
  {"storming": n} once the first n are open and {"reopened": count} at the end.
"""

import json
import resource
import socket
import struct
import sys


def _drain(s: socket.socket) -> bytes:
    got = b""
    try:
        while chunk := s.recv(4096):
            got += chunk
    except (ConnectionResetError, TimeoutError, OSError):
        pass
    return got


def write(spec) -> dict:
    s = socket.create_connection((spec["host"], spec["port"]), timeout=20)
    hdr = struct.pack("<BBBBIIIQQ", 0xD7, 1, 1, 0, spec["length"], spec["rkey"], 0,
                      spec["addr"], 0)
    try:
        s.sendall(hdr + b"\xee" * spec["length"])
        s.sendall(struct.pack("<II", 0x31485044, 0x10000) + bytes(48))   # a guessed hello
    except OSError:
        pass
    got = _drain(s)
    s.close()
    return {"received": got.hex()}


def credential(spec) -> dict:
    from dualpath.errors import RdmaError
    from dualpath.tcp import Credential, TcpEngine

    with TcpEngine("127.0.0.1", 0) as eng:
        conn = eng.connection(eng.cq(16))
        try:
            conn.connect(spec["host"], spec["port"], timeout=20, credential=Credential(
                spec["id"], bytes.fromhex(spec["secret_hex"])))
            return {"errno": 0}
        except RdmaError as e:
            return {"errno": e.errno}
        finally:
            conn.close()


def _opened(spec) -> socket.socket:
    """A connection to the target, its connect under way (non-blocking)."""
    s = socket.socket()
    s.setblocking(False)
    try:
        s.connect((spec["host"], spec["port"]))
    except BlockingIOError:
        pass
    return s


def flood(spec) -> None:
    n = spec["n"]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, n + 256)), hard))
    held = [_opened(spec) for _ in range(n)]
    print(json.dumps({"held": len(held)}), flush=True)
    sys.stdin.read()      # hold them until the test closes our stdin
    for s in held:
        s.close()


def storm(spec) -> None:
    import threading
    import time

    n = spec["n"]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, n + 256)), hard))
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    held = [_opened(spec) for _ in range(n)]
    print(json.dumps({"storming": n}), flush=True)
    reopened = 0
    while not done.is_set():
        for i, s in enumerate(held):
            try:
                while s.recv(4096):       # the challenge: read and ignored
                    pass
            except (BlockingIOError, OSError) as e:
                if isinstance(e, BlockingIOError):
                    continue
            s.close()                     # closed by the target (EOF or reset): again
            held[i] = _opened(spec)
            reopened += 1
        time.sleep(0.01)
    for s in held:
        s.close()
    print(json.dumps({"reopened": reopened}), flush=True)


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    if spec["mode"] == "flood":
        flood(spec)
    elif spec["mode"] == "storm":
        storm(spec)
    else:
        print(json.dumps({"write": write, "credential": credential}[spec["mode"]](spec)))
