"""Benchmark of decide's ranking backends against Dynamo's RadixTree on the Mooncake trace.

The trace's requests are replayed into simulated workers (LRU device and host tiers, with
device evictions offloaded to host), producing canonical batches that build both the
decide index and a Dynamo RadixTree (device tier). The same trace requests are then asked,
in 512-token blocks as the trace gives them, one at a time and in batches. A decision
counts once its whole answer (every field of docs/decide.md's answer) is JSON bytes, as the service
sends it and records it in KV_DECISIONS.

    DYN_LOG=error python bench/decide.py [--trace ../shared/data/mooncake_synthetic_trace.jsonl] [--workers 64]
                           [--batch 1024] [--backends cpu,cuda] [--gpu-workers 256]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import pickle
import random
import sys
import time
from collections import OrderedDict
from pathlib import Path

import attrs
import numpy as np

from kvledger.core.decision_codec import decision_to_json
from kvledger.core.events import EventBatch, Provenance, Removed, Stored, Tier, WorkerId
from kvledger.core.fold import InventoryFold
from kvledger.core.hashing import local_block_hashes, sequence_hashes
from kvledger.core.reuse import ReuseRequest, decide
from kvledger.core.settings import ReuseSettings

REPO = Path(__file__).resolve().parent.parent
# Run as a script, this folder would come first on sys.path: the benchmarks are scripts, loaded by
# path where one uses another, and one is named like the standard library (bench/codecs.py).
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]
DEFAULT_TRACE = REPO.parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl"
TRACE_BLOCK = 512


def load_trace(path: Path) -> list[list[int]]:
    with path.open() as lines:
        return [json.loads(line)["hash_ids"] for line in lines if line.strip()]


def local_hash_of(hash_id: int, cache: dict[int, int]) -> int:
    """Each trace block id becomes a fixed block of 512 token ids, hashed like an engine would."""
    local = cache.get(hash_id)
    if local is None:
        tokens = [(hash_id * TRACE_BLOCK + k) % 0xFFFFFFFF for k in range(TRACE_BLOCK)]
        local = cache[hash_id] = local_block_hashes(tokens, TRACE_BLOCK)[0]
    return local


class SimulatedWorker:
    """A worker's device and host tiers as LRU caches of engine hashes; device evictions go to host."""

    def __init__(self, worker: WorkerId, device_blocks: int, host_blocks: int) -> None:
        self.worker = worker
        self.device: OrderedDict[int, None] = OrderedDict()
        self.host: OrderedDict[int, None] = OrderedDict()
        self.device_blocks, self.host_blocks = device_blocks, host_blocks
        self.seq = 0

    def serve(self, engine: list[int], local: list[int]) -> tuple[list, list]:
        """Events for serving one request: (canonical events, Dynamo device events)."""
        held = 0
        while held < len(engine) and engine[held] in self.device:
            self.device.move_to_end(engine[held])
            held += 1
        events: list = []
        device_events: list = []
        if held < len(engine):
            parent = engine[held - 1] if held else None
            new = [(e, l) for e, l in zip(engine[held:], local[held:]) if e not in self.device]
            if new:
                stored = Stored(Tier.DEVICE, tuple(e for e, _ in new), parent, TRACE_BLOCK, tuple(l for _, l in new))
                events.append(stored)
                device_events.append(stored)
            for e in engine[held:]:
                self.device[e] = None
                self.device.move_to_end(e)
        evicted = []
        while len(self.device) > self.device_blocks:
            evicted.append(self.device.popitem(last=False)[0])
        if evicted:
            removed = Removed(Tier.DEVICE, tuple(evicted))
            events.append(removed)
            device_events.append(removed)
            # Offloaded to host: a host block has no parent the engine still announces there.
            offload = [e for e in evicted if e not in self.host]
            if offload:
                events.append(Stored(Tier.HOST, tuple(offload), None, TRACE_BLOCK,
                                     tuple(self.local_of[e] for e in offload)))
            for e in evicted:
                self.host[e] = None
                self.host.move_to_end(e)
            dropped = []
            while len(self.host) > self.host_blocks:
                dropped.append(self.host.popitem(last=False)[0])
            if dropped:
                events.append(Removed(Tier.HOST, tuple(dropped)))
        return events, device_events

    local_of: dict[int, int] = {}


