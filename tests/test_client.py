"""`kvledger.client` against a real decide service on a real nats-server, over NATS and HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from urllib.parse import urlsplit

import attrs
import msgspec
import nats
import nats.errors
import pytest

from kvledger.client import (
    DecideError,
    MSGPACK, Answer, DecideClient, DecideClientSync, DecideRequest, DecideUnavailable, RequestRefused, RetryPolicy,
)
from kvledger.app.demo import decide_asker, run_closed_loop
from kvledger.core.events import WorkerId
from kvledger.core.settings import Settings
from kvledger.runtime.backoff import Backoff
from kvledger.runtime.lifetime import cancel_and_wait
from kvledger.runtime.streams import DECIDE_BATCH_SUBJECT, DECIDE_SUBJECT, DECISIONS_SUBJECT, decisions_stream, ensure_stream
from kvledger.runtime.streams import events_stream, message_ids
from kvledger.sim.workload import CacheChange, EngineCache, Request
from builders import BLOCK_SIZE, local_hashes, publish
from engines import wait_until
from test_decide_service import DEADLINE_S, ask, decide_settings, http, request_body, scenario

from kvledger.decide.serving.service import DecideService

pytestmark = pytest.mark.service

TRANSPORTS = ("nats", "http", "http-msgpack")
QUICK_RETRIES = RetryPolicy(attempts=3, first_backoff=timedelta(milliseconds=20))


@attrs.frozen
class RunningDecide:
    service: DecideService
    settings: Settings
    nc: nats.NATS  # the test's own connection, beside any client's
    nats_url: str

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.service.http_port}"

    @property
    def decisions(self) -> str:
        return self.settings.stream.decisions_stream

    async def records(self) -> int:
        return (await self.nc.jetstream().stream_info(self.decisions)).state.messages

    def metric(self, name: str, **labels: str) -> float:
        """A counter of the service summed over every label set matching `labels`."""
        return sum(
            sample.value
            for metric in self.service.metrics.registry.collect() for sample in metric.samples
            if sample.name == name and all(sample.labels.get(key) == value for key, value in labels.items())
        )


@contextlib.asynccontextmanager
async def decide_on_the_scenario(nats_url: str, settings) -> AsyncIterator[RunningDecide]:
    """decide, ready, on the five batches of test_decide_service's scenario (the source holds 11 blocks)."""
    early, late = scenario()
    async with await nats.connect(nats_url) as nc:
        await ensure_stream(nc.jetstream(), events_stream(settings.stream))
        await publish(nc.jetstream(), early + late)
        async with DecideService(settings) as service:
            await service.wait_ready(DEADLINE_S)
            yield RunningDecide(service, settings, nc, nats_url)


@pytest.fixture
async def running(nats_server) -> AsyncIterator[RunningDecide]:
    async with decide_on_the_scenario(nats_server.url, decide_settings(nats_server.url)) as running:
        yield running


async def open_client(transport: str, running: RunningDecide, **options) -> DecideClient:
    if transport == "nats":
        return await DecideClient.connect_nats(running.nats_url, **options)
    media_type = MSGPACK if transport == "http-msgpack" else "application/json"
    return DecideClient.http(running.http_url, media_type=media_type, **options)


async def raw_answer(transport: str, running: RunningDecide, body: object, *, batch: bool = False) -> object:
    """What the service sends for `body`, asked without the client."""
    if transport == "nats":
        return await ask(running.nc, DECIDE_BATCH_SUBJECT if batch else DECIDE_SUBJECT, body)
    path = "/v1/decide/batch" if batch else "/v1/decide"
    if transport == "http":
        _, reply, _ = await asyncio.to_thread(http, running.service.http_port, path, json.dumps(body).encode())
        return json.loads(reply)
    _, reply, _ = await asyncio.to_thread(http, running.service.http_port, path, msgspec.msgpack.encode(body), MSGPACK)
    return msgspec.msgpack.decode(reply)


def as_json(value: object) -> object:
    """`value` as the plain lists and dicts its JSON decodes to (tuples become lists)."""
    return msgspec.json.decode(msgspec.json.encode(value))


def typed_request(request_id: str, target: str | None = "target") -> DecideRequest:
    """The same request as test_decide_service's `request_body`, as the client's value."""
    return DecideRequest(request_id=request_id, local_hashes=local_hashes(list(range(1, 13))), block_size=BLOCK_SIZE,
                         target=target)


