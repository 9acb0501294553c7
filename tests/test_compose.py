"""The container lane, part two: the service image and docker/compose.yml, run for real.

The image is built from this checkout; compose.yml comes up as shipped (its NATS with the
per-service users of docker/nats-server.conf, decide behind its bearer token), only with
every host port chosen by Docker so parallel runs never collide. A simulated vLLM engine
on the host publishes over ZMQ; ingest in its container bridges it into JetStream, store
projects it into the PostgreSQL container, and the SQL inventory must equal what the
engine holds. decide must answer with its token, refuse without, and NATS must refuse a
client without a user.
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
import sqlalchemy as sa

import services
from conftest import _service_or_skip
from engines import wait_until
from images import REPO, TAG, kvledger_image
from kvledger.events import WorkerId
from kvledger.sim.engine import SimulatedEngine
from kvledger.sim.fleet import SimulatedFleet, SimulatedWorker, free_tcp_port
from kvledger.sim.workload import DEMO_BLOCK_SIZE, EngineCache, synthetic_requests
from pipeline import truth_inventory

pytestmark = [pytest.mark.container, pytest.mark.service]

COMPOSE_FILE = REPO / "docker" / "compose.yml"
PUBLISHER = "vllm-0"
READY_TIMEOUT_S = 180.0
SECRETS = ("KVLEDGER_NATS_INGEST_PASSWORD", "KVLEDGER_NATS_STORE_PASSWORD", "KVLEDGER_NATS_DECIDE_PASSWORD",
           "KVLEDGER_NATS_ROUTER_PASSWORD", "KVLEDGER_DECIDE_HTTP_TOKEN", "POSTGRES_PASSWORD")

# Host ports left to Docker (and PostgreSQL published, for the test's SQL): `!override`
# replaces the shipped lists rather than adding to them.
PORTS_CHOSEN_BY_DOCKER = """
services:
  nats:
    ports: !override ["127.0.0.1::4222"]
  postgres:
    ports: ["127.0.0.1::5432"]
  ingest:
    ports: !override ["127.0.0.1::9101"]
  store:
    ports: !override ["127.0.0.1::9102"]
  decide:
    ports: !override ["127.0.0.1::9103"]
"""


class ComposeStack:
    """One compose project of docker/compose.yml: up, its published ports, its logs, down with its volumes."""

    def __init__(self, project: str, environment: dict[str, str], override: Path) -> None:
        self.project = project
        self.environment = {**os.environ, **environment}
        self.files = ["-f", str(COMPOSE_FILE), "-f", str(override)]

    def compose(self, *arguments: str, timeout: float = 300) -> str:
        result = subprocess.run(["docker", "compose", "-p", self.project, *self.files, *arguments],
                                env=self.environment, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"docker compose {' '.join(arguments)} exited {result.returncode}:\n{result.stderr[-4000:]}")
        return result.stdout

    def port(self, service: str, container_port: int) -> int:
        return int(self.compose("port", service, str(container_port)).strip().rsplit(":", 1)[1])

    def logs(self) -> str:
        try:
            return self.compose("logs", "--no-color", "--tail", "30")
        except RuntimeError as failure:
            return str(failure)

    def down(self) -> None:
        self.compose("down", "--volumes", "--remove-orphans", "--timeout", "10")


def http(url: str, body: bytes | None = None, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, headers=headers or {}, method="POST" if body else "GET")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as refused:
        return refused.code, refused.read()
    except OSError:
        return 0, b""


@pytest.fixture(scope="module")
def engine_ports() -> tuple[int, int]:
    return free_tcp_port(), free_tcp_port()


@pytest.fixture(scope="module")
def stack(engine_ports, tmp_path_factory) -> Iterator[ComposeStack]:
    """compose.yml up with fresh secrets, images from the environment and kvledger:test; down afterwards."""
    _service_or_skip(lambda: services.container_source("kvledger stack", "docker compose"))
    kvledger_image()
    override = tmp_path_factory.mktemp("compose") / "ports.yml"
    override.write_text(PORTS_CHOSEN_BY_DOCKER)
    publish, replay = engine_ports
    environment = {name: secrets.token_hex(16) for name in SECRETS}
    environment |= {
        "KVLEDGER_TAG": TAG,
        "KVLEDGER_NATS_IMAGE": services.nats_image(os.environ),
        "KVLEDGER_POSTGRES_IMAGE": services.postgres_image(os.environ),
        "ENGINE_ENDPOINT": f"tcp://host.docker.internal:{publish},replay=tcp://host.docker.internal:{replay}",
        "ENGINE_PUBLISHER": PUBLISHER,
    }
    stack = ComposeStack(f"kvledger-test-{secrets.token_hex(4)}", environment, override)
    try:
        stack.compose("up", "--detach", "--no-build", "--quiet-pull")
        yield stack
    except BaseException:
        print(stack.logs())
        raise
    finally:
        stack.down()


def await_ready(stack: ComposeStack, service: str, port: int) -> float:
    """Seconds until the service's /readyz answers 200 (from now)."""
    started = time.monotonic()
    url = f"http://127.0.0.1:{stack.port(service, port)}/readyz"
    while http(url)[0] != 200:
        if time.monotonic() - started > READY_TIMEOUT_S:
            raise AssertionError(f"{service} not ready after {READY_TIMEOUT_S:.0f} s:\n{stack.logs()}")
        time.sleep(0.2)
    return time.monotonic() - started