def build_inventory(trace: list[list[int]], workers: int, seed: int, with_dynamo: bool):
    """Replay the trace into `workers` simulated workers.

    Returns the index, the queries, the canonical batches and, `with_dynamo`, the device
    events as Dynamo's RadixTree takes them: (worker number, event JSON).
    """
    from kvledger.decide.inventory.index import InventoryIndex

    rng = random.Random(seed)
    cache: dict[int, int] = {}
    fleet = [SimulatedWorker(WorkerId(f"w{n:03d}"), 600, 1500) for n in range(workers)]
    index = InventoryIndex()
    dynamo_events: list[tuple[int, bytes]] = []
    queries: list[ReuseRequest] = []
    batches: list[EventBatch] = []
    stream_seq = 0
    for number, hash_ids in enumerate(trace):
        local = [local_hash_of(h, cache) for h in hash_ids]
        engine = sequence_hashes(local)  # an engine's block hash: the chained content hash
        for e, l in zip(engine, local):
            SimulatedWorker.local_of[e] = l
        # A cache-unaware router: each request lands on a random worker, asked about first.
        serving = fleet[rng.randrange(workers)]
        queries.append(ReuseRequest(f"q{number}", tuple(local), TRACE_BLOCK, serving.worker))
        events, device_events = serving.serve(engine, local)
        if events:
            stream_seq += 1
            batches.append(EventBatch(serving.worker, 0, serving.seq, 0.0, 0.0, Provenance.NATIVE, tuple(events)))
            index.apply(batches[-1], stream_seq)
            serving.seq += 1
        if with_dynamo:
            worker_number = int(serving.worker.publisher[1:])
            for event in device_events:
                dynamo_events.append((worker_number, _dynamo_event(len(dynamo_events) + 1, event)))
    return index, queries, batches, dynamo_events


def dynamo_process(connection, events: list[tuple[int, bytes]], sequences: list[list[int]], rounds: int) -> None:
    """Dynamo's side, in a process of its own, as its router runs: build the tree, then one
    measurement per "run" asked.

    find_matches hands each query to a Rust thread and waits for the answer. When the
    scheduler puts that thread on the other core, every query pays a cross-core wake-up
    (about 60 µs on this VM instead of about 5 µs per query), and it stays that way while
    queries keep coming; which one happens depended on what ran before (kvledger's numpy
    runs, a full GC, other load), so runs read 17 k or 200 k/s. Pinning the process, and
    so the threads it starts, to one core gives Dynamo its fast case every time.
    """
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    import dynamo._core

    tree = dynamo._core.RadixTree()
    refused = 0
    for worker, event in events:
        try:
            tree.apply_event(worker, event)
        except RuntimeError:
            # LRU evicts from the middle of chains; Dynamo drops a block's descendants with
            # it and then refuses their later removal or children. Counted.
            refused += 1
    for sequence in sequences:  # an untimed pass, so Dynamo is measured warm
        tree.find_matches(sequence)
    connection.send(refused)
    while connection.recv() == "run":
        connection.send(time_single(tree.find_matches, sequences, rounds))


def _dynamo_event(event_id: int, event) -> bytes:
    if isinstance(event, Stored):
        data = {"stored": {"parent_hash": event.parent_hash, "blocks": [
            {"block_hash": b, "tokens_hash": l} for b, l in zip(event.block_hashes, event.local_hashes)]}}
    else:
        data = {"removed": {"block_hashes": list(event.block_hashes)}}
    return json.dumps({"event_id": event_id, "data": data}).encode()


def figures(answered: int, elapsed: float, latencies: list[float]) -> dict[str, float]:
    """A measurement: answers per second, and p50/p99 of the latencies (seconds) in ms."""
    p50, p99 = np.percentile(np.asarray(latencies), [50, 99])
    return {"per_s": answered / elapsed, "p50_ms": float(p50) * 1e3, "p99_ms": float(p99) * 1e3}


# A pass over the trace's queries in batches of 1 024 takes about 30 ms: too short to
# measure alone, so every measurement replays the queries until it has run this long.
MEASURE_S = 0.5


def replays(rounds: int):
    """Round numbers: at least `rounds`, and on until MEASURE_S has passed."""
    started = time.perf_counter()
    done = 0
    while done < rounds or time.perf_counter() - started < MEASURE_S:
        yield done
        done += 1


def time_single(decide_one, queries: list, rounds: int = 1) -> dict[str, float]:
    """Rate from an untimed loop (a per-call timer costs about 3 % of a 5 µs call), then p50/p99 from a timed pass."""
    calls = 0
    started = time.perf_counter()
    for _ in replays(rounds):
        for query in queries:
            decide_one(query)
        calls += len(queries)
    elapsed = time.perf_counter() - started
    latencies = []
    for query in queries:
        t0 = time.perf_counter()
        decide_one(query)
        latencies.append(time.perf_counter() - t0)
    return figures(calls, elapsed, latencies)


