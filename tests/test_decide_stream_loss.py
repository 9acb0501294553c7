"""decide when KV_EVENTS loses acknowledged messages (issue 31): it notices and rebuilds from what the stream reproduces.

The loss is made as a crash makes it: nats-server's store folder is copied while the server
is paused (what was on disk), traffic goes on and is acknowledged, then the server is
SIGKILLed, the copy put back and the server restarted on the same port. Later publishes
reuse the lost stream seqs.
"""

from __future__ import annotations

import json
import time

import nats
import pytest

import services
from builders import BLOCK_SIZE, Stream, local_hashes, publish, removed, stored
from engines import wait_until
from kvledger.core.decision_codec import decision_to_json
from kvledger.core.events import WorkerId, decode_batch
from kvledger.core.fold import InventoryFold
from kvledger.core.reuse import ReuseRequest, decide
from kvledger.runtime.streams import (
    DECIDE_SUBJECT, SNAPSHOTS_BUCKET, decisions_stream, ensure_stream, events_stream, snapshot_object_name,
)
from kvledger.core.settings import load_settings
from kvledger.core.snapshot import StreamPosition, encode_snapshot

from kvledger.decide.serving.service import DecideService
from kvledger.decide.serving.stream_check import stream_regression

pytestmark = pytest.mark.service

W1, W2, W3, W4 = (WorkerId(f"w{number}") for number in range(1, 5))
GHOST = WorkerId("ghost")  # announced only by a lost batch (and snapshots that must be refused)
DEADLINE_S = 20.0
TARGETS = ("w1", "w2", "w3", "w4", "ghost", None)


def settings_for(url: str):
    return load_settings(environ={}, overrides={
        "nats.url": url, "decide.http_port": 0, "decide.backend": "cpu",
        "reuse.enable_decode_to_prefill_gpu_reuse": True, "reuse.enable_decode_to_prefill_reuse": True,
        "reuse.transfer_source_prefill_token_us": 1000.0, "reuse.transfer_source_lookup_budget_ms": 1e9,
    }).settings


def scenario() -> tuple[list, list, list]:
    """Batches kept by the crash, batches it loses, and those the engines send after it (their seqs go on)."""
    stream = Stream()
    kept = [
        stream.batch(W1, stored(list(range(1, 9)))),
        stream.batch(W2, stored([1, 2, 3, 4])),
        stream.batch(W3, stored([1, 2, 3, 4, 5, 6])),
        stream.batch(W2, stored([5, 6], parent=4)),
    ]
    lost = [
        stream.batch(W1, removed([5, 6, 7, 8])),
        stream.batch(W2, stored([7, 8, 9, 10], parent=6)),
        stream.batch(W3, removed([3, 4, 5, 6])),
        stream.batch(GHOST, stored(list(range(1, 13)))),
        stream.batch(W2, removed([1, 2])),
        stream.batch(W3, stored([20, 21])),
    ]
    after = [
        stream.batch(W1, stored([9, 10, 11, 12], parent=8)),
        stream.batch(W4, stored(list(range(1, 13)))),
        stream.batch(W2, stored([11, 12], parent=10)),
        stream.batch(W3, removed([1, 2])),
        stream.batch(W4, removed([10, 11, 12])),
        stream.batch(W1, removed([12])),
        stream.batch(W2, stored([30])),
        stream.batch(W3, stored([7, 8], parent=6)),
        stream.batch(W4, stored([10, 11], parent=9)),
    ]
    return kept, lost, after


async def streams_holding(js, settings, batches) -> None:
    """KV_EVENTS holding `batches`, and KV_DECISIONS made for decide to record its answers in."""
    await ensure_stream(js, events_stream(settings.stream))
    await ensure_stream(js, decisions_stream(settings.stream))
    await publish(js, batches)


async def fold_of_the_stream(js, stream: str) -> InventoryFold:
    """The reference: every message KV_EVENTS holds now, folded in stream order at its stream seq."""
    state = (await js.stream_info(stream)).state
    fold = InventoryFold()
    for seq in range(state.first_seq, state.last_seq + 1):
        fold.apply(decode_batch((await js.get_msg(stream, seq)).data), seq)
    return fold


def requests() -> list[ReuseRequest]:
    return [ReuseRequest(f"r-{n}-{target}", local_hashes(list(range(1, blocks + 1))), BLOCK_SIZE,
                         WorkerId.parse(target) if target else None)
            for n, blocks in enumerate((3, 8, 12)) for target in TARGETS]


