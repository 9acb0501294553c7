"""An engine restarted while ingest was away is told from a continuation by content (ingest/incarnation.py).

Driven by vLLM 0.33's and SGLang 0.5.23's own `ZmqEventPublisher`s, loaded out of their
wheels as the golden recorders load them (skipped where a wheel is not at hand:
`engines.engine_wheel`; `.ci/run` fetches both), and by the project's
simulated engine. ingest is stopped; the engine restarts (a new publisher on
the same ports, seqs from 0) or goes on; it publishes; ingest starts again. KV_EVENTS,
folded, must hold exactly what the engine holds, or report the worker uncertain.
"""

from __future__ import annotations

import time
import timeit

import pytest

from engines import (
    SglangEngine, VllmEngine, engine_endpoints, engine_wheel, load_engine_kv_events, one_block, read_stream,
    settings_for, wait_until,
)
from kvledger.core.events import EventBatch, Gap, GapReason, Provenance, Tier, WorkerId, decode_batch, encode_batch
from kvledger.core.fold import InventoryFold
from kvledger.ingest.bridge import Bridge
from kvledger.ingest.endpoints import StreamSource
from kvledger.ingest.incarnation import Incarnation, is_restart_marker, judge, same_engine_batch
from kvledger.ingest.wire import Engine, decode_payload
from kvledger.sim.engine import SimulatedEngine
from kvledger.sim.vllm import VllmBlockRemoved, encode_vllm_batch

OLD, NEW = 1_000, 2_000  # block ids of the first and the second incarnation
RESUME = 12  # batches the first incarnation publishes while ingest follows it: ingest resumes at seq 12
SMALL_BUFFER = 8


class SimDriver:
    """The project's simulated engine: `restart` starts its counter and buffer over on the same sockets."""

    def __init__(self, pub: str, replay: str, buffer_steps: int) -> None:
        self.engine = SimulatedEngine(pub, replay, buffer_steps=buffer_steps)
        self.pub_endpoint, self.replay_endpoint = pub, replay

    async def start(self) -> None:
        await self.engine.__aenter__()
        self.pub_endpoint, self.replay_endpoint = self.engine.pub_endpoint, self.engine.replay_endpoint

    async def stop(self) -> None:
        await self.engine.close()

    async def restart(self) -> None:
        self.engine.restart()

    def store(self, block: int, parent: int | None) -> object:
        return one_block(block, "GPU", parent)

    def remove(self, block: int) -> object:
        return VllmBlockRemoved((block,), "GPU")

    async def publish(self, events: list[object], ts: float) -> int:
        return await self.engine.publish(events, ts=ts)


class VllmDriver:
    """vLLM's own publisher: `restart` shuts it down and starts a new one on the same ports."""

    def __init__(self, pub: str, replay: str, buffer_steps: int) -> None:
        wheel = engine_wheel("vllm")
        if wheel is None:
            pytest.skip("vLLM's wheel is not at hand (KVLEDGER_TEST_VLLM_WHEEL, or ~/.cache/kvledger/wheels)")
        self.engine = VllmEngine(load_engine_kv_events("vllm", wheel), pub, replay, buffer_steps=buffer_steps)
        self.pub_endpoint, self.replay_endpoint = pub, replay

    async def start(self) -> None:
        self.engine.start()

    async def stop(self) -> None:
        self.engine.stop()

    async def restart(self) -> None:
        self.engine.restart()

    def store(self, block: int, parent: int | None) -> object:
        return self.engine.store(block, parent)

    def remove(self, block: int) -> object:
        return self.engine.remove(block)

    async def publish(self, events: list[object], ts: float) -> int:
        return await self.engine.publish(events, ts)


class SglangDriver(VllmDriver):
    """SGLang's own publisher (its copy of vLLM's); `restart` as vLLM's."""

    def __init__(self, pub: str, replay: str, buffer_steps: int) -> None:
        wheel = engine_wheel("sglang")
        if wheel is None:
            pytest.skip("SGLang's wheel is not at hand (KVLEDGER_TEST_SGLANG_WHEEL, or ~/.cache/kvledger/wheels)")
        self.engine = SglangEngine(load_engine_kv_events("sglang", wheel), pub, replay, buffer_steps=buffer_steps)
        self.pub_endpoint, self.replay_endpoint = pub, replay