def refused_request(request_id: str) -> DecideRequest:
    return DecideRequest(request_id=request_id, local_hashes=(1, 2), block_size=0)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_one_decide_returns_the_typed_answer_field_for_field(transport: str, running: RunningDecide) -> None:
    raw = await raw_answer(transport, running, request_body("typed-1"))
    async with await open_client(transport, running) as client:
        answer = await client.decide(typed_request("typed-1"))
    assert isinstance(answer, Answer)
    # The exact names, in decision_to_json's order; `inflight` comes only with in-flight credit (none here).
    assert [name for name in Answer.__struct_fields__ if name != "inflight"] == list(raw)
    assert as_json(answer) == raw
    assert answer.chosen is not None and answer.chosen.source == "source" and answer.chosen.tier == "device"
    assert answer.overlaps["source/1"].device == raw["overlaps"]["source/1"]["device"] == 11
    assert await running.records() == 1  # the raw ask and the client's share one id, so one record


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_batch_answers_in_order_with_a_refusal_in_place(transport: str, running: RunningDecide) -> None:
    requests = [typed_request("b-1"), refused_request("b-2"), typed_request("b-3", target=None)]
    raw = await raw_answer(transport, running, [as_json(request) for request in requests], batch=True)
    async with await open_client(transport, running) as client:
        first, refusal, last = await client.decide_batch(requests)
    assert isinstance(first, Answer) and isinstance(last, Answer)
    assert [as_json(first), as_json(last)] == [raw[0], raw[2]]
    assert isinstance(refusal, RequestRefused)
    assert (refusal.request_id, refusal.field, refusal.message) == ("b-2", "block_size", raw[1]["error"]["message"])
    assert last.target == "source/1"  # no target given: the most-credited worker


async def test_a_client_on_a_given_connection_leaves_it_open(running: RunningDecide) -> None:
    async with await DecideClient.connect_nats(running.nc) as client:
        assert (await client.decide(typed_request("given-1"))).request_id == "given-1"
    assert running.nc.is_connected


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_refused_request_raises_and_is_sent_once(transport: str, running: RunningDecide) -> None:
    async with await open_client(transport, running, retry=RetryPolicy(attempts=5)) as client:
        with pytest.raises(RequestRefused) as refused:
            await client.decide(refused_request("bad-1"))
    assert (refused.value.request_id, refused.value.field) == ("bad-1", "block_size")
    assert refused.value.message.startswith("required, a positive integer")
    assert running.metric("kvledger_decide_malformed_requests_total", field="block_size") == 1.0
    assert await running.records() == 0


class ReplyHoldingRelay:
    """A TCP relay in front of a real server that, once armed, holds the server's bytes back
    until the client has sent `marker` twice: the first attempt reaches the service and is
    answered, but the answer arrives after the client has given up and sent it again."""

    def __init__(self, upstream_host: str, upstream_port: int, marker: bytes) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.marker = marker
        self.sent_by_client = bytearray()  # since armed
        self._released = asyncio.Event()
        self._released.set()
        self._pumps: set[asyncio.Task] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> ReplyHoldingRelay:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._server.close()
        await cancel_and_wait(self._pumps)
        await self._server.wait_closed()

    def arm(self) -> None:
        self.sent_by_client.clear()
        self._released.clear()

    async def _relay(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        server_reader, server_writer = await asyncio.open_connection(*self.upstream)
        for pump in (self._pump(client_reader, server_writer, from_client=True),
                     self._pump(server_reader, client_writer, from_client=False)):
            task = asyncio.create_task(pump)
            self._pumps.add(task)
            task.add_done_callback(self._pumps.discard)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, from_client: bool) -> None:
        try:
            while chunk := await reader.read(65536):
                if from_client and not self._released.is_set():
                    self.sent_by_client += chunk
                    if self.sent_by_client.count(self.marker) >= 2:
                        self._released.set()
                if not from_client:
                    await self._released.wait()
                writer.write(chunk)
                await writer.drain()
        except ConnectionError:
            pass  # the client gave up on this connection (an HTTP attempt that timed out)
        finally:
            writer.close()


