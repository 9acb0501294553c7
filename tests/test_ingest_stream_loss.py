"""ingest re-fetches what KV_EVENTS acknowledged and then lost (issue 31), against a real nats-server.

JetStream acknowledges before it fsyncs, so an OS crash or a power loss keeps only what had
reached the disk, and later messages reuse the lost stream seqs. Modelled here on a local
server: its store folder copied while it is paused (what was on disk), more traffic
acknowledged, then the server SIGKILLed, the copy put back and the server started again on
the same port. What the copy cannot show: a real crash loses what the kernel had not
written back, which may not be a clean tail of every file.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from pathlib import Path

import nats
import nats.js.errors
import pytest

from engines import engine_endpoints, one_block, read_batches, read_stream, settings_for, wait_until
from kvledger.core.events import Gap, GapReason, Provenance, WorkerId
from kvledger.ingest.bridge import Bridge
from kvledger.ingest.endpoints import StreamSource
from kvledger.ingest.sequence import Emit
from kvledger.ingest.stream_repair import AckedPositions, Loss, LostBatch, LostRun, plan_repair
from kvledger.runtime.streams import dead_letters_stream, ensure_stream, events_stream
from kvledger.sim.engine import SimulatedEngine
from services import copy_nats_store, restore_nats_store


def source(name: str, engine: SimulatedEngine) -> StreamSource:
    return StreamSource(WorkerId(name), engine.pub_endpoint, engine.replay_endpoint, Provenance.NATIVE)


async def publish_rounds(engines: list[SimulatedEngine], rounds: range, pause_s: float = 0.0) -> None:
    for block in rounds:
        for engine in engines:
            await engine.publish([one_block(block)])
        if block % 50 == 0:
            await asyncio.sleep(pause_s)  # let ingest read while the engines run


async def _read_when_available(url: str, subject: str):
    """The subject's batches; a cluster node just restarted may answer 503 for a moment."""
    for attempt in range(50):
        try:
            return await read_batches(url, subject)
        except nats.js.errors.ServiceUnavailableError:
            await asyncio.sleep(0.1)
    return await read_batches(url, subject)


async def _last_seq_is(url: str, name: str, seq: int) -> bool:
    batches = await _read_when_available(url, f"kv.ev.{name}.0")
    return bool(batches) and batches[-1].seq == seq


def gaps_of(batches) -> list[Gap]:
    return [event for batch in batches for event in batch.events if isinstance(event, Gap)]


async def acked_around_a_copy(bridge: Bridge, engines, nats_server, on_disk: Path, kept: int, lost: int) -> None:
    """`kept` rounds acknowledged, the server's store copied to `on_disk`, then `lost` more rounds acknowledged."""
    await bridge.wait_ready(timeout=10)
    await publish_rounds(engines, range(kept))
    await wait_until(lambda: bridge.publisher.counters.published >= 2 * kept, 10, "the first batches acked")
    copy_nats_store(nats_server, on_disk)
    await publish_rounds(engines, range(kept, kept + lost))
    await wait_until(lambda: bridge.publisher.counters.published >= 2 * (kept + lost), 10, "the rest acked")
    await bridge.publisher.flush(10)


