"""The JetStream publisher against a real nats-server: every ack is checked, refusals are retried in order."""

from __future__ import annotations

import asyncio
import logging

import nats
import pytest
from nats.js.api import DiscardPolicy, StorageType, StreamConfig

from engines import read_stream, settings_for, wait_until
from kvledger.core.settings import NatsSettings
from kvledger.ingest.publish_connection import AckReply, PublishConnection, PublishConnectionError
from kvledger.ingest.publisher import JetStreamPublisher
from kvledger.runtime.embedded import EmbeddedNats
from kvledger.runtime.nats_options import NatsAuthError, is_auth_error
from kvledger.runtime.streams import events_stream

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


@pytest.fixture
def locked_server(tmp_path):
    with EmbeddedNats(tmp_path / "nats", extra_args=("--user", "alice", "--pass", "s3cret")) as server:
        yield server


@pytest.fixture
def token_server(tmp_path):
    with EmbeddedNats(tmp_path / "nats", extra_args=("--auth", "t0ken")) as server:
        yield server


def _nats_settings(url: str, **values: object) -> NatsSettings:
    return settings_for(url, **{f"nats.{key}": value for key, value in values.items()}).nats


async def _publish_once(settings: NatsSettings) -> AckReply:
    replies: list[AckReply] = []
    async with PublishConnection(settings, name="test", on_reply=replies.append, on_lost=lambda: None) as connection:
        connection.publish_many([("nowhere.0", b"x", "id-1", 7)])
        await wait_until(lambda: replies or None, 5, "the no-responders reply")
    return replies[0]


async def test_the_publishing_connection_logs_in_with_a_password_in_settings_or_in_the_url(locked_server) -> None:
    host_port = locked_server.url.removeprefix("nats://")
    for settings in (_nats_settings(locked_server.url, user="alice", password="s3cret"),
                     _nats_settings(f"nats://alice:s3cret@{host_port}")):
        reply = await _publish_once(settings)
        assert (reply.token, reply.status) == (7, "503")  # no stream listens on nowhere.0: a status, not an ack


async def test_the_publishing_connection_logs_in_with_a_token(token_server) -> None:
    assert (await _publish_once(_nats_settings(token_server.url, token="t0ken"))).status == "503"


async def test_a_refused_login_on_the_publishing_connection_is_an_auth_error(locked_server) -> None:
    with pytest.raises(PublishConnectionError) as refused:
        await _publish_once(_nats_settings(locked_server.url, user="alice", password="wrong"))
    assert is_auth_error(refused.value)
    assert "wrong" not in str(refused.value)


async def test_a_cluster_url_that_never_answers_is_passed_over_for_a_healthy_one(nats_server) -> None:
    # The silent server accepts TCP and never sends INFO; its abandoned socket must not
    # later tear down the healthy connection that replaced it.
    held = []
    silent = await asyncio.start_server(lambda reader, writer: held.append(writer), "127.0.0.1", 0)
    silent_url = f"nats://127.0.0.1:{silent.sockets[0].getsockname()[1]}"
    try:
        nats_settings = NatsSettings(url=f"{silent_url},{nats_server.url}", connect_timeout_s=0.5)
        async with JetStreamPublisher(nats_settings, [events_stream(settings_for(nats_server.url).stream)],
                                      ack_timeout_s=2.0) as publisher:
            await publisher.wait_connected(timeout=20)
            for seq in range(3):
                await publisher.publish(SUBJECT, b"batch %d" % seq, f"pub:0:0:{seq}")
            await publisher.flush(10)
            assert publisher.counters.published == 3
    finally:
        silent.close()
    messages = await read_stream(nats_server.url)
    assert [data for _, _, data in messages] == [b"batch %d" % seq for seq in range(3)]


def _configured_server(tmp_path, config: str) -> EmbeddedNats:
    conf = tmp_path / "nats.conf"
    conf.write_text(config)
    return EmbeddedNats(tmp_path / "nats", extra_args=("-c", str(conf)))


async def test_max_record_leaves_room_for_the_header_the_server_counts_against_max_payload(tmp_path) -> None:
    with _configured_server(tmp_path, "max_payload: 4096\n") as server:
        settings = settings_for(server.url)
        async with JetStreamPublisher(settings.nats, [events_stream(settings.stream)], ack_timeout_s=2.0) as publisher:
            await publisher.wait_connected(timeout=10)
            largest = publisher.max_record("pub:0:0:0")
            assert publisher.max_payload == 4096 and largest < 4096
            await publisher.publish(SUBJECT, b"x" * largest, "pub:0:0:0")
            await publisher.flush(10)
        # One byte more and the server refuses the message and drops the connection.
        async with PublishConnection(settings.nats, name="test", on_reply=lambda reply: None, on_lost=lambda: None) as connection:
            connection.publish_many([(SUBJECT, b"x" * (largest + 1), "pub:0:0:1", 1)])
            await wait_until(lambda: connection.closed.is_set() or None, 5, "the server to refuse the message")
            assert "maximum payload" in connection.error.lower()
        assert [len(data) for _, _, data in await read_stream(server.url)] == [largest]


async def test_a_publish_permission_violation_stops_publishing_with_the_servers_words(tmp_path) -> None:
    config = 'authorization { users = [ {user: u, password: p, permissions: {publish: {deny: ["kv.ev.denied.>"]}}} ] }\n'
    with _configured_server(tmp_path, config) as server:
        settings = settings_for(server.url, **{"nats.user": "u", "nats.password": "p"})
        async with JetStreamPublisher(settings.nats, [events_stream(settings.stream)], ack_timeout_s=2.0) as publisher:
            await publisher.wait_connected(timeout=10)
            await publisher.publish("kv.ev.denied.0", b"x", "denied:0:0:0")
            with pytest.raises(NatsAuthError) as refused:
                async with asyncio.timeout(10):
                    await publisher.finished()
            assert publisher.failed and publisher.counters.published == 0
    assert "refused a publish or subscription" in str(refused.value)
    assert "permissions violation" in str(refused.value).lower() and "kv.ev.denied.0" in str(refused.value)
