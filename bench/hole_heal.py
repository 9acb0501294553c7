"""How long a hole in the middle of KV_EVENTS takes to heal (docs/ingest.md, "Holes mid-stream").

    python bench/hole_heal.py [--rounds 3] [--workers 4] [--requests 200]

Each round: a throwaway nats-server (tests/services.py), simulated engines with replay sockets and
ingest in this process. `--requests` requests are served; one batch of the first worker is deleted
from the middle of KV_EVENTS (as a corrupted block would lose it); as many requests again are
served; then store (SQLite) and decide start and read the stream. From their start:

- found: store's or decide's fold reaches the worker's next batch, holds it back and asks
  ingest (kvledger.runtime.refetch): mostly their start and catching up to that batch;
- fetched: ingest has published the seq again, from the engine's replay buffer;
- backlog: store has projected the stream as it stood at its start (the batch fetched again
  lands after it, so no heal comes sooner);
- store healed: SQL holds every batch and the worker is certain again ("hole healed");
- decide healed: decide's index stands at the stream's end, the worker certain.

Yardstick, in the same round: one fetch of that seq from the engine's replay socket (the
irreducible part of a heal); each time is printed with its ratio to it. Ingest does no periodic
probing for holes (it fetches only when asked), so it costs ingest's throughput nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import nats.js.errors  # noqa: E402

import services  # noqa: E402
from pipeline import Pipeline, pipeline_settings  # noqa: E402
from kvledger.core.events import decode_batch  # noqa: E402
from kvledger.ingest.replay_client import ReplayClient  # noqa: E402
from kvledger.sim.fleet import SimulatedFleet  # noqa: E402
from kvledger.sim.workload import synthetic_requests  # noqa: E402

POLL_S = 0.002


async def serve(fleet: SimulatedFleet, requests, start: int) -> int:
    served = 0
    for number, request in enumerate(requests, start):
        await fleet.workers[number % len(fleet.workers)].serve(request)
        served += 1
    return served


async def until(check, what: str, timeout_s: float = 120.0) -> float:
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return time.monotonic()
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        await asyncio.sleep(POLL_S)


async def one_round(nats_url: str, work: Path, args, seed: int) -> dict[str, float]:
    requests = synthetic_requests(10_000, seed=seed)
    db_url = f"sqlite:///{work / f'ledger-{seed}.db'}"
    async with SimulatedFleet(args.workers, gpu_blocks=64, cpu_blocks=128, prefix=f"heal{seed}") as fleet:
        settings = pipeline_settings(nats_url, db_url)
        async with Pipeline(settings, fleet, readers=False) as pipeline:
            js, stream = pipeline.nc.jetstream(), settings.stream.events_stream
            served = await serve(fleet, itertools.islice(requests, args.requests), 0)

            async def holds(count: int) -> bool:
                return (await js.stream_info(stream)).state.messages >= count

            sent = sum(worker.engine.batches_published for worker in fleet.workers)
            await until(lambda: holds(sent), "the first half in KV_EVENTS")
            worker = fleet.workers[0]
            info = await js.stream_info(stream)
            mine = []
            for seq in range(info.state.first_seq, info.state.last_seq + 1):
                try:
                    if f".{worker.worker.publisher}." in (await js.get_msg(stream, seq)).subject + ".":
                        mine.append(seq)
                except nats.js.errors.NotFoundError:  # an earlier round's deleted batch
                    continue
            victim = mine[len(mine) // 2]
            lost_seq = decode_batch((await js.get_msg(stream, victim)).data).seq
            await pipeline.nc.jsm().delete_msg(stream, victim)
            await serve(fleet, itertools.islice(requests, args.requests), served)
            sent = sum(w.engine.batches_published for w in fleet.workers)
            await until(lambda: holds(sent - 1), "the second half in KV_EVENTS")

            replay = ReplayClient(worker.engine.replay_endpoint, pipeline.bridge._context)
            started = time.monotonic()
            await replay.fetch(lost_seq)
            yardstick = time.monotonic() - started

            last = (await js.stream_info(stream)).state.last_seq
            started = time.monotonic()
            await pipeline.start_readers()
            found = await until(lambda: pipeline.store.events.metrics.refetch_requests.value >= 1
                                or pipeline.decide.metrics.refetch_requests.value >= 1, "store or decide asking")
            fetched = await until(lambda: pipeline.bridge.metrics.refetched.value >= 1, "ingest fetching again")
            publisher = worker.worker.publisher

            def store_healed() -> bool:
                rows = pipeline.sql(f"SELECT uncertain_since FROM workers WHERE publisher = '{publisher}'")
                checkpoint = pipeline.sql("SELECT stream_seq FROM checkpoints WHERE stream = 'KV_EVENTS'")
                return rows == [(None,)] and checkpoint and checkpoint[0][0] > last

            def caught_up() -> bool:
                checkpoint = pipeline.sql("SELECT stream_seq FROM checkpoints WHERE stream = 'KV_EVENTS'")
                return bool(checkpoint) and checkpoint[0][0] >= last

            backlog = await until(caught_up, "store at the stream's end as it stood")
            store = await until(store_healed, "store healed")
            index = pipeline.decide.index
            decide = await until(
                lambda: index.inventory_seq > last and worker.worker.name not in index.uncertain_names(), "decide healed")
    return {"yardstick_s": yardstick, "found_s": found - started, "fetched_s": fetched - found,
            "backlog_s": backlog - found, "store_healed_s": store - found, "decide_healed_s": decide - found}


async def main_async(args) -> None:
    binary = services.find_nats_server(str(Path(sys.executable).parent))
    rounds = []
    with tempfile.TemporaryDirectory() as folder, services.LocalNatsServer(binary).start() as server:
        for round_number in range(args.rounds):
            figures = await one_round(server.url, Path(folder), args, 100 + round_number)
            rounds.append(figures)
            print(f"round {round_number + 1}: " + ", ".join(
                f"{name} {value * 1000:.1f} ms" + ("" if name == "yardstick_s" else
                                                   f" ({value / figures['yardstick_s']:.1f}x)")
                for name, value in figures.items()), flush=True)
    print("median: " + ", ".join(f"{name} {statistics.median(r[name] for r in rounds) * 1000:.1f} ms"
                                 for name in rounds[0]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--requests", type=int, default=200)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