@pytest.mark.parametrize("transport", ("nats", "http"))
async def test_a_timed_out_request_is_sent_again_under_its_id_and_recorded_once(
    transport: str, running: RunningDecide,
) -> None:
    if transport == "nats":
        upstream = urlsplit(running.nats_url)
        relay = ReplyHoldingRelay(upstream.hostname, upstream.port, f"PUB {DECIDE_SUBJECT} ".encode())
    else:
        relay = ReplyHoldingRelay("127.0.0.1", running.service.http_port, b"POST /v1/decide ")
    async with relay:
        timeout = timedelta(milliseconds=300)
        if transport == "nats":
            client = await DecideClient.connect_nats(f"nats://127.0.0.1:{relay.port}", timeout=timeout, retry=QUICK_RETRIES)
        else:
            client = DecideClient.http(f"http://127.0.0.1:{relay.port}", timeout=timeout, retry=QUICK_RETRIES)
        async with client:
            request = DecideRequest(local_hashes=local_hashes(list(range(1, 13))), block_size=BLOCK_SIZE, target="target")
            relay.arm()
            answer = await client.decide(request)
    assert answer.request_id == request.request_id and len(request.request_id) == 32  # generated: uuid4 hex
    assert relay.sent_by_client.count(request.request_id.encode()) == 2  # both attempts, one id
    assert running.metric("kvledger_decide_decisions_total") == 2.0  # the service answered both
    assert await running.records() == 1  # and recorded the id once
    record = await running.nc.jetstream().get_last_msg(running.decisions, DECISIONS_SUBJECT)
    assert record.headers["Nats-Msg-Id"] == request.request_id
    assert json.loads(record.data) == as_json(answer)


@pytest.mark.parametrize("transport", ("nats", "http"))
async def test_a_service_side_failure_is_retried_then_reported(transport: str, running: RunningDecide) -> None:
    """Without KV_DECISIONS no answer is taken: over HTTP decide answers `internal error` (500); over
    NATS the client, which takes its record's ack itself, hears none. Each attempt ranked, none recorded."""
    js = running.nc.jetstream()
    await js.delete_stream(running.decisions)
    unrecorded = {"http": "no stream listens on the subject", "nats": "the answer came, but no ack of its record"}
    async with await open_client(transport, running, retry=QUICK_RETRIES, timeout=timedelta(milliseconds=500)) as client:
        request = typed_request("unrecorded-1")
        with pytest.raises(DecideUnavailable, match=f"after 3 attempt.*{unrecorded[transport]}"):
            await client.decide(request)
        assert running.metric("kvledger_decide_decisions_total") == 3.0
        await ensure_stream(js, decisions_stream(running.settings.stream))
        assert (await client.decide(request)).request_id == "unrecorded-1"  # the router's own retry, same id
    assert await running.records() == 1


async def test_no_responders_is_retried_then_reported_and_the_same_request_answered_later(nats_server) -> None:
    request = typed_request("early-1", target=None)
    async with await DecideClient.connect_nats(nats_server.url, retry=QUICK_RETRIES) as client:
        with pytest.raises(DecideUnavailable, match="after 3 attempt.*NoRespondersError") as unavailable:
            await client.decide(request)
        assert isinstance(unavailable.value.__cause__, nats.errors.NoRespondersError)
        settings = decide_settings(nats_server.url)
        async with DecideService(settings) as service:
            await service.wait_ready(DEADLINE_S)
            assert (await client.decide(request)).reason == "no_workers"
    async with await nats.connect(nats_server.url) as nc:
        assert (await nc.jetstream().stream_info(settings.stream.decisions_stream)).state.messages == 1


def ask_synchronously(nats_url: str, http_url: str) -> dict[str, object]:
    """Plain synchronous code, on a thread without an event loop, as a router's might be."""
    seen: dict[str, object] = {}
    with DecideClientSync.connect_nats(nats_url, timeout=timedelta(seconds=5)) as client:
        seen["nats"] = client.decide(typed_request("sync-1"))
        seen["batch"] = client.decide_batch([typed_request("sync-2"), refused_request("sync-3")])
        with contextlib.suppress(RequestRefused):
            client.decide(refused_request("sync-4"))
            raise AssertionError("a refused request did not raise")
    with DecideClientSync.http(http_url) as client:
        seen["http"] = client.decide(typed_request("sync-5"))
    return seen


