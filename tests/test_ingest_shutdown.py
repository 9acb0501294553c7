"""Closing ingest at any point of its startup returns, and leaves no ZMQ context behind.

Real ZMQ (a simulated engine), a real nats-server, and `kvledger ingest` as a real process.
The bound on each close is generous: it fails on a hang, never on a slow machine.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Awaitable

import pytest

from engines import engine_endpoints, http_get, one_block, settings_for, wait_until
from kvledger.core.events import Provenance, WorkerId
from kvledger.ingest.bridge import Bridge
from kvledger.ingest.endpoints import StreamSource
from kvledger.sim.engine import SimulatedEngine
from services import free_ports
from test_ingest_bridge import IngestProcess

CLOSE_BOUND_S = 10.0
# From "before the stream task ran" through resuming from JetStream, the handshake, the
# catch-up replay and the first publishes, to following the SUB socket.
DELAYS_S = (0.0, 0.001, 0.005, 0.02, 0.05, 0.1)
ROUNDS = 10


def native_threads() -> int:
    """Threads Python did not start: libzmq's I/O thread and reaper, two per live context."""
    return len(os.listdir("/proc/self/task")) - threading.active_count()


async def returns_within(awaitable: Awaitable[object], what: str) -> None:
    # asyncio.wait, not wait_for: on a hang, wait_for would cancel the close and wait for it again.
    task = asyncio.ensure_future(awaitable)
    done, _ = await asyncio.wait({task}, timeout=CLOSE_BOUND_S)
    if not done:
        task.cancel()
        pytest.fail(f"{what}: still running after {CLOSE_BOUND_S}s")
    if not task.cancelled():
        task.result()


def sources_for(engine: SimulatedEngine, name: str) -> list[StreamSource]:
    return [StreamSource(WorkerId(name), engine.pub_endpoint, engine.replay_endpoint, Provenance.NATIVE)]


@pytest.fixture
def linux_proc() -> None:
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("counting libzmq's threads and reading signal handlers needs Linux's /proc")


async def test_a_bridge_closed_at_any_moment_after_start_returns_and_terminates_its_zmq_context(nats_server, linux_proc) -> None:
    pub, replay = engine_endpoints()
    async with SimulatedEngine(pub, replay) as engine:
        for block in range(3):
            await engine.publish([one_block(block)])  # so early closes also land in the catch-up replay
        settings = settings_for(nats_server.url)
        baseline = native_threads()
        for round_ in range(ROUNDS):
            for delay in DELAYS_S:
                bridge = Bridge(settings, sources_for(engine, f"closed-{round_}"))
                await bridge.start()
                streams = list(bridge._tasks)
                await asyncio.sleep(delay)
                await returns_within(bridge.close(), f"close {delay * 1000:g} ms after start (round {round_})")
                assert all(task.done() for task in streams)
                assert bridge._context.closed
            # The close that hung about 1 run in 3: right after one health check.
            bridge = Bridge(settings, sources_for(engine, f"checked-{round_}"))
            await bridge.start()
            assert (await http_get(bridge.http_port, "/healthz"))[0] == 200
            await returns_within(bridge.close(), f"close right after a health check (round {round_})")
            assert bridge._context.closed
        assert native_threads() == baseline, "a ZMQ context outlived its Bridge"


async def test_a_bridge_cancelled_while_starting_closes_and_terminates_its_zmq_context(nats_server, linux_proc) -> None:
    pub, replay = engine_endpoints()
    async with SimulatedEngine(pub, replay) as engine:
        settings = settings_for(nats_server.url)
        baseline = native_threads()
        for round_ in range(ROUNDS):
            for delay in DELAYS_S:
                bridge = Bridge(settings, sources_for(engine, f"cancelled-{round_}"))
                stop = asyncio.Event()

                async def serve() -> None:
                    async with bridge:
                        await stop.wait()

                # Both, as `kvledger up` does when another service fails: the cancel may land in start() or after.
                serving = asyncio.create_task(serve())
                await asyncio.sleep(delay)
                stop.set()
                serving.cancel()
                await returns_within(asyncio.wait({serving}), f"cancel {delay * 1000:g} ms into start (round {round_})")
                assert serving.cancelled() or serving.exception() is None
                assert bridge._context.closed
        assert native_threads() == baseline, "a ZMQ context outlived its Bridge"


async def test_kvledger_ingest_stopped_by_sigterm_right_after_startup_exits_cleanly(nats_server) -> None:
    pub, replay = engine_endpoints()
    async with SimulatedEngine(pub, replay) as engine:
        for round_ in range(3):
            ingest = IngestProcess(nats_server.url, engine, f"sigterm-{round_}")
            ingest.start()
            await ingest.started()  # /healthz answers: the streams have just been started
            assert await asyncio.to_thread(ingest.stop) == 0


def _catches_sigterm(pid: int) -> bool:
    """The process has a SIGTERM handler (`kvledger ingest` installs it just before starting the bridge)."""
    with open(f"/proc/{pid}/status") as status:
        caught = next(line for line in status if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) & (1 << (signal.SIGTERM - 1)))


async def test_kvledger_ingest_stopped_by_sigterm_while_nats_is_away_exits_cleanly(linux_proc) -> None:
    [port] = free_ports(1)  # nothing listens there: the start waits for NATS
    pub, replay = engine_endpoints()
    async with SimulatedEngine(pub, replay) as engine:
        ingest = IngestProcess(f"nats://127.0.0.1:{port}", engine, "unconnected")
        ingest.start()
        try:
            await wait_until(lambda: _catches_sigterm(ingest.process.pid), 20, "ingest's SIGTERM handler")
            assert await asyncio.to_thread(ingest.stop) == 0, "stopped while starting is a clean stop, not a failed start"
        finally:
            if ingest.process.poll() is None:
                ingest.kill()