async def test_batches_the_stream_lost_are_fetched_again_and_republished_in_order(nats_server, tmp_path) -> None:
    """Traffic goes on through the crash: what ingest buffered meanwhile goes out after the repair."""
    kept, lost, after = 200, 300, 1000
    engines = [await SimulatedEngine(*engine_endpoints()).__aenter__() for _ in range(2)]
    names = ["vllm-a", "vllm-b"]
    try:
        async with Bridge(settings_for(nats_server.url), [source(n, e) for n, e in zip(names, engines)]) as bridge:
            await acked_around_a_copy(bridge, engines, nats_server, tmp_path / "on-disk", kept, lost)
            traffic = asyncio.create_task(publish_rounds(engines, range(kept + lost, kept + lost + after), 0.05))
            await asyncio.to_thread(restore_nats_store, nats_server, tmp_path / "on-disk")
            restored = time.monotonic()
            await wait_until(lambda: bridge.metrics.stream_repaired.value > 0, 10, "the repair")
            found_in = time.monotonic() - restored
            await traffic
            for name in names:
                await wait_until(lambda: _last_seq_is(nats_server.url, name, kept + lost + after - 1), 10, f"{name}'s last batch")
            repaired = bridge.metrics.stream_repaired.value
            assert bridge.publisher.counters.reconnects >= 1
            assert bridge.metrics.stream_lost.value == 0
        messages = await read_stream(nats_server.url)
        for name, engine in zip(names, engines):
            batches = await read_batches(nats_server.url, f"kv.ev.{name}.0")
            # Every batch the engine buffers, once, in the engine's order, without a gap.
            assert [b.seq for b in batches] == engine.buffered_seqs == list(range(kept + lost + after))
            assert gaps_of(batches) == []
        # At least everything acknowledged after the copy was lost (and a last few before it
        # that had not reached the disk when it was taken).
        assert 2 * lost <= repaired <= 2 * (kept + lost)
        stream_seqs = [seq for seq, _, _ in messages]
        assert stream_seqs == sorted(stream_seqs) and len(set(stream_seqs)) == len(stream_seqs)
        print(f"\nlost {repaired:.0f} acknowledged batches; found and queued first {found_in:.2f} s after the server "
              "answered again (the publisher's reconnect backoff included)")
    finally:
        for engine in engines:
            await engine.close()


async def test_what_no_engine_buffers_any_more_is_an_explicit_stream_lost_gap(nats_server, tmp_path) -> None:
    kept, lost, after, short = 100, 300, 20, 50
    short_memory = await SimulatedEngine(*engine_endpoints(), buffer_steps=short).__aenter__()
    forgetful = await SimulatedEngine(*engine_endpoints()).__aenter__()
    engines = [short_memory, forgetful]
    try:
        sources = [source("short", short_memory), source("forgetful", forgetful)]
        async with Bridge(settings_for(nats_server.url), sources) as bridge:
            await acked_around_a_copy(bridge, engines, nats_server, tmp_path / "on-disk", kept, lost)
            forgetful.shrink_replay_buffer(0)  # it buffers nothing any more
            restore_nats_store(nats_server, tmp_path / "on-disk")
            await wait_until(lambda: bridge.metrics.stream_lost.value > 0, 10, "the stream check")
            await bridge.publisher.flush(10)
            await publish_rounds(engines, range(kept + lost, kept + lost + after))
            for name in ("short", "forgetful"):
                await wait_until(lambda: _last_seq_is(nats_server.url, name, kept + lost + after - 1), 10, f"{name}'s last batch")
            stream_lost = bridge.metrics.stream_lost.value
            repaired = bridge.metrics.stream_repaired.value
            gap_metric = bridge.metrics.gaps.labels(GapReason.STREAM_LOST.value).value
        end = kept + lost + after

        # The short-memory engine: what it still buffered is repaired, what it did not is one Gap before it.
        batches = await read_batches(nats_server.url, "kv.ev.short.0")
        seqs = [b.seq for b in batches]
        first_lost = seqs.index(kept + lost - short)  # the first batch its buffer still had at the check
        survived = seqs[:first_lost]
        assert survived == list(range(len(survived))) and len(survived) <= kept
        assert seqs[first_lost:] == list(range(kept + lost - short, end))
        assert gaps_of(batches) == [Gap(len(survived), kept + lost - short, GapReason.STREAM_LOST)]
        assert batches[first_lost].events[0] == Gap(len(survived), kept + lost - short, GapReason.STREAM_LOST)
        assert len(batches[first_lost].events) > 1, "the repaired batch keeps its own events after the gap"

        # The engine that buffers nothing: one batch stands for the lost range, under the last lost seq's identity.
        batches = await read_batches(nats_server.url, "kv.ev.forgetful.0")
        seqs = [b.seq for b in batches]
        stand_in = seqs.index(kept + lost - 1)
        assert seqs[:stand_in] == list(range(stand_in)) and stand_in <= kept
        assert seqs[stand_in:] == list(range(kept + lost - 1, end))
        assert batches[stand_in].events == (Gap(stand_in, kept + lost, GapReason.STREAM_LOST),)
        assert batches[stand_in].msg_id == f"forgetful:0:0:{kept + lost - 1}"
        assert gaps_of(batches) == [Gap(stand_in, kept + lost, GapReason.STREAM_LOST)]

        assert repaired == short
        assert stream_lost == (kept + lost - short - first_lost) + (kept + lost - stand_in)
        assert gap_metric == 2
    finally:
        for engine in engines:
            await engine.close()