async def test_compose_carries_engine_batches_into_sql_and_decide_answers_only_with_its_token(
    stack: ComposeStack, engine_ports
) -> None:
    publish, replay = engine_ports
    # Bound on every interface: ingest reaches it from its container through the host gateway.
    async with SimulatedEngine(f"tcp://0.0.0.0:{publish}", f"tcp://0.0.0.0:{replay}") as engine:
        for service, port in (("decide", 9103), ("store", 9102), ("ingest", 9101)):
            await_ready(stack, service, port)
        worker = SimulatedWorker(WorkerId(PUBLISHER), engine, EngineCache(48, 96))
        for request in itertools.islice(synthetic_requests(10_000, seed=3), 300):
            await worker.serve(request)

        password = stack.environment["POSTGRES_PASSWORD"]
        sql = sa.create_engine(
            f"postgresql+psycopg://kvledger:{password}@127.0.0.1:{stack.port('postgres', 5432)}/kvledger")
        try:
            def projected() -> bool:
                with sql.connect() as connection:
                    return connection.execute(sa.text(
                        "SELECT COUNT(DISTINCT engine_seq) FROM event_log WHERE publisher = :publisher"),
                        {"publisher": PUBLISHER}).scalar_one() >= engine.next_seq

            await wait_until(projected, 120, f"all {engine.next_seq} engine batches in SQL")
            with sql.connect() as connection:
                rows = connection.execute(sa.text(
                    "SELECT publisher, dp_rank, tier, engine_hash FROM block_residency "
                    "WHERE removed_seq IS NULL AND provenance = 'native'")).all()
                gaps = connection.execute(sa.text("SELECT COUNT(*) FROM event_log WHERE kind = 'gap'")).scalar_one()
        finally:
            sql.dispose()

    inventory: dict[tuple[str, int, str], set[int]] = {}
    for publisher, rank, tier, engine_hash in rows:
        inventory.setdefault((publisher, rank, tier), set()).add(engine_hash % 2**64)
    fleet = SimulatedFleet(0)
    fleet.workers.append(worker)
    assert inventory == truth_inventory(fleet)
    assert gaps == 0

    decide_url = f"http://127.0.0.1:{stack.port('decide', 9103)}/v1/decide"
    body = json.dumps({"request_id": "compose-probe", "local_hashes": [], "block_size": DEMO_BLOCK_SIZE}).encode()
    token = stack.environment["KVLEDGER_DECIDE_HTTP_TOKEN"]
    json_type = {"Content-Type": "application/json"}
    status, answer = http(decide_url, body, {**json_type, "Authorization": f"Bearer {token}"})
    assert status == 200, answer
    assert json.loads(answer)["request_id"] == "compose-probe"
    assert http(decide_url, body, json_type)[0] == 401
    assert http(decide_url, body, {**json_type, "Authorization": "Bearer not-the-token"})[0] == 401


async def test_compose_nats_refuses_a_client_without_a_user(stack: ComposeStack) -> None:
    url = f"nats://127.0.0.1:{stack.port('nats', 4222)}"
    with pytest.raises(Exception, match="(?i)authorization"):
        await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=5)
    router = await nats.connect(url, user="router", password=stack.environment["KVLEDGER_NATS_ROUTER_PASSWORD"],
                                allow_reconnect=False, connect_timeout=5)
    await router.close()