def body(request: ReuseRequest) -> bytes:
    return json.dumps({"request_id": request.request_id, "local_hashes": [str(h) for h in request.local_hashes],
                       "block_size": request.block_size,
                       "target": request.target.name if request.target else None}).encode()


async def answers_of(nc, service: DecideService, at_seq: int) -> list[dict]:
    """decide's answers over NATS once the index stands at `at_seq`."""
    await wait_until(lambda: service.ready and service.index.inventory_seq == at_seq, DEADLINE_S,
                     f"decide ready at inventory_seq {at_seq}", interval=0.01)
    return [json.loads((await nc.request(DECIDE_SUBJECT, body(request), timeout=10)).data) for request in requests()]


def _names_ghost(answer: dict) -> bool:
    """Whether an answer (to a request not naming it) knows the worker only a lost batch announced."""
    return not answer["request_id"].endswith("-ghost") and "ghost" in json.dumps(answer)


def reference_answers(fold: InventoryFold, settings) -> list[dict]:
    return [decision_to_json(decide(fold, request, settings.reuse, backend="cpu")) for request in requests()]


async def put_snapshot(js, name_seq: int, batches, position: StreamPosition | None, inventory_seq: int | None = None):
    """A snapshot object as store writes one: the fold of `batches`, where the stream stood, named by its ledger seq."""
    fold = InventoryFold()
    fold.apply_all(batches)
    if inventory_seq is not None:
        fold.inventory_seq = inventory_seq
    try:
        bucket = await js.object_store(SNAPSHOTS_BUCKET)
    except Exception:
        bucket = await js.create_object_store(SNAPSHOTS_BUCKET)
    await bucket.put(snapshot_object_name(name_seq), encode_snapshot(fold, position))
    return bucket


@pytest.mark.parametrize("traffic_after", [True, False], ids=["seqs-reused", "stream-shorter"])
async def test_decide_notices_the_stream_losing_its_tail_and_answers_as_the_stream_now_is(
    nats_server, tmp_path, traffic_after: bool,
) -> None:
    settings = settings_for(nats_server.url)
    stream_name = settings.stream.events_stream
    kept, lost, after = scenario()
    if not traffic_after:
        after = []
    async with await nats.connect(nats_server.url) as nc:
        js = nc.jetstream()
        await streams_holding(js, settings, kept)  # the decisions stream in the copy too: decide records answers there
        # A snapshot the crash keeps (valid after it), and one standing at the last lost message.
        await put_snapshot(js, len(kept), kept, StreamPosition(len(kept), kept[-1][0].msg_id))
        await put_snapshot(js, len(kept) + len(lost), kept + lost,
                           StreamPosition(len(kept) + len(lost), lost[-1][0].msg_id))
        on_disk = services.copy_nats_store(nats_server, tmp_path / "on-disk")

    async with DecideService(settings) as service:
        assert service.started_from == snapshot_object_name(len(kept))  # the other stands past the stream
        async with await nats.connect(nats_server.url) as nc:
            js = nc.jetstream()
            await publish(js, lost)
            before_loss = await answers_of(nc, service, len(kept) + len(lost))
        assert any(_names_ghost(answer) for answer in before_loss)

        services.restore_nats_store(nats_server, on_disk)
        restarted = time.monotonic()
        async with await nats.connect(nats_server.url) as nc:
            js = nc.jetstream()
            assert (await js.stream_info(stream_name)).state.last_seq == len(kept)
            await publish(js, after)  # reuses the lost seqs, and goes past where decide stood
            await wait_until(lambda: service.last_regression is not None, DEADLINE_S, "decide noticing the loss",
                             interval=0.005)
            detected = time.monotonic()
            answers = await answers_of(nc, service, len(kept) + len(after))
            caught_up = time.monotonic()
            fold = await fold_of_the_stream(js, stream_name)

    # Rebuilt from the snapshot the stream still reproduces; the one at the lost message refused.
    assert service.started_from == snapshot_object_name(len(kept))
    assert service.metrics.stream_regressions.value == 1
    regression = service.last_regression
    assert regression.applied == StreamPosition(len(kept) + len(lost), lost[-1][0].msg_id)
    if traffic_after:
        assert (regression.last_seq, regression.found_msg_id) == (len(kept) + len(after), after[len(lost) - 1][0].msg_id)
    else:
        assert (regression.last_seq, regression.found_msg_id) == (len(kept), None)
    assert answers == reference_answers(fold, settings)
    assert not any(_names_ghost(answer) for answer in answers)
    # What decide answered before this work: the lost tail kept, the reused seqs dropped as redelivered.
    stale = InventoryFold()
    stale.apply_all(kept + lost)
    stale.apply_all((batch, len(kept) + n + 1) for n, (batch, _) in enumerate(after))
    assert reference_answers(stale, settings) != answers
    print(f"\nloss -> detected {detected - restarted:.3f} s ({regression.describe()}); "
          f"-> rebuilt and caught up {caught_up - restarted:.3f} s (rebuild {service.rebuilt_after_s:.3f} s)")


