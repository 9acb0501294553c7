"""How long kvledger takes to notice and heal a JetStream that lost acknowledged messages.

    python bench/stream_loss.py [--rounds 3] [--workers 4] [--requests 400] [--after 20]

Each round: an embedded nats-server (store on local disk), simulated engines with replay
sockets, ingest, store (SQLite) and decide in this process. Half the requests are served
and projected; then nats-server is paused and its store folder copied (what a power loss
would leave on disk), the other half is served, acknowledged and projected; then
nats-server is SIGKILLed, the copy put back and the server started again on the same port,
and `--after` more requests are served (their batches take the lost seqs). From the moment
the restarted server is ready:

- ingest: until it has published again every lost batch (fetched from the engines);
- store: until it found the loss, and until SQL holds every engine batch once;
- decide: until it found the loss, and until its rebuilt index stands at the stream's end.

The yardstick, measured in the same round: nats-server's own restart (SIGKILL to ready,
recovering its store). Each time is printed as a ratio to it; the summary is the median
over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvledger.core.events import Provenance  # noqa: E402
from kvledger.core.settings import load_settings  # noqa: E402
from kvledger.decide.serving.service import DecideService  # noqa: E402
from kvledger.ingest.bridge import Bridge  # noqa: E402
from kvledger.ingest.endpoints import StreamSource  # noqa: E402
from kvledger.runtime.embedded import EmbeddedNats  # noqa: E402
from kvledger.sim.fleet import SimulatedFleet  # noqa: E402
from kvledger.sim.workload import synthetic_requests  # noqa: E402
from kvledger.store import database  # noqa: E402
from kvledger.store.service import StoreService  # noqa: E402

POLL_S = 0.01


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def serve(fleet: SimulatedFleet, requests: list, start: int) -> None:
    for number, request in enumerate(requests, start):
        await fleet.workers[number % len(fleet.workers)].serve(request)


def sql_batches(url: str) -> int:
    with database.opened(url) as engine, engine.connect() as connection:
        return connection.execute(sa.text("SELECT COUNT(*) FROM event_log WHERE event_idx = 0")).scalar_one()


async def until(check, what: str, timeout_s: float = 120.0) -> float:
    """Wait until `check()` is true; the monotonic time it first was."""
    deadline = time.monotonic() + timeout_s
    while True:
        if check():
            return time.monotonic()
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        await asyncio.sleep(POLL_S)


async def one_round(args: argparse.Namespace, root: Path, seed: int) -> dict[str, float]:
    requests = list(itertools.islice(synthetic_requests(100_000, seed=seed), args.requests + args.after))
    half = args.requests // 2
    server = EmbeddedNats(root / "nats", port=free_port())
    server.start()
    db_url = f"sqlite:///{root / 'ledger.db'}"
    with database.opened(db_url) as engine:
        database.upgrade(engine)
    settings = load_settings(environ={}, overrides={
        "nats.url": server.url, "db.url": db_url, "ingest.http_port": 0, "store.http_port": 0,
        "decide.http_port": 0, "store.snapshot_every_events": 1_000_000,
    }).settings
    async with SimulatedFleet(args.workers, gpu_blocks=256, cpu_blocks=512) as fleet:
        sources = [StreamSource(w.worker, w.engine.pub_endpoint, w.engine.replay_endpoint, Provenance.NATIVE) for w in fleet.workers]
        bridge = await Bridge(settings, sources).__aenter__()
        await bridge.wait_ready(timeout=30)
        store_stop = asyncio.Event()
        store = StoreService(settings)
        store_task = asyncio.create_task(store.run(store_stop))
        decide = await DecideService(settings).__aenter__()
        try:
            def sent() -> int:
                return sum(worker.engine.batches_published for worker in fleet.workers)

            await serve(fleet, requests[:half], 0)
            await until(lambda: sql_batches(db_url) >= sent(), "the first half in SQL")
            process = server._process
            os.kill(process.pid, signal.SIGSTOP)
            try:
                shutil.copytree(server.store_dir, root / "on-disk")
            finally:
                os.kill(process.pid, signal.SIGCONT)
            before_loss = sent()
            await serve(fleet, requests[half:args.requests], half)
            await until(lambda: sql_batches(db_url) >= sent(), "the second half in SQL")
            lost = sent() - before_loss

            killed = time.monotonic()
            server.kill()
            shutil.rmtree(server.store_dir)
            shutil.copytree(root / "on-disk", server.store_dir)
            server.start()
            ready = time.monotonic()
            await serve(fleet, requests[args.requests:], args.requests)
            total = sent()
            repaired = bridge.metrics.stream_repaired
            found_by_store = store.metrics.stream_losses.labels(settings.stream.events_stream)
            found_by_decide = decide.metrics.stream_regressions
            waits = {
                "ingest republished every lost batch": until(lambda: repaired.value >= lost, "ingest's repair"),
                "store found the loss": until(lambda: found_by_store.value >= 1, "store's detection"),
                "store: every batch once in SQL": until(lambda: sql_batches(db_url) >= total, "SQL healed"),
                "decide found the loss": until(lambda: found_by_decide.value >= 1, "decide's detection"),
                # Healed, the stream holds each engine batch once, one message each.
                "decide: rebuilt index at the stream's end": until(
                    lambda: found_by_decide.value >= 1 and decide.index.inventory_seq >= total and decide.ready,
                    "decide rebuilt"),
            }
            times = dict(zip(waits, await asyncio.gather(*waits.values())))
            if sql_batches(db_url) != total:
                raise SystemExit(f"SQL holds {sql_batches(db_url)} batches, the engines sent {total}")
        finally:
            await decide.close()
            store_stop.set()
            await store_task
            await bridge.close()
            server.stop()
    figures = {name: moment - ready for name, moment in times.items()}
    figures["yardstick: nats-server restart (SIGKILL to ready)"] = ready - killed
    figures["lost batches"] = lost
    return figures


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--requests", type=int, default=400, help="served before the crash, half of them lost")
    parser.add_argument("--after", type=int, default=20, help="served right after the restart")
    args = parser.parse_args()
    rounds = []
    for number in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="kvledger-loss-") as root:
            figures = await one_round(args, Path(root), seed=number + 1)
        rounds.append(figures)
        yardstick = figures["yardstick: nats-server restart (SIGKILL to ready)"]
        print(f"round {number + 1}: {int(figures['lost batches'])} acknowledged batches lost; "
              f"nats-server restart {yardstick * 1000:.0f} ms")
        for name, seconds in figures.items():
            if name.startswith(("yardstick", "lost")):
                continue
            print(f"  {name:48s} {seconds * 1000:8.0f} ms after the restart  ({seconds / yardstick:5.2f} x the restart)")
    print(f"\nmedian of {args.rounds} rounds (ms after the restarted server was ready; ratio to its restart):")
    for name in rounds[0]:
        if name.startswith("lost"):
            continue
        values = [figures[name] for figures in rounds]
        ratios = [figures[name] / figures["yardstick: nats-server restart (SIGKILL to ready)"] for figures in rounds]
        print(f"  {name:52s} {statistics.median(values) * 1000:8.0f} ms  {statistics.median(ratios):5.2f} x")


if __name__ == "__main__":
    asyncio.run(main())
