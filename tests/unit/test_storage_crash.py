"""Crash safety: a writer killed (SIGKILL) mid-block leaves no visible block.

The child process writes one block through BlockStore.write with one step replaced by a
pause that first prints READY; the parent then SIGKILLs it, so the kill lands exactly
at that step (no timing involved).
"""

import select
import signal
import subprocess
import sys

import pytest

from dualpath.kv.prefix import block_keys
from dualpath.kv.profiles import get_profile
from dualpath.storage import BlockStore
from dualpath.storage.ledger import LEDGER_DIR
from dualpath.storage.store import aligned_bytes

PROFILE = get_profile("demo", 4)
KEY = block_keys(list(range(4)), 4)[0]

_CHILD = """
import os, sys, time
from dualpath.kv.profiles import get_profile
from dualpath.storage import BlockStore
from dualpath.storage.store import aligned_bytes

def pause():
    print("READY", flush=True)
    while True:
        time.sleep(60)

stage = sys.argv[2]
real_writev = os.writev
if stage == "mid-payload":       # half the bytes reach the temp file, then we stop
    def writev(fd, bufs):
        flat = b"".join(bytes(b) for b in bufs)
        os.write(fd, flat[:len(flat) // 2])
        os.fsync(fd)
        pause()
    os.writev = writev
elif stage == "before-rename":   # the whole temp file is written and fsynced
    os.rename = lambda *a, **kw: pause()
store = BlockStore(sys.argv[1], get_profile("demo", 4))
store.write(bytes.fromhex(sys.argv[3]), aligned_bytes(store.layout.full_bytes))
"""


@pytest.mark.parametrize("stage", ["mid-payload", "before-rename"])
def test_writer_killed_mid_block_leaves_no_visible_block(tmp_path, stage):
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path), stage, KEY.hex()],
                             stdout=subprocess.PIPE, text=True)
    try:
        # A generous bound only so a broken child cannot hang the suite; not a timing check.
        ready, _, _ = select.select([child.stdout], [], [], 120)
        assert ready and child.stdout.readline().strip() == "READY"
        child.send_signal(signal.SIGKILL)
        assert child.wait(60) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
        child.stdout.close()

    with BlockStore(tmp_path, PROFILE) as store:
        temps = list(store.dir.rglob(".*.tmp"))
        assert len(temps) == 1                                   # the kill was mid-write
        full_file = 4096 + store.layout.full_bytes
        assert temps[0].stat().st_size == (full_file // 2 if stage == "mid-payload" else full_file)
        assert not store.contains(KEY)
        assert not store.read_into(KEY, aligned_bytes(store.layout.full_bytes))
        assert (store.stats.misses, store.stats.corrupt_blocks) == (1, 0)
        # (the store's ledger, .ledger/, records the read's miss: not a block)
        visible = [p for p in store.dir.rglob("*") if p.is_file() and
                   not p.name.startswith(".") and LEDGER_DIR not in p.parts]
        assert visible == []
        assert store.sweep_temp(max_age_s=0) == 1
