"""The container lane, part three: docker/compose.cluster.yml with a NATS node killed.

The three-node JetStream cluster comes up as shipped (nats-server.cluster.conf, users per
service, streams at three replicas, two store shards, two decide replicas), with host ports
left to Docker. A simulated engine on the host publishes; the node leading KV_EVENTS is
killed with `docker kill` (SIGKILL) mid-run and the engine keeps publishing. Nothing may be
lost or doubled: every engine batch once in SQL, the inventory equal to the engine's.
"""

from __future__ import annotations

import itertools
import json
import subprocess
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from conftest import _service_or_skip
from engines import wait_until
from kvledger.core.events import WorkerId
from kvledger.sim.engine import SimulatedEngine
from kvledger.sim.fleet import SimulatedWorker, free_tcp_port
from kvledger.sim.workload import DEMO_BLOCK_SIZE, EngineCache, synthetic_requests
from stacks import CLUSTER_COMPOSE_FILE, ComposeStack, compose_stack, http, require_compose
from test_compose import engine_truth, sql_inventory

pytestmark = [pytest.mark.container, pytest.mark.service]

PUBLISHER = "vllm-0"
NODES = ("nats-1", "nats-2", "nats-3")
CATCH_UP_TIMEOUT_S = 180

PORTS_CHOSEN_BY_DOCKER = """
services:
  nats-1:
    ports: !override ["127.0.0.1::4222", "127.0.0.1::8222"]
  nats-2:
    ports: !override ["127.0.0.1::8222"]
  nats-3:
    ports: !override ["127.0.0.1::8222"]
  postgres:
    ports: ["127.0.0.1::5432"]
  ingest:
    ports: !override ["127.0.0.1::9101"]
  store:
    ports: !override ["127.0.0.1::9102"]
  store-2:
    ports: !override ["127.0.0.1::9102"]
  decide-1:
    ports: !override ["127.0.0.1::9103"]
  decide-2:
    ports: !override ["127.0.0.1::9103"]
"""


@pytest.fixture(scope="module")
def engine_ports() -> tuple[int, int]:
    return free_tcp_port(), free_tcp_port()


@pytest.fixture(scope="module")
def cluster(engine_ports, tmp_path_factory) -> Iterator[ComposeStack]:
    _service_or_skip(require_compose)
    publish, replay = engine_ports
    with compose_stack(
        CLUSTER_COMPOSE_FILE, PORTS_CHOSEN_BY_DOCKER, tmp_path_factory.mktemp("cluster"),
        ENGINE_ENDPOINT=f"tcp://host.docker.internal:{publish},replay=tcp://host.docker.internal:{replay}",
        ENGINE_PUBLISHER=PUBLISHER,
    ) as stack:
        yield stack


def events_leader(stack: ComposeStack) -> str | None:
    """The node leading KV_EVENTS, from the monitoring endpoint of whichever node answers."""
    for node in NODES:
        status, body = http(f"http://127.0.0.1:{stack.port(node, 8222)}/jsz?accounts=true&streams=true")
        if status != 200:
            continue
        for account in json.loads(body).get("account_details", []):
            for stream in account.get("stream_detail", []):
                if stream["name"] == "KV_EVENTS" and stream.get("cluster", {}).get("leader"):
                    return stream["cluster"]["leader"]
    return None


def decide_connections(stack: ComposeStack, killed: str) -> str:
    """Where each decide replica is connected, as the surviving nodes see it, with its subscriptions."""
    lines = []
    for node in NODES:
        if node == killed:
            continue
        status, body = http(f"http://127.0.0.1:{stack.port(node, 8222)}/connz?subs=1")
        if status != 200:
            lines.append(f"{node}: /connz answered {status}")
            continue
        for connection in json.loads(body).get("connections", []):
            if connection.get("name") == "kvledger-decide":
                lines.append(f"{node}: decide from {connection['ip']}, {connection.get('subscriptions', 0)} "
                             f"subscriptions {sorted(connection.get('subscriptions_list', []))}")
    return "\n".join(lines)


