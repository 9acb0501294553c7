"""`kvledger decide` end to end over a real nats-server: events in, reference answers out, on record."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import attrs
import msgspec
import nats
import pytest

from engines import wait_until
from kvledger.core.decision_codec import (
    ANSWER_DECODER, RECORD_ACK_HEADER, RECORD_ACK_TO_CALLER, answer_of, decision_to_json, record_ack_subject,
    request_from_json,
)
from kvledger.core.events import WorkerId
from kvledger.core.fold import InventoryFold
from kvledger.core.reuse import ReuseRequest, decide
from kvledger.core.settings import DecideSettings, load_settings
from kvledger.core.snapshot import encode_snapshot
from kvledger.runtime.jetstream_ack import read_ack
from kvledger.runtime.streams import DECIDE_BATCH_SUBJECT, DECIDE_SUBJECT, DECISIONS_SUBJECT, SNAPSHOTS_BUCKET, snapshot_object_name
from builders import BLOCK_SIZE, Stream, local_hashes, publish, removed, stored

from kvledger.decide.inventory.index import InventoryIndex
from kvledger.decide.ranking.backend import RankingBackend, choose_backend
from kvledger.decide.ranking.cpu import CpuBackend
from kvledger.decide.serving.service import DecideService
from kvledger.decide.startup import StartupError, seconds_since_process_start
from kvledger.runtime.streams import StreamConflictError, ensure_stream
from kvledger.runtime.streams import StreamSpec, decisions_stream, events_stream

pytestmark = pytest.mark.service

TARGET, SOURCE = WorkerId("target"), WorkerId("source", 1)
DEADLINE_S = 20.0


def decide_settings(url: str, **reuse: object):
    overrides = {"nats.url": url, "decide.http_port": 0, "decide.backend": "auto",
                 "reuse.enable_decode_to_prefill_gpu_reuse": True, "reuse.enable_decode_to_prefill_reuse": True,
                 "reuse.transfer_source_prefill_token_us": 1000.0, "reuse.transfer_source_lookup_budget_ms": 1e9}
    overrides.update({f"reuse.{key}": value for key, value in reuse.items()})
    return load_settings(environ={}, overrides=overrides).settings


def scenario() -> tuple[list, list]:
    """Five batches: the source holds 12 blocks, the target 3, then the source loses its tail."""
    stream = Stream()
    early = [
        stream.batch(SOURCE, stored(list(range(1, 9)), engine_offset=1 << 63)),
        stream.batch(TARGET, stored([1, 2, 3])),
    ]
    late = [
        stream.batch(SOURCE, stored(list(range(9, 13)), parent=8 + (1 << 63), engine_offset=1 << 63)),
        stream.batch(WorkerId("other"), stored([1, 2, 3, 4, 5])),
        stream.batch(SOURCE, removed([12 + (1 << 63)])),
    ]
    return early, late


def request_body(request_id: str, target: str | None = "target", blocks: int = 12) -> dict:
    return {"request_id": request_id, "target": target, "local_hashes": [str(h) for h in local_hashes(list(range(1, blocks + 1)))],
            "block_size": BLOCK_SIZE}


async def ask(nc, subject: str, body: object) -> object:
    reply = await nc.request(subject, json.dumps(body).encode(), timeout=10)
    return json.loads(reply.data)


async def answer_at(nc, body: dict, inventory_seq: int) -> dict:
    """Ask until the answer reflects `inventory_seq` (the index follows the stream asynchronously); fail at the deadline."""

    async def reflected() -> dict | None:
        answer = await ask(nc, DECIDE_SUBJECT, body)
        return answer if answer["inventory_seq"] >= inventory_seq else None

    return await wait_until(reflected, DEADLINE_S, f"an answer at inventory_seq {inventory_seq}", interval=0.02)


def http(port: int, path: str, body: bytes | None = None, content_type: str = "application/json") -> tuple[int, bytes, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method="POST" if body is not None else "GET",
                                     headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read(), response.headers.get("Content-Type", "")
    except urllib.error.HTTPError as error:
        return error.code, error.read(), error.headers.get("Content-Type", "")


async def test_answers_equal_the_reference_and_are_recorded_once_in_kv_decisions(nats_server) -> None:
    settings = decide_settings(nats_server.url)
    early, late = scenario()
    async with await nats.connect(nats_server.url) as nc:
        js = nc.jetstream()
        await ensure_stream(js, events_stream(settings.stream))
        await publish(js, early)  # replayed at startup
        async with DecideService(settings) as service:
            await service.wait_ready(DEADLINE_S)
            assert service.index.inventory_seq == 2
            await publish(js, late)  # followed live
            fold = InventoryFold()
            fold.apply_all(early + late)
            request = ReuseRequest("r-1", local_hashes(list(range(1, 13))), BLOCK_SIZE, TARGET)
            expected = decide(fold, request, settings.reuse, backend=service.backend.name)

            answer = await answer_at(nc, request_body("r-1"), 5)
            assert answer == decision_to_json(expected)
            assert expected.chosen is not None and expected.chosen.source == "source"
            assert answer["backend"] in ("cpu", "cuda")

            record = await js.get_last_msg(settings.stream.decisions_stream, DECISIONS_SUBJECT)
            assert record.headers["Nats-Msg-Id"] == "r-1"
            assert ANSWER_DECODER.decode(record.data) == answer_of(expected)
            before = (await js.stream_info(settings.stream.decisions_stream)).state.messages
            assert await ask(nc, DECIDE_SUBJECT, request_body("r-1")) == answer  # a retry
            assert (await js.stream_info(settings.stream.decisions_stream)).state.messages == before


async def test_every_answer_of_a_batch_is_its_own_record_and_a_missing_decisions_stream_is_an_error_answer(
    nats_server,
) -> None:
    settings = decide_settings(nats_server.url)
    decisions = settings.stream.decisions_stream
    early, _ = scenario()
    async with await nats.connect(nats_server.url) as nc:
        js = nc.jetstream()
        await ensure_stream(js, events_stream(settings.stream))
        await publish(js, early)
        async with DecideService(settings) as service:
            await service.wait_ready(DEADLINE_S)
            answers = await ask(nc, DECIDE_BATCH_SUBJECT, [request_body(f"batch-{n}") for n in range(300)])
            assert [answer["request_id"] for answer in answers] == [f"batch-{n}" for n in range(300)]
            assert (await js.stream_info(decisions)).state.messages == 300
            for seq in (1, 150, 300):
                record = await js.get_msg(decisions, seq)
                assert json.loads(record.data) == answers[seq - 1]
                assert record.headers["Nats-Msg-Id"] == answers[seq - 1]["request_id"]

            # An answer that cannot be put on record is not given: the client hears why.
            await js.delete_stream(decisions)
            failed = await ask(nc, DECIDE_SUBJECT, request_body("unrecorded"))
            assert failed["error"]["message"].startswith("internal error: DecisionsNotRecorded")
            assert "no stream listens on the subject" in failed["error"]["message"]
            await ensure_stream(js, decisions_stream(settings.stream))
            assert (await ask(nc, DECIDE_SUBJECT, request_body("recorded-again")))["request_id"] == "recorded-again"
            assert (await js.stream_info(decisions)).state.messages == 1


async def test_a_caller_taking_its_records_ack_gets_the_answer_at_once_and_the_ack_from_jetstream(nats_server) -> None:
    settings = decide_settings(nats_server.url)
    decisions = settings.stream.decisions_stream
    take_the_ack = {RECORD_ACK_HEADER: RECORD_ACK_TO_CALLER}
    async with await nats.connect(nats_server.url) as nc:
        js = nc.jetstream()
        async with DecideService(settings) as service:
            await service.wait_ready(DEADLINE_S)
            inbox = nc.new_inbox()
            received: asyncio.Queue = asyncio.Queue()
            await nc.subscribe(inbox + ".>", cb=received.put)

            reply_to = inbox + ".1"
            await nc.publish(DECIDE_SUBJECT, json.dumps(request_body("taker-1")).encode(), reply=reply_to,
                             headers=take_the_ack)
            messages = {message.subject: message for message in
                        [await asyncio.wait_for(received.get(), DEADLINE_S) for _ in range(2)]}
            assert sorted(messages) == sorted([reply_to, record_ack_subject(reply_to)])
            answer = messages[reply_to]
            assert answer.headers == take_the_ack  # says the ack comes on its own
            assert json.loads(answer.data)["request_id"] == "taker-1"
            ack = read_ack(None, "", messages[record_ack_subject(reply_to)].data)
            assert (ack.stream, ack.seq, ack.duplicate) == (decisions, 1, False)
            record = await js.get_msg(decisions, 1)
            assert (record.data, record.headers["Nats-Msg-Id"]) == (answer.data, "taker-1")

            # A refusal is no answer: not recorded, so no header and no ack.
            await nc.publish(DECIDE_SUBJECT, b'{"request_id": "refused-1"}', reply=inbox + ".2", headers=take_the_ack)
            refusal = await asyncio.wait_for(received.get(), DEADLINE_S)
            assert refusal.subject == inbox + ".2" and RECORD_ACK_HEADER not in (refusal.headers or {})
            assert json.loads(refusal.data)["error"]["field"] == "block_size"

            # A plain request gets its reply once decide saw the record acknowledged: no header.
            plain = await nc.request(DECIDE_SUBJECT, json.dumps(request_body("plain-1")).encode(), timeout=DEADLINE_S)
            assert RECORD_ACK_HEADER not in (plain.headers or {})
            assert (await js.get_msg(decisions, 2)).headers["Nats-Msg-Id"] == "plain-1"
            await nc.flush()
            assert received.empty()  # no ack went to the caller but for the one that asked


async def test_malformed_requests_get_an_error_naming_the_field_and_the_service_goes_on(nats_server) -> None:
    settings = decide_settings(nats_server.url)
    async with await nats.connect(nats_server.url) as nc:
        async with DecideService(settings) as service:
            await service.wait_ready(DEADLINE_S)
            missing = request_body("bad-1")
            del missing["block_size"]
            assert (await ask(nc, DECIDE_SUBJECT, missing))["error"]["field"] == "block_size"
            reply = await nc.request(DECIDE_SUBJECT, b"{not json", timeout=10)
            assert json.loads(reply.data)["error"]["field"] == "request"
            hashes = request_body("bad-2")
            hashes["local_hashes"][1] = -5
            assert (await ask(nc, DECIDE_SUBJECT, hashes))["error"]["field"] == "local_hashes[1]"
            assert (await ask(nc, DECIDE_BATCH_SUBJECT, {"not": "a list"}))["error"]["field"] == "requests"

            answers = await ask(nc, DECIDE_BATCH_SUBJECT, [request_body("ok-1"), {"request_id": "bad-3"}, request_body("ok-2", None)])
            assert [a.get("request_id") for a in answers] == ["ok-1", "bad-3", "ok-2"]
            assert answers[1]["error"]["field"] == "block_size"
            assert answers[0]["reason"] == "no_candidates" and answers[2]["reason"] == "no_workers"
            assert (await ask(nc, DECIDE_SUBJECT, request_body("ok-3")))["request_id"] == "ok-3"
            text = (await asyncio.to_thread(http, service.http_port, "/metrics"))[1].decode()
            assert 'kvledger_decide_malformed_requests_total{field="block_size"} 2.0' in text


async def test_warm_start_from_the_newest_snapshot_then_replay_after_it(nats_server) -> None:
    settings = decide_settings(nats_server.url)
    early, late = scenario()
    async with await nats.connect(nats_server.url) as nc:
        js = nc.jetstream()
        await ensure_stream(js, events_stream(settings.stream))
        await publish(js, early + late)
        snapshots = await js.create_object_store(SNAPSHOTS_BUCKET)
        older, newer = InventoryFold(), InventoryFold()
        older.apply_all(early[:1])
        newer.apply_all(early)
        await snapshots.put(snapshot_object_name(1), encode_snapshot(older))
        await snapshots.put(snapshot_object_name(2), encode_snapshot(newer))
        async with DecideService(settings) as service:
            assert service.started_from == snapshot_object_name(2)
            await service.wait_ready(DEADLINE_S)
            # The index gauges count the warm-started index before any decision is asked.
            metrics = (await asyncio.to_thread(http, service.http_port, "/metrics"))[1].decode()
            assert service.index.size > 0
            assert f"kvledger_decide_index_size {float(service.index.size)}" in metrics
            assert f"kvledger_decide_workers {float(service.index.worker_count)}" in metrics
            # The snapshot's plain workers left the fold for the compact arrays.
            assert service.index.promoted_count == 0
            assert "kvledger_decide_promoted_workers 0.0" in metrics
            assert f"kvledger_decide_index_bytes {float(service.index.array_bytes)}" in metrics
            fold = InventoryFold()
            fold.apply_all(early + late)
            request = ReuseRequest("warm", local_hashes(list(range(1, 13))), BLOCK_SIZE, None)
            answer = await answer_at(nc, request_body("warm", None), 5)
            assert answer == decision_to_json(decide(fold, request, settings.reuse, backend=service.backend.name))


async def test_http_front_answers_json_and_msgpack_and_refuses_other_media_types(nats_server) -> None:
    settings = decide_settings(nats_server.url)
    async with await nats.connect(nats_server.url) as nc:
        async with DecideService(settings) as service:
            await service.wait_ready(DEADLINE_S)
            port = service.http_port
            assert (await asyncio.to_thread(http, port, "/healthz"))[0] == 200
            assert (await asyncio.to_thread(http, port, "/readyz"))[0] == 200
            status, body, _ = await asyncio.to_thread(http, port, "/v1/decide", json.dumps(request_body("h-1")).encode())
            assert status == 200
            assert json.loads(body) == await ask(nc, DECIDE_SUBJECT, request_body("h-1"))
            status, body, media = await asyncio.to_thread(
                http, port, "/v1/decide/batch", msgspec.msgpack.encode([request_body("h-2"), request_body("h-3")]),
                "application/msgpack")
            assert status == 200 and media == "application/msgpack"
            assert [a["request_id"] for a in msgspec.msgpack.decode(body)] == ["h-2", "h-3"]
            status, body, _ = await asyncio.to_thread(http, port, "/v1/decide", b"request_id=x", "text/plain")
            assert status == 415
            assert json.loads(body)["error"]["field"] == "content-type"
            status, body, _ = await asyncio.to_thread(http, port, "/v1/decide", b'{"request_id": "x"}')
            assert status == 400 and json.loads(body)["error"]["field"] == "block_size"
            metrics = (await asyncio.to_thread(http, port, "/metrics"))[1].decode()
            for name in ("kvledger_decide_decisions_total", "kvledger_decide_latency_seconds_bucket",
                         "kvledger_decide_batch_size_bucket", "kvledger_decide_index_size",
                         "kvledger_decide_inventory_lag"):
                assert name in metrics


async def test_the_refusal_status_comes_from_settings(nats_server) -> None:
    settings = decide_settings(nats_server.url)
    settings = load_settings(environ={}, overrides={"nats.url": nats_server.url, "decide.http_port": 0,
                                                    "decide.reject_media_status_code": 406}).settings
    async with DecideService(settings) as service:
        await service.wait_ready(DEADLINE_S)
        status, _, _ = await asyncio.to_thread(http, service.http_port, "/v1/decide", b"<x/>", "application/xml")
        assert status == 406


def test_the_media_refusal_status_defaults_to_415_without_any_environment() -> None:
    assert load_settings(environ={}).settings.decide.reject_media_status_code == 415
    assert DecideSettings().reject_media_status_code == 415


async def test_a_conflicting_decisions_stream_is_a_clear_startup_error(nats_server) -> None:
    settings = decide_settings(nats_server.url)
    async with await nats.connect(nats_server.url) as nc:
        await ensure_stream(nc.jetstream(), StreamSpec(settings.stream.decisions_stream, ("kv.dec",), 600.0, 0.0, -1, 1))
        with pytest.raises(StreamConflictError, match="KV_DECISIONS exists with different settings.*duplicate_window"):
            async with DecideService(settings):
                pass


def test_auto_picks_cuda_only_when_a_device_answers_and_says_which() -> None:
    from kvledger.decide.ranking.cuda import device_unavailable_reason

    backend, line = choose_backend("auto", InventoryIndex())
    if device_unavailable_reason() is None:
        assert backend.name == "cuda" and "cuda" in line
    else:
        assert backend.name == "cpu"
        assert line.startswith("backend cpu (auto: no CUDA device answers")
    with pytest.raises(StartupError, match="backend = cuda") if device_unavailable_reason() else _nothing():
        choose_backend("cuda", InventoryIndex())


def test_a_cuda_backend_that_cannot_start_says_why_at_startup() -> None:
    """Any failure while the backend starts (here: a device that does not exist) is a CudaUnavailable,
    which `auto` turns into cpu, instead of an error on every later request."""
    from kvledger.decide.ranking.cuda import CudaBackend, CudaUnavailable, device_unavailable_reason

    reason = device_unavailable_reason()
    if reason is not None:
        pytest.skip(f"cuda backend not exercised: {reason}")
    with pytest.raises(CudaUnavailable, match="could not start"):
        CudaBackend(InventoryIndex(), device_id=10_000)
    with CudaBackend(InventoryIndex()) as backend:  # the startup self-check ranked on the device
        assert backend.arch.startswith("sm_")


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


async def test_concurrent_single_requests_are_ranked_together_each_answer_its_own_and_on_record(nats_server) -> None:
    """64 clients at once on `kvledger.decide`, 8 over HTTP: few backend calls, each answer exact and on record."""
    settings = decide_settings(nats_server.url)
    settings = attrs.evolve(settings, decide=attrs.evolve(settings.decide, batch_window_us=5000.0, max_batch=16))
    early, late = scenario()
    async with await nats.connect(nats_server.url) as nc:
        js = nc.jetstream()
        await ensure_stream(js, events_stream(settings.stream))
        await publish(js, early + late)
        async with DecideService(settings) as service:
            await service.wait_ready(DEADLINE_S)
            await answer_at(nc, request_body("warm"), 5)
            fold = InventoryFold()
            fold.apply_all(early + late)
            bodies = [request_body(f"c-{n}", target=("target", "other", None)[n % 3], blocks=1 + n % 12) for n in range(64)]
            before = _batch_sizes(service)
            answers = await asyncio.gather(*(ask(nc, DECIDE_SUBJECT, body) for body in bodies))
            over_http = await asyncio.gather(*(
                asyncio.to_thread(http, service.http_port, "/v1/decide", json.dumps(body).encode()) for body in bodies[:8]
            ))
            for body, answer in zip(bodies, answers):
                request = ReuseRequest(body["request_id"], tuple(int(h) for h in body["local_hashes"]), BLOCK_SIZE,
                                       WorkerId.parse(body["target"]) if body["target"] else None)
                assert answer == decision_to_json(decide(fold, request, settings.reuse, backend=service.backend.name))
            assert [(status, json.loads(raw)) for status, raw, _ in over_http] == [(200, answer) for answer in answers[:8]]
            calls, largest, _ = _batch_sizes(service, since=before)
            assert calls < 64 + 8 and largest > 1  # concurrent singles shared backend calls
            assert largest <= 16  # never more than decide.max_batch (16 is a bucket bound)
            # each answer on record once under its request id (the HTTP ones are retries of the same ids)
            assert (await js.stream_info(settings.stream.decisions_stream)).state.messages == 1 + 64


def _batch_sizes(service: DecideService, since: tuple | None = None) -> tuple:
    """(backend calls, bucket bound of the largest, buckets) from kvledger_decide_batch_size, optionally since `since`."""
    samples = {
        (sample.name, sample.labels.get("le")): sample.value
        for metric in service.metrics.batch_size.collect() for sample in metric.samples
    }
    count = samples[("kvledger_decide_batch_size_count", None)]
    buckets = sorted((float(le), value) for (name, le), value in samples.items() if name.endswith("_bucket"))
    if since is not None:
        count -= since[0]
        buckets = [(le, value - before) for (le, value), (_, before) in zip(buckets, since[2])]
    largest = next(le for le, value in buckets if value >= count)
    return count, largest, buckets


async def test_the_backend_is_warmed_up_before_the_service_reports_ready(nats_server, monkeypatch) -> None:
    settings = decide_settings(nats_server.url)
    settings = attrs.evolve(settings, decide=attrs.evolve(settings.decide, backend="cpu"))
    service = DecideService(settings)
    seen_at_warm_up: list[tuple[bool, float | None]] = []
    warm_up = CpuBackend.warm_up

    def watched_warm_up(backend: CpuBackend, reuse) -> None:
        seen_at_warm_up.append((service.ready, service.warm_up_seconds))
        warm_up(backend, reuse)

    monkeypatch.setattr(CpuBackend, "warm_up", watched_warm_up)
    async with service:
        await service.wait_ready(DEADLINE_S)
        assert seen_at_warm_up == [(False, None)]  # warmed up once, while not yet ready
        assert service.warm_up_seconds is not None and service.warm_up_seconds > 0
        metrics = (await asyncio.to_thread(http, service.http_port, "/metrics"))[1].decode()
        gauge = next(line for line in metrics.splitlines() if line.startswith("kvledger_decide_warm_up_seconds "))
        assert float(gauge.split()[1]) == service.warm_up_seconds
        assert _batch_sizes(service)[0] == 0  # the warm-up answer is not counted as a decision
        if seconds_since_process_start() is not None:
            assert 0 < service.ready_after_process_start_s <= seconds_since_process_start()


def test_both_backends_keep_the_ranking_backend_contract() -> None:
    from kvledger.decide.ranking.cuda import CudaBackend, device_unavailable_reason

    index = InventoryIndex()
    assert isinstance(CpuBackend(index), RankingBackend)
    if device_unavailable_reason() is None:
        with CudaBackend(index) as backend:
            assert isinstance(backend, RankingBackend)



async def test_two_replicas_give_byte_identical_answers_at_the_same_inventory_seq(nats_server) -> None:
    """Replicas fold the same stream the same way: at one inventory_seq their answers are the same bytes."""
    settings = decide_settings(nats_server.url)
    settings = attrs.evolve(settings, decide=attrs.evolve(settings.decide, backend="cpu"))
    early, late = scenario()
    async with await nats.connect(nats_server.url) as nc:
        js = nc.jetstream()
        await ensure_stream(js, events_stream(settings.stream))
        await publish(js, early)
        async with DecideService(settings) as first, DecideService(settings) as second:
            await first.wait_ready(DEADLINE_S)
            await second.wait_ready(DEADLINE_S)
            await publish(js, late)
            deadline = time.monotonic() + DEADLINE_S
            while not (first.index.inventory_seq == second.index.inventory_seq == 5):
                assert time.monotonic() < deadline, "the replicas did not both reach inventory_seq 5"
                await asyncio.sleep(0.01)
            bodies = [request_body("same-1"), request_body("same-2", target=None), request_body("same-3", blocks=4)]
            requests = [request_from_json(body) for body in bodies]
            answers = [(await first.answer(requests)).parts, (await second.answer(requests)).parts]
    assert answers[0] == answers[1]
    assert [json.loads(part)["inventory_seq"] for part in answers[0]] == [5, 5, 5]
