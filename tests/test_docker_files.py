"""docker/: the compose files and the Dockerfile agree with the CLI, the settings registry and
pyproject — checked statically, without a Docker engine.

Every service that runs the kvledger image has its command parsed by the real
`kvledger.app.cli.build_parser()` (with `${VAR:-default}` expanded to the default and a
required `${VAR:?message}` to a placeholder), every
`KVLEDGER_*` variable must be in `ENV_REGISTRY` and load through `load_settings`, the cluster
file has a routed three-node JetStream cluster, replicated streams and two decide replicas,
and the Dockerfile copies everything the wheel is built from.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import yaml  # PyYAML, in the test extra

from kvledger.app.cli import COMMANDS, build_parser
from kvledger.core.settings import ENV_REGISTRY, load_settings

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
COMPOSE_FILES = ("compose.yml", "compose.cluster.yml")
CLUSTER_NATS = "nats://nats-1:4222,nats://nats-2:4222,nats://nats-3:4222"

_VARIABLE = re.compile(
    r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?::?(?P<operator>[-?])(?P<default>[^}]*))?\}|\$(?P<bare>[A-Za-z_][A-Za-z0-9_]*)"
)
# The secrets compose.yml requires (`${VAR:?message}`): compose refuses to start without them.
REQUIRED_SECRETS = {"KVLEDGER_NATS_INGEST_PASSWORD", "KVLEDGER_NATS_STORE_PASSWORD", "KVLEDGER_NATS_DECIDE_PASSWORD",
                    "KVLEDGER_NATS_ROUTER_PASSWORD", "KVLEDGER_DECIDE_HTTP_TOKEN", "POSTGRES_PASSWORD"}


def expand(value: str) -> str:
    """Compose interpolation with an empty environment: `${VAR:-default}` becomes default, a
    required secret `${VAR:?message}` the placeholder `required-VAR`."""
    value = value.replace("$$", "\0")

    def substitute(match: re.Match[str]) -> str:
        if match.group("operator") == "?":
            assert match.group("name") in REQUIRED_SECRETS, f"{value!r}: only secrets may be required"
            return f"required-{match.group('name')}"
        if match.group("bare") is not None or match.group("default") is None:
            name = match.group("bare") or match.group("name")
            raise AssertionError(f"{value!r}: ${name} has no default, so the file does not work out of the box")
        return match.group("default")

    return _VARIABLE.sub(substitute, value).replace("\0", "$")


def load_compose(name: str) -> dict:
    with open(DOCKER / name, encoding="utf-8") as handle:
        return yaml.safe_load(handle)


def command_of(service: dict) -> list[str]:
    command = service.get("command")
    assert command is not None, "a kvledger service needs a command (the image's default is --help)"
    words = shlex.split(command) if isinstance(command, str) else [str(word) for word in command]
    return [expand(word) for word in words]


def environment_of(service: dict) -> dict[str, str]:
    environment = service.get("environment") or {}
    if isinstance(environment, list):
        environment = dict(item.split("=", 1) for item in environment)
    return {str(key): expand(str(value)) for key, value in environment.items()}


def is_kvledger(service: dict) -> bool:
    build = service.get("build")
    if isinstance(build, dict) and build.get("dockerfile") == "docker/Dockerfile":
        return True
    return str(service.get("image", "")).startswith("kvledger")


def kvledger_services(name: str) -> dict[str, dict]:
    return {key: value for key, value in load_compose(name)["services"].items() if is_kvledger(value)}


def subcommand_words(argv: list[str]) -> tuple[str, ...]:
    """The longest COMMANDS entry that prefixes argv's leading words."""
    matches = [command.words for command in COMMANDS if tuple(argv[: len(command.words)]) == command.words]
    assert matches, f"{argv!r} starts with no kvledger subcommand (known: {[' '.join(c.words) for c in COMMANDS]})"
    return max(matches, key=len)


def all_compose_services() -> list[tuple[str, str]]:
    return [(name, service) for name in COMPOSE_FILES for service in kvledger_services(name)]


# ------------------------------------------------------------------ compose


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_file_builds_the_image_from_the_repository(name: str) -> None:
    services = kvledger_services(name)
    assert {"migrate", "ingest", "store"} <= set(services)
    for service_name, service in services.items():
        build = service.get("build")
        assert isinstance(build, dict), f"{service_name}: no build section"
        assert build["context"] == ".."
        assert build["dockerfile"] == "docker/Dockerfile"
        assert (DOCKER / build["context"] / build["dockerfile"]).resolve() == DOCKER / "Dockerfile"


@pytest.mark.parametrize(("name", "service_name"), all_compose_services())
def test_kvledger_commands_parse_with_the_real_cli(name: str, service_name: str) -> None:
    service = kvledger_services(name)[service_name]
    argv = command_of(service)
    words = subcommand_words(argv)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{name} {service_name}: `kvledger {shlex.join(argv)}` is refused by the CLI (exit {exc.code})")
    assert getattr(args, "_command").words == words