DRIVERS = {"simulated": SimDriver, "vllm": VllmDriver, "sglang": SglangDriver}


class EngineLife:
    """One engine incarnation's batches and what it holds after them (the engine's truth)."""

    def __init__(self, driver, base: int, ts0: float) -> None:
        self.driver, self.base, self.ts0 = driver, base, ts0
        self.count = 0
        self.held: set[int] = set()

    async def publish(self, batches: int) -> None:
        for _ in range(batches):
            i, block = self.count, self.base + self.count
            events = [self.driver.store(block, block - 1 if i else None)]
            self.held.add(block)
            if i % 3 == 2:  # an eviction now and then, so a continuation taken wrongly shows
                events.append(self.driver.remove(block - 2))
                self.held.discard(block - 2)
            await self.driver.publish(events, self.ts0 + i)
            self.count += 1


async def _follow(nats_url: str, worker: WorkerId, driver, wait_for: int | None = None) -> float | None:
    """Run ingest until it caught up with the engine (and KV_EVENTS holds `wait_for` batches); its check's time."""
    source = StreamSource(worker, driver.pub_endpoint, driver.replay_endpoint, Provenance.NATIVE)
    async with Bridge(settings_for(nats_url), [source]) as bridge:
        await bridge.wait_ready(timeout=15)
        if wait_for is not None:
            await wait_until(lambda: _holds(nats_url, worker, wait_for), 10, f"{wait_for} batches")
        await bridge.publisher.flush(10)
        return bridge.streams[0].incarnation_check_s


async def _first_incarnation_followed(nats_url: str, worker: WorkerId, driver) -> EngineLife:
    """ingest follows the engine's first incarnation for RESUME batches, then stops."""
    first = EngineLife(driver, OLD, 1_000_000.0)
    source = StreamSource(worker, driver.pub_endpoint, driver.replay_endpoint, Provenance.NATIVE)
    async with Bridge(settings_for(nats_url), [source]) as bridge:
        await bridge.wait_ready(timeout=15)
        await first.publish(RESUME)
        await wait_until(lambda: _holds(nats_url, worker, RESUME), 10, f"{RESUME} batches")
        await bridge.publisher.flush(10)
    return first


async def _holds(nats_url: str, worker: WorkerId, count: int) -> bool:
    return len(await read_stream(nats_url, subject=_subject(worker))) >= count


def _subject(worker: WorkerId) -> str:
    return f"kv.ev.{worker.publisher}.{worker.dp_rank}"


async def _ledger(nats_url: str, worker: WorkerId) -> tuple[list[EventBatch], InventoryFold]:
    fold, batches = InventoryFold(), []
    for stream_seq, _, data in await read_stream(nats_url, subject=_subject(worker)):
        batch = decode_batch(data)
        batches.append(batch)
        fold.apply(batch, stream_seq)
    return batches, fold


def _held(fold: InventoryFold, worker: WorkerId) -> set[int]:
    return {record.engine_hash for record in fold.records(worker, Provenance.NATIVE, Tier.DEVICE)}


def _gaps(batches: list[EventBatch]) -> list[tuple[int, int, Gap]]:
    return [(batch.epoch, batch.seq, event) for batch in batches for event in batch.events if isinstance(event, Gap)]


# (new incarnation's batches while ingest is away, the engine's replay buffer, restarted?) and what ingest must find
CASES = {
    # the new counter ends below the last seq ingest published (seq 11): a restart
    "restart_below": (RESUME - 3, 10_000, True, "restart"),
    # ... at that last seq: the engine holds another batch there
    "restart_at_last_seq": (RESUME, 10_000, True, "restart"),
    # ... at the seq ingest resumes at (the engine's seq 12 would be taken as the next one)
    "restart_at_resume_seq": (RESUME + 1, 10_000, True, "restart"),
    # ... well past it (the case seen with vLLM in issue 43)
    "restart_past": (RESUME + 25, 10_000, True, "restart"),
    # ... past it and past its buffer: seq 11 rotated out, nothing to compare: uncertain
    "restart_rotated": (RESUME + 20, SMALL_BUFFER, True, "uncertain"),
    # the engine went on: a continuation, no new epoch
    "continuation": (10, 10_000, False, "continuation"),
    # the engine went on past its buffer: what it no longer buffers is a gap, uncertain
    "continuation_rotated": (20, SMALL_BUFFER, False, "uncertain"),
}


