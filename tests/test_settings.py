"""Settings: defaults, precedence, strict errors, secrets, digest, the env registry and its docs."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import attrs
import pytest

from kvledger.core.settings import (
    ENV_REGISTRY,
    SETTINGS_REGISTRY,
    DecideSettings,
    LoadedSettings,
    NatsSettings,
    ReuseSettings,
    Settings,
    SettingsError,
    StreamSettings,
    as_display_rows,
    as_json_records,
    load_settings,
    reference_table_markdown,
    settings_digest,
)

REPO_ROOT = Path(__file__).parents[1]
DOC = REPO_ROOT / "docs" / "settings.md"
PACKAGES = ("kvledger", "ingest", "store", "decide")
SETTINGS_MODULE = Path("kvledger") / "core" / "settings.py"


def write(tmp_path: Path, text: str, name: str = "kvledger.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def load(config: Path | None = None, environ: dict[str, str] | None = None, **overrides: object) -> LoadedSettings:
    return load_settings(config, environ=environ or {}, overrides={k.replace("__", "."): v for k, v in overrides.items()})


# ------------------------------------------------------------------ defaults


def test_reuse_defaults_match_design_section_5() -> None:
    assert attrs.asdict(ReuseSettings()) == {
        "enable_decode_to_prefill_reuse": False,
        "enable_decode_to_prefill_gpu_reuse": False,
        "minimum_transfer_prefix_blocks": 4,
        "minimum_estimated_ttft_saving_ms": 5.0,
        "transfer_source_prefill_token_us": 50.0,
        "transfer_source_estimated_block_us": 400.0,
        "transfer_source_gpu_estimated_block_us": 40.0,
        "transfer_source_lookup_budget_ms": 2.0,
        "device_credit_weight": 1.0,
        "host_credit_weight": 0.75,
        "disk_credit_weight": 0.25,
    }


def test_loaded_defaults_with_empty_environment() -> None:
    loaded = load_settings(environ={})
    settings = loaded.settings
    assert settings == Settings()
    assert settings.decide.reject_media_status_code == 415
    assert settings.decide.backend == "auto"
    assert settings.nats.url == "nats://127.0.0.1:4222"
    assert settings.db.url == "sqlite:///.kvledger/ledger.db"
    assert (settings.stream.events_stream, settings.stream.decisions_stream) == ("KV_EVENTS", "KV_DECISIONS")
    assert settings.stream.duplicate_window_s == 120.0
    assert settings.ingest.endpoints == ()
    assert settings.ingest.max_batch_bytes == 16777216
    assert set(loaded.sources) == set(SETTINGS_REGISTRY)
    assert set(loaded.sources.values()) == {"default"}


def test_settings_are_frozen() -> None:
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        Settings().nats.url = "nats://elsewhere:4222"  # type: ignore[misc]


def test_registry_covers_every_field_with_docs() -> None:
    assert "KVLEDGER_NATS_URL" in ENV_REGISTRY
    section, field, type_, description = ENV_REGISTRY["KVLEDGER_REUSE_MINIMUM_TRANSFER_PREFIX_BLOCKS"]
    assert (section, field, type_) == ("reuse", "minimum_transfer_prefix_blocks", int)
    assert description
    expected = {
        f"{section_field.name}.{field.name}"
        for section_field in attrs.fields(Settings)
        for field in attrs.fields(section_field.type)
    }
    assert set(SETTINGS_REGISTRY) == expected
    assert {entry.env_name for entry in SETTINGS_REGISTRY.values()} == set(ENV_REGISTRY)


# ---------------------------------------------------------------- precedence


def test_precedence_default_file_env_cli_with_sources(tmp_path: Path) -> None:
    config = write(
        tmp_path,
        """
        [nats]
        url = "nats://file:4222"
        connect_timeout_s = 9
        [db]
        url = "sqlite:///file.db"
        [reuse]
        minimum_transfer_prefix_blocks = 6
        """.replace("        ", ""),
    )
    environ = {
        "KVLEDGER_NATS_URL": "nats://env:4222",
        "KVLEDGER_REUSE_MINIMUM_TRANSFER_PREFIX_BLOCKS": "7",
        "PATH": "/usr/bin",  # not ours: ignored
    }
    loaded = load_settings(config, environ=environ, overrides={"nats.url": "nats://cli:4222"})
    s, sources = loaded.settings, loaded.sources

    assert s.nats.url == "nats://cli:4222" and sources["nats.url"] == "cli"
    assert s.reuse.minimum_transfer_prefix_blocks == 7
    assert sources["reuse.minimum_transfer_prefix_blocks"] == "env KVLEDGER_REUSE_MINIMUM_TRANSFER_PREFIX_BLOCKS"
    assert s.db.url == "sqlite:///file.db" and sources["db.url"] == f"file {config}"
    assert s.nats.connect_timeout_s == 9.0 and isinstance(s.nats.connect_timeout_s, float)
    assert s.store.batch_size == 512 and sources["store.batch_size"] == "default"


def test_text_overrides_are_parsed_like_environment_values() -> None:
    loaded = load(reuse__minimum_transfer_prefix_blocks="9", reuse__enable_decode_to_prefill_reuse=True)
    assert loaded.settings.reuse.minimum_transfer_prefix_blocks == 9
    assert loaded.settings.reuse.enable_decode_to_prefill_reuse is True
    assert loaded.sources["reuse.enable_decode_to_prefill_reuse"] == "cli"


# ------------------------------------------------------------- unknown keys


def test_unknown_top_level_keys_exact_message(tmp_path: Path) -> None:
    with pytest.raises(SettingsError) as info:
        load(write(tmp_path, 'b = 1\na = "x"\n'))
    assert str(info.value) == "unknown setting(s): ['a', 'b']"


def test_unknown_keys_inside_sections_are_dotted(tmp_path: Path) -> None:
    config = write(tmp_path, "zz = 1\n[nats]\nurll = 'nats://x'\n[reuse]\nminimum_blocks = 3\n[extra]\nq = 1\n")
    with pytest.raises(SettingsError) as info:
        load(config)
    assert str(info.value) == "unknown setting(s): ['extra', 'nats.urll', 'reuse.minimum_blocks', 'zz']"


def test_section_that_is_not_a_table(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"setting nats: expected a \[nats\] table, got 'x' \(str\)"):
        load(write(tmp_path, 'nats = "x"\n'))


def test_unknown_environment_variables_fail_but_harness_ones_are_ignored() -> None:
    environ = {
        "KVLEDGER_NATS_URLL": "nats://typo",
        "KVLEDGER_BOGUS": "1",
        "KVLEDGER_TEST_NATS_URL": "nats://harness",
        "KVLEDGER_REQUIRE_SERVICES": "1",
        "NOT_KVLEDGER_X": "1",
    }
    with pytest.raises(SettingsError) as info:
        load_settings(environ=environ)
    assert str(info.value) == "unknown setting(s): ['KVLEDGER_BOGUS', 'KVLEDGER_NATS_URLL']"

    harness_only = {"KVLEDGER_TEST_NATS_URL": "nats://harness", "KVLEDGER_REQUIRE_SERVICES": "1"}
    assert load_settings(environ=harness_only).settings == Settings()


def test_the_container_files_variables_are_not_taken_for_settings() -> None:
    """An operator who exported compose's variables (images, nats-server's per-service passwords)
    runs kvledger in the same shell; CI exports the stand-in images for the whole suite."""
    compose = {
        "KVLEDGER_IMAGE": "kvledger:test", "KVLEDGER_NATS_IMAGE": "kvledger-ci/nats:2.15",
        "KVLEDGER_POSTGRES_IMAGE": "kvledger-ci/postgres:15", "KVLEDGER_PYTHON_IMAGE": "kvledger-ci/python:3.11-slim",
        "KVLEDGER_TAG": "latest", "KVLEDGER_NATS_INGEST_PASSWORD": "a", "KVLEDGER_NATS_STORE_PASSWORD": "b",
        "KVLEDGER_NATS_DECIDE_PASSWORD": "c", "KVLEDGER_NATS_ROUTER_PASSWORD": "d",
    }
    assert load_settings(environ=compose).settings == Settings()


def test_unknown_override_key() -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(environ={}, overrides={"nats.bogus": "x"})
    assert str(info.value) == "unknown setting(s): ['nats.bogus']"


# ---------------------------------------------------------------- bad values


def test_bad_env_value_names_key_type_and_variable() -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(environ={"KVLEDGER_REUSE_MINIMUM_TRANSFER_PREFIX_BLOCKS": "abc"})
    assert str(info.value) == (
        "setting reuse.minimum_transfer_prefix_blocks: expected int, got 'abc' (str) "
        "from KVLEDGER_REUSE_MINIMUM_TRANSFER_PREFIX_BLOCKS"
    )


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('[reuse]\nminimum_transfer_prefix_blocks = "4"\n', r"setting reuse.minimum_transfer_prefix_blocks: expected int, got '4' \(str\)"),
        ("[reuse]\nminimum_transfer_prefix_blocks = true\n", r"expected int, got True \(bool\)"),
        ("[reuse]\nminimum_transfer_prefix_blocks = 4.0\n", r"expected int, got 4.0 \(float\)"),
        ("[reuse]\nhost_credit_weight = true\n", r"setting reuse.host_credit_weight: expected float, got True \(bool\)"),
        ("[reuse]\nhost_credit_weight = nan\n", r"expected float, got nan \(float\)"),
        ("[reuse]\nenable_decode_to_prefill_reuse = 1\n", r"expected bool, got 1 \(int\)"),
        ("[nats]\nurl = 4222\n", r"setting nats.url: expected str, got 4222 \(int\)"),
        ('[ingest]\nendpoints = "tcp://a:1"\n', r"setting ingest.endpoints: expected list\[str\], got 'tcp://a:1' \(str\)"),
        ("[ingest]\nendpoints = [1]\n", r"expected list\[str\], got \[1\] \(list\)"),
    ],
)
def test_toml_values_are_strict(tmp_path: Path, toml: str, message: str) -> None:
    config = write(tmp_path, toml)
    with pytest.raises(SettingsError, match=message + f" from file {re.escape(str(config))}$"):
        load(config)


def test_int_is_accepted_for_float_in_toml(tmp_path: Path) -> None:
    loaded = load(write(tmp_path, "[reuse]\nhost_credit_weight = 1\n"))
    assert loaded.settings.reuse.host_credit_weight == 1.0
    assert isinstance(loaded.settings.reuse.host_credit_weight, float)


@pytest.mark.parametrize(("text", "expected"), [("true", True), ("TRUE", True), ("1", True), ("Yes", True), ("false", False), ("0", False), ("no", False), ("NO", False)])
def test_bool_from_environment(text: str, expected: bool) -> None:
    loaded = load_settings(environ={"KVLEDGER_REUSE_ENABLE_DECODE_TO_PREFILL_GPU_REUSE": text})
    assert loaded.settings.reuse.enable_decode_to_prefill_gpu_reuse is expected


def test_bad_bool_from_environment() -> None:
    with pytest.raises(SettingsError, match=r"setting reuse.enable_decode_to_prefill_reuse: expected bool, got 'maybe' \(str\) from KVLEDGER_REUSE_ENABLE_DECODE_TO_PREFILL_REUSE"):
        load_settings(environ={"KVLEDGER_REUSE_ENABLE_DECODE_TO_PREFILL_REUSE": "maybe"})


def test_list_from_environment_is_comma_separated() -> None:
    environ = {"KVLEDGER_INGEST_ENDPOINTS": " tcp://a:5557, tcp://b:5557,replay=tcp://b:5558,provenance=retained ,"}
    assert load_settings(environ=environ).settings.ingest.endpoints == (
        "tcp://a:5557",
        "tcp://b:5557,replay=tcp://b:5558,provenance=retained",
    )
    assert load_settings(environ={"KVLEDGER_INGEST_ENDPOINTS": ""}).settings.ingest.endpoints == ()


def test_numbers_and_optional_strings_from_environment() -> None:
    loaded = load_settings(
        environ={
            "KVLEDGER_STREAM_MAX_BYTES": "1048576",
            "KVLEDGER_REUSE_HOST_CREDIT_WEIGHT": "0.5",
            "KVLEDGER_NATS_USER": "",
        }
    )
    assert loaded.settings.stream.max_bytes == 1048576
    assert loaded.settings.reuse.host_credit_weight == 0.5
    assert loaded.settings.nats.user is None
    with pytest.raises(SettingsError, match=r"expected float, got 'fast' \(str\) from KVLEDGER_REUSE_HOST_CREDIT_WEIGHT"):
        load_settings(environ={"KVLEDGER_REUSE_HOST_CREDIT_WEIGHT": "fast"})
    with pytest.raises(SettingsError, match=r"expected int, got '1.5' \(str\)"):
        load_settings(environ={"KVLEDGER_STREAM_REPLICAS": "1.5"})


def test_duplicate_window_below_two_minutes_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"setting stream.duplicate_window_s: must be >= 120, got 60.0 from file "):
        load(write(tmp_path, "[stream]\nduplicate_window_s = 60\n"))
    with pytest.raises(SettingsError, match=r"setting stream.duplicate_window_s: must be >= 120"):
        StreamSettings(duplicate_window_s=119.0)
    assert load(write(tmp_path, "[stream]\nduplicate_window_s = 120\n")).settings.stream.duplicate_window_s == 120.0


def test_backend_is_validated() -> None:
    with pytest.raises(SettingsError, match=r"setting decide.backend: must be one of auto, cpu, cuda, got 'gpu' from KVLEDGER_DECIDE_BACKEND"):
        load_settings(environ={"KVLEDGER_DECIDE_BACKEND": "gpu"})
    with pytest.raises(SettingsError, match="decide.backend"):
        DecideSettings(backend="tpu")
    assert load_settings(environ={"KVLEDGER_DECIDE_BACKEND": "cuda"}).settings.decide.backend == "cuda"


def test_reject_media_status_code_range() -> None:
    with pytest.raises(SettingsError, match=r"setting decide.reject_media_status_code: must be between 400 and 599, got 200 from the command line"):
        load_settings(environ={}, overrides={"decide.reject_media_status_code": 200})


def test_publisher_name_is_validated() -> None:
    with pytest.raises(SettingsError, match=r"setting ingest.publisher: .*'\.'"):
        load_settings(environ={"KVLEDGER_INGEST_PUBLISHER": "a.b"})


# --------------------------------------------------------------------- files


def test_missing_file_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "absent.toml"
    with pytest.raises(SettingsError, match=f"config file {re.escape(str(missing))}: not found"):
        load(missing)


def test_malformed_toml_names_the_file(tmp_path: Path) -> None:
    config = write(tmp_path, "[nats\nurl = 1\n")
    with pytest.raises(SettingsError, match=f"config file {re.escape(str(config))}: invalid TOML"):
        load(config)


def test_errors_are_value_errors() -> None:
    assert issubclass(SettingsError, ValueError)


# ------------------------------------------------------------------- secrets


def test_secrets_never_in_repr_or_display() -> None:
    loaded = load_settings(environ={"KVLEDGER_NATS_TOKEN": "tok-s3cret", "KVLEDGER_NATS_PASSWORD": "pw-s3cret"})
    assert loaded.settings.nats.token == "tok-s3cret"
    for text in (repr(loaded), repr(loaded.settings), repr(loaded.settings.nats), str(loaded.settings)):
        assert "s3cret" not in text
    rows = {key: (value, source) for key, value, source in as_display_rows(loaded)}
    assert rows["nats.token"] == ("***", "env KVLEDGER_NATS_TOKEN")
    assert rows["nats.password"] == ("***", "env KVLEDGER_NATS_PASSWORD")
    assert "s3cret" not in repr(as_json_records(loaded))
    assert "token=None" in repr(NatsSettings())


def test_display_rows_cover_every_setting_in_order() -> None:
    rows = as_display_rows(load_settings(environ={}))
    assert [key for key, _, _ in rows] == list(SETTINGS_REGISTRY)
    shown = dict((key, value) for key, value, _ in rows)
    assert shown["nats.token"] == "(unset)"
    assert shown["reuse.enable_decode_to_prefill_reuse"] == "false"
    assert shown["ingest.endpoints"] == "[]"


# -------------------------------------------------------------------- digest


def test_settings_digest_is_stable_and_sensitive() -> None:
    digest = settings_digest(ReuseSettings())
    assert re.fullmatch(r"[0-9a-f]{16}", digest)
    assert settings_digest(ReuseSettings()) == digest
    assert settings_digest(ReuseSettings(minimum_estimated_ttft_saving_ms=5)) == digest  # int and float agree
    assert settings_digest(ReuseSettings(minimum_transfer_prefix_blocks=5)) != digest
    assert settings_digest(ReuseSettings(enable_decode_to_prefill_reuse=True)) != digest
    assert settings_digest(load_settings(environ={}).settings.reuse) == digest


def test_settings_digest_is_pinned() -> None:
    # Recorded decisions carry this digest; a change here must be deliberate.
    assert settings_digest(ReuseSettings()) == "d2513dd80b4003c9"


# ------------------------------------------------- environment reads: settings only


_ENV_ATTRIBUTES = {"environ", "environb", "getenv", "getenvb"}


def _environment_reads(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    os_names = {"os"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            os_names |= {alias.asname or alias.name for alias in node.names if alias.name == "os"}
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            for alias in node.names:
                if alias.name in _ENV_ATTRIBUTES or alias.name == "*":
                    found.append((node.lineno, f"from os import {alias.name}"))
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in os_names and node.attr in _ENV_ATTRIBUTES:
                found.append((node.lineno, f"{node.value.id}.{node.attr}"))
            elif node.value.id == "environ" and node.attr == "get":
                found.append((node.lineno, "environ.get"))
    return found


def _package_modules() -> list[Path]:
    modules = [path for package in PACKAGES for path in sorted((REPO_ROOT / package).rglob("*.py"))]
    assert modules, "no package sources found"
    return modules


def test_only_the_settings_module_reads_the_environment() -> None:
    offenders = [
        f"{path.relative_to(REPO_ROOT)}:{line}: {what}"
        for path in _package_modules()
        if path.relative_to(REPO_ROOT) != SETTINGS_MODULE
        for line, what in _environment_reads(path)
    ]
    assert not offenders, "only kvledger/core/settings.py may read the environment:\n" + "\n".join(offenders)


def test_the_environment_scan_finds_reads(tmp_path: Path) -> None:
    sample = write(
        tmp_path,
        "import os as o\nfrom os import getenv\nx = o.environ['A']\ny = environ.get('B')\n",
        name="sample.py",
    )
    assert _environment_reads(sample) == [(2, "from os import getenv"), (3, "o.environ"), (4, "environ.get")]


def test_settings_reads_the_environment_in_one_function() -> None:
    tree = ast.parse((REPO_ROOT / SETTINGS_MODULE).read_text(encoding="utf-8"))
    readers = {
        function.name
        for function in ast.walk(tree)
        if isinstance(function, ast.FunctionDef)
        for node in ast.walk(function)
        if isinstance(node, ast.Attribute) and node.attr in _ENV_ATTRIBUTES
    }
    assert readers == {"read_environment"}
    assert len(_environment_reads(REPO_ROOT / SETTINGS_MODULE)) == 1


# ---------------------------------------------------------------------- docs


def test_every_registered_variable_is_documented() -> None:
    text = DOC.read_text(encoding="utf-8")
    missing = [name for name in ENV_REGISTRY if f"`{name}`" not in text]
    assert not missing, f"undocumented in docs/settings.md: {missing}"


def test_documented_table_matches_the_registry() -> None:
    text = DOC.read_text(encoding="utf-8")
    match = re.search(r"<!-- settings-table:begin -->\n(.*?)<!-- settings-table:end -->", text, re.S)
    assert match, "docs/settings.md lacks the settings-table markers"
    expected = reference_table_markdown()
    assert match.group(1) == expected, (
        "docs/settings.md is out of date; replace the table between the markers with:\n" + expected
    )


def test_documented_toml_example_loads(tmp_path: Path) -> None:
    example = re.search(r"```toml\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)
    assert example
    loaded = load(write(tmp_path, example.group(1)))
    assert loaded.settings.stream.replicas == 3