@pytest.mark.parametrize(("name", "service_name"), all_compose_services())
def test_kvledger_environment_is_registered_and_loads(name: str, service_name: str) -> None:
    service = kvledger_services(name)[service_name]
    environment = {key: value for key, value in environment_of(service).items() if key.startswith("KVLEDGER_")}
    unknown = sorted(set(environment) - set(ENV_REGISTRY))
    assert not unknown, f"{name} {service_name}: not settings: {unknown}"
    load_settings(environ=environment)


@pytest.mark.parametrize(("name", "service_name"), all_compose_services())
def test_flags_and_environment_load_as_settings(name: str, service_name: str) -> None:
    """What the service would run with: its environment, then its command's setting flags."""
    service = kvledger_services(name)[service_name]
    argv = command_of(service)
    args = build_parser().parse_args(argv)
    overrides = {
        dest.removeprefix("setting:"): value
        for dest, value in vars(args).items()
        if dest.startswith("setting:") and value is not None
    }
    environment = {key: value for key, value in environment_of(service).items() if key.startswith("KVLEDGER_")}
    settings = load_settings(environ=environment, overrides=overrides).settings
    if argv[0] == "store" or argv[:2] == ["db", "upgrade"]:
        assert settings.db.url.startswith("postgresql+psycopg://"), f"{service_name} must use the compose Postgres"
    if argv[0] in ("ingest", "store", "decide"):
        assert "127.0.0.1" not in settings.nats.url, f"{service_name} must reach the compose NATS, not localhost"


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_ingest_names_an_endpoint_and_a_publisher(name: str) -> None:
    from kvledger.ingest.endpoints import parse_endpoints, stream_sources

    argv = command_of(kvledger_services(name)["ingest"])
    args = build_parser().parse_args(argv)
    endpoints = parse_endpoints(vars(args)["setting:ingest.endpoints"], args.publisher)
    assert stream_sources(endpoints), "ingest would follow no engine stream"


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_store_waits_for_migrations_and_migrate_for_postgres(name: str) -> None:
    services = load_compose(name)["services"]
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["store"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert "pg_isready" in " ".join(services["postgres"]["healthcheck"]["test"])
    assert expand(services["postgres"]["image"]) == "postgres:15"


def test_single_node_compose() -> None:
    services = load_compose("compose.yml")["services"]
    nats = services["nats"]
    assert expand(nats["image"]) == "nats:2.15"
    assert command_of(nats) == ["--config", "/etc/nats/nats-server.conf"]
    assert "./nats-server.conf:/etc/nats/nats-server.conf:ro" in nats["volumes"]
    assert set(environment_of(nats)) == {f"KVLEDGER_NATS_{user}_PASSWORD" for user in ("INGEST", "STORE", "DECIDE", "ROUTER")}
    assert any(volume.endswith(":/data") for volume in nats["volumes"])
    assert "9103:9103" in services["decide"]["ports"]
    assert environment_of(services["decide"])["KVLEDGER_DECIDE_HTTP_TOKEN"] == "required-KVLEDGER_DECIDE_HTTP_TOKEN"
    for service_name in ("ingest", "store", "decide"):
        assert command_of(services[service_name])[1:3] == ["--nats", "nats://nats:4222"]
        assert environment_of(services[service_name])["KVLEDGER_NATS_USER"] == service_name
    assert {"prometheus", "grafana"} == {name for name, service in services.items() if service.get("profiles")}


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_every_stage_has_a_readiness_check_with_a_start_period(name: str) -> None:
    for service_name, service in kvledger_services(name).items():
        if command_of(service)[0] in ("ingest", "store", "decide"):
            check = service["healthcheck"]
            assert "/readyz" in " ".join(check["test"]), service_name
            assert check["start_period"], service_name


def test_nats_configurations_sync_jetstream_every_second_in_one_place() -> None:
    single = (DOCKER / "nats-server.conf").read_text(encoding="utf-8")
    cluster = (DOCKER / "nats-server.cluster.conf").read_text(encoding="utf-8")
    assert re.findall(r"^\s*sync_interval:\s*(\S+)", single, re.MULTILINE) == ["1s"]
    assert "sync_interval" not in cluster and "include ./nats-server.conf" in cluster


def test_cluster_has_three_routed_jetstream_nodes() -> None:
    services = load_compose("compose.cluster.yml")["services"]
    nodes = sorted(name for name, service in services.items() if expand(str(service.get("image", ""))).startswith("nats:"))
    assert nodes == ["nats-1", "nats-2", "nats-3"]
    configuration = (DOCKER / "nats-server.cluster.conf").read_text(encoding="utf-8")
    routes = re.findall(r"nats-route://([\w-]+):6222", configuration)
    assert sorted(routes) == nodes
    assert re.search(r"^cluster \{[^}]*name: kvledger", configuration, re.MULTILINE)
    volumes = set()
    for node in nodes:
        argv = command_of(services[node])
        options = dict(zip(argv, argv[1:]))
        assert options["--config"] == "/etc/nats/nats-server.cluster.conf"
        assert options["--server_name"] == node
        assert "./nats-server.cluster.conf:/etc/nats/nats-server.cluster.conf:ro" in services[node]["volumes"]
        [volume] = [v for v in services[node]["volumes"] if v.endswith(":/data")]
        volumes.add(volume)
    assert len(volumes) == 3, "each NATS node needs its own data volume"


def test_cluster_services_use_every_node_and_three_replicas() -> None:
    services = kvledger_services("compose.cluster.yml")
    for service_name, service in services.items():
        argv = command_of(service)
        if argv[0] in ("ingest", "store", "decide"):
            assert dict(zip(argv, argv[1:]))["--nats"] == CLUSTER_NATS, service_name
            settings = load_settings(environ=environment_of(service)).settings
            assert settings.stream.replicas == 3, service_name


def test_cluster_splits_the_store_in_two_shards_on_one_postgres() -> None:
    services = load_compose("compose.cluster.yml")["services"]
    shards = {}
    for name in ("store", "store-2"):
        argv = services[name]["command"]
        shards[name] = argv[argv.index("--shard") + 1]
        assert argv[argv.index("--db") + 1].startswith("postgresql+psycopg://")
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert sorted(shards.values()) == ["0/2", "1/2"]
    assert services["store"]["ports"] != services["store-2"]["ports"]


def test_cluster_has_two_decide_replicas_on_different_host_ports() -> None:
    services = kvledger_services("compose.cluster.yml")
    replicas = sorted(name for name, service in services.items() if command_of(service)[0] == "decide")
    assert replicas == ["decide-1", "decide-2"]
    host_ports = [str(services[name]["ports"][0]).split(":")[0] for name in replicas]
    assert len(set(host_ports)) == 2, host_ports


# --------------------------------------------------------------- Dockerfile


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (DOCKER / "Dockerfile").read_text(encoding="utf-8")
    text = re.sub(r"\\\n", " ", text)  # continuation lines
    lines = [line.strip() for line in text.splitlines()]
    return [tuple(line.split(None, 1)) for line in lines if line and not line.startswith("#")]  # type: ignore[misc]


def wheel_packages() -> list[str]:
    with open(REPO / "pyproject.toml", "rb") as handle:
        pyproject = tomllib.load(handle)
    return list(pyproject["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"])


def copied_sources() -> set[str]:
    copied = set()
    for instruction, argument in dockerfile_instructions():
        if instruction.upper() == "COPY":
            *sources, _ = argument.split()
            copied.update(source.rstrip("/") for source in sources if not source.startswith("--"))
    return copied


def test_dockerfile_base_entrypoint_and_user() -> None:
    instructions = dockerfile_instructions()
    by_name = [(name.upper(), argument) for name, argument in instructions]
    assert by_name[:2] == [("ARG", "PYTHON_IMAGE=python:3.11-slim"), ("FROM", "${PYTHON_IMAGE}")]
    entrypoints = [argument for name, argument in by_name if name == "ENTRYPOINT"]
    assert entrypoints == ['["kvledger"]']
    assert [argument for name, argument in by_name if name == "CMD"] == ['["--help"]']
    users = [argument for name, argument in by_name if name == "USER"]
    assert users and not users[-1].startswith(("root", "0")), "the image must not run as root"
    assert any(name == "RUN" and "pip install --no-cache-dir --no-deps ." in argument for name, argument in by_name)


def test_dockerfile_copies_what_the_wheel_is_built_from() -> None:
    needed = {*wheel_packages(), "cuda", "migrations", "pyproject.toml", "README.md"}
    missing = needed - copied_sources()
    assert not missing, f"docker/Dockerfile does not COPY {sorted(missing)}"
    for source in copied_sources():
        assert (REPO / source).exists(), f"docker/Dockerfile copies {source}, which does not exist"


def test_dockerignore_keeps_local_state_out_of_the_context() -> None:
    patterns = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines() if line.strip()}
    for required in (".git", ".venv*", ".kvledger", "**/__pycache__", ".pytest_cache", ".hypothesis"):
        assert required in patterns, f".dockerignore lacks {required}"
    assert not patterns & set(copied_sources()), "the Dockerfile copies something .dockerignore excludes"


def test_the_copied_files_alone_build_the_wheel(tmp_path: Path) -> None:
    """Simulate the image's build context: only what the Dockerfile copies, then build offline."""
    pytest.importorskip("hatchling", reason="building the wheel offline needs hatchling (in the test extra)")
    context = tmp_path / "src"
    context.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for source in copied_sources():
        origin = REPO / source
        if origin.is_dir():
            shutil.copytree(origin, context / source, ignore=ignore)
        else:
            shutil.copy2(origin, context / source)
    out = tmp_path / "wheel"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(context)],
        capture_output=True, text=True,
    )
    assert built.returncode == 0, built.stderr
    assert list(out.glob("kvledger-*.whl"))