@pytest.mark.parametrize("driver_kind", DRIVERS)
@pytest.mark.parametrize("case", CASES)
async def test_a_restart_while_ingest_was_away_is_found_by_content_never_taken_silently(
    nats_server, driver_kind: str, case: str,
) -> None:
    published, buffer_steps, restart, expected = CASES[case]
    worker = WorkerId(f"inc-{case.replace('_', '-')}-{driver_kind}")
    driver = DRIVERS[driver_kind](*engine_endpoints(), buffer_steps)
    await driver.start()
    try:
        first = await _first_incarnation_followed(nats_server.url, worker, driver)
        if restart:
            await driver.restart()
            engine = EngineLife(driver, NEW, 2_000_000.0)
        else:
            engine = first
        await engine.publish(published)
        started = time.perf_counter()
        check_s = await _follow(nats_server.url, worker, driver)
        caught_up_s = time.perf_counter() - started
    finally:
        await driver.stop()
    batches, fold = await _ledger(nats_server.url, worker)
    gaps = _gaps(batches)
    print(f"\n{driver_kind} {case}: incarnation check {check_s * 1000:.2f} ms; ingest start to caught up {caught_up_s:.2f} s")
    assert check_s is not None
    if expected == "restart":
        assert gaps[0] == (1, 0, Gap(RESUME, 0, GapReason.PUBLISHER_RESTART))
        assert [(b.epoch, b.seq) for b in batches] == [(0, s) for s in range(RESUME)] + [(1, s) for s in range(published)]
        assert len(gaps) == 1
        assert _held(fold, worker) == engine.held and not fold.is_uncertain(worker)
    elif expected == "continuation":
        assert gaps == [] and {b.epoch for b in batches} == {0}
        assert [b.seq for b in batches] == list(range(RESUME + published))
        assert _held(fold, worker) == engine.held and not fold.is_uncertain(worker)
    else:
        # The seqs cannot tell a rotated continuation from a restart: neither is claimed, the worker is uncertain.
        assert {b.epoch for b in batches} == {0}
        engine_next_seq = published if restart else RESUME + published
        assert [gap for *_, gap in gaps] == [Gap(RESUME - 1, engine_next_seq - SMALL_BUFFER, GapReason.REPLAY_INCOMPLETE)]
        assert fold.is_uncertain(worker)
    # never silently wrong: what the fold holds is the engine's truth, or the worker is uncertain
    assert _held(fold, worker) == engine.held or fold.is_uncertain(worker)


@pytest.mark.parametrize("driver_kind", DRIVERS)
async def test_a_restarted_engine_that_published_nothing_yet_is_cleared_at_once_and_resumed_after(
    nats_server, driver_kind: str,
) -> None:
    worker = WorkerId(f"inc-silent-{driver_kind}")
    driver = DRIVERS[driver_kind](*engine_endpoints(), 10_000)
    await driver.start()
    try:
        await _first_incarnation_followed(nats_server.url, worker, driver)
        await driver.restart()
        await _follow(nats_server.url, worker, driver, wait_for=RESUME + 1)
        batches, fold = await _ledger(nats_server.url, worker)
        # the old inventory is cleared now, not at the new engine's first batch
        assert is_restart_marker(batches[-1]) and (batches[-1].epoch, batches[-1].seq) == (0, RESUME)
        assert _held(fold, worker) == set() and not fold.is_uncertain(worker)
        second = EngineLife(driver, NEW, 2_000_000.0)
        await second.publish(4)
        # ingest restarted after the marker resumes at the new epoch's seq 0: no second restart
        await _follow(nats_server.url, worker, driver, wait_for=RESUME + 5)
    finally:
        await driver.stop()
    batches, fold = await _ledger(nats_server.url, worker)
    assert [(b.epoch, b.seq) for b in batches] == [(0, s) for s in range(RESUME + 1)] + [(1, s) for s in range(4)]
    assert len(_gaps(batches)) == 1
    assert _held(fold, worker) == second.held and not fold.is_uncertain(worker)


