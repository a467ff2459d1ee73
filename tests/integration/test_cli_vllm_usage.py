"""Usage errors of the vLLM P/D commands: exit 2 and a message naming what is wrong,
before anything starts."""

from __future__ import annotations

import pytest

from dualpath.cli import main


@pytest.mark.parametrize("argv, needle", [
    (["replay", "--url", "http://127.0.0.1:1"], "--engine vllm"),
    (["replay", "--engine", "vllm", "--concurrency", "0"], "--concurrency"),
    (["up", "--model", "/x"], "--engine vllm"),
    (["up", "--cores", "0"], "--cores is for --engine vllm"),
    (["up", "--engine", "vllm", "--model", "/nonexistent/model"], "config.json"),
    (["frontend", "--ready-file", "/nonexistent/dir/ready"], "--ready-file"),
])
def test_bad_usage_exits_2_naming_it(argv, needle, capsys):
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_a_frontend_api_key_too_short_is_a_config_error(tmp_path, capsys):
    key = tmp_path / "k"
    key.write_text("short")
    cfg = tmp_path / "f.toml"
    cfg.write_text(f'[frontend]\napi_key_file = "{key}"\nlisten = "127.0.0.1:0"\n'
                   '[tls]\nplaintext = true\n')
    assert main(["frontend", "--config", str(cfg)]) == 2
    assert "16 characters" in capsys.readouterr().err


def test_a_taken_front_end_port_is_refused_at_once_naming_it(tmp_path, capsys):
    """vLLM's own server defaults to port 8000, as the front end does: `up` says so
    before it starts anything (it took minutes of start-up to fail)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        cfg = tmp_path / "up.toml"
        cfg.write_text(f'[frontend]\nlisten = "127.0.0.1:{port}"\n')
        model = tmp_path / "m"
        model.mkdir()
        (model / "config.json").write_text("{}")
        assert main(["up", "--engine", "vllm", "--config", str(cfg),
                     "--model", str(model)]) == 2
    err = capsys.readouterr().err
    assert f"frontend.listen = 127.0.0.1:{port}" in err and "another process" in err


@pytest.mark.parametrize("argv, needle", [
    (["up", "--engine", "vllm", "--concurrency", "0"], "concurrency"),
    (["up", "--engine", "vllm", "--cores", "0-"], "--cores '0-': not a CPU list"),
    (["up", "--engine", "vllm", "--cores", "99999"], "cores 99999 are not among those"),
])
def test_bad_concurrency_exits_2(argv, needle, tmp_path, capsys):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"num_hidden_layers": 2, "num_attention_heads": 2, '
                                       '"hidden_size": 64}')
    assert main([*argv, "--model", str(model), "--config", str(_free_fe(tmp_path))]) == 2
    assert needle in capsys.readouterr().err


def _free_fe(tmp_path):
    cfg = tmp_path / "up.toml"
    cfg.write_text('[frontend]\nlisten = "127.0.0.1:0"\n')
    return cfg
