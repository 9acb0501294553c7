"""Store's consumer: one that delivers past messages the stream still holds is rewound to the checkpoint.

After a leader change in a NATS cluster, a durable consumer can resume past messages that
were delivered but never acknowledged; with AckPolicy.ALL the next ack would acknowledge
them unread and the fold would report a hole for data the stream holds. Here the durable
consumer is replaced under a running store by one that starts ten messages later, which
is what the store sees then.
"""

from __future__ import annotations

import time

import nats
import pytest
import sqlalchemy as sa
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from builders import BLOCK_SIZE, local_hashes
from kvledger.core.events import EventBatch, Provenance, Stored, Tier, WorkerId
from kvledger.store import database, tables
from kvledger.store.jetstream import _FAST_FETCH_ATTRIBUTES, fetch, first_gap, stream_seq
from kvledger.store.projector import EVENTS_DURABLE
from store_harness import RunningStore, checkpoint, publish, store_settings

pytestmark = pytest.mark.service

WORKER = WorkerId("skip-w1")


def batches(first_seq: int, count: int) -> list[EventBatch]:
    """One store of a fresh block per batch, consecutive engine seqs from `first_seq`."""
    return [
        EventBatch(WORKER, 0, seq, 1000.0 + seq, 1000.0 + seq, Provenance.NATIVE,
                   (Stored(Tier.DEVICE, (10_000 + seq,), None, BLOCK_SIZE, local_hashes([seq])),))
        for seq in range(first_seq, first_seq + count)
    ]


def ledger(url: str) -> tuple[int, int]:
    """(event_log rows of the worker, uncertain periods of the worker)."""
    with database.opened(url) as engine, engine.connect() as connection:
        events = connection.execute(sa.select(sa.func.count()).select_from(tables.event_log)
                                    .where(tables.event_log.c.publisher == WORKER.publisher)).scalar_one()
        uncertain = connection.execute(sa.select(sa.func.count()).select_from(tables.uncertain_periods)
                                       .where(tables.uncertain_periods.c.publisher == WORKER.publisher)).scalar_one()
    return events, uncertain


def test_a_gap_is_found_after_the_checkpoint_only() -> None:
    assert first_gap([5, 6, 7], 4) is None
    assert first_gap([3, 4, 5, 6], 4) is None  # redeliveries at or below the checkpoint
    assert first_gap([15, 16], 4) == (5, 15)
    assert first_gap([5, 6, 9], 4) == (7, 9)
    assert first_gap([], 4) is None


async def test_a_consumer_resuming_past_held_messages_is_rewound_and_nothing_is_uncertain(
        nats_server, sqlite_url) -> None:
    with database.opened(sqlite_url) as engine:
        database.upgrade(engine)
    settings = store_settings(nats_server.url, sqlite_url, batch_size=8)
    first = await publish(nats_server.url, batches(0, 100), settings)
    async with RunningStore(settings) as running:
        await running.until(lambda: checkpoint(sqlite_url) >= first, f"checkpoint {first}")
        connection = await nats.connect(nats_server.url)
        try:
            js = connection.jetstream()
            # A consumer under the store's durable name that resumes ten messages late.
            await js.delete_consumer(settings.stream.events_stream, EVENTS_DURABLE)
            await js.add_consumer(settings.stream.events_stream, ConsumerConfig(
                durable_name=EVENTS_DURABLE, deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                opt_start_seq=first + 11, ack_policy=AckPolicy.ALL, ack_wait=120.0, max_waiting=16,
            ))
        finally:
            await connection.close()
        last = await publish(nats_server.url, batches(100, 50), settings)
        await running.until(lambda: checkpoint(sqlite_url) >= last, f"checkpoint {last}")
        assert ledger(sqlite_url) == (150, 0)  # every event once, the worker never uncertain
        assert running.service.metrics.rewinds.labels(settings.stream.events_stream).value >= 1


async def test_a_message_the_stream_no_longer_holds_is_a_real_gap(nats_server, sqlite_url) -> None:
    with database.opened(sqlite_url) as engine:
        database.upgrade(engine)
    settings = store_settings(nats_server.url, sqlite_url, batch_size=8)
    last = await publish(nats_server.url, batches(0, 20), settings)
    connection = await nats.connect(nats_server.url)
    try:
        await connection.jetstream().delete_msg(settings.stream.events_stream, 6)  # batch seq 5 is gone
    finally:
        await connection.close()
    async with RunningStore(settings) as running:
        await running.until(lambda: checkpoint(sqlite_url) >= last, f"checkpoint {last}")
        rewinds = running.service.metrics.rewinds.labels(settings.stream.events_stream).value
    assert rewinds == 0
    assert ledger(sqlite_url) == (19, 1)  # the fold reports the hole: that batch is lost


async def test_fetch_takes_what_the_consumer_delivers_in_order_and_times_out_when_it_has_nothing(nats_server) -> None:
    connection = await nats.connect(nats_server.url)
    try:
        js = connection.jetstream()
        await js.add_stream(name="FETCHED", subjects=["fetched.>"])
        for n in range(5):
            await js.publish(f"fetched.{n}", str(n).encode())
        subscription = await js.pull_subscribe("fetched.>", durable="fetcher", stream="FETCHED",
                                               config=ConsumerConfig(ack_policy=AckPolicy.ALL))
        # the queue-draining path, not nats-py's own fetch (kept for a nats-py laid out otherwise)
        assert _FAST_FETCH_ATTRIBUTES <= set(vars(subscription))
        first = await fetch(subscription, 3, 5.0)
        started = time.monotonic()
        rest = await fetch(subscription, 10, 5.0)  # fewer than asked: what there is, at once
        assert time.monotonic() - started < 2.5
        assert [m.data for m in first + rest] == [b"0", b"1", b"2", b"3", b"4"]
        assert [m.metadata.sequence.stream for m in first + rest] == [1, 2, 3, 4, 5]
        assert [stream_seq(m) for m in first + rest] == [1, 2, 3, 4, 5]
        await rest[-1].ack()
        with pytest.raises(TimeoutError):
            await fetch(subscription, 10, 0.3)
        await js.publish("fetched.5", b"5")
        assert [m.data for m in await fetch(subscription, 10, 1.0)] == [b"5"]
    finally:
        await connection.close()


@pytest.mark.parametrize("reply", [
    "$JS.ACK.KV_EVENTS.store-events.1.4242.17.1733380000000000000.9",  # the layout nats-server 2.x sends
    "$JS.ACK.hub._.KV_EVENTS.store-events.1.4242.17.1733380000000000000.9.r4nd0m",  # with a domain and account hash
    "$JS.ACK._.ACCHASH.KV_EVENTS.store-events.2.4242.17.1733380000000000000.9",
])
def test_the_stream_seq_read_from_an_ack_subject_is_the_one_nats_py_parses(reply: str) -> None:
    message = Msg(_client=None, subject="kv.ev.a.0", reply=reply, data=b"")
    assert stream_seq(message) == message.metadata.sequence.stream == 4242