# --- the rules alone --------------------------------------------------------------------------

def _payload(ts: float, block: int) -> bytes:
    return encode_vllm_batch(ts, [one_block(block)], 0)


def _record(payload: bytes, seq: int = 7, gaps: tuple[Gap, ...] = ()) -> EventBatch:
    """What ingest published for `payload` at `seq`, as read back from KV_EVENTS."""
    decoded = decode_payload(payload)
    batch = EventBatch(WorkerId("w"), 0, seq, decoded.engine_ts, time.time(), Provenance.NATIVE, (*gaps, *decoded.events))
    return decode_batch(encode_batch(batch))


def test_the_canonical_batch_read_back_is_compared_by_the_engine_ts_and_events_not_ingests() -> None:
    payload = _payload(1_000.5, 42)
    assert same_engine_batch(_record(payload), payload, engine=Engine.VLLM, max_bytes=None) is True
    # ingest's own gaps and its ingest_ts are not the engine's
    gapped = _record(payload, gaps=(Gap(3, 7, GapReason.REPLAY_INCOMPLETE),))
    assert same_engine_batch(gapped, payload, engine=Engine.VLLM, max_bytes=None) is True
    # the same events at another time, or other events at the same time: another batch
    assert same_engine_batch(_record(payload), _payload(1_001.5, 42), engine=Engine.VLLM, max_bytes=None) is False
    assert same_engine_batch(_record(payload), _payload(1_000.5, 43), engine=Engine.VLLM, max_bytes=None) is False
    assert same_engine_batch(_record(payload), b"\xc1", engine=Engine.VLLM, max_bytes=None) is False
    # a record that kept nothing of the engine's batch cannot be compared
    lost = EventBatch(WorkerId("w"), 0, 7, 0.0, 0.0, Provenance.NATIVE, (Gap(7, 8, GapReason.STREAM_LOST),))
    assert same_engine_batch(lost, payload, engine=Engine.VLLM, max_bytes=None) is None
    undecodable = EventBatch(WorkerId("w"), 0, 7, 0.0, 0.0, Provenance.NATIVE, (Gap(7, 8, GapReason.MISSED),))
    assert same_engine_batch(undecodable, b"\xc1", engine=Engine.VLLM, max_bytes=None) is None


def test_the_verdict_table() -> None:
    same = {b"ours": True, b"theirs": False, b"blank": None}.get
    assert judge(11, [(11, b"ours"), (12, b"x")], True, same).incarnation is Incarnation.CONTINUATION
    assert judge(11, [(11, b"theirs"), (12, b"x")], True, same).incarnation is Incarnation.RESTART
    assert judge(11, [], True, same).incarnation is Incarnation.RESTART  # the engine's newest seq is below 11
    assert judge(11, [(11, b"blank")], True, same).incarnation is Incarnation.UNVERIFIED
    rotated = judge(11, [(12, b"x"), (13, b"y")], True, same)
    assert (rotated.incarnation, rotated.first) == (Incarnation.UNVERIFIED, 12)
    assert judge(11, [], False, same).incarnation is Incarnation.UNVERIFIED  # no answer in time
    assert judge(11, [(11, b"ours")], False, same).incarnation is Incarnation.CONTINUATION


def test_the_check_costs_one_batch_decoded_and_compared() -> None:
    payload = encode_vllm_batch(1_000.5, [one_block(block, parent=block - 1 if block else None) for block in range(16)], 0)
    record = _record(payload)
    runs = 2000
    seconds = timeit.timeit(lambda: same_engine_batch(record, payload, engine=Engine.VLLM, max_bytes=None), number=runs)
    print(f"\ncomparing a 16-block batch with its canonical record: {seconds / runs * 1e6:.1f} µs")
    assert seconds / runs < 0.005