async def test_the_sync_client_works_from_synchronous_code(running: RunningDecide) -> None:
    seen = await asyncio.to_thread(ask_synchronously, running.nats_url, running.http_url)
    assert seen["nats"].request_id == "sync-1" and seen["nats"].reason == "chosen"
    answer, refusal = seen["batch"]
    assert answer.request_id == "sync-2" and (refusal.request_id, refusal.field) == ("sync-3", "block_size")
    assert as_json(seen["http"]) == {**as_json(seen["nats"]), "request_id": "sync-5"}
    assert await running.records() == 3


@attrs.define
class UnannouncedWorker:
    """A demo worker whose cache changes are never published: decide's inventory stays the scenario's."""

    worker: WorkerId
    cache: EngineCache

    async def serve(self, request: Request) -> CacheChange:
        return self.cache.serve(request.block_ids)


async def test_the_demo_loop_asks_decide_through_the_client(running: RunningDecide) -> None:
    workers = [UnannouncedWorker(WorkerId(f"sim-{n}"), EngineCache(64, 64)) for n in range(2)]
    requests = [Request(f"demo-{n}", tuple(range(n % 3, 6))) for n in range(6)]
    async with await DecideClient.connect_nats(running.nats_url) as client:
        score = await run_closed_loop(workers, requests, decide_asker(client), duration_s=60.0, reuse=True)
    assert (score.requests, score.decisions) == (6, 6)
    assert score.reuse_chosen == 0  # the scenario's workers hold other tokens than the demo's blocks
    assert await running.records() == 6


def test_backoff_doubles_up_to_its_ceiling_and_jitter_only_shortens_it() -> None:
    policy = RetryPolicy(attempts=6, first_backoff=timedelta(milliseconds=100), max_backoff=timedelta(milliseconds=350))
    for failed, ceiling in ((1, 0.1), (2, 0.2), (3, 0.35), (5, 0.35)):
        assert all(ceiling * 0.5 <= policy.backoff_s(failed) <= ceiling for _ in range(50))
    assert RetryPolicy(jitter=0.0).backoff_s(1) == 0.05
    # Thousands of failures in a row still wait the ceiling (the doubling once overflowed a float).
    assert RetryPolicy(attempts=6000, jitter=0.0).backoff_s(5000) == 1.0  # max_backoff
    backoff = Backoff(0.05, 2.0)
    backoff.failures = 4000
    assert backoff.delay_s == 2.0
    with pytest.raises(ValueError):
        RetryPolicy(attempts=0)
    assert DecideRequest(block_size=16).request_id != DecideRequest(block_size=16).request_id


async def test_with_decide_http_token_set_the_http_client_needs_it_and_a_refusal_is_never_recorded(nats_server) -> None:
    settings = decide_settings(nats_server.url)
    settings = attrs.evolve(settings, decide=attrs.evolve(settings.decide, http_token="router-secret"))
    async with decide_on_the_scenario(nats_server.url, settings) as running:
        for token in (None, "guess"):
            async with DecideClient.http(running.http_url, token=token, retry=RetryPolicy(attempts=3)) as client:
                with pytest.raises(DecideError, match="HTTP 401"):
                    await client.decide(typed_request(f"refused-{token}"))
        async with DecideClient.http(running.http_url, token="router-secret") as client:
            answer = await client.decide(typed_request("allowed"))
        assert answer.request_id == "allowed" and answer.target == "target"
        assert await running.records() == 1  # the refused ones never reached KV_DECISIONS


async def test_over_nats_an_answer_kv_decisions_refuses_to_record_is_never_returned(running: RunningDecide) -> None:
    """The client takes its record's ack itself: a refused record means no answer, however fast the answer came."""
    js = running.nc.jetstream()
    async with await open_client("nats", running, retry=QUICK_RETRIES) as client:
        assert (await client.decide(typed_request("before-sealing"))).request_id == "before-sealing"
        config = (await js.stream_info(running.decisions)).config
        await js.update_stream(dataclasses.replace(config, sealed=True))  # refuses every new message
        with pytest.raises(DecideUnavailable, match="after 3 attempt.*not recorded.*sealed stream"):
            await client.decide(typed_request("after-sealing"))
    assert running.metric("kvledger_decide_decisions_total") == 4.0  # each attempt was answered
    assert await running.records() == 1