def time_batches(decide_many, queries: list[ReuseRequest], batch: int, rounds: int = 1) -> dict[str, float]:
    latencies = []
    answered = 0
    started = time.perf_counter()
    for _ in replays(rounds):
        for start in range(0, len(queries) - batch + 1, batch):
            chunk = queries[start:start + batch]
            t0 = time.perf_counter()
            answers = decide_many(chunk)
            latencies.append(time.perf_counter() - t0)
            assert len(answers) == len(chunk)
            answered += len(chunk)
    return figures(answered, time.perf_counter() - started, latencies)


SETTLE_S = 1.0
# Dynamo's find_matches takes about 5 µs per query warm; a median call 4 times slower is
# its slow mode (see `dynamo_process`), not the radix tree.
SLOW_HAND_OFF_MS = 0.020


def interleaved(repeats: int, measures: dict[str, object]) -> dict[str, list[dict[str, float]]]:
    """Every path's runs, taken in turns (path A, B, …, then A, B, … again), each after an idle second.

    Taking turns spreads any moment the shared machine is busy over every path alike, and
    the idle second lets whatever ran before settle (Dynamo, in its own process, waits
    for its turn while the cpu paths run).
    """
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in measures}
    for _ in range(repeats):
        for label, measure in measures.items():
            time.sleep(SETTLE_S)
            runs[label].append(measure())
    return runs