def log_records(log: str) -> str:
    """A service's log without its tracebacks' frames: the records alone."""
    return "\n".join(line for line in log.splitlines()
                     if not line.split("|", 1)[-1].startswith(("  ", " Traceback", " During handling", " The above")))


async def test_cluster_loses_nothing_when_the_events_leader_is_killed(cluster: ComposeStack, engine_ports) -> None:
    publish, replay = engine_ports
    requests = synthetic_requests(10_000, seed=5)
    async with SimulatedEngine(f"tcp://0.0.0.0:{publish}", f"tcp://0.0.0.0:{replay}") as engine:
        for service, port in (("decide-1", 9103), ("decide-2", 9103), ("store", 9102), ("store-2", 9102),
                              ("ingest", 9101)):
            cluster.await_ready(service, port)
        worker = SimulatedWorker(WorkerId(PUBLISHER), engine, EngineCache(48, 96))
        sql = cluster.sql_engine()
        try:
            def batches_in_sql() -> int:
                with sql.connect() as connection:
                    return connection.execute(sa.text(
                        "SELECT COUNT(DISTINCT engine_seq) FROM event_log WHERE publisher = :publisher"),
                        {"publisher": PUBLISHER}).scalar_one()

            for request in itertools.islice(requests, 150):
                await worker.serve(request)
            await wait_until(lambda: batches_in_sql() > 0, CATCH_UP_TIMEOUT_S, "the first batches in SQL")

            leader = await wait_until(lambda: events_leader(cluster), 30, "a KV_EVENTS leader")
            assert leader in NODES
            subprocess.run(["docker", "kill", cluster.container(leader)], check=True, capture_output=True)

            for request in itertools.islice(requests, 150):
                await worker.serve(request)
            await wait_until(lambda: batches_in_sql() >= engine.next_seq, CATCH_UP_TIMEOUT_S,
                             f"all {engine.next_seq} engine batches in SQL after {leader} was killed")

            with sql.connect() as connection:
                # Gaps and liveness records carry the stream's (epoch, next seq) for orientation, not an
                # engine batch of their own (ingest started before the engine: unreachable, then reachable).
                doubled = connection.execute(sa.text(
                    "SELECT e.* FROM event_log e JOIN (SELECT publisher, epoch, engine_seq, event_idx FROM event_log "
                    "WHERE kind NOT IN ('gap', 'reachable', 'unreachable') "
                    "GROUP BY publisher, epoch, engine_seq, event_idx HAVING COUNT(*) > 1) d "
                    "USING (publisher, epoch, engine_seq, event_idx) ORDER BY e.stream_seq"
                )).mappings().all()
                assert not doubled, f"{doubled}\n{log_records(cluster.service_log('ingest'))[-6000:]}"
                assert connection.execute(sa.text("SELECT COUNT(*) FROM event_log WHERE kind = 'gap'")).scalar_one() == 0
                assert sql_inventory(connection) == engine_truth(worker)
        finally:
            sql.dispose()

    token = cluster.environment["KVLEDGER_DECIDE_HTTP_TOKEN"]
    body = json.dumps({"request_id": "cluster-probe", "local_hashes": [], "block_size": DEMO_BLOCK_SIZE}).encode()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
    for replica in ("decide-1", "decide-2"):
        url = f"http://127.0.0.1:{cluster.port(replica, 9103)}/v1/decide"
        # An answer that cannot be recorded in KV_DECISIONS is refused (500) until the
        # stream has its leader again; a client retries (docs/decide.md, "On record").
        replies: list[tuple[int, bytes]] = []

        def answered() -> bool:
            replies.append(http(url, body, headers))
            return replies[-1][0] == 200

        try:
            await wait_until(answered, 60, f"{replica} to answer and record")
        except AssertionError as timed_out:
            # What the replica said last, and its own account (its log), beside the timeout.
            last = replies[-1] if replies else None
            address = subprocess.run(
                ["docker", "inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}",
                 cluster.container(replica)], capture_output=True, text=True).stdout.strip()
            raise AssertionError(f"{timed_out}; last reply {last!r}\n{replica} is at {address}\n"
                                 f"{decide_connections(cluster, leader)}\n"
                                 f"{log_records(cluster.service_log(replica))[-8000:]}") from None