@pytest.mark.parametrize("found_by", ["periodic check", "first write after a quiet spell"])
async def test_a_loss_under_a_connection_that_stays_up_is_repaired_before_anything_newer(
    nats_cluster, tmp_path, found_by: str,
) -> None:
    """A 3-node cluster, KV_EVENTS on one node (R1), ingest connected to another: the node
    holding the stream loses its acknowledged tail while ingest is idle, and ingest's own
    connection never breaks. The periodic check finds it; or, when traffic resumes before
    that check is due, the check before the first write after a quiet spell does."""
    kept, lost, after = 100, 200, 100
    provisioning = settings_for(nats_cluster.urls)
    nc = await nats.connect(nats_cluster.url_list)
    try:
        for spec in (events_stream(provisioning.stream), dead_letters_stream(provisioning.stream)):
            await ensure_stream(nc.jetstream(), spec)
    finally:
        await nc.close()
    holder = nats_cluster.nodes[await nats_cluster.stream_leader("KV_EVENTS")]
    elsewhere = next(node for node in nats_cluster.nodes.values() if node is not holder)
    interval = 0.5 if found_by == "periodic check" else 600.0
    settings = settings_for(elsewhere.url, **{"ingest.stream_check_interval_s": interval})
    engines = [await SimulatedEngine(*engine_endpoints()).__aenter__() for _ in range(2)]
    names = ["vllm-a", "vllm-b"]
    try:
        async with Bridge(settings, [source(n, e) for n, e in zip(names, engines)]) as bridge:
            await bridge.wait_ready(timeout=10)
            await publish_rounds(engines, range(kept))
            await bridge.publisher.flush(10)
            os.kill(holder._process.pid, signal.SIGSTOP)
            try:
                shutil.copytree(holder.store_dir, tmp_path / "on-disk")
            finally:
                os.kill(holder._process.pid, signal.SIGCONT)
            await publish_rounds(engines, range(kept, kept + lost))
            await wait_until(lambda: bridge.publisher.counters.published >= 2 * (kept + lost), 10, "the rest acked")
            await bridge.publisher.flush(10)
            reconnects = bridge.publisher.counters.reconnects
            crashed = time.monotonic()
            holder.kill()
            shutil.rmtree(holder.store_dir)
            shutil.copytree(tmp_path / "on-disk", holder.store_dir)
            await nats_cluster.restart_async(holder.name)
            restarted_in = time.monotonic() - crashed
            if found_by == "periodic check":
                await wait_until(lambda: bridge.metrics.stream_repaired.value > 0, 15, "the periodic check's repair")
            await publish_rounds(engines, range(kept + lost, kept + lost + after))
            await wait_until(lambda: bridge.metrics.stream_repaired.value > 0, 15, "the repair")
            await bridge.publisher.flush(10)
            repaired_in = time.monotonic() - crashed - restarted_in
            for name in names:
                await wait_until(
                    lambda: _last_seq_is(elsewhere.url, name, kept + lost + after - 1), 15, f"{name}'s last batch",
                )
            assert bridge.publisher.counters.reconnects == reconnects, "ingest's connection stayed up"
            repaired = bridge.metrics.stream_repaired.value
        for name in names:
            batches = await _read_when_available(elsewhere.url, f"kv.ev.{name}.0")
            assert [b.seq for b in batches] == list(range(kept + lost + after)), "every batch once, in engine order"
            assert gaps_of(batches) == []
        assert 2 * lost <= repaired <= 2 * (kept + lost)
        print(f"\n{found_by}: lost {repaired:.0f} acknowledged batches; node back {restarted_in:.2f} s after the crash, "
              f"repaired and acknowledged {repaired_in:.2f} s after that")
    finally:
        for engine in engines:
            await engine.close()


# --- the rules alone, without sockets ---------------------------------------------------


def _acked(positions: AckedPositions, epoch: int, seqs: range, first_stream_seq: int) -> None:
    for offset, seq in enumerate(seqs):
        positions.acked(epoch, seq, first_stream_seq + offset)


