"""Bad config input ends in a ConfigError that names the key (or file), the value and
what is allowed, and `dualpath config check` turns it into exit 2 with one line, never a
traceback. Expected messages come from dualpath/config.py's wording."""

import pytest

from dualpath import cli, config
from dualpath.errors import ConfigError


@pytest.mark.parametrize("text, expected", [
    ('[scheduler]\nlistn = "x"\n', "unknown config key scheduler.listn"),
    ("[scheduler]\nlisten = 5\n", "config key scheduler.listen = 5: expected str"),
    ("[transport]\nport = 999\n", "config key transport.port = 999: must be >= 1, <= 255"),
    ('[transport]\nkind = "ib"\n', "allowed values are one of 'auto', 'verbs', 'tcp'"),
    ("[bogus]\n", "unknown config section [bogus]"),
    ("scheduler = 5\n", "config section [scheduler] must be a table"),
    ("[scheduler\n", "is not valid TOML"),
    # nan and inf compare false with every bound: `config check` said ok and the
    # scheduler started with a NaN storage rate (alpha = NaN tokens).
    ("[scheduler]\nstorage_read_bytes_per_s = nan\n",
     "scheduler.storage_read_bytes_per_s = nan: must be a finite number"),
    ("[scheduler]\nalpha_window_s = inf\n", ("scheduler.alpha_window_s = inf: must be a "
     "finite number")),
    ("[transfer]\ntimeout_s = -inf\n", "transfer.timeout_s = -inf: must be a finite number"),
    # lease_ms travels as uint32 in RegisterGroupResponse: 2^32 raised ValueError there.
    ("[scheduler]\nlease_ms = 4294967296\n", ("scheduler.lease_ms = 4294967296: must be "
     ">= 10, <= 4294967295")),
    ("[engine]\ndecode_hbm_mib = 17592186044416\n", ("engine.decode_hbm_mib = "
     "17592186044416: must be >= 1, <= 16777216")),
    # TOML integers are int64; Python's parser reads any size.
    ("[storage]\nsnic_burst_bytes = 99999999999999999999\n",
     "storage.snic_burst_bytes = 99999999999999999999: outside TOML's integer range"),
])
def test_bad_file_names_what_is_wrong_and_exits_2(tmp_path, capsys, text, expected):
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=_re(expected)):
        config.load(path)
    assert cli.main(["config", "check", str(path)]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(tmp_path / "nope.toml")


def test_unreadable_path_is_a_config_error_not_a_traceback(tmp_path, capsys):
    # A directory given as the config file raised IsADirectoryError (exit 1, traceback).
    with pytest.raises(ConfigError, match=_re(f"config file {tmp_path}: cannot read")):
        config.load(tmp_path)
    assert cli.main(["config", "check", str(tmp_path)]) == cli.EXIT_USAGE
    assert "cannot read" in capsys.readouterr().err


def _re(text: str) -> str:
    import re

    return re.escape(text)


def test_docs_lists_every_key_with_its_doc_and_range():
    # Every registered section's fields (config.SECTIONS), read back from the classes.
    import dataclasses

    text = config.docs()
    lines = {ln.split("`")[1]: ln for ln in text.splitlines() if ln.startswith("| `")}
    for name in config.SECTIONS:
        for f in dataclasses.fields(config._section_class(name)):
            line = lines[f"{name}.{f.name}"]
            assert f.metadata["doc"] and f.metadata["doc"][:20] in line
            if f.metadata.get("min") is not None:   # ranges were left out of the docs
                assert f">= {f.metadata['min']}" in line
            if f.metadata.get("max") is not None:
                assert f"<= {f.metadata['max']}" in line


def test_engine_model_profile_is_checked_by_config_check(tmp_path, capsys):
    # `config check` said ok; only a started node refused the unknown profile.
    path = tmp_path / "c.toml"
    path.write_text('[engine]\nmodel_profile = "nope"\n')
    assert cli.main(["config", "check", str(path)]) == cli.EXIT_USAGE
    assert "engine.model_profile = 'nope': allowed values are one of 'demo'" in \
        capsys.readouterr().err


@pytest.mark.parametrize("section, key, value", [
    ("scheduler", "listen", "127.0.0.1:99999"), ("scheduler", "metrics_listen", "zzz"),
    ("engine", "control_listen", ""), ("engine", "metrics_listen", "host:port"),
])
def test_listen_addresses_are_checked_by_config_check(tmp_path, capsys, section, key, value):
    # `config check` said ok; the daemon refused (or gRPC wrapped the port) at start.
    path = tmp_path / "c.toml"
    path.write_text(f'[{section}]\n{key} = "{value}"\n')
    assert cli.main(["config", "check", str(path)]) == cli.EXIT_USAGE
    assert f"config key {section}.{key} = {value!r}: expected host:port" in \
        capsys.readouterr().err


def test_binary_file_is_a_config_error_not_a_traceback(tmp_path, capsys):
    # tomllib raised UnicodeDecodeError: exit 1 with a traceback.
    path = tmp_path / "c.toml"
    path.write_bytes(b"\xff\xfe\x00\x01[scheduler]\n")
    with pytest.raises(ConfigError, match="is not a UTF-8 text file"):
        config.load(path)
    assert cli.main(["config", "check", str(path)]) == cli.EXIT_USAGE
    assert "not a UTF-8 text file" in capsys.readouterr().err