async def test_a_consumer_resuming_on_reused_seqs_is_caught_by_the_position_before_it(
    nats_server, tmp_path, monkeypatch,
) -> None:
    """With no reconnect check and no periodic check in time, the ordered consumer re-created after the
    restart delivers the new messages at the reused seqs first; checking where the index then
    stands would compare a new message with itself. The position before the consumer resumed is checked."""
    from kvledger.decide.serving import service as decide_service

    async def nothing(self) -> None:
        return None

    monkeypatch.setattr(decide_service, "STREAM_CHECK_INTERVAL_S", 60.0)
    monkeypatch.setattr(DecideService, "_on_reconnected", nothing)
    monkeypatch.setattr(DecideService, "_on_disconnected", nothing)
    settings = settings_for(nats_server.url)
    stream_name = settings.stream.events_stream
    kept, lost, after = scenario()
    async with await nats.connect(nats_server.url) as nc:
        js = nc.jetstream()
        await streams_holding(js, settings, kept)
        on_disk = services.copy_nats_store(nats_server, tmp_path / "on-disk")
    async with DecideService(settings) as service:
        async with await nats.connect(nats_server.url) as nc:
            await publish(nc.jetstream(), lost)
            await answers_of(nc, service, len(kept) + len(lost))
        services.restore_nats_store(nats_server, on_disk)
        restarted = time.monotonic()
        async with await nats.connect(nats_server.url) as nc:
            js = nc.jetstream()
            await publish(js, after)
            await wait_until(lambda: service.last_regression is not None, DEADLINE_S, "decide noticing", interval=0.005)
            detected = time.monotonic()
            answers = await answers_of(nc, service, len(kept) + len(after))
            assert answers == reference_answers(await fold_of_the_stream(js, stream_name), settings)
    assert service.last_regression.applied == StreamPosition(len(kept) + len(lost), lost[-1][0].msg_id)
    print(f"\nloss -> detected by the consumer's resumption alone {detected - restarted:.3f} s")


async def test_the_periodic_check_notices_a_stream_gone_backwards_without_a_reconnect(nats_server) -> None:
    """KV_EVENTS deleted and made again under a connected decide (as a cluster's new leader with an
    old copy would present it): no reconnect, so the check every 2 s finds it."""
    settings = settings_for(nats_server.url)
    stream_name = settings.stream.events_stream
    kept, lost, after = scenario()
    async with await nats.connect(nats_server.url) as nc:
        js = nc.jetstream()
        await streams_holding(js, settings, kept + lost)
        async with DecideService(settings) as service:
            await answers_of(nc, service, len(kept) + len(lost))
            await js.delete_stream(stream_name)
            await ensure_stream(js, events_stream(settings.stream))
            replaced = time.monotonic()
            await publish(js, after[:3])
            await wait_until(lambda: service.last_regression is not None, DEADLINE_S, "decide noticing", interval=0.005)
            detected = time.monotonic()
            answers = await answers_of(nc, service, 3)
            assert answers == reference_answers(await fold_of_the_stream(js, stream_name), settings)
            assert service.started_from is None and service.last_regression.last_seq == 3
            assert detected - replaced < 2.0 + 1.0  # one check interval, and slack for a busy machine
    print(f"\nstream replaced -> detected {detected - replaced:.3f} s; rebuild {service.rebuilt_after_s:.3f} s")