class DecideProcess:
    """`kvledger decide` as a process of its own, which a test can SIGKILL and start again."""

    def __init__(self, nats_url: str) -> None:
        self.args = [sys.executable, "-m", "kvledger.app.cli", "decide", "--nats", nats_url]
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("KVLEDGER_")}
        self.env.update(KVLEDGER_DECIDE_HTTP_PORT="0", KVLEDGER_DECIDE_BACKEND="cpu")
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(self.args, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(30)


async def routers_asking_through(nats_url: str, fault: Callable[[], Awaitable[None]]) -> list[tuple[float, float, str]]:
    """16 routers ask decide (a process of its own) without pause through one DecideClient;
    after 300 answers `fault()` runs, and after 300 more the routers stop. Returns every
    answer's (asked, answered, request id), with ("fault", start, end) of the fault first."""
    patient = RetryPolicy(attempts=10_000, first_backoff=timedelta(milliseconds=20), max_backoff=timedelta(milliseconds=100))
    returned: list[tuple[float, float, str]] = []
    stop = asyncio.Event()
    async with await DecideClient.connect_nats(nats_url, timeout=timedelta(milliseconds=500), retry=patient,
                                               max_reconnect_attempts=-1, reconnect_time_wait=0.2) as client:
        # The first start may compile the kernels: the patient retries wait for it.
        await asyncio.wait_for(client.decide(typed_request("first", target=None)), 300)

        async def router(number: int) -> None:
            asked = 0
            while not stop.is_set():
                request = typed_request(f"r{number}-{asked}", target=None)
                started = time.monotonic()
                answer = await client.decide(request)
                assert answer.request_id == request.request_id
                returned.append((started, time.monotonic(), answer.request_id))
                asked += 1

        routers = [asyncio.create_task(router(number)) for number in range(16)]
        try:
            await wait_until(lambda: len(returned) >= 300, 60, "300 answers before the fault")
            fault_started = time.monotonic()
            answered_by_then = len(returned)
            await fault()
            fault_ended = time.monotonic()
            await wait_until(lambda: len(returned) >= answered_by_then + 300, 300, "300 answers after the fault")
        finally:
            stop.set()
            await asyncio.gather(*routers, return_exceptions=True)
    for task in routers:
        task.result()  # a router that failed fails the test
    return [(fault_started, fault_ended, "fault"), *returned]


async def assert_every_returned_answer_is_on_record_once(nats_url: str, returned: list[tuple[float, float, str]]) -> None:
    (fault_started, fault_ended, _), *answers = returned
    # Asked before the service was back, answered after: each took more than one attempt.
    crossing = [request_id for asked, answered, request_id in answers if asked < fault_ended < answered]
    assert crossing, "no request had to outlast the fault"
    assert any(answered < fault_started for _, answered, _ in answers)
    async with await nats.connect(nats_url) as nc:
        recorded = await message_ids(nc.jetstream(), decide_settings(nats_url).stream.decisions_stream, DECISIONS_SUBJECT)
    assert len(recorded) == len(set(recorded))  # each once: a retry under the same id is deduplicated
    assert set(recorded) == {request_id for _, _, request_id in answers} | {"first"}


async def test_every_answer_a_client_returned_is_on_record_across_a_kill_9_of_decide(nats_server) -> None:
    """decide is SIGKILLed mid-stream and started again: every answer DecideClient returned,
    before, across and after the kill, is in KV_DECISIONS, once."""
    decide = DecideProcess(nats_server.url)
    decide.start()

    async def kill_and_restart_decide() -> None:
        decide.kill()
        await asyncio.sleep(0.3)  # the requests in flight now go unanswered, and are asked again
        decide.start()

    try:
        returned = await routers_asking_through(nats_server.url, kill_and_restart_decide)
    finally:
        decide.stop()
    await assert_every_returned_answer_is_on_record_once(nats_server.url, returned)


async def test_every_answer_a_client_returned_is_on_record_across_a_kill_9_of_nats_server(nats_server) -> None:
    """nats-server (JetStream, KV_DECISIONS) is SIGKILLed mid-stream and restarted on its store:
    the acks a client took were for stored records, and the ones lost with the server are
    asked for again under the same ids."""
    decide = DecideProcess(nats_server.url)
    decide.start()

    async def kill_and_restart_nats() -> None:
        nats_server.kill()
        await asyncio.sleep(0.3)
        await asyncio.to_thread(nats_server.restart)

    try:
        returned = await routers_asking_through(nats_server.url, kill_and_restart_nats)
    finally:
        decide.stop()
    await assert_every_returned_answer_is_on_record_once(nats_server.url, returned)
