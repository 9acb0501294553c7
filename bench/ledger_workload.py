"""A fleet's recorded decision loop, generated fast: KV_EVENTS batches and KV_DECISIONS records in a real JetStream.

`publish_ledger` plays a fleet of simulated workers (publishers × dp ranks) serving requests
that share system prompts, and publishes straight into JetStream what ingest and decide
would have: each served request is one engine batch on `kv.ev.<publisher>.<dp_rank>`
(the record codec of kvledger/core/events.py, with its Msg-Id), and every request is first
answered by decide's own CPU backend (decide/ranking/cpu.py) against decide's index folded from
exactly the batches published so far, its record appended to KV_DECISIONS by decide's own
recorder (decide/serving/recorder.py: the answer, `Kvledger-Relied-Prefix`, `Kvledger-Request`, and
`Kvledger-Shadow` when shadow settings are given). So each decision's inventory_seq is a
real KV_EVENTS seq and its relied-on blocks are ones its target (or chosen source) held then.

Churn: each worker's device tier is an LRU of whole prompts (a system prompt, a request's
own suffix) holding `device_blocks`; what it evicts is offloaded to its host tier (an LRU
of `host_blocks`) or dropped; a worker restarts now and then (a new epoch whose first batch
carries `Gap(publisher_restart)`: its inventory empties); a share of requests is cancelled
after decide answered them (the target never serves them). Verdicts come out a mix of
fresh, stale (the chosen source evicted the prefix) and lost (the target lost its credit).

Stream time is wall time: JetStream stamps each decision record when it stores it (store
reads decided_ts from that stamp, `message.metadata.timestamp`), and no client can set it.
So the ledger is generated as fast as this process goes, each batch's ingest_ts is the
clock when it is published, and a horizon is fair when it covers a fixed number of decisions
at the rate they were generated (`Ledger.horizon_ms`, at most half a minute). A last batch, a
minute of stream time after the last decision, settles every decision at any horizon under a
minute. Every kernel the generation runs is compiled (or loaded from the kernel cache) before
its clock starts: compiling on the way would stretch the stream time, and the horizon with it.
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
from collections.abc import Callable

import attrs
import msgspec
import nats

from kvledger.core.events import EventBatch, Gap, GapReason, Provenance, Removed, Stored, Tier, WorkerId, encode_batch
from kvledger.core.reuse import ReuseRequest
from kvledger.core.settings import ReuseSettings, StreamSettings
from kvledger.runtime.streams import DECISIONS_SUBJECT, decisions_stream, ensure_stream, events_stream

CLOSING_AFTER_S = 60.0  # stream time between the last decision and the batch that settles it
LONGEST_HORIZON_MS = 500 * CLOSING_AFTER_S  # half of it: a horizon the closing batch surely settles


@attrs.frozen
class FleetShape:
    """The fleet and its traffic. Defaults: 64 workers (16 publishers × 4 dp ranks), 512 system prompts."""

    publishers: int = 16
    dp_ranks: int = 4
    families: int = 512  # system prompts the requests share
    prefix_blocks: tuple[int, int] = (8, 48)  # a system prompt's length, in blocks
    suffix_blocks: tuple[int, int] = (2, 8)  # a request's own blocks after its system prompt
    device_blocks: int = 1024
    host_blocks: int = 2048
    offload: float = 0.5  # share of device evictions kept on the host tier
    batch: int = 16  # requests decide answers together (one inventory seq)
    unnamed: float = 0.2  # requests naming no target: decide's most-credited worker serves them
    affinity: float = 0.6  # named requests sent to the worker that last served their system prompt
    cancelled: float = 0.1  # answered requests the target never serves
    restart_every: int = 400  # decide batches between two worker restarts, on average
    block_size: int = 16
    seed: int = 1

    @property
    def workers(self) -> int:
        return self.publishers * self.dp_ranks


@attrs.define
class _Cache:
    """One tier of one worker: whole prompts (units) in LRU order, each with its engine hashes."""

    capacity: int
    units: collections.OrderedDict = attrs.field(factory=collections.OrderedDict)
    blocks: int = 0

    def add(self, key, unit) -> None:
        self.units[key] = unit
        self.blocks += len(unit[0])

    def pop_oldest(self):
        key, unit = self.units.popitem(last=False)
        self.blocks -= len(unit[0])
        return key, unit


@attrs.define
class _Worker:
    worker: WorkerId
    device: _Cache
    host: _Cache
    epoch: int = 0
    seq: int = 0


class FleetWorkload:
    """The fleet's state and its next moves (pure: no I/O); `publish_ledger` publishes them."""

    def __init__(self, shape: FleetShape) -> None:
        self.shape = shape
        self.rng = random.Random(shape.seed)
        rng = self.rng
        self.workers = [
            _Worker(WorkerId(f"node-{p:02d}", r), _Cache(shape.device_blocks), _Cache(shape.host_blocks))
            for p in range(shape.publishers) for r in range(shape.dp_ranks)
        ]
        self.by_name = {w.worker.name: w for w in self.workers}
        # A system prompt's blocks have the same local hashes on every worker (same tokens), and the
        # same engine hashes (vLLM's are content hashes); half the engine hashes are >= 2^63.
        self.family_local = []
        self.family_engine = []
        for family in range(shape.families):
            length = rng.randint(*shape.prefix_blocks)
            self.family_local.append(tuple(rng.getrandbits(64) for _ in range(length)))
            high = (family & 1) << 63
            self.family_engine.append(tuple(high | ((family + 1) << 24) | position for position in range(length)))
        # Zipf-like popularity: a few system prompts serve most requests.
        self.family_weights = [1.0 / (rank + 1) ** 0.8 for rank in range(shape.families)]
        self.last_server: dict[int, _Worker] = {}
        self.requests_made = 0

    def requests(self) -> list[tuple[ReuseRequest, int, tuple[int, ...], tuple[int, ...]]]:
        """The next decide batch: (request, system prompt, suffix engine hashes, suffix local hashes) each."""
        shape, rng = self.shape, self.rng
        families = rng.choices(range(shape.families), weights=self.family_weights, k=shape.batch)
        made = []
        for family in families:
            number = self.requests_made
            self.requests_made += 1
            length = rng.randint(*shape.suffix_blocks)
            suffix_engine = tuple((1 << 62) | (number << 4) | position for position in range(length))
            suffix_local = tuple(rng.getrandbits(64) for _ in range(length))
            target = None
            if rng.random() >= shape.unnamed:
                last = self.last_server.get(family)
                chosen = last if last is not None and rng.random() < shape.affinity else rng.choice(self.workers)
                target = chosen.worker
            request = ReuseRequest(f"req-{number:010d}", self.family_local[family] + suffix_local, shape.block_size,
                                   target)
            made.append((request, family, suffix_engine, suffix_local))
        return made

    def serve(self, worker_name: str, family: int, suffix_engine: tuple[int, ...], suffix_local: tuple[int, ...],
              now: float) -> EventBatch | None:
        """The batch `worker_name` publishes serving one request (None: cancelled, it never serves it)."""
        if self.rng.random() < self.shape.cancelled:
            return None
        worker = self.by_name[worker_name]
        self.last_server[family] = worker
        device = worker.device
        prefix = self.family_engine[family]
        events: list = []
        if ("f", family) in device.units:
            device.units.move_to_end(("f", family))
            events.append(Stored(Tier.DEVICE, suffix_engine, prefix[-1], self.shape.block_size, suffix_local))
        else:
            device.add(("f", family), (prefix, None, self.family_local[family]))
            events.append(Stored(Tier.DEVICE, prefix + suffix_engine, None, self.shape.block_size,
                                 self.family_local[family] + suffix_local))
        device.add(("s", suffix_engine[0]), (suffix_engine, prefix[-1], suffix_local))
        self._evict(worker, events)
        return self._batch(worker, events, now)

    def _evict(self, worker: _Worker, events: list) -> None:
        device, host = worker.device, worker.host
        removed = []
        while device.blocks > device.capacity:
            key, unit = device.pop_oldest()
            removed += unit[0]
            if self.rng.random() < self.shape.offload and key not in host.units:
                host.add(key, unit)
                events.append(Stored(Tier.HOST, unit[0], unit[1], self.shape.block_size, unit[2]))
        if removed:
            events.insert(1, Removed(Tier.DEVICE, tuple(removed)))
        gone = []
        while host.blocks > host.capacity:
            gone += host.pop_oldest()[1][0]
        if gone:
            events.append(Removed(Tier.HOST, tuple(gone)))

    def restart(self, now: float) -> EventBatch:
        """A worker's engine restarts: a new epoch, its cache empty (ingest's Gap(publisher_restart))."""
        worker = self.rng.choice(self.workers)
        expected = worker.seq
        worker.epoch += 1
        worker.seq = 0
        worker.device = _Cache(self.shape.device_blocks)
        worker.host = _Cache(self.shape.host_blocks)
        self.last_server = {family: w for family, w in self.last_server.items() if w is not worker}
        return self._batch(worker, [Gap(expected, 0, GapReason.PUBLISHER_RESTART)], now)

    @staticmethod
    def _batch(worker: _Worker, events: list, now: float) -> EventBatch:
        batch = EventBatch(worker.worker, worker.epoch, worker.seq, now, now, Provenance.NATIVE, tuple(events))
        worker.seq += 1
        return batch


