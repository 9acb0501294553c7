"""docker/nats-server.conf on a real nats-server: each service works with its own user, and no
user can do what its service never needs (decide publish engine events, store publish to any
kvledger subject, anyone delete a stream)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import nats
import pytest
import sqlalchemy as sa

from cluster import cluster_binary
from kvledger.decide.serving.service import DecideService
from engines import wait_until
from kvledger.client import NO_RETRIES, DecideClient, DecideRequest
from kvledger.core.events import Provenance, WorkerId
from kvledger.core.settings import load_settings
from kvledger.ingest.bridge import Bridge
from kvledger.ingest.endpoints import StreamSource
from kvledger.runtime.streams import DECIDE_SUBJECT
from kvledger.sim.engine import SimulatedEngine
from kvledger.sim.vllm import VllmBlockStored
from services import LocalNatsServer, free_ports
from kvledger.store import database
from kvledger.store.service import StoreService

pytestmark = pytest.mark.service

CONF = Path(__file__).resolve().parent.parent / "docker" / "nats-server.conf"
PASSWORDS = {"ingest": "ingest-pw", "store": "store-pw", "decide": "decide-pw", "router": "router-pw"}


@pytest.fixture
def locked_down_nats():
    """nats-server started with docker/nats-server.conf as shipped, only its store folder moved here."""
    config = CONF.read_text().replace("store_dir: /data", "store_dir: {store_dir}")
    env = {f"KVLEDGER_NATS_{user.upper()}_PASSWORD": password for user, password in PASSWORDS.items()}
    with LocalNatsServer(cluster_binary(), config_text=config, env=env).start() as server:
        yield server.url


def settings_as(user: str, url: str, db_url: str, **overrides):
    values = {"nats.url": url, "nats.user": user, "nats.password": PASSWORDS[user], "db.url": db_url,
              "ingest.http_port": 0, "store.http_port": 0, "decide.http_port": 0, **overrides}
    return load_settings(environ={}, overrides=values).settings


async def violations_of(url: str, user: str, subjects: list[str]) -> list[str]:
    """What the server answers when `user` publishes to each subject: its permission errors."""
    errors: list[str] = []

    async def on_error(error: Exception) -> None:
        errors.append(str(error))

    nc = await nats.connect(url, user=user, password=PASSWORDS[user], error_cb=on_error, allow_reconnect=False)
    try:
        for subject in subjects:
            await nc.publish(subject, b"not yours")
        await nc.flush()
        await asyncio.sleep(0.3)  # the -ERR lines arrive after the PONG
    finally:
        await nc.close()
    return errors


async def test_each_service_works_with_its_own_user(locked_down_nats, sqlite_url, tmp_path) -> None:
    with database.opened(sqlite_url) as engine:
        database.upgrade(engine)
    worker = WorkerId("locked")
    pub, replay = f"tcp://127.0.0.1:{free_ports(1)[0]}", f"tcp://127.0.0.1:{free_ports(1)[0]}"
    async with SimulatedEngine(pub, replay) as simulated:
        source = StreamSource(worker, pub, replay, Provenance.NATIVE)
        async with Bridge(settings_as("ingest", locked_down_nats, sqlite_url), [source]) as bridge:
            await bridge.wait_ready(timeout=20)
            for seq in range(20):
                await simulated.publish([VllmBlockStored((1000 + seq,), 999 + seq if seq else None, tuple(range(16 * seq, 16 * seq + 16)), 16)])
            nc = await nats.connect(locked_down_nats, user="ingest", password=PASSWORDS["ingest"])
            try:
                async def stored() -> bool:
                    return (await nc.jetstream().stream_info("KV_EVENTS")).state.messages == 20

                await wait_until(stored, 20, "20 batches in KV_EVENTS")
            finally:
                await nc.close()
        store_stop = asyncio.Event()
        store = StoreService(settings_as("store", locked_down_nats, sqlite_url, **{"store.snapshot_every_events": 5}))
        store_task = asyncio.create_task(store.run(store_stop))
        try:
            def rows() -> int:
                with database.opened(sqlite_url) as engine, engine.connect() as connection:
                    return connection.execute(sa.text("SELECT COUNT(*) FROM block_residency WHERE removed_seq IS NULL")).scalar()

            await wait_until(lambda: rows() == 20 or (store_task.done() and store_task.result()), 30, "20 blocks in SQL")
            def snapshots() -> int:
                with database.opened(sqlite_url) as engine, engine.connect() as connection:
                    return connection.execute(sa.text("SELECT COUNT(*) FROM snapshots")).scalar()

            # store's user writes its snapshots into the KV_SNAPSHOTS object store
            await wait_until(snapshots, 30, "a snapshot written by store")
            async with DecideService(settings_as("decide", locked_down_nats, sqlite_url)) as decide:
                await decide.wait_ready(30)
                nc = await nats.connect(locked_down_nats, user="router", password=PASSWORDS["router"])
                try:
                    reply = await nc.request(DECIDE_SUBJECT, b'{"request_id": "p", "local_hashes": [], "block_size": 16}', timeout=10)
                    # kvledger.client takes its record's ack from JetStream under the router's own inbox
                    async with await DecideClient.connect_nats(nc, retry=NO_RETRIES) as client:
                        taken = await client.decide(DecideRequest(request_id="q", local_hashes=(), block_size=16))
                finally:
                    await nc.close()
                assert decide.started_from is not None  # decide's user read the snapshot
                answer = json.loads(reply.data)
                assert answer["request_id"] == "p" and answer["inventory_seq"] == 20, answer
                assert (taken.request_id, taken.inventory_seq) == ("q", 20)
        finally:
            store_stop.set()
            await store_task


async def test_decide_cannot_publish_engine_events_and_store_publishes_no_stream_subject(locked_down_nats) -> None:
    refused = await violations_of(locked_down_nats, "decide", ["kv.ev.forged.0", "kv.dlq.forged"])
    assert len(refused) == 2 and all("permissions violation for publish" in error.lower() for error in refused), refused
    subjects = ["kv.ev.forged.0", "kv.dec", "kv.dlq.forged", "kvledger.decide"]
    refused = await violations_of(locked_down_nats, "store", subjects)
    assert len(refused) == len(subjects) and all("permissions violation for publish" in error.lower() for error in refused), refused
    # ingest publishes engine events, and is refused the audit trail
    refused = await violations_of(locked_down_nats, "ingest", ["kv.dec", "kvledger.decide"])
    assert len(refused) == 2, refused
    # a router asks, and can forge nothing
    refused = await violations_of(locked_down_nats, "router", ["kv.ev.forged.0", "kv.dec", "$JS.API.STREAM.DELETE.KV_EVENTS",
                                                               "kvledger.ingest.refetch"])
    assert len(refused) == 4, refused
    # store and decide ask ingest to fetch a hole mid-stream again
    for user in ("store", "decide"):
        assert await violations_of(locked_down_nats, user, ["kvledger.ingest.refetch"]) == [], user