def median_run(runs: list[dict[str, float]]) -> dict[str, float]:
    """The run with the median rate (the lower middle one of an even count)."""
    return sorted(runs, key=lambda run: run["per_s"])[(len(runs) - 1) // 2]


def row(label: str, runs: list[dict[str, float]]) -> str:
    middle = median_run(runs)
    rates = [run["per_s"] for run in runs]
    return (f"| {label} | {middle['per_s']:,.0f} ({min(rates):,.0f} – {max(rates):,.0f}) "
            f"| {middle['p50_ms']:.3f} | {middle['p99_ms']:.3f} |")


def request_json(query: ReuseRequest, round_number: int) -> dict:
    """A query as a client sends it; each round's ids are new, so every answer is a new record."""
    return {"request_id": f"{query.request_id}-r{round_number}", "target": query.target.name if query.target else None,
            "local_hashes": list(query.local_hashes), "block_size": query.block_size}


async def time_requests(nc, subject: str, bodies: list[bytes], answers_each: int, timeout: float) -> dict[str, float]:
    """NATS requests one after another, after an idle second: answers per second and latency per request."""
    await asyncio.sleep(SETTLE_S)
    latencies = []
    started = time.perf_counter()
    for body in bodies:
        t0 = time.perf_counter()
        await nc.request(subject, body, timeout=timeout)
        latencies.append(time.perf_counter() - t0)
    return figures(len(bodies) * answers_each, time.perf_counter() - started, latencies)


async def service_figures(batches: list[EventBatch], queries: list[ReuseRequest], reuse: ReuseSettings,
                          batch: int, repeats: int) -> dict[str, list[dict[str, float]]]:
    """`kvledger decide` end to end on an embedded nats-server: KV_EVENTS replayed at startup,
    then requests over NATS (cpu backend); each answer waits for its KV_DECISIONS ack, as always."""
    import tempfile

    import nats

    from kvledger.decide.serving.service import DecideService
    from kvledger.runtime.embedded import EmbeddedNats
    from kvledger.core.settings import load_settings
    from kvledger.runtime.streams import (
        DECIDE_BATCH_SUBJECT, DECIDE_SUBJECT, ensure_stream, events_stream, publish_batches,
    )

    overrides = {f"reuse.{field.name}": getattr(reuse, field.name) for field in attrs.fields(ReuseSettings)}
    with tempfile.TemporaryDirectory() as store, EmbeddedNats(store) as server:
        overrides.update({"nats.url": server.url, "decide.http_port": 0, "decide.backend": "cpu",
                          "decide.http_host": "127.0.0.1"})
        settings = load_settings(environ={}, overrides=overrides).settings
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        await ensure_stream(js, events_stream(settings.stream))
        await publish_batches(js, batches)
        rounds = itertools.count()
        runs: dict[str, list[dict[str, float]]] = {"batched": [], "single": []}
        async with DecideService(settings) as service:
            await service.wait_ready(120)
            for _ in range(repeats):
                # Bodies are encoded before the clock starts: the client's JSON is not the service's work.
                number = next(rounds)
                bodies = [json.dumps([request_json(q, number) for q in queries[start:start + batch]]).encode()
                          for start in range(0, len(queries) - batch + 1, batch)]
                runs["batched"].append(await time_requests(nc, DECIDE_BATCH_SUBJECT, bodies, batch, 60))
                number = next(rounds)
                singles = [json.dumps(request_json(q, number)).encode() for q in queries[:1000]]
                runs["single"].append(await time_requests(nc, DECIDE_SUBJECT, singles, 1, 10))
        await nc.close()
    return runs


def dynamo_unavailable_reason() -> str | None:
    """None when Dynamo's RadixTree can be imported, else why not (the yardstick is then left out)."""
    try:
        import dynamo._core  # noqa: F401
    except ImportError as error:
        return f"ai-dynamo-runtime is not installed here ({error})"
    return None


def gpu_figures(index, queries: list[ReuseRequest], batches: list[EventBatch], workers: int,
                reuse: ReuseSettings, args: argparse.Namespace) -> tuple[list[str], int]:
    """The cuda backend at one fleet size, beside cpu on the same index: rates, p99 per batch,
    parity on every query, device bytes per indexed block, the time to apply dirty slots, and
    (with --gpu-profile) where one pass of full answers spends its host time. Returns the
    summary lines and how many answers differed from cpu's."""
    from kvledger.decide.ranking.cpu import CpuBackend
    from kvledger.decide.ranking.cuda import CudaBackend

    lines = []
    cpu = CpuBackend(index)
    with CudaBackend(index) as cuda:
        cuda.decide_batch(queries[: args.batch], reuse)  # upload, warm up
        checked = cuda.decide_batch(queries, reuse)
        expected = cpu.decide_batch(queries, reuse)
        differing = sum(attrs.evolve(a, backend="cpu") != b for a, b in zip(checked, expected))
        runs = interleaved(args.repeats, {
            "full": lambda: time_batches(lambda qs: cuda.answer_texts(qs, reuse).answers, queries, args.batch,
                                         args.rounds),
            "ranked": lambda: time_batches(lambda qs: cuda.rank_batch(qs, reuse).reason, queries, args.batch,
                                           args.rounds),
            "cpu": lambda: time_batches(lambda qs: cpu.answer_texts(qs, reuse).answers, queries, args.batch,
                                        args.rounds),
        })
        print(row(f"cuda ({cuda.arch}), batches of {args.batch}, full answers as JSON bytes (latency per batch), "
                  f"{workers} workers", runs["full"]))
        print(row(f"cuda ({cuda.arch}), batches of {args.batch}, ranking only (no Python answers), {workers} workers",
                  runs["ranked"]))
        print(row(f"cpu beside it, batches of {args.batch}, full answers as JSON bytes, {workers} workers", runs["cpu"]))
        device_bytes = cuda.table_device_bytes
        full_rate = median_run(runs["full"])["per_s"]
        lines.append(f"cuda vs cpu on all {len(queries)} queries at {workers} workers: "
                     f"{'identical' if not differing else f'{differing} DIFFER'}")
        lines.append(f"cuda at {workers} workers: full JSON answers {full_rate:,.0f}/s "
                     f"(goal >= 1,000,000/s at 256), {full_rate / median_run(runs['cpu'])['per_s']:.2f}x cpu; "
                     f"device table and rows {device_bytes / 2**20:.1f} MiB = {device_bytes / max(index.size, 1):.0f} "
                     f"bytes per indexed block ({index.size} blocks)")
        if args.gpu_profile:
            import cProfile
            import pstats

            profile = cProfile.Profile()
            profile.runcall(lambda: [cuda.answer_texts(queries[start:start + args.batch], reuse)
                                     for start in range(0, len(queries), args.batch)])
            print(f"\nwhere one pass of cuda full answers spends its time, {workers} workers (cProfile, tottime):")
            pstats.Stats(profile).sort_stats("tottime").print_stats(14)
    lines += dirty_apply_figures(batches, workers, args.dirty_chunk)
    return lines, differing


def dirty_apply_figures(batches: list[EventBatch], workers: int, chunk: int) -> list[str]:
    """Time to bring the device mirror up to date after each `chunk` further event batches.

    The mirror is built from all but the last batches, uploaded whole, then the held-back
    batches are applied `chunk` at a time, each followed by `sync_table` (scatter of the
    dirty table slots and rows, waited for). A change of the arrays' shape re-uploads all.
    """
    from kvledger.decide.ranking.cuda import CudaBackend
    from kvledger.decide.inventory.index import InventoryIndex

    held_back = min(len(batches) // 2, 40 * chunk)
    mirror = InventoryIndex()
    stream_seq = 0
    for stream_seq, batch in enumerate(batches[: len(batches) - held_back], 1):
        mirror.apply(batch, stream_seq)
    scatters, uploads = [], []
    with CudaBackend(mirror) as cuda:
        cuda.sync_table()
        cuda.stream.sync()
        for start in range(len(batches) - held_back, len(batches), chunk):
            generation = mirror.generation
            for batch in batches[start:start + chunk]:
                stream_seq += 1
                mirror.apply(batch, stream_seq)
            dirty = len(mirror.dirty_table_slots) + len(mirror.dirty_rows)
            began = time.perf_counter()
            cuda.sync_table()
            cuda.stream.sync()
            elapsed_ms = (time.perf_counter() - began) * 1000.0
            (uploads if mirror.generation != generation else scatters).append((dirty, elapsed_ms))
    if not scatters:
        return [f"dirty slots at {workers} workers: every step re-uploaded the arrays ({len(uploads)} uploads)"]
    times = sorted(ms for _, ms in scatters)
    dirty_mean = sum(d for d, _ in scatters) / len(scatters)
    line = (f"applying {chunk} event batches at {workers} workers: {dirty_mean:.0f} dirty table slots and rows on "
            f"average, scattered in p50 {times[len(times) // 2]:.3f} ms, p99 {times[int(len(times) * 0.99)]:.3f} ms "
            f"({len(scatters)} steps)")
    if uploads:
        line += f"; {len(uploads)} steps grew the arrays and re-uploaded them: {max(ms for _, ms in uploads):.2f} ms at most"
    return [line]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--gpu-workers", type=int, default=256, help="fleet size for the cuda figures")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--backends", default="cpu,cuda", help="comma-separated; cuda is skipped without a GPU")
    parser.add_argument("--rounds", type=int, default=1,
                        help=f"least times the query set is replayed per measurement (and on for {MEASURE_S} s)")
    parser.add_argument("--repeats", type=int, default=5, help="measurements per path, taken in turns; the median is shown")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--no-service", action="store_true", help="skip the end-to-end service figures")
    parser.add_argument("--parity-sample", type=int, default=100, help="answers checked against the reference")
    parser.add_argument("--gpu-profile", action="store_true", help="print where one cuda pass spends its host time")
    parser.add_argument("--only", help="comma-separated paths to time (single, batched, untargeted, values, ranking, "
                        "reuse_off, recorded, recorded_str, recorded_python, shadow, shadow_again); default all")
    parser.add_argument("--dirty-chunk", type=int, default=16, help="event batches applied between device updates")
    args = parser.parse_args(argv)

    from kvledger.decide.ranking.cpu import CpuBackend

    trace = load_trace(args.trace)
    # Reuse on, default thresholds and budget: full decisions with candidates and ranking.
    reuse = ReuseSettings(enable_decode_to_prefill_reuse=True, enable_decode_to_prefill_gpu_reuse=True)
    t0 = time.perf_counter()
    dynamo_missing = dynamo_unavailable_reason()
    with_dynamo = dynamo_missing is None
    index, queries, batches, dynamo_events = build_inventory(trace, args.workers, args.seed, with_dynamo=with_dynamo)
    # Both sides read queries just received: Dynamo's process unpickles its sequences, and
    # these are unpickled here, laid out as a service's just-decoded requests are, not spread
    # over the heap among the inventory's objects (about 5 % of a batched answer's time).
    queries = pickle.loads(pickle.dumps(queries))
    sequences = [list(q.local_hashes) for q in queries]
    import multiprocessing

    if with_dynamo:
        dynamo_side, dynamo_connection = multiprocessing.Pipe()
        dynamo_worker = multiprocessing.get_context("spawn").Process(
            target=dynamo_process, args=(dynamo_connection, dynamo_events, sequences, args.rounds), daemon=True)
        dynamo_worker.start()
        dynamo_line = (f"Dynamo refused {dynamo_side.recv()} of {len(dynamo_events)} device events "
                       "(see docs/benchmarks.md)")
    else:
        dynamo_line = f"Dynamo not measured: {dynamo_missing}"
    print(f"trace {args.trace} : {len(trace)} requests, 512-token blocks (not re-blocked); "
          f"{args.workers} workers (LRU device 600 / host 1500 blocks each); "
          f"index {index.size} sequence hashes, inventory_seq {index.inventory_seq}; built in {time.perf_counter() - t0:.1f}s; "
          f"{dynamo_line}")

    cpu = CpuBackend(index)
    sample = queries[:: max(1, len(queries) // args.parity_sample)][: args.parity_sample]
    # The reference walks blocks in Python and would spend its 2 ms budget; parity is checked without one.
    roomy = attrs.evolve(reuse, transfer_source_lookup_budget_ms=1e9)
    # The reference reads a fold of its own: decide's index keeps plain workers' records outside its fold.
    reference = InventoryFold()
    reference.apply_all((batch, stream_seq) for stream_seq, batch in enumerate(batches, 1))
    expected = [decide(reference, q, roomy, backend="cpu") for q in sample]
    mismatches = sum(cpu.decide(q, roomy) != answer for q, answer in zip(sample, expected))
    # Without a target, the credit of every worker picks one: a path of its own.
    untargeted_sample = [attrs.evolve(q, target=None) for q in sample]
    mismatches += sum(got != decide(reference, q, roomy, backend="cpu")
                      for q, got in zip(untargeted_sample, cpu.decide_batch(untargeted_sample, roomy)))
    # The JSON the service sends must be the codec's, byte for byte (compact separators).
    mismatches += sum(got != json.dumps(decision_to_json(answer), separators=(",", ":")).encode()
                      for got, answer in zip(cpu.answer_batch(sample, roomy).encoded(), expected))
    answers = cpu.decide_batch(queries, reuse)
    batch_json = cpu.answer_batch(queries, reuse).encoded()
    # The service's one-call path writes the same bytes, and the same relied-on prefixes.
    from kvledger.decide.ranking.ranked import AnswerTexts

    mismatches += sum(cpu.answer_texts(chunk, reuse) != AnswerTexts.of(cpu.answer_batch(chunk, reuse))
                      for chunk in (queries[start:start + args.batch] for start in range(0, len(queries), args.batch)))
    mismatches += sum(got != json.dumps(decision_to_json(answer), separators=(",", ":")).encode()
                      for got, answer in zip(batch_json, answers))
    reasons: dict[str, int] = {}
    for answer in answers:
        reasons[answer.reason] = reasons.get(answer.reason, 0) + 1
    candidates = sum(len(a.candidates) for a in answers) / len(answers)
    overlapping = sum(len(a.overlaps) for a in answers) / len(answers)
    print(f"parity with the reference model on {len(sample)} sampled queries (Decision values and JSON), "
          f"and of all {len(queries)} batched JSON answers with their Decision values: "
          f"{'ok' if not mismatches else f'{mismatches} MISMATCHES'}; reasons {reasons}; "
          f"mean {candidates:.1f} candidates and {overlapping:.1f} workers in overlaps per answer")

    from kvledger.decide.ranking.cpu import rank_batch
    from kvledger.decide.serving.recorder import request_header_texts, request_texts
    from kvledger.decide.serving.shadow import ShadowDecisions
    from kvledger.core.decision_codec import request_header
    from kvledger.core.settings import enabled_reuse

    untargeted = [attrs.evolve(q, target=None) for q in queries]
    reuse_off = ReuseSettings()
    shadow = ShadowDecisions(enabled_reuse(reuse_off))

    def recorded(batch: list[ReuseRequest], shadows: str | None, requests: str | None) -> list[bytes]:
        """What the service computes per batch with reuse off: the answers and relied-on prefixes, each
        record's request header (`requests`: "batch" as the service writes them, one buffer for the
        records' frames; "str" the same as a str each, as the service took them before; "python" one at
        a time as `request_header` does; None: not at all) and, with `shadows`, each record's shadow
        header ("live": read off the live ranking, as the service does; "again": the batch ranked again)."""
        if shadows == "live":
            texts, _ = shadow.answer_with_live(cpu, batch, reuse_off, inflight=False)
        else:
            texts = cpu.answer_texts(batch, reuse_off)
        if requests == "batch":
            request_header_texts(batch, texts.arrays, texts.targets)
        elif requests == "str":
            request_texts(batch, texts.arrays)
        elif requests == "python":
            [request_header(q) for q in batch]
        if shadows == "again":
            shadow.answer(cpu, batch, texts)
        return texts.answers

    paths = {
        "single": (f"cpu, single requests, full answers as JSON bytes (and relied-on prefixes), {args.workers} workers",
                   lambda: time_single(lambda q: cpu.answer_texts([q], reuse).answers, queries, args.rounds)),
        "batched": (f"cpu, batches of {args.batch}, full answers as JSON bytes (and relied-on prefixes; latency per "
                    f"batch), {args.workers} workers",
                    lambda: time_batches(lambda qs: cpu.answer_texts(qs, reuse).answers, queries, args.batch,
                                         args.rounds)),
        "untargeted": (f"cpu, batches of {args.batch}, full JSON answers, no target given (credit of every worker "
                       f"picks one), {args.workers} workers",
                       lambda: time_batches(lambda qs: cpu.answer_texts(qs, reuse).answers, untargeted, args.batch,
                                            args.rounds)),
        "values": (f"cpu, batches of {args.batch}, full answers as Decision values, {args.workers} workers",
                   lambda: time_batches(lambda qs: cpu.decide_batch(qs, reuse), queries, args.batch, args.rounds)),
        "ranking": (f"cpu, batches of {args.batch}, ranking only (arrays, no Python answers), {args.workers} workers",
                    lambda: time_batches(lambda qs: rank_batch(index, qs, reuse).reason, queries, args.batch,
                                         args.rounds)),
        # What the service computes per batch with reuse off (the default): without each record's
        # request header, with it (as the service writes it, and as request_header writes one), and with
        # shadow decisions too (decide.shadow: the batch ranked again with both enable flags on).
        "reuse_off": (f"cpu, batches of {args.batch}, reuse off: JSON answers and relied-on prefixes, "
                      f"{args.workers} workers",
                      lambda: time_batches(lambda qs: recorded(qs, None, None), queries, args.batch, args.rounds)),
        "recorded": (f"cpu, batches of {args.batch}, reuse off: the same, plus each record's request header "
                     f"(decide.serving.recorder.request_header_texts, one compiled call a batch, one buffer), {args.workers} workers",
                     lambda: time_batches(lambda qs: recorded(qs, None, "batch"), queries, args.batch, args.rounds)),
        "recorded_str": (f"cpu, batches of {args.batch}, reuse off: the same, the request headers as a str each "
                         f"(decide.serving.recorder.request_texts), {args.workers} workers",
                         lambda: time_batches(lambda qs: recorded(qs, None, "str"), queries, args.batch, args.rounds)),
        "recorded_python": (f"cpu, batches of {args.batch}, reuse off: the same, the request headers written one "
                            f"at a time (decision_codec.request_header), {args.workers} workers",
                            lambda: time_batches(lambda qs: recorded(qs, None, "python"), queries, args.batch,
                                                 args.rounds)),
        "shadow": (f"cpu, batches of {args.batch}, reuse off with decide.shadow: request headers, plus each record's "
                   f"shadow header (read off the live ranking in the same call), {args.workers} workers",
                   lambda: time_batches(lambda qs: recorded(qs, "live", "batch"), queries, args.batch, args.rounds)),
        "shadow_again": (f"cpu, batches of {args.batch}, reuse off with decide.shadow: the same, the batch ranked "
                         f"again with reuse on (where the shadow cannot share the live ranking), {args.workers} workers",
                         lambda: time_batches(lambda qs: recorded(qs, "again", "batch"), queries, args.batch,
                                              args.rounds)),
    }
    if with_dynamo:
        dynamo_path = (f"Dynamo RadixTree.find_matches, single, in its own process (one core), {args.workers} "
                       "workers (overlap scores only)", lambda: (dynamo_side.send("run"), dynamo_side.recv())[1])
        # Dynamo's run comes right after the batched run it is compared with, so each pair
        # shares the same minute of a shared machine.
        paths = {name: path for name, path in (("single", paths["single"]), ("batched", paths["batched"]),
                                                ("dynamo", dynamo_path), *paths.items())}
    if args.only:
        paths = {name: path for name, path in paths.items() if name in args.only.split(",")}
    print(f"\n{args.repeats} runs of each path, taken in turns, each after an idle {SETTLE_S:.0f} s and lasting at "
          f"least {MEASURE_S} s; shown: the median run's rate (the range of all runs), p50 and p99\n")
    runs = interleaved(args.repeats, {name: measure for name, (_, measure) in paths.items()})
    if with_dynamo:
        dynamo_side.send("stop")
        dynamo_worker.join(10)
    print("| path | decisions (or queries) / s | p50 ms | p99 ms |")
    print("|---|---|---|---|")
    for name, (label, _) in paths.items():
        print(row(label, runs[name]))

    if not args.no_service:
        service = asyncio.run(service_figures(batches, queries, reuse, args.batch, args.repeats))
        print(row(f"kvledger decide service over NATS, batches of {args.batch} (request to reply, each answer "
                  f"acknowledged in KV_DECISIONS), cpu, {args.workers} workers", service["batched"]))
        print(row(f"kvledger decide service over NATS, single requests (request to reply, recorded), cpu, "
                  f"{args.workers} workers", service["single"]))

    gpu_lines = []
    if "cuda" in args.backends.split(","):
        from kvledger.decide.ranking.cuda import CudaBackend, device_unavailable_reason

        reason = device_unavailable_reason()
        if reason is not None:
            gpu_lines.append(f"cuda: not measured ({reason})")
        else:
            for workers in sorted({args.workers, args.gpu_workers}):
                if workers == args.workers:
                    gpu_index, gpu_queries, gpu_batches = index, queries, batches
                else:
                    gpu_index, gpu_queries, gpu_batches, _ = build_inventory(trace, workers, args.seed, with_dynamo=False)
                    gpu_queries = pickle.loads(pickle.dumps(gpu_queries))
                lines, differing = gpu_figures(gpu_index, gpu_queries, gpu_batches, workers, reuse, args)
                gpu_lines += lines
                mismatches += differing
    print()
    def cost_line(what: str, without: str, with_: str) -> None:
        if without in runs and with_ in runs:
            # Runs taken in turns are paired (each `with_` run beside the `without` run of its round).
            paired = sorted(1 - on["per_s"] / off["per_s"] for off, on in zip(runs[without], runs[with_]))
            off, on = median_run(runs[without]), median_run(runs[with_])
            print(f"{what} costs the batched rate {paired[(len(paired) - 1) // 2]:.1%} with reuse off, the median of "
                  f"{len(paired)} rounds' costs ({paired[0]:.1%} – {paired[-1]:.1%}; medians {off['per_s']:,.0f}/s "
                  f"-> {on['per_s']:,.0f}/s)")

    cost_line("each record's request header (one compiled call a batch, one buffer)", "reuse_off", "recorded")
    cost_line("each record's request header as a str each (request_texts)", "reuse_off", "recorded_str")
    cost_line("each record's request header written one at a time (request_header)", "reuse_off", "recorded_python")
    cost_line("decide.shadow, read off the live ranking (with the request headers)", "recorded", "shadow")
    cost_line("decide.shadow, ranked again (with the request headers)", "recorded", "shadow_again")
    if "batched" not in runs or "single" not in runs:
        return 0 if not mismatches else 1
    batched = median_run(runs["batched"])
    single_p99 = f"cpu single p99 {median_run(runs['single'])['p99_ms'] * 1000:.0f} µs (goal <= 50 µs, in process: " \
                 "the service adds NATS request/reply and the KV_DECISIONS ack)"
    if not with_dynamo:
        print(f"cpu batched JSON answers: {batched['per_s']:,.0f}/s (no Dynamo ratio: {dynamo_missing}); {single_p99}")
    else:
        dynamo = median_run(runs["dynamo"])
        dynamo_rates = [run["per_s"] for run in runs["dynamo"]]
        paired = sorted(ours["per_s"] / theirs["per_s"] for ours, theirs in zip(runs["batched"], runs["dynamo"]))
        print(f"cpu batched JSON answers / Dynamo queries: {paired[(len(paired) - 1) // 2]:.2f}x, the median of "
              f"{len(paired)} rounds' ratios, each batched run beside the Dynamo run right after it "
              f"({paired[0]:.2f} – {paired[-1]:.2f}x; ratio of the medians {batched['per_s'] / dynamo['per_s']:.2f}x) "
              f"(goal >= 3x); {single_p99}")
        if max(dynamo_rates) > 2 * min(dynamo_rates) or dynamo["p50_ms"] > SLOW_HAND_OFF_MS:
            print(f"WARNING: Dynamo ran slow or unevenly ({min(dynamo_rates):,.0f} – {max(dynamo_rates):,.0f}/s, "
                  f"p50 {dynamo['p50_ms'] * 1e3:.0f} µs per query; warm it is about 5 µs and 200 k/s here; load "
                  f"average {os.getloadavg()[0]:.1f}): the ratio is NOT trustworthy; run again on a quiet machine")
    for line in gpu_lines:
        print(line)
    return 0 if not mismatches else 1


if __name__ == "__main__":
    sys.exit(main())