@attrs.frozen
class Ledger:
    """What `publish_ledger` put in the streams, and how fast."""

    decisions: int
    event_batches: int
    block_events: int
    events_last_seq: int
    decisions_last_seq: int
    restarts: int
    first_decision_ts: float
    last_decision_ts: float
    generate_s: float  # wall time of the whole generation, publishing included
    decide_s: float  # of which decide's backend ranking and writing the answers (its batched rate: the yardstick)
    fold_s: float  # of which decide's index folding the batches

    @property
    def decisions_per_s(self) -> float:
        """The decision rate in stream time (= wall time of generation)."""
        return self.decisions / max(self.last_decision_ts - self.first_decision_ts, 1e-9)

    def horizon_ms(self, decisions: int) -> float:
        """The horizon covering `decisions` decisions at the rate they were generated, in whole ms (at least 1),
        and at most `LONGEST_HORIZON_MS`, since the closing batch must settle the last decisions: a slow
        generation's horizon would otherwise pass it and leave them without a verdict."""
        return float(min(max(1, round(1000 * decisions / self.decisions_per_s)), round(LONGEST_HORIZON_MS)))


class _Target(msgspec.Struct):
    target: str | None = None


_TARGET = msgspec.json.Decoder(_Target)


async def publish_ledger(nats_url: str, decisions: int, shape: FleetShape, reuse: ReuseSettings,
                         shadow: ReuseSettings | None = None, stream: StreamSettings | None = None,
                         progress: Callable[[int], None] | None = None) -> Ledger:
    """Publish a fleet's ledger of `decisions` recorded decisions into empty KV_EVENTS and KV_DECISIONS."""
    from kvledger.decide.ranking.cpu import CpuBackend
    from kvledger.decide.inventory.index import InventoryIndex
    from kvledger.decide.serving.recorder import DecisionRecorder, RecordBatch, Texts, request_header_texts
    from kvledger.decide.serving.service import compile_every_kernel
    from kvledger.decide.serving.shadow import ShadowDecisions, compile_shadow_kernels

    stream = stream or StreamSettings()
    workload = FleetWorkload(shape)
    index = InventoryIndex()
    backend = CpuBackend(index)
    # Every kernel the generation runs compiled (or loaded) before the clock starts: a fresh kernel cache
    # otherwise stretches the ledger's stream time by minutes of compiling, and its horizon with it.
    compile_every_kernel(reuse)
    shadows = ShadowDecisions(shadow) if shadow is not None else None
    if shadow is not None:
        compile_shadow_kernels(reuse, shadow)
    async with await nats.connect(nats_url) as nc:
        js = nc.jetstream(publish_async_max_pending=4096)
        await ensure_stream(js, events_stream(stream))
        await ensure_stream(js, decisions_stream(stream))
        recorder = DecisionRecorder(nc, DECISIONS_SUBJECT, stream.decisions_stream, timeout_s=60.0)
        await recorder.start()
        window = asyncio.Semaphore(64)  # decide batches whose acks are awaited together
        recording: set[asyncio.Task] = set()
        failures: list[BaseException] = []

        async def record(batch: RecordBatch) -> None:
            try:
                await recorder.record(batch)
            except BaseException as error:  # noqa: BLE001 - reported after the loop
                failures.append(error)
            finally:
                window.release()

        seq = 0
        block_events = restarts = made = 0
        decide_s = fold_s = 0.0
        first_ts = last_ts = 0.0
        last_ack = None

        async def publish(batch: EventBatch) -> None:
            nonlocal seq, block_events, fold_s, last_ack
            seq += 1
            started = time.perf_counter()
            index.apply(batch, seq)
            fold_s += time.perf_counter() - started
            block_events += sum(len(e.block_hashes) for e in batch.events if type(e) in (Stored, Removed))
            last_ack = await js.publish_async(batch.subject, encode_batch(batch), headers={"Nats-Msg-Id": batch.msg_id})

        started_at = time.perf_counter()
        restart_chance = 1.0 / shape.restart_every
        while made < decisions:
            if workload.rng.random() < restart_chance:
                await publish(workload.restart(time.time()))
                restarts += 1
            asked = workload.requests()[:decisions - made]
            requests = [request for request, *_ in asked]
            clock = time.perf_counter()
            answers = backend.answer_texts(requests, reuse)
            relied = answers.relied_prefixes
            shadow_texts = None
            if shadows is not None:
                shadow_texts, shadow_relied = shadows.answer(backend, requests)
                relied = [max(live, other, key=len) for live, other in zip(relied, shadow_relied)]
            headers = request_header_texts(requests, answers.arrays, answers.targets)
            decide_s += time.perf_counter() - clock
            await window.acquire()
            now = time.time()
            first_ts = first_ts or now
            last_ts = now
            task = asyncio.create_task(record(RecordBatch(
                [request.request_id for request in requests], answers.answers, relied, headers, shadow_texts,
                ids=Texts(answers.arrays.ids, answers.arrays.id_bounds) if answers.arrays is not None else None,
            )))
            recording.add(task)
            task.add_done_callback(recording.discard)
            await asyncio.sleep(0)  # the records go on the connection before the batches that follow them
            for (request, family, suffix_engine, suffix_local), answer in zip(asked, answers.answers):
                served = request.target.name if request.target is not None else _TARGET.decode(answer).target
                served = served or workload.rng.choice(workload.workers).worker.name
                batch = workload.serve(served, family, suffix_engine, suffix_local, time.time())
                if batch is not None:
                    await publish(batch)
            made += len(requests)
            if progress is not None and made % (shape.batch * 4096) < shape.batch:
                progress(made)
        # The batch that settles the last decisions: a restart a minute of stream time later.
        closing = workload.restart(last_ts + CLOSING_AFTER_S)
        await publish(closing)
        restarts += 1
        await asyncio.gather(*recording)
        await js.publish_async_completed()
        if failures:
            raise failures[0]
        generate_s = time.perf_counter() - started_at
        events_info = await js.stream_info(stream.events_stream)
        decisions_info = await js.stream_info(stream.decisions_stream)
        if events_info.state.last_seq != seq or decisions_info.state.messages != decisions:
            raise RuntimeError(f"streams hold {events_info.state.last_seq} batches and {decisions_info.state.messages} "
                               f"decisions; published {seq} and {decisions}")
        if last_ack is not None and (await last_ack).seq != seq:
            raise RuntimeError("KV_EVENTS seqs differ from the ones decide's index folded")
    return Ledger(decisions, seq, block_events, seq, decisions_info.state.last_seq, restarts, first_ts, last_ts,
                  generate_s, decide_s, fold_s)
