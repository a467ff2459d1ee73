"""Exit codes shared by every command (dualpath/cli.py): 2 for bad usage or config, 3 for
a remote service that cannot be reached, and one `dualpath: error:` line instead of a
traceback. 127.0.0.1:1 is a closed loopback port (nothing listens on port 1)."""

import pytest

from dualpath import cli
from dualpath.errors import RemoteUnavailable

DOWN = "127.0.0.1:1"


@pytest.fixture
def plaintext(tmp_path):
    """A config that opts into plaintext gRPC (clients refuse to run without [tls])."""
    path = tmp_path / "plain.toml"
    path.write_text("[tls]\nplaintext = true\n")
    return str(path)


def run(capsys, *argv):
    rc = cli.main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, err


def test_replay_against_an_unreachable_scheduler_exits_3(capsys, plaintext):
    # Was an AioRpcError traceback with exit 1. Now it retries, then gives up.
    rc, err = run(capsys, "replay", "--scheduler", DOWN, "--nodes", "p0,d0", "--agents", "1",
                  "--max-rounds", "1", "--modes", "basic", "--no-progress", "--timeout", "10",
                  "--config", plaintext, "--give-up-after", "0.3")
    assert rc == cli.EXIT_UNAVAILABLE and f"scheduler {DOWN}: UNAVAILABLE" in err
    assert "no round finished: no partial report" in err


def test_replay_missing_trace_file_exits_2(capsys, tmp_path):
    # Was a FileNotFoundError traceback with exit 1.
    missing = tmp_path / "none.jsonl"
    rc, err = run(capsys, "replay", "--trace", str(missing), "--scheduler", DOWN,
                  "--nodes", "p0")
    assert rc == cli.EXIT_USAGE and f"--trace {missing}: cannot read" in err


@pytest.mark.parametrize("argv", [["ctl", "engines"], ["ctl", "stats", "--json"],
                                  ["submit", "--prompt-tokens", "10"]])
def test_client_commands_against_an_unreachable_scheduler_exit_3(capsys, argv, plaintext):
    rc, err = run(capsys, *argv, "--scheduler", DOWN, "--config", plaintext)
    assert rc == cli.EXIT_UNAVAILABLE and "UNAVAILABLE" in err


def test_remote_unavailable_from_any_command_maps_to_3(capsys, monkeypatch):
    def down(args):
        raise RemoteUnavailable("node n0 127.0.0.1:1: UNAVAILABLE")

    parser = cli.build_parser()
    args = parser.parse_args(["config", "docs"])
    args.func = down
    monkeypatch.setattr(cli, "build_parser", lambda: _Fixed(args))
    rc, err = run(capsys, "config", "docs")
    assert rc == cli.EXIT_UNAVAILABLE and "dualpath: error: node n0" in err


class _Fixed:
    def __init__(self, args):
        self.args = args

    def parse_args(self, argv):
        return self.args


def test_node_ready_file_in_a_missing_directory_exits_2_before_starting(capsys, tmp_path):
    # Was a FileNotFoundError traceback (exit 1) once the node had started and was serving.
    ready = tmp_path / "no" / "ready"
    rc, err = run(capsys, "node", "--role", "prefill", "--node-id", "p0", "--scheduler", DOWN,
                  "--ready-file", str(ready))
    assert rc == cli.EXIT_USAGE and f"--ready-file {ready}: directory" in err


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_replay_output_in_a_missing_directory_is_refused_before_the_run(capsys, tmp_path,
                                                                         flag):
    # Was found only after the whole run, as a FileNotFoundError traceback (result lost).
    # DOWN as the scheduler: had the run started, the exit code would be 3.
    out = tmp_path / "no" / "r.out"
    rc, err = run(capsys, "replay", "--scheduler", DOWN, "--nodes", "p0", flag, str(out))
    assert rc == cli.EXIT_USAGE and f"{flag} {out}: directory" in err


def test_demo_bad_out_and_numbers_exit_2(capsys, tmp_path):
    (tmp_path / "file").write_text("")
    rc, err = run(capsys, "demo", "--out", str(tmp_path / "file" / "sub"))
    assert rc == cli.EXIT_USAGE and "--out" in err
    rc, err = run(capsys, "demo", "--out", str(tmp_path), "--snic-gbit", "-1")
    assert rc == cli.EXIT_USAGE and "--snic-gbit" in err


def test_sigterm_inside_a_local_cluster_block_unwinds_and_restores_the_handler():
    # replay/demo run their local cluster inside this block: SIGTERM's default action
    # killed the parent at once and left the cluster's processes (own sessions) running.
    import os
    import signal
    import threading

    from dualpath.cluster.cli import sigterm_as_interrupt

    before = signal.getsignal(signal.SIGTERM)
    stopped = []
    with pytest.raises(KeyboardInterrupt), sigterm_as_interrupt():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            threading.Event().wait(60)   # bound only; the signal ends the wait
        finally:
            stopped.append("cluster.stop")
    assert stopped == ["cluster.stop"]
    assert signal.getsignal(signal.SIGTERM) is before


def test_bad_log_level_exits_2_without_a_traceback(capsys, monkeypatch):
    # Both were logging's ValueError traceback.
    with pytest.raises(SystemExit) as e:
        cli.main(["--log-level", "loud", "config", "docs"])
    assert e.value.code == 2 and "--log-level" in capsys.readouterr().err
    monkeypatch.setenv("DUALPATH_LOG", "loud")
    rc, err = run(capsys, "config", "docs")
    assert rc == cli.EXIT_USAGE and "DUALPATH_LOG = 'LOUD'" in err


@pytest.mark.parametrize("word", ["quota=4294967296", f"alpha={2**64}", "beta=²", "beta=-1"])
def test_ctl_set_values_beyond_the_wire_field_exit_2(capsys, word, plaintext):
    # compute_quota_ms is uint32 and alpha/beta uint64 (proto/dualpath/v1/admin.proto);
    # past that protobuf raised a ValueError traceback, and '²' passed str.isdigit().
    rc, err = run(capsys, "ctl", "set", word, "--scheduler", DOWN, "--config", plaintext)
    assert rc == cli.EXIT_USAGE and f"ctl set: {word!r}" in err


def test_ctl_set_accepts_the_largest_values():
    from dualpath.scheduler.cli import parse_set

    assert parse_set(["quota=4294967295", f"alpha={2**64 - 1}", "split_read=on"]) == {
        "compute_quota_ms": 2**32 - 1, "alpha_tokens": 2**64 - 1, "split_read": True}


@pytest.mark.parametrize("flag, value", [("--timeout", "-5"), ("--snic-gbit", "-3")])
def test_replay_bad_numbers_exit_2_before_connecting(capsys, flag, value):
    # With --scheduler these reached the run (exit 3 here, as DOWN is closed).
    rc, err = run(capsys, "replay", "--scheduler", DOWN, "--nodes", "p0", flag, value)
    assert rc == cli.EXIT_USAGE and f"{flag} {value}: must be" in err


def test_version_names_the_package_and_its_native_build(capsys, monkeypatch):
    from dualpath import _native, _version

    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"dualpath {_version.__version__}; native extension "
                          f"{_native.NATIVE_VERSION} ")
    assert "dma-buf memory registration" in out
    # A native build that does not load says why, instead of a traceback.
    monkeypatch.setitem(__import__("sys").modules, "dualpath._native", None)
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert "native extension: import of dualpath._native halted" in capsys.readouterr().out