def _stream(holds: dict[int, tuple[int, int]]):
    """`held` and `last_held` of a stream holding (epoch, seq) at each stream seq of `holds`."""

    async def held(position) -> bool:
        return holds.get(position[2]) == position[:2]

    async def last_held():
        if not holds:
            return None
        stream_seq = max(holds)
        return (*holds[stream_seq], stream_seq)

    return held, last_held


async def test_the_first_lost_batch_is_found_by_binary_search_and_the_ring_forgets_from_there() -> None:
    positions = AckedPositions()
    _acked(positions, 0, range(10), 100)
    held, last_held = _stream({100 + seq: (0, seq) for seq in range(5)})
    assert await positions.find_loss(held, last_held) == Loss((LostRun(0, 5, 10),))
    assert len(positions) == 5 and positions.last == (0, 4, 104)
    assert await positions.find_loss(held, last_held) is None  # what is left is held


async def test_a_loss_beyond_the_ring_starts_after_the_last_message_on_the_subject() -> None:
    positions = AckedPositions(limit=4)
    _acked(positions, 0, range(10), 100)  # the ring keeps seqs 6-9
    held, last_held = _stream({100 + seq: (0, seq) for seq in range(3)})
    assert await positions.find_loss(held, last_held) == Loss((LostRun(0, 3, 10),), reaches_back=False)


async def test_after_the_stream_went_back_only_what_was_acked_before_is_checked() -> None:
    positions = AckedPositions()
    _acked(positions, 0, range(5), 100)
    positions.stream_went_back()  # seqs 3 and 4 are lost; 5 and 6 take their stream seqs
    _acked(positions, 0, range(5, 7), 103)
    holds = {100: (0, 0), 101: (0, 1), 102: (0, 2), 103: (0, 5), 104: (0, 6)}
    assert await positions.find_loss(*_stream(holds)) == Loss((LostRun(0, 3, 5),))
    assert positions.last == (0, 2, 102)


async def test_lost_runs_keep_epochs_apart_and_skip_seqs_never_published() -> None:
    positions = AckedPositions()
    for epoch, seq, stream_seq in [(0, 7, 1), (0, 8, 2), (0, 9, 3), (0, 12, 4), (1, 0, 5), (1, 1, 6)]:
        positions.acked(epoch, seq, stream_seq)
    loss = await positions.find_loss(*_stream({1: (0, 7)}))
    assert loss.runs == (LostRun(0, 8, 10), LostRun(0, 12, 13), LostRun(1, 0, 2))
    assert loss.batches == 5 and loss.describe() == "epoch 0 seqs 8-9, epoch 0 seq 12, epoch 1 seqs 0-1"


def test_a_repair_takes_what_the_engine_buffers_and_gaps_the_rest() -> None:
    restart = (Gap(10, 0, GapReason.PUBLISHER_RESTART),)
    loss = Loss((LostRun(0, 8, 11), LostRun(1, 0, 6)))
    replayed = [(seq, b"p%d" % seq) for seq in (2, 3, 4, 5, 6)]  # epoch 1 from seq 2 on; 0 and 1 are gone
    not_ours = {4}  # replay under seq 4 is not what was published under it
    repair = plan_repair(
        loss, 1, replayed, lambda seq, payload: seq not in not_ours, lambda epoch, seq: restart if (epoch, seq) == (1, 0) else (),
    )
    assert repair.batches == (
        LostBatch(0, 10, Gap(8, 11, GapReason.STREAM_LOST)),  # the old epoch: nothing of it is buffered
        Emit(1, 2, b"p2", (Gap(0, 2, GapReason.STREAM_LOST),)),
        Emit(1, 3, b"p3", ()),
        Emit(1, 5, b"p5", (Gap(4, 5, GapReason.STREAM_LOST),)),
    )
    assert (repair.repaired, repair.lost) == (3, 6)
    # A lost batch that carried gaps carries them again.
    again = plan_repair(Loss((LostRun(1, 0, 1),)), 1, [(0, b"p0")], lambda *_: True, lambda epoch, seq: restart)
    assert again.batches == (Emit(1, 0, b"p0", restart),)
