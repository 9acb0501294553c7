"""The container lane, part two: the service image and docker/compose.yml, run for real.

The image is built from this checkout; compose.yml comes up as shipped (its NATS with the
per-service users of docker/nats-server.conf, decide behind its bearer token), only with
every host port chosen by Docker (tests/stacks.py). A simulated vLLM engine on the host
publishes over ZMQ; ingest in its container bridges it into JetStream, store projects it
into the PostgreSQL container, and the SQL inventory must equal what the engine holds.
decide must answer with its token and refuse without, NATS must refuse a client without
a user, and JetStream must run with nats-server.conf's sync interval.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator

import nats
import pytest
import sqlalchemy as sa

from conftest import _service_or_skip
from engines import wait_until
from kvledger.core.events import WorkerId
from kvledger.sim.engine import SimulatedEngine
from kvledger.sim.fleet import SimulatedFleet, SimulatedWorker, free_tcp_port
from kvledger.sim.workload import DEMO_BLOCK_SIZE, EngineCache, synthetic_requests
from pipeline import truth_inventory
from stacks import COMPOSE_FILE, ComposeStack, compose_stack, http, require_compose

pytestmark = [pytest.mark.container, pytest.mark.service]

PUBLISHER = "vllm-0"
READY_WITHIN_S = 15.0

# Host ports left to Docker (and PostgreSQL published, for the test's SQL): `!override`
# replaces the shipped lists rather than adding to them.
PORTS_CHOSEN_BY_DOCKER = """
services:
  nats:
    ports: !override ["127.0.0.1::4222", "127.0.0.1::8222"]
  postgres:
    ports: ["127.0.0.1::5432"]
  ingest:
    ports: !override ["127.0.0.1::9101"]
  store:
    ports: !override ["127.0.0.1::9102"]
  decide:
    ports: !override ["127.0.0.1::9103"]
"""


@pytest.fixture(scope="module")
def engine_ports() -> tuple[int, int]:
    return free_tcp_port(), free_tcp_port()


@pytest.fixture(scope="module")
def stack(engine_ports, tmp_path_factory) -> Iterator[ComposeStack]:
    _service_or_skip(require_compose)
    publish, replay = engine_ports
    with compose_stack(
        COMPOSE_FILE, PORTS_CHOSEN_BY_DOCKER, tmp_path_factory.mktemp("compose"),
        ENGINE_ENDPOINT=f"tcp://host.docker.internal:{publish},replay=tcp://host.docker.internal:{replay}",
        ENGINE_PUBLISHER=PUBLISHER,
    ) as stack:
        yield stack


def sql_inventory(connection: sa.Connection) -> dict[tuple[str, int, str], set[int]]:
    """Open native residency rows, shaped as `pipeline.truth_inventory`."""
    inventory: dict[tuple[str, int, str], set[int]] = {}
    for publisher, rank, tier, engine_hash in connection.execute(sa.text(
        "SELECT publisher, dp_rank, tier, engine_hash FROM block_residency "
        "WHERE removed_seq IS NULL AND provenance = 'native'"
    )):
        inventory.setdefault((publisher, rank, tier), set()).add(engine_hash % 2**64)
    return inventory


def engine_truth(worker: SimulatedWorker) -> dict[tuple[str, int, str], set[int]]:
    fleet = SimulatedFleet(0)
    fleet.workers.append(worker)
    return truth_inventory(fleet)


async def test_compose_carries_engine_batches_into_sql_and_decide_answers_only_with_its_token(
    stack: ComposeStack, engine_ports
) -> None:
    publish, replay = engine_ports
    # Bound on every interface: ingest reaches it from its container through the host gateway.
    async with SimulatedEngine(f"tcp://0.0.0.0:{publish}", f"tcp://0.0.0.0:{replay}") as engine:
        for service, port in (("decide", 9103), ("store", 9102), ("ingest", 9101)):
            stack.await_ready(service, port)
        # Kernels compiled into the image: a new decide container is ready within seconds,
        # as decide itself reports it.
        reported = re.search(r"ready at inventory_seq \d+, ([\d.]+) s after the process started",
                             stack.service_log("decide"))
        assert reported, stack.service_log("decide")
        assert float(reported.group(1)) < READY_WITHIN_S, reported.group(0)
        worker = SimulatedWorker(WorkerId(PUBLISHER), engine, EngineCache(48, 96))
        for request in itertools.islice(synthetic_requests(10_000, seed=3), 300):
            await worker.serve(request)

        sql = stack.sql_engine()
        try:
            def projected() -> bool:
                with sql.connect() as connection:
                    return connection.execute(sa.text(
                        "SELECT COUNT(DISTINCT engine_seq) FROM event_log WHERE publisher = :publisher"),
                        {"publisher": PUBLISHER}).scalar_one() >= engine.next_seq

            await wait_until(projected, 120, f"all {engine.next_seq} engine batches in SQL")
            with sql.connect() as connection:
                assert sql_inventory(connection) == engine_truth(worker)
                assert connection.execute(sa.text("SELECT COUNT(*) FROM event_log WHERE kind = 'gap'")).scalar_one() == 0
        finally:
            sql.dispose()

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


def test_compose_jetstream_syncs_every_second(stack: ComposeStack) -> None:
    status, body = http(f"http://127.0.0.1:{stack.port('nats', 8222)}/varz")
    assert status == 200
    assert json.loads(body)["jetstream"]["config"]["sync_interval"] == 1_000_000_000  # nanoseconds
