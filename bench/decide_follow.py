"""How fast decide follows KV_EVENTS, beside a bare ordered consumer reading the same stream.

    python bench/decide_follow.py [--batches 16000] [--workers 64] [--repeats 3]

A stream shaped like bench/fleet.py's: `--workers` engines, each batch storing a prompt of
16 blocks (a chain from the root) and, once the engine holds 32 prompts, removing its
oldest: 32 block events per batch, a constant inventory. The batches are published to
KV_EVENTS on an embedded nats-server first; then, taken in turns:

- the yardstick: a bare nats-py ordered consumer from the stream's start that reads each
  message's metadata and decodes its record (what any follower pays before doing anything);
- `DecideService` (cpu) started on the stream: from its start to ready (caught up with the
  stream's last seq), less its backend warm-up (`warm_up_seconds`, which `kvledger decide`
  pays once before it follows);
- decide's `InventoryIndex` alone, applying the decoded batches in process.

Printed: block events/s of each, and decide's over the yardstick's.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Run as a script, this folder would come first on sys.path: the benchmarks are scripts, loaded by
# path where one uses another, and one is named like the standard library (bench/codecs.py).
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]

import nats  # noqa: E402
from nats.js.api import ConsumerConfig, DeliverPolicy  # noqa: E402

from kvledger.core.events import EventBatch, Provenance, Removed, Stored, Tier, WorkerId, decode_batch, encode_batch  # noqa: E402
from kvledger.core.hashing import sequence_hashes  # noqa: E402

BLOCKS_PER_PROMPT = 16
HELD_PROMPTS = 32
PROMPT_POOL = 400


def fleet_batches(count: int, workers: int, seed: int = 1) -> list[EventBatch]:
    """Engine w's batch c stores pool prompt (c + w) and, once full, removes the one HELD_PROMPTS before it."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(PROMPT_POOL):
        local = [rng.getrandbits(64) for _ in range(BLOCKS_PER_PROMPT)]
        prompts.append((tuple(sequence_hashes(local)), tuple(local)))
    names = [WorkerId(f"w{number:03d}") for number in range(workers)]
    batches: list[EventBatch] = []
    step = 0
    while len(batches) < count:
        for number, worker in enumerate(names):
            engine, local = prompts[(step + number) % PROMPT_POOL]
            events = [Stored(Tier.DEVICE, engine, None, BLOCKS_PER_PROMPT, local)]
            if step >= HELD_PROMPTS:
                events.append(Removed(Tier.DEVICE, prompts[(step - HELD_PROMPTS + number) % PROMPT_POOL][0]))
            batches.append(EventBatch(worker, 0, step, 0.0, 0.0, Provenance.NATIVE, tuple(events)))
        step += 1
    return batches[:count]


async def bare_consumer(js, subject: str, count: int) -> float:
    """Seconds a bare ordered consumer takes to read and decode `count` messages from the start."""
    done = asyncio.Event()
    seen = 0

    async def on_message(msg) -> None:
        nonlocal seen
        msg.metadata  # noqa: B018  (parsed from the reply subject, as every follower does)
        decode_batch(msg.data)
        seen += 1
        if seen == count:
            done.set()

    started = time.perf_counter()
    subscription = await js.subscribe(subject, cb=on_message, ordered_consumer=True,
                                      config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL))
    await done.wait()
    elapsed = time.perf_counter() - started
    await subscription.unsubscribe()
    return elapsed


async def decide_service(settings) -> float:
    """Seconds from starting DecideService to its being caught up, less its backend warm-up."""
    from kvledger.decide.serving.service import DecideService

    started = time.perf_counter()
    async with DecideService(settings) as service:
        await service.wait_ready(300)
        return time.perf_counter() - started - service.warm_up_seconds


def index_alone(batches: list[EventBatch]) -> float:
    from kvledger.decide.inventory.index import InventoryIndex

    encoded = [encode_batch(batch) for batch in batches]
    index = InventoryIndex()
    started = time.perf_counter()
    for stream_seq, data in enumerate(encoded, 1):
        index.apply(decode_batch(data), stream_seq)
    return time.perf_counter() - started


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=16000)
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="measurements of each, taken in turns")
    args = parser.parse_args(argv)

    from kvledger.decide.ranking.cpu import compile_kernels
    from kvledger.runtime.embedded import EmbeddedNats
    from kvledger.runtime.streams import EVENTS_SUBJECT_PREFIX, ensure_stream, events_stream, publish_batches
    from kvledger.core.settings import ReuseSettings, load_settings

    compile_kernels(ReuseSettings())  # so the in-process index is not timed compiling
    batches = fleet_batches(args.batches, args.workers)
    events = sum(len(event.block_hashes) for batch in batches for event in batch.events)
    with tempfile.TemporaryDirectory() as store, EmbeddedNats(store) as server:
        settings = load_settings(environ={}, overrides={
            "nats.url": server.url, "decide.http_port": 0, "decide.http_host": "127.0.0.1", "decide.backend": "cpu",
        }).settings
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        await ensure_stream(js, events_stream(settings.stream))
        await publish_batches(js, batches)
        print(f"{len(batches):,} batches ({events:,} block events) of {args.workers} engines in KV_EVENTS; "
              f"{args.repeats} measurements of each, taken in turns\n")
        runs: dict[str, list[float]] = {"bare": [], "service": [], "index": []}
        for _ in range(args.repeats):
            runs["bare"].append(events / await bare_consumer(js, f"{EVENTS_SUBJECT_PREFIX}.>", len(batches)))
            runs["service"].append(events / await decide_service(settings))
            runs["index"].append(events / index_alone(batches))
        await nc.close()
    labels = {
        "bare": "bare nats-py ordered consumer (metadata and record decoded), the yardstick",
        "service": "DecideService catching up from its start (less the backend warm-up)",
        "index": "InventoryIndex.apply alone, in process (records decoded)",
    }
    print("| follower | block events/s, median (range) | batches/s |")
    print("|---|---|---|")
    for name, rates in runs.items():
        median = statistics.median(rates)
        print(f"| {labels[name]} | {median:,.0f} ({min(rates):,.0f} – {max(rates):,.0f}) "
              f"| {median * len(batches) / events:,.0f} |")
    ratio = statistics.median(runs["service"]) / statistics.median(runs["bare"])
    print(f"\ndecide service / bare consumer: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
