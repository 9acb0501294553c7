"""The JetStream publisher against a real nats-server: every ack is checked, refusals are retried in order."""

from __future__ import annotations

import logging

import nats
from nats.js.api import DiscardPolicy, StorageType, StreamConfig

from engines import read_stream, settings_for, wait_until
from ingest.publisher import JetStreamPublisher
from kvledger.streams import events_stream

SUBJECT = "kv.ev.pub.0"


async def _limit_messages(url: str, stream: str, max_msgs: int) -> None:
    """Change the stream's message limit by hand (an operator's edit; ingest never changes it)."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        config = (await js.stream_info(stream)).config
        config.max_msgs, config.discard = max_msgs, DiscardPolicy.NEW
        await js.update_stream(config)
    finally:
        await nc.close()


async def test_a_stream_full_error_ack_is_not_success_and_the_batch_lands_in_order_once_there_is_room(
    nats_server, caplog,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvledger.ingest.publisher")
    settings = settings_for(nats_server.url)
    async with JetStreamPublisher(settings.nats, [events_stream(settings.stream)], ack_timeout_s=2.0) as publisher:
        await publisher.wait_connected(timeout=10)
        await _limit_messages(nats_server.url, "KV_EVENTS", 2)
        for seq in range(6):
            await publisher.publish(SUBJECT, b"batch %d" % seq, f"pub:0:0:{seq}")
        await wait_until(lambda: publisher.counters.reconnects >= 2 or None, 10, "the refusal to be retried")
        assert publisher.counters.published == 2, "an error ack must never count as acknowledged"
        assert publisher.buffered == 4 and publisher.counters.retries >= 4
        assert "maximum messages exceeded" in caplog.text
        await _limit_messages(nats_server.url, "KV_EVENTS", -1)
        await publisher.flush(15)
        assert publisher.counters.published == 6
    messages = await read_stream(nats_server.url)
    assert [data for _, _, data in messages] == [b"batch %d" % seq for seq in range(6)], "each exactly once, in order"


async def test_a_subject_no_stream_listens_on_is_a_failure_until_a_stream_takes_it(nats_server, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="kvledger.ingest.publisher")
    settings = settings_for(nats_server.url)
    async with JetStreamPublisher(settings.nats, [events_stream(settings.stream)], ack_timeout_s=2.0) as publisher:
        await publisher.wait_connected(timeout=10)
        await publisher.publish("elsewhere.0", b"orphan", "orphan:0")
        await publisher.publish(SUBJECT, b"behind it", "pub:0:0:0")
        await wait_until(lambda: publisher.counters.reconnects >= 1 or None, 10, "the missing stream to be noticed")
        assert publisher.counters.published == 0 and publisher.buffered == 2
        assert "no stream listens on the subject" in caplog.text
        nc = await nats.connect(nats_server.url)
        await nc.jetstream().add_stream(StreamConfig(name="ELSEWHERE", subjects=["elsewhere.>"], storage=StorageType.FILE))
        await nc.close()
        await publisher.flush(15)
        assert publisher.counters.published == 2
    assert [data for _, _, data in await read_stream(nats_server.url, "ELSEWHERE")] == [b"orphan"]
    assert [data for _, _, data in await read_stream(nats_server.url)] == [b"behind it"]
