"""The journal's native protocol: records as journald parses them (fields, priorities,
the length-prefixed form for multi-line values), the daemon's own fields, and the
choice of handler from JOURNAL_STREAM."""

from __future__ import annotations

import logging
import os
import socket
import struct
import sys

import pytest

from dualpath import journald


def parse(data: bytes) -> dict[str, str]:
    """journald's reading of one datagram (systemd.journal-fields / native protocol)."""
    out, i = {}, 0
    while i < len(data):
        nl = data.index(b"\n", i)
        line = data[i:nl]
        if b"=" in line:
            k, v = line.split(b"=", 1)
            i = nl + 1
        else:
            k = line
            (n,) = struct.unpack("<Q", data[nl + 1:nl + 9])
            v = data[nl + 9:nl + 9 + n]
            assert data[nl + 9 + n:nl + 10 + n] == b"\n"
            i = nl + 10 + n
        out[k.decode()] = v.decode()
    return out


@pytest.fixture
def journal(tmp_path):
    path = str(tmp_path / "journal.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(5)
    h = journald.JournalHandler(path)
    log = logging.getLogger("dualpath.test.journal")
    log.addHandler(h)
    log.setLevel(logging.DEBUG)
    log.propagate = False
    yield log, lambda: parse(sock.recv(65536))
    log.removeHandler(h)
    h.close()
    sock.close()
    journald._fields.clear()


def test_a_record_carries_priority_code_location_and_the_daemons_fields(journal):
    log, recv = journal
    journald.set_fields(DUALPATH_NODE_ID="p0", DUALPATH_ROLE="prefill")
    log.warning("lease %d lost", 7)
    f = recv()
    assert f["MESSAGE"] == "lease 7 lost" and f["PRIORITY"] == "4"
    assert f["SYSLOG_IDENTIFIER"] == "dualpath" and f["LOGGER"] == "dualpath.test.journal"
    assert f["CODE_FILE"].endswith("test_journald.py") and int(f["CODE_LINE"]) > 0
    assert f["CODE_FUNC"] == "test_a_record_carries_priority_code_location_and_the_daemons_fields"
    assert (f["DUALPATH_NODE_ID"], f["DUALPATH_ROLE"]) == ("p0", "prefill")
    log.debug("d")
    assert recv()["PRIORITY"] == "7"
    log.error("e")
    assert recv()["PRIORITY"] == "3"


def test_a_multi_line_message_and_a_traceback_use_the_length_prefixed_form(journal):
    log, recv = journal
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("failed\\nbadly".replace("\\n", "\n"))
    f = recv()
    assert f["MESSAGE"].startswith("failed\nbadly\nTraceback")
    assert "RuntimeError: boom" in f["MESSAGE"]


def test_field_names_are_checked():
    with pytest.raises(ValueError, match="journal field name"):
        journald.set_fields(node_id="x")
    with pytest.raises(ValueError):
        journald.set_fields(_PID="1")


def test_stderr_is_the_journal_only_when_journal_stream_names_it(tmp_path, monkeypatch):
    f = open(tmp_path / "stderr", "w")   # noqa: SIM115 - closed below
    try:
        monkeypatch.setattr(sys, "stderr", f)
        st = os.fstat(f.fileno())
        assert journald.stderr_is_journal({"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"})
        assert not journald.stderr_is_journal({"JOURNAL_STREAM": f"{st.st_dev}:1"})
        assert not journald.stderr_is_journal({"JOURNAL_STREAM": "junk"})
        assert not journald.stderr_is_journal({})
    finally:
        f.close()


def test_an_unreachable_journal_falls_back_to_stderr(tmp_path, capsys):
    h = journald.JournalHandler(str(tmp_path / "nobody"))
    log = logging.getLogger("dualpath.test.nojournal")
    log.addHandler(h)
    log.propagate = False
    try:
        log.warning("still said")
    finally:
        log.removeHandler(h)
        h.close()
    assert "WARNING dualpath.test.nojournal: still said" in capsys.readouterr().err
