"""`kvledger config show` run as a real process: table, JSON, sources, masking, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvledger
from kvledger.core.settings import SETTINGS_REGISTRY


def clean_environment(**extra: str) -> dict[str, str]:
    """The test process's environment without any KVLEDGER_ variable, plus `extra`."""
    environ = {name: value for name, value in os.environ.items() if not name.startswith("KVLEDGER_")}
    environ.update(extra)
    return environ


def kvledger_cli(tmp_path: Path, *args: str, **extra_env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvledger.app.cli", *args],
        cwd=tmp_path,
        env=clean_environment(**extra_env),
        capture_output=True,
        text=True,
        timeout=30,
    )


def table(stdout: str) -> dict[str, tuple[str, str]]:
    lines = stdout.splitlines()
    assert lines[0].split() == ["key", "value", "source"]
    rows = {}
    for line in lines[1:]:
        key, rest = line.split(None, 1)
        value, source = rest.rsplit("  ", 1)
        rows[key] = (value.strip(), source.strip())
    return rows


def test_config_show_prints_every_setting_with_default_sources(tmp_path: Path) -> None:
    result = kvledger_cli(tmp_path, "config", "show")
    assert result.returncode == 0, result.stderr
    rows = table(result.stdout)
    assert list(rows) == list(SETTINGS_REGISTRY)
    assert rows["nats.url"] == ("nats://127.0.0.1:4222", "default")
    assert rows["decide.reject_media_status_code"] == ("415", "default")
    assert rows["nats.password"] == ("(unset)", "default")
    # columns are aligned: every value starts at the same offset
    lines = result.stdout.splitlines()
    offset = lines[0].index("value")
    assert all(line[offset - 2 : offset] == "  " and line[offset] != " " for line in lines)


def test_file_env_and_flags_show_their_sources(tmp_path: Path) -> None:
    config = tmp_path / "kvledger.toml"
    config.write_text('[db]\nurl = "sqlite:///from-file.db"\n[store]\nbatch_size = 64\n', encoding="utf-8")
    result = kvledger_cli(
        tmp_path,
        "--config",
        str(config),
        "config",
        "show",
        "--nats",
        "nats://flag:4222",
        KVLEDGER_STORE_BATCH_SIZE="128",
        KVLEDGER_REUSE_ENABLE_DECODE_TO_PREFILL_REUSE="yes",
    )
    assert result.returncode == 0, result.stderr
    rows = table(result.stdout)
    assert rows["nats.url"] == ("nats://flag:4222", "cli")
    assert rows["db.url"] == ("sqlite:///from-file.db", f"file {config}")
    assert rows["store.batch_size"] == ("128", "env KVLEDGER_STORE_BATCH_SIZE")
    assert rows["reuse.enable_decode_to_prefill_reuse"] == ("true", "env KVLEDGER_REUSE_ENABLE_DECODE_TO_PREFILL_REUSE")


@pytest.mark.parametrize(
    "args",
    [
        ("--nats", "nats://g:1", "--db", "sqlite:///g.db", "config", "show"),
        ("config", "--nats", "nats://g:1", "show", "--db", "sqlite:///g.db"),
        ("config", "show", "--nats", "nats://g:1", "--db", "sqlite:///g.db"),
    ],
)
def test_global_flags_work_before_and_after_the_subcommand(tmp_path: Path, args: tuple[str, ...]) -> None:
    result = kvledger_cli(tmp_path, *args, "--json")
    assert result.returncode == 0, result.stderr
    records = {record["key"]: record for record in json.loads(result.stdout)}
    assert records["nats.url"] == {"key": "nats.url", "value": "nats://g:1", "source": "cli"}
    assert records["db.url"] == {"key": "db.url", "value": "sqlite:///g.db", "source": "cli"}


def test_json_output_parses_with_typed_values(tmp_path: Path) -> None:
    result = kvledger_cli(tmp_path, "config", "show", "--json", KVLEDGER_INGEST_ENDPOINTS="tcp://a:1,tcp://b:1")
    assert result.returncode == 0, result.stderr
    records = json.loads(result.stdout)
    assert [record["key"] for record in records] == list(SETTINGS_REGISTRY)
    values = {record["key"]: record["value"] for record in records}
    assert values["reuse.minimum_transfer_prefix_blocks"] == 4
    assert values["reuse.enable_decode_to_prefill_reuse"] is False
    assert values["nats.token"] is None
    assert values["ingest.endpoints"] == ["tcp://a:1", "tcp://b:1"]


def test_secrets_are_masked_everywhere(tmp_path: Path) -> None:
    secret = "pw-Zq8-never-print"
    for args in (("config", "show"), ("config", "show", "--json")):
        result = kvledger_cli(tmp_path, *args, KVLEDGER_NATS_PASSWORD=secret, KVLEDGER_NATS_USER="kv")
        assert result.returncode == 0, result.stderr
        assert secret not in result.stdout and secret not in result.stderr
    assert table(kvledger_cli(tmp_path, "config", "show", KVLEDGER_NATS_PASSWORD=secret).stdout)["nats.password"] == (
        "***",
        "env KVLEDGER_NATS_PASSWORD",
    )


def test_unknown_top_level_keys_exit_2(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("b = 2\na = 1\n", encoding="utf-8")
    result = kvledger_cli(tmp_path, "config", "show", "--config", str(config))
    assert result.returncode == 2
    assert result.stderr == "kvledger: unknown setting(s): ['a', 'b']\n"
    assert result.stdout == ""


def test_unknown_environment_variable_exits_2(tmp_path: Path) -> None:
    result = kvledger_cli(tmp_path, "config", "show", KVLEDGER_NATS_URLL="nats://typo", KVLEDGER_TEST_ANYTHING="ok")
    assert result.returncode == 2
    assert result.stderr == "kvledger: unknown setting(s): ['KVLEDGER_NATS_URLL']\n"


def test_missing_config_file_exits_2(tmp_path: Path) -> None:
    result = kvledger_cli(tmp_path, "--config", "absent.toml", "config", "show")
    assert result.returncode == 2
    assert result.stderr == "kvledger: config file absent.toml: not found\n"


def test_version(tmp_path: Path) -> None:
    result = kvledger_cli(tmp_path, "--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"kvledger {kvledger.__version__}"


def test_group_without_subcommand_prints_help_and_exits_2(tmp_path: Path) -> None:
    result = kvledger_cli(tmp_path, "config")
    assert result.returncode == 2
    assert "show" in result.stderr


def test_main_returns_exit_codes_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    from kvledger.app.cli import main

    assert main(["--version"]) == 0
    assert main(["no-such-command"]) == 2
    capsys.readouterr()


def test_core_imports_no_stage_package(tmp_path: Path) -> None:
    probe = (
        "import sys, kvledger.app.cli, kvledger.core.settings; "
        "print(sorted(m for m in sys.modules if m.split('.')[:2] in (['kvledger', 'ingest'], ['kvledger', 'store'], "
        "['kvledger', 'decide'])))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=clean_environment(), capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_command_line_imports_neither_nats_nor_numpy_before_a_command_needs_them(tmp_path: Path) -> None:
    """An audit's command is mostly its imports on a small ledger: nats-py and numpy are a third of a second that
    only the commands which use them pay."""
    probe = "import sys, kvledger.app.cli; print(sorted({m.split('.')[0] for m in sys.modules} & {'nats', 'numpy'}))"
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=clean_environment(), capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
