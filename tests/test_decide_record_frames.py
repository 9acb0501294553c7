"""decide's records as one write: `decide.serving.recorder.write_frames` writes what nats-py's `publish` would.

The same batch is recorded twice into a KV_DECISIONS of the test's own, once framed (the
batch's protocol text written by one compiled call) and once published record by record
through nats-py; JetStream must hold the same records (data and every header), and acks
come back the same way: to the recorder, or to the caller's subject where it takes them.
"""

from __future__ import annotations

import asyncio

import nats
import pytest
from nats.js.api import StreamConfig

from kvledger.core.decision_codec import RELIED_PREFIX_HEADER, REQUEST_HEADER, SHADOW_HEADER
from kvledger.core.events import WorkerId
from kvledger.core.reuse import ReuseRequest

from kvledger.decide.serving import recorder as recorder_module
from kvledger.decide.serving.recorder import DecisionRecorder, DecisionsNotRecorded, RecordBatch, Texts, request_header_texts

pytestmark = pytest.mark.service


@pytest.fixture(autouse=True)
def framed_from_one(monkeypatch) -> None:
    """Every batch framed, however small (in service, a batch below FRAMED_FROM is published record by record)."""
    monkeypatch.setattr(recorder_module, "FRAMED_FROM", 1)


def _batch(prefix: str, ack_to: list[str | None] | None = None) -> RecordBatch:
    requests = [
        ReuseRequest(f"{prefix}-a", (1, 2, 3), 16, WorkerId("w1")),
        ReuseRequest(f"{prefix}-é", (), 16, None, None, WorkerId("f", 2)),  # a non-ASCII id, no blocks
        ReuseRequest(f"{prefix}-c", tuple(range(40)), 512, WorkerId("w", 3)),
    ]
    return RecordBatch(
        [request.request_id for request in requests],
        [b'{"request_id":"' + request.request_id.encode() + b'","n":' + str(n).encode() + b"}"
         for n, request in enumerate(requests)],
        [b"00ff" * 4, b"", b"ab" * 8],
        request_header_texts(requests),
        Texts.of([b'{"settings_digest":"x","reason":"chosen"}', b"", b'{"reason":"disabled"}']),
        ack_to,
    )


async def _records(js, stream: str, first: int, count: int) -> list[tuple[bytes, dict]]:
    records = []
    for seq in range(first, first + count):
        message = await js.get_msg(stream, seq)
        records.append((message.data, {str(key): str(value) for key, value in (message.headers or {}).items()}))
    return records


async def test_framed_records_are_what_nats_py_publishes(nats_server) -> None:
    async with await nats.connect(nats_server.url) as nc:
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name="FRAMES", subjects=["frames.dec"]))
        framed = DecisionRecorder(nc, "frames.dec", "FRAMES")
        plain = DecisionRecorder(nc, "frames.dec", "FRAMES")
        plain.framed = False
        assert framed.framed, "this nats-py has the internals the framed path writes through"
        for recorder in (framed, plain):
            await recorder.start()
        await framed.record(_batch("framed"))
        await plain.record(_batch("plain"))
        one, other = await _records(js, "FRAMES", 1, 3), await _records(js, "FRAMES", 4, 3)
        for (framed_data, framed_headers), (plain_data, plain_headers) in zip(one, other):
            assert framed_data.replace(b"framed", b"plain") == plain_data
            assert {key: value.replace("framed", "plain") for key, value in framed_headers.items()} == plain_headers
        assert framed_headers[REQUEST_HEADER].startswith('{"block_size":512,"blocks":40,"local_hashes":"')
        assert RELIED_PREFIX_HEADER not in one[1][1] and SHADOW_HEADER not in one[1][1]
        # A record the stream already holds (the same Msg-Id) is acknowledged, and kept once.
        await framed.record(_batch("framed"))
        assert (await js.stream_info("FRAMES")).state.messages == 6


async def test_records_whose_caller_takes_the_ack_are_acked_to_the_caller(nats_server) -> None:
    async with await nats.connect(nats_server.url) as nc:
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name="FRAMES2", subjects=["frames2.dec"]))
        recorder = DecisionRecorder(nc, "frames2.dec", "FRAMES2")
        await recorder.start()
        inbox = nc.new_inbox()
        acks = await nc.subscribe(inbox + ".*")
        # The first and last are the caller's; the recorder waits for the middle one only.
        await recorder.record(_batch("taken", [inbox + ".0", None, inbox + ".2"]))
        subjects = sorted([(await acks.next_msg(timeout=5)).subject for _ in range(2)])
        assert subjects == [inbox + ".0", inbox + ".2"]
        assert (await js.stream_info("FRAMES2")).state.messages == 3


async def test_a_stream_that_refuses_the_records_is_an_error_naming_the_request(nats_server) -> None:
    async with await nats.connect(nats_server.url) as nc:
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name="FRAMES3", subjects=["frames3.dec"]))
        recorder = DecisionRecorder(nc, "frames3.dec", "ELSEWHERE", timeout_s=2.0)  # Nats-Expected-Stream differs
        await recorder.start()
        with pytest.raises(DecisionsNotRecorded, match="refused the answer to request 'refused-"):
            await recorder.record(_batch("refused"))
        await asyncio.sleep(0)