async def test_a_snapshot_whose_position_the_stream_no_longer_holds_is_refused(nats_server) -> None:
    settings = settings_for(nats_server.url)
    kept, lost, _ = scenario()
    async with await nats.connect(nats_server.url) as nc:
        js = nc.jetstream()
        await streams_holding(js, settings, kept)
        ghost = [(lost[3][0], len(kept))]
        # Named by ledger seqs, which run ahead of stream seqs once store has seen a loss.
        bucket = await put_snapshot(js, 1002, kept[:2], StreamPosition(2, kept[1][0].msg_id), inventory_seq=1002)
        await put_snapshot(js, 2003, kept[:2] + ghost, StreamPosition(3, "a-lost-message"), inventory_seq=2003)
        await put_snapshot(js, 2009, kept[:2] + ghost, None, inventory_seq=9)  # from before positions: past the end
        reference = reference_answers(await fold_of_the_stream(js, settings.stream.events_stream), settings)

        async with DecideService(settings) as service:
            assert service.started_from == snapshot_object_name(1002)
            # It stands at the snapshot's stream seq, not its ledger seq, so seqs 3-4 are followed.
            assert await answers_of(nc, service, len(kept)) == reference

        await bucket.delete(snapshot_object_name(1002))
        async with DecideService(settings) as service:
            assert service.started_from is None  # none left to trust: replayed from the stream's first seq
            assert await answers_of(nc, service, len(kept)) == reference
            assert service.metrics.stream_regressions.value == 0


async def test_the_position_check_names_what_the_stream_lost(nats_server) -> None:
    settings = settings_for(nats_server.url)
    stream = settings.stream.events_stream
    kept, _, _ = scenario()
    async with await nats.connect(nats_server.url) as nc:
        js = nc.jetstream()
        await streams_holding(js, settings, kept)
        held = kept[2][0].msg_id
        assert await stream_regression(js, stream, StreamPosition(3, held)) is None
        assert await stream_regression(js, stream, StreamPosition(3, "")) is None  # an old snapshot's: the seq alone
        assert await stream_regression(js, stream, StreamPosition(0, "")) is None
        past = await stream_regression(js, stream, StreamPosition(7, "x"))
        assert (past.last_seq, past.found_msg_id) == (4, None)
        assert "last seq is 4" in past.describe() and "inventory_seq 7" in past.describe()
        other = await stream_regression(js, stream, StreamPosition(3, "another"))
        assert other.found_msg_id == held and repr(held) in other.describe()
        await js.purge_stream(stream, seq=4)  # retention, not loss: seqs below 4 aged out
        assert await stream_regression(js, stream, StreamPosition(2, "gone")) is None


def test_scenario_messages_are_distinct() -> None:
    kept, lost, after = scenario()
    ids = [batch.msg_id for batch, _ in kept + lost + after]
    assert len(set(ids)) == len(ids)
    assert len(after) > len(lost)  # the new messages go past where decide stood: only the Msg-Id can tell


def test_a_backend_switched_to_a_rebuilt_index_answers_as_one_made_for_it() -> None:
    """`use_index`: what a rebuild relies on. On cuda the device copy is replaced whole, though the
    new index's generation and shapes may equal the old one's."""
    import attrs

    from kvledger.decide.ranking.backend import choose_backend
    from kvledger.decide.ranking.cpu import CpuBackend
    from kvledger.decide.inventory.index import index_from_batches

    kept, lost, after = scenario()
    followed = index_from_batches(kept + lost)
    rebuilt = index_from_batches(kept + [(batch, len(kept) + n + 1) for n, (batch, _) in enumerate(after)])
    reuse = settings_for("nats://127.0.0.1:4222").reuse
    backend, _ = choose_backend("auto", followed)

    def answers() -> list:
        return [attrs.evolve(answer, backend="cpu") for answer in backend.decide_batch(requests(), reuse)]

    try:
        assert answers() == CpuBackend(followed).decide_batch(requests(), reuse)  # on cuda: now on the device
        backend.use_index(rebuilt)
        assert answers() == CpuBackend(rebuilt).decide_batch(requests(), reuse)
        assert answers() != CpuBackend(followed).decide_batch(requests(), reuse)
    finally:
        backend.close()


async def test_decide_closes_cleanly_while_its_connection_is_reconnecting(nats_server) -> None:
    """A test or a shutdown may end while nats-server is being restored: drain is refused then."""
    service = DecideService(settings_for(nats_server.url))
    async with service:
        await service.wait_ready(DEADLINE_S)
        nats_server.kill()
        await wait_until(lambda: service._nc.is_reconnecting, DEADLINE_S, "decide reconnecting", interval=0.01)
    assert service._nc is None
