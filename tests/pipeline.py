"""The whole system for end-to-end tests: simulated engines → ingest → JetStream → store + decide.

store and decide run in this process (each with its own stop event); ingest runs either
in-process or as a real `kvledger ingest` process so it can be SIGKILLed.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import nats
import sqlalchemy as sa

from kvledger.decide.serving.service import DecideService
from engines import http_get, wait_until
from kvledger.core.events import Provenance, Tier, WorkerId
from kvledger.core.settings import Settings, load_settings
from kvledger.ingest.bridge import Bridge
from kvledger.ingest.endpoints import StreamSource
from kvledger.runtime.nats_options import connect_options
from kvledger.runtime.streams import DECIDE_SUBJECT
from kvledger.sim.fleet import SimulatedFleet
from services import free_ports
from kvledger.store import database
from kvledger.store.service import StoreService

U64 = 1 << 64


def pipeline_settings(nats_url: str, db_url: str, **overrides: object) -> Settings:
    values = {
        "nats.url": nats_url, "db.url": db_url, "ingest.http_port": 0, "store.http_port": 0,
        "decide.http_port": 0, "store.snapshot_every_events": 1_000_000, **overrides,
    }
    return load_settings(environ={}, overrides=values).settings


class IngestProcess:
    """`kvledger ingest` for every fleet worker, as a process that can be SIGKILLed."""

    def __init__(self, settings: Settings, fleet: SimulatedFleet) -> None:
        [self.http_port] = free_ports(1)
        self.args = [sys.executable, "-m", "kvledger.app.cli", "ingest", "--nats", settings.nats.url]
        for worker in fleet.workers:
            self.args += ["--endpoint", worker.endpoint_spec, "--publisher", worker.worker.publisher]
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("KVLEDGER_")}
        self.env["KVLEDGER_INGEST_HTTP_PORT"] = str(self.http_port)
        # The streams as the test's settings provision them (a cluster's are R3), or ingest refuses them.
        self.env["KVLEDGER_STREAM_REPLICAS"] = str(settings.stream.replicas)
        self.process: subprocess.Popen | None = None

    async def start(self) -> None:
        self.process = subprocess.Popen(self.args, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

        async def ready() -> bool:
            if self.process.poll() is not None:
                raise AssertionError(f"ingest exited: {self.process.stderr.read().decode()[-3000:]}")
            try:
                return (await http_get(self.http_port, "/readyz"))[0] == 200
            except OSError:
                return False

        await wait_until(ready, 30, "ingest /readyz")

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    async def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            await asyncio.to_thread(self.process.wait, 30)


class Pipeline:
    def __init__(self, settings: Settings, fleet: SimulatedFleet, *, ingest_as_process: bool = False,
                 readers: bool = True) -> None:
        self.settings = settings
        self.fleet = fleet
        self.ingest_as_process = ingest_as_process
        self.readers = readers  # False: store and decide start later (`start_readers`)
        self.store_stop = asyncio.Event()
        self.store: StoreService | None = None
        self._store_task: asyncio.Task | None = None
        self.decide: DecideService | None = None
        self.bridge: Bridge | None = None
        self.ingest: IngestProcess | None = None
        self.nc: nats.NATS | None = None

    async def __aenter__(self) -> Pipeline:
        with database.opened(self.settings.db.url) as engine:
            database.upgrade(engine)
        if self.ingest_as_process:
            self.ingest = IngestProcess(self.settings, self.fleet)
            await self.ingest.start()
        else:
            sources = [
                StreamSource(w.worker, w.engine.pub_endpoint, w.engine.replay_endpoint, Provenance.NATIVE)
                for w in self.fleet.workers
            ]
            self.bridge = await Bridge(self.settings, sources).__aenter__()
            await self.bridge.wait_ready(timeout=30)
        if self.readers:
            await self.start_readers()
        # The URL may be a cluster's comma-joined list, which nats.connect takes only as a list of servers.
        options = connect_options(self.settings.nats, name="kvledger-test")
        self.nc = await nats.connect(**options)
        return self

    async def start_readers(self) -> None:
        """store and decide, reading KV_EVENTS from where SQL and their snapshots stand."""
        self.store = StoreService(self.settings)
        self._store_task = asyncio.create_task(self.store.run(self.store_stop))
        self.decide = await DecideService(self.settings).__aenter__()

    async def __aexit__(self, *exc_info: object) -> None:
        if self.nc is not None:
            await self.nc.close()
        if self.decide is not None:
            await self.decide.close()
        self.store_stop.set()
        if self._store_task is not None:
            await self._store_task
        if self.bridge is not None:
            await self.bridge.close()
        if self.ingest is not None:
            await self.ingest.stop()

    async def events_last_seq(self) -> int:
        for _ in range(100):
            try:
                info = await self.nc.jetstream().stream_info(self.settings.stream.events_stream)
                return info.state.last_seq
            except Exception:  # the server may be restarting under a fault test
                await asyncio.sleep(0.1)
        raise AssertionError("KV_EVENTS unreachable")

    async def settled(self, batches: int, timeout: float = 60) -> int:
        """Wait until KV_EVENTS holds `batches` batches and store has projected all of them."""

        async def stream_full() -> int | None:
            info = await self.nc.jetstream().stream_info(self.settings.stream.events_stream)
            return info.state.last_seq if info.state.messages >= batches else None

        last = await wait_until(stream_full, timeout, f"{batches} batches in KV_EVENTS")

        def checkpoint() -> int:
            with database.opened(self.settings.db.url) as engine, engine.connect() as connection:
                value = connection.execute(
                    sa.text("SELECT stream_seq FROM checkpoints WHERE stream = :s"), {"s": self.settings.stream.events_stream}
                ).scalar()
            return value or 0

        await wait_until(lambda: checkpoint() >= last, timeout, f"store checkpoint at {last}")
        return last

    def sql_inventory(self) -> dict[tuple[str, int, str], set[int]]:
        """Open native residency rows: (publisher, dp_rank, tier) → engine hashes (unsigned)."""
        inventory: dict[tuple[str, int, str], set[int]] = {}
        with database.opened(self.settings.db.url) as engine, engine.connect() as connection:
            rows = connection.execute(sa.text(
                "SELECT publisher, dp_rank, tier, engine_hash FROM block_residency "
                "WHERE removed_seq IS NULL AND provenance = 'native'"
            ))
            for publisher, rank, tier, engine_hash in rows:
                inventory.setdefault((publisher, rank, tier), set()).add(engine_hash % U64)
        return inventory

    def sql(self, query: str) -> list[tuple]:
        with database.opened(self.settings.db.url) as engine, engine.connect() as connection:
            return [tuple(row) for row in connection.execute(sa.text(query))]

    async def ask(self, body: dict) -> dict:
        reply = await self.nc.request(DECIDE_SUBJECT, json.dumps(body).encode(), timeout=10)
        return json.loads(reply.data)


def truth_inventory(fleet: SimulatedFleet) -> dict[tuple[str, int, str], set[int]]:
    """What the simulated engines really hold: the same shape as `Pipeline.sql_inventory`."""
    truth: dict[tuple[str, int, str], set[int]] = {}
    for worker in fleet.workers:
        for tier, blocks in ((Tier.DEVICE, worker.cache.gpu), (Tier.HOST, worker.cache.cpu)):
            if blocks:
                truth[(worker.worker.publisher, worker.worker.dp_rank, tier.value)] = set(blocks)
    return truth


class TruthView:
    """The reference model's InventoryView over the simulator's caches (all native)."""

    def __init__(self, fleet: SimulatedFleet, inventory_seq: int) -> None:
        from kvledger.sim.workload import engine_hash

        self.inventory_seq = inventory_seq
        self._fleet = fleet
        self._engine_hash = engine_hash

    def workers(self) -> list[WorkerId]:
        return sorted(worker.worker for worker in self._fleet.workers)

    def holds(self, worker: WorkerId, provenance: Provenance, tier: Tier, sequence_hash: int) -> bool:
        if provenance is not Provenance.NATIVE:
            return False
        cache = self._fleet.worker(worker).cache
        blocks = {Tier.DEVICE: cache.gpu, Tier.HOST: cache.cpu}.get(tier, {})
        return self._engine_hash(sequence_hash) in blocks

    def uncertain_workers(self) -> list[WorkerId]:
        return []

    def unreachable_workers(self) -> list[WorkerId]:
        return []
