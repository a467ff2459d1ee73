"""Usage errors of the vLLM P/D commands: exit 2 and a message naming what is wrong,
before anything starts."""

from __future__ import annotations

import pytest

from dualpath.cli import main


@pytest.mark.parametrize("argv, needle", [
    (["replay", "--url", "http://127.0.0.1:1"], "--engine vllm"),
    (["replay", "--engine", "vllm", "--concurrency", "0"], "--concurrency"),
    (["up", "--model", "/x"], "--engine vllm"),
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
