"""`kvledger decide`: the reuse decision service (docs/decide.md).

Warm-starts the index from the newest KV_SNAPSHOTS object (or replays KV_EVENTS from the
start), warms the backend up, follows KV_EVENTS live with an ordered consumer, answers
`kvledger.decide` and `kvledger.decide.batch` over NATS and `POST /v1/decide[/batch]` over
HTTP, and appends every answer to KV_DECISIONS with Nats-Msg-Id = request id so a retried
request is recorded once. A reply leaves once its record is acknowledged, or, for a NATS
request that asks to take the acknowledgement itself (`kvledger.client` does), once its
record is published with the caller's ack subject (docs/decide.md, "On record").
On every NATS reconnect and every `STREAM_CHECK_INTERVAL_S` it checks that KV_EVENTS still
holds the message the index applied last, and rebuilds the index when the stream went
backwards (docs/decide.md, "When KV_EVENTS loses messages").
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import multiprocessing
import os
import shutil
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import TYPE_CHECKING

import attrs
import nats
import nats.errors
import nats.js
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import ConsumerConfig, DeliverPolicy
import uvloop

from kvledger.core.decision_codec import (
    REQUEST_FIELDS, RECORD_ACK_HEADER, RECORD_ACK_TO_CALLER, RequestError, error_reply,
    record_ack_subject,
)
from kvledger.core.events import EVENTS_SUBJECT_PREFIX, RecordError, decode_batch
from kvledger.core.reuse import Reason, ReuseRequest
from kvledger.core.settings import ReuseSettings, Settings
from kvledger.core.snapshot import StreamPosition
from kvledger.runtime.http import HttpFront, HttpLimits, Request, Response, Route, health_routes
from kvledger.runtime.lifetime import AsyncLifetime
from kvledger.runtime.memory import mapped_zeros
from kvledger.runtime.nats_options import auth_failure, connect_options, is_auth_error
from kvledger.runtime.refetch import ask_refetch
from kvledger.runtime.streams import (
    ensure_stream,
    DECIDE_BATCH_SUBJECT,
    DECIDE_SUBJECT,
    DECISIONS_SUBJECT,
    SNAPSHOTS_BUCKET,
    decisions_stream,
    events_stream,
)
from kvledger.runtime.backoff import Backoff
from kvledger.runtime.entry import run_stage
from kvledger.runtime.system import install_stop_signals

from kvledger.decide.compiled import page_out_compiler, release_linking_ir
from kvledger.decide.inventory.index import InventoryIndex, allocate_query_arrays_with
from kvledger.decide.ranking.backend import RankingBackend, choose_backend
from kvledger.decide.ranking.cpu import compile_batch_kernels, compile_kernels, compile_single_request_kernels
from kvledger.decide.routers.dynamo_indexer import DynamoIndexerApi, compile_answer_kernels
from kvledger.decide.serving.batching import MicroBatcher
from kvledger.decide.serving.inflight import InflightLedger, InflightRouting
from kvledger.decide.serving.readers import (
    LAYOUT_PATH, IndexSharing, ReaderProcesses, counted, private_socket_path, read_only_view,
)
from kvledger.decide.serving.media import (
    MEDIA_TYPES,
    EncodedAnswers,
    Parsed,
    parse_batch,
    parse_single,
    encoded_response,
    json_bytes,
)
from kvledger.decide.metrics import DecideMetrics
from kvledger.decide.ranking.ranked import AnswerTexts
from kvledger.decide.serving.recorder import DecisionRecorder, RecordBatch, Texts, compile_record_kernels, request_header_texts
from kvledger.decide.serving.shadow import ShadowDecisions, ShadowTexts, compile_shadow_kernels, shadow_reuse
from kvledger.decide.startup import StartupError, seconds_since_process_start, settle_subscriptions
from kvledger.decide.serving.stream_check import (
    CHECK_ERRORS, MSG_ID_HEADER, NO_POSITION, StreamRegression, stream_regression, trusted_snapshot,
)

if TYPE_CHECKING:
    from kvledger.decide.routers.grpc_front import GrpcFront

log = logging.getLogger("kvledger.decide")

QUEUE_GROUP = "kvledger-decide"
# How often the index's position is checked against KV_EVENTS while running (one stream_info
# and one get_msg), and how soon again after a reconnect whose check could not be made yet.
STREAM_CHECK_INTERVAL_S = 2.0
STREAM_RECHECK_S = 0.1
# nats-py re-creates an ordered consumer after two heartbeats missed; its default (5 s) left
# decide 10-15 s behind after every nats-server restart, its consumer (in memory) being gone.
CONSUMER_HEARTBEAT_S = 1.0
_CALLER_TAKES_THE_ACK = {RECORD_ACK_HEADER: RECORD_ACK_TO_CALLER}


@attrs.frozen
class SingleRequest:
    """A single request waiting for its micro-batch, and where its record's ack goes when its caller takes it."""

    parsed: Parsed
    ack_to: str | None = None


# --- the service -----------------------------------------------------------------------------


class DecideService(AsyncLifetime):
    """The running decision service; `async with DecideService(settings) as service:`."""

    def __init__(self, settings: Settings, *, clock: Callable[[], float] = time.perf_counter) -> None:
        self.settings = settings
        self.metrics = DecideMetrics()
        self.index = InventoryIndex()
        self.backend: RankingBackend | None = None
        self.backend_line = ""
        self.http_port: int | None = None
        self.started_from: str | None = None  # the snapshot object of a warm start (or of the last rebuild)
        self.last_regression: StreamRegression | None = None  # what the last rebuild was for
        self.rebuilt_after_s: float | None = None  # from its detection until the rebuilt index caught up
        self.warm_up_seconds: float | None = None  # set before the service can become ready
        self.ready_after_process_start_s: float | None = None  # the cold start, where the OS tells it
        self._clock = clock
        self._nc: nats.NATS | None = None
        self._js: nats.js.JetStreamContext | None = None
        self._recorder: DecisionRecorder | None = None
        self._subscriptions: list[Subscription] = []
        self._singles: Subscription | None = None
        # Concurrent single requests (NATS and HTTP) are ranked and recorded together.
        self._batcher = MicroBatcher(
            self._answer_singles, window_s=settings.decide.batch_window_us / 1e6, max_batch=settings.decide.max_batch,
            failure_reply=_failure_reply,
        )
        self._http: HttpFront | None = None
        self.dynamo = DynamoIndexerApi(lambda: self.index)  # Dynamo's indexer API: reads, never recorded
        self.grpc: GrpcFront | None = None  # SGLang's and llm-d's indexer APIs (decide.grpc_listen)
        self._ready = asyncio.Event()
        self._warm_target = 0
        self._stopped = asyncio.Event()
        # The KV_EVENTS message the index applied last (seq and Msg-Id), checked against the stream,
        # and the positions it stood at when its consumer resumed, not yet checked (see _on_event).
        self._applied = NO_POSITION
        self._unchecked: list[StreamPosition] = []
        self._consumer_seq = 0
        self._events: Subscription | None = None
        self._following = 0  # bumped when the index is replaced: a consumer of an older one applies nothing
        self._rebuild_started: float | None = None
        self._check_now = asyncio.Event()
        self._watcher: asyncio.Task | None = None
        # Beside the live answer: what reuse would choose (decide/serving/shadow.py), and the blocks of
        # requests routed within the TTL (decide/serving/inflight.py).
        self.shadow: ShadowDecisions | None = None
        self.inflight = InflightRouting(InflightLedger(settings.decide.inflight_ttl_ms / 1000))
        # Index readers (decide/serving/readers.py): the query arrays shared, the readers' processes, decide's
        # Unix-socket front that answers their layout requests and what they pass on.
        self.sharing: IndexSharing | None = None
        self.readers: ReaderProcesses | None = None
        self._internal_http: HttpFront | None = None
        self._internal_http_path: str | None = None
        self._kernels_before_s = 0.0  # the kernels' loading, when it came before the readers were forked

    # lifetime

    async def start(self) -> None:
        settings = self.settings
        options = connect_options(settings.nats, name="kvledger-decide")
        # nats-py keeps retrying a refused login forever; one attempt without reconnects
        # turns bad credentials into an error at startup instead of a silent hang.
        try:
            await (await nats.connect(**options, allow_reconnect=False)).close()
        except Exception as error:
            if is_auth_error(error):
                raise auth_failure(settings.nats, error) from None
        self._nc = await nats.connect(**options, disconnected_cb=self._on_disconnected,
                                      reconnected_cb=self._on_reconnected)
        js = self._js = self._nc.jetstream()
        events_spec = events_stream(settings.stream)
        await ensure_stream(js, events_spec)
        await ensure_stream(js, decisions_stream(settings.stream))
        self._recorder = DecisionRecorder(self._nc, DECISIONS_SUBJECT, settings.stream.decisions_stream)
        await self._recorder.start()
        self._subscriptions.append(self._recorder.subscription)

        shadow = shadow_reuse(settings)
        self.shadow = ShadowDecisions(shadow) if shadow is not None else None
        if settings.decide.index_readers:
            if not hasattr(os, "memfd_create") or not os.path.isdir("/proc/self/fd"):
                raise StartupError("decide.index_readers needs Linux (memfd and /proc); set it to 0 here")
            if settings.decide.index_readers_port == settings.decide.http_port:
                raise StartupError("decide.index_readers_port must differ from decide.http_port "
                                   f"({settings.decide.http_port}): the readers share a port of their own")
            self.sharing = IndexSharing()
            allocate_query_arrays_with(self.sharing.arrays.zeros)  # before the index decide answers from is made
            self.dynamo.changed = lambda: self.sharing.publish(self.index, self.dynamo.registry)
            await self._fork_readers()
        await self._load_index()
        await self._start_backend()
        await self._follow_events()
        self._watcher = asyncio.create_task(self._watch_stream(), name="decide-stream-check")
        self._singles = await self._nc.subscribe(DECIDE_SUBJECT, queue=QUEUE_GROUP, cb=self._on_single)
        self._subscriptions.append(self._singles)
        self._subscriptions.append(await self._nc.subscribe(DECIDE_BATCH_SUBJECT, queue=QUEUE_GROUP, cb=self._on_batch))
        await settle_subscriptions(self._nc)  # the server has our interest before anyone is told we started
        limits = HttpLimits(idle_timeout_s=settings.decide.http_idle_timeout_s, body_timeout_s=settings.decide.http_body_timeout_s)
        self._http = await HttpFront(
            self._routes(), settings.decide.http_host, settings.decide.http_port, limits=limits,
            token=settings.decide.http_token,
        ).start()
        self.http_port = self._http.port
        if self.sharing is not None:
            await self._start_internal_front(limits)
        log.info("decide: NATS %s and %s; HTTP front, metrics and health on :%d",
                 DECIDE_SUBJECT, DECIDE_BATCH_SUBJECT, self.http_port)
        # --- gRPC front (decide/routers/grpc_front.py): SGLang's KVIndexer and llm-d's IndexerService ---
        if settings.decide.grpc_listen is not None:
            # Imported only here: grpc and protobuf are about 20 MB of a decide process that serves no gRPC.
            from kvledger.decide.routers.grpc_front import GrpcFront, load_router_settings

            self.grpc = GrpcFront(lambda: self.index, self.metrics, settings.decide.grpc_listen,
                                  routers=load_router_settings(settings.decide.grpc_routers),
                                  max_message_bytes=settings.decide.grpc_max_message_bytes)
            await self.grpc.start()
        # --- end of the gRPC front ---
        self._check_warm()

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
            self._watcher = None
        if self._http is not None:
            await self._http.close()  # requests in progress are answered first
            self._http = None
        if self.grpc is not None:  # the gRPC front (decide/routers/grpc_front.py)
            await self.grpc.close()
            self.grpc = None
        if self.readers is not None:
            await self.readers.close()
            self.readers = None
        if self._internal_http is not None:
            await self._internal_http.close()
            self._internal_http = None
        if self._internal_http_path is not None:  # made when the readers were forked, before the front started
            shutil.rmtree(os.path.dirname(self._internal_http_path), ignore_errors=True)
            self._internal_http_path = None
        if self.sharing is not None:
            allocate_query_arrays_with(mapped_zeros)
        if self._events is not None:
            self._subscriptions.append(self._events)
            self._events = None
        for subscription in self._subscriptions:
            try:
                await subscription.unsubscribe()
            except Exception:  # the connection may already be gone; nothing left to undo
                pass
        self._subscriptions.clear()
        # Requests already taken are answered (and recorded) before the connection drains.
        await self._batcher.close()
        if self._nc is not None and not self._nc.is_closed:
            try:
                await self._nc.drain()
            except nats.errors.ConnectionReconnectingError:
                # Nothing drains through a connection that is not up; closing it flushes what was
                # queued meanwhile into the lost socket, and the client is closed all the same.
                with contextlib.suppress(OSError):
                    await self._nc.close()
        self._nc = None
        if self.backend is not None:
            self.backend.close()
        self._stopped.set()

    async def _fork_readers(self) -> None:
        """The index readers, forked once every kernel is loaded and before the index is: they share decide's
        modules and kernels, and no page of an index (a snapshot's, or arrays decide replaces later) stays in
        them once decide lets it go. Each listens once decide's Unix-socket front answers it
        (`_start_internal_front`)."""
        settings = self.settings.decide
        limits = HttpLimits(idle_timeout_s=settings.http_idle_timeout_s, body_timeout_s=settings.http_body_timeout_s)
        self._internal_http_path = private_socket_path()
        # Every kernel loaded first, the readers' (their arrays are read-only: a type of their own) and decide's:
        # loading writes to numba's and LLVM's pages, which would then stay copied in decide.
        started = time.perf_counter()
        await asyncio.to_thread(compile_answer_kernels, read_only_view(self.index))
        await self._compile_kernels()
        _hand_back_compiler_memory()
        self._kernels_before_s = time.perf_counter() - started  # part of the warm-up (`_start_backend`)
        self.readers = ReaderProcesses(
            settings.index_readers, host=settings.http_host, port=settings.index_readers_port,
            socket_path=self._internal_http_path, control=self.sharing.arrays.handle(self.sharing.control),
            token=settings.http_token, limits=limits, max_request_bytes=settings.http_max_request_bytes,
            max_query_bytes=settings.http_max_batch_bytes, restarted=self.metrics.reader_restarts.inc)
        self.readers.start()

    async def _start_internal_front(self, limits: HttpLimits) -> None:
        """decide's Unix-socket front: the layout, and what the readers pass on; the readers listen once it answers."""
        settings = self.settings.decide
        routes = self.dynamo.routes(max_request_bytes=settings.http_max_request_bytes,
                                    max_query_bytes=settings.http_max_batch_bytes)
        for path in ("/query", "/query_by_hash"):  # a reader passes a query on only when it could not answer
            routes[("POST", path)] = counted(routes[("POST", path)], self.metrics.reader_queries_passed_on.inc)
        routes[("GET", LAYOUT_PATH)] = self.sharing.layout_route(lambda: self.index, self.dynamo.registry)
        self._internal_http = await HttpFront(routes, "", 0, limits=limits, token=settings.http_token,
                                              unix_path=self._internal_http_path).start()
        log.info("decide: %d index readers on :%d", settings.index_readers, settings.index_readers_port)

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Return once the index has caught up with KV_EVENTS as it was at startup (after a rebuild: when it began)."""
        await asyncio.wait_for(self._ready.wait(), timeout)

    def _check_warm(self) -> None:
        # Ready needs both: caught up with KV_EVENTS, and listening, so the cold start
        # measured here ends when a client can be answered.
        listening = self.http_port is not None
        if not self._ready.is_set() and listening and self.index.inventory_seq >= self._warm_target:
            if self._rebuild_started is not None:
                self.rebuilt_after_s = time.monotonic() - self._rebuild_started
                self._rebuild_started = None
                self.metrics.rebuild_seconds.set(self.rebuilt_after_s)
                self._ready.set()
                log.info("decide: index rebuilt; ready again at inventory_seq %d, %.3f s after the loss was detected",
                         self.index.inventory_seq, self.rebuilt_after_s)
                return
            self.ready_after_process_start_s = seconds_since_process_start()
            self._ready.set()
            if self.ready_after_process_start_s is None:
                log.info("decide: ready at inventory_seq %d", self.index.inventory_seq)
            else:
                log.info("decide: ready at inventory_seq %d, %.2f s after the process started",
                         self.index.inventory_seq, self.ready_after_process_start_s)

    async def _compile_kernels(self) -> None:
        """The compiled CPU kernels decide runs, compiled or loaded from the kernel cache in a worker thread."""
        await asyncio.to_thread(compile_kernels, self.settings.reuse)
        await asyncio.to_thread(compile_record_kernels)
        await asyncio.to_thread(compile_answer_kernels, self.index)  # a router's first /query
        if self.shadow is not None:
            await asyncio.to_thread(compile_shadow_kernels, self.settings.reuse, self.shadow.reuse)

    async def _start_backend(self) -> None:
        """Choose the backend, compile it and answer once, so neither the first client nor /readyz waits on it.

        The compiled CPU kernels (shared by both backends) are compiled or loaded in a worker
        thread: on a machine's first start that takes a while, and `kvledger up` runs ingest
        and store on this same loop. The backend itself starts on the loop thread: a CUDA
        context is current only in the thread that made it, and this loop answers later.
        """
        started = time.perf_counter()
        if self.readers is None:  # else loaded before the readers were forked (`_fork_readers`)
            await self._compile_kernels()
        self.backend, self.backend_line = choose_backend(self.settings.decide.backend, self.index)
        log.info("decide: %s", self.backend_line)
        # Every answer's reason at 0 from the start, so a dashboard's rate() sees the first of each.
        for reason in (value for name, value in vars(Reason).items() if not name.startswith("_")):
            self.metrics.decisions.labels(self.backend.name, reason)
        self.metrics.expect("field", REQUEST_FIELDS)
        self.backend.warm_up(self.settings.reuse)
        # With readers, handed back before the fork: walking every object now would copy each page decide still
        # shares with them.
        if self.readers is None:
            _hand_back_compiler_memory()
        self.warm_up_seconds = time.perf_counter() - started + self._kernels_before_s
        self.metrics.warm_up.set(self.warm_up_seconds)
        log.info("decide: backend warmed up in %.1f ms", self.warm_up_seconds * 1000)

    # following KV_EVENTS

    async def _load_index(self) -> None:
        """A fresh index: from the newest snapshot KV_EVENTS still reproduces, else empty (replayed from the start)."""
        assert self._js is not None
        stream = self.settings.stream.events_stream
        warm = await trusted_snapshot(self._js, stream)
        if warm is not None:
            self.index, self.started_from, self._applied = warm.index, warm.name, warm.position
            log.info("decide: warm start from snapshot %s (stream seq %d)", warm.name, warm.position.seq)
        else:
            self.index, self.started_from, self._applied = InventoryIndex(), None, NO_POSITION
            log.info("decide: no snapshot in %s that %s still holds; replaying it from the start", SNAPSHOTS_BUCKET, stream)
        if self.backend is not None:
            self.backend.use_index(self.index)
        if self.sharing is not None:
            self.sharing.publish(self.index, self.dynamo.registry)

    async def _follow_events(self) -> None:
        """Follow KV_EVENTS from the index's seq on with an ordered consumer; ready once at the stream's last seq."""
        assert self._js is not None
        stream = self.settings.stream.events_stream
        info = await self._js.stream_info(stream)
        self._warm_target = info.state.last_seq
        start_seq = max(self.index.inventory_seq + 1, info.state.first_seq, 1)
        self.metrics.inventory_lag.set(max(self._warm_target - start_seq + 1, 0))
        self._report_index()
        following = self._following
        self._consumer_seq = 0
        self._events = await self._js.subscribe(
            f"{EVENTS_SUBJECT_PREFIX}.>", stream=stream, ordered_consumer=True, idle_heartbeat=CONSUMER_HEARTBEAT_S,
            cb=functools.partial(self._on_event, following=following),
            config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start_seq),
        )

    async def _on_disconnected(self) -> None:
        self._resumed()

    async def _on_reconnected(self) -> None:
        self._check_now.set()  # a restarted server may have come back with less than it acknowledged

    def _resumed(self) -> None:
        """What comes next may come from a stream that lost messages: where the index stands is checked first."""
        if not self._unchecked or self._unchecked[-1] != self._applied:
            self._unchecked.append(self._applied)
        self._check_now.set()

    async def _watch_stream(self) -> None:
        """Check the index's position against KV_EVENTS after every reconnect and every few seconds."""
        stream = self.settings.stream.events_stream
        urgent = False
        while True:
            try:
                await asyncio.wait_for(self._check_now.wait(), STREAM_RECHECK_S if urgent else STREAM_CHECK_INTERVAL_S)
            except TimeoutError:
                pass
            urgent = urgent or self._check_now.is_set()
            self._check_now.clear()
            assert self._js is not None
            unchecked = list(self._unchecked)
            try:
                regression = None
                for position in [*unchecked, self._applied]:
                    regression = regression or await stream_regression(self._js, stream, position)
                urgent = False
                if regression is not None:
                    await self._rebuild(regression)
                else:
                    del self._unchecked[:len(unchecked)]  # those added meanwhile wait for the next check
            except CHECK_ERRORS as error:  # e.g. JetStream still recovering its streams after a restart
                log.debug("decide: KV_EVENTS could not be checked yet (%s: %s)", type(error).__name__, error)
            except Exception:  # a bug here must not end the checks for the rest of the process
                log.exception("decide: checking KV_EVENTS failed")

    async def _rebuild(self, regression: StreamRegression) -> None:
        """Replace the index by one KV_EVENTS reproduces; answers go on from it, not ready until it caught up."""
        self.metrics.stream_regressions.inc()
        self.last_regression = regression
        self._rebuild_started = time.monotonic()
        log.warning("decide: %s; rebuilding the index from a state the stream reproduces", regression.describe())
        self._ready.clear()
        self._following += 1
        self._unchecked.clear()
        events, self._events = self._events, None
        if events is not None:
            try:
                await events.unsubscribe()
            except Exception:  # its consumer may be gone with the server's lost state; nothing left to undo
                pass
        retry = Backoff(first_s=STREAM_RECHECK_S, limit_s=STREAM_CHECK_INTERVAL_S)
        while True:
            try:
                await self._load_index()
                await self._follow_events()
                break
            except CHECK_ERRORS as error:  # the server went away again meanwhile
                log.warning("decide: rebuilding the index failed (%s: %s); retrying", type(error).__name__, error)
                await retry.wait()
        self._check_warm()

    async def _on_event(self, msg: Msg, following: int) -> None:
        if following != self._following:
            return  # delivered to the consumer of an index already replaced
        metadata = msg.metadata
        stream_seq = metadata.sequence.stream
        consumer_seq = metadata.sequence.consumer
        if consumer_seq != self._consumer_seq + 1:
            # nats-py re-created the ordered consumer (after a stall or a reconnect) from the seq
            # after ours: it follows the stream as it is now, which may have reused the seqs of
            # messages the index applied. Checking where the index stands now would compare a
            # new message with itself; the position before the consumer resumed is checked.
            self._resumed()
        self._consumer_seq = consumer_seq
        if stream_seq > self._applied.seq:  # a restored consumer may deliver again what the index has
            self._applied = StreamPosition(stream_seq, (msg.headers or {}).get(MSG_ID_HEADER, ""))
        try:
            batch = decode_batch(msg.data)
        except RecordError as error:
            # ingest dead-letters what it cannot normalise; a record that still fails here is
            # counted and passed over rather than stopping the index.
            self.metrics.undecodable_events.inc()
            log.warning("decide: KV_EVENTS seq %d undecodable (%s); skipped", stream_seq, error)
            batch = None
        with self._index_written():
            if batch is None:
                self.index.skip(stream_seq)
            else:
                self.index.apply(batch, stream_seq)
        if batch is not None:
            holes = self.index.take_holes()
            if holes and self._nc is not None:
                self.metrics.refetch_requests.inc(await ask_refetch(self._nc, holes, "decide"))
        self.metrics.inventory_lag.set(metadata.num_pending)
        self._report_index()
        self._check_warm()

    @contextlib.contextmanager
    def _index_written(self):
        """Around every change to the index: index readers keep no answer given while it changes."""
        sharing = self.sharing
        if sharing is None:
            yield
            return
        sharing.begin_write()
        try:
            yield
        finally:
            sharing.end_write(self.index, self.dynamo.registry)

    def _report_index(self) -> None:
        """The index gauges, from startup on: after a warm start they must not read 0."""
        self.metrics.inventory_seq.set(self.index.inventory_seq)
        self.metrics.index_size.set(self.index.size)
        self.metrics.workers.set(self.index.worker_count)
        self.metrics.promoted_workers.set(self.index.promoted_count)
        self.metrics.index_bytes.set(self.index.array_bytes)

    # answering

    def decide_many(self, requests: Sequence[ReuseRequest]) -> AnswerTexts:
        """Rank requests with the chosen backend and record the metrics."""
        return self._decide_many(requests)[0]

    def _decide_many(self, requests: Sequence[ReuseRequest]) -> tuple[AnswerTexts, ShadowTexts | None]:
        """The live answers, with the metrics recorded, and with `decide.shadow` the shadow's part of the records."""
        assert self.backend is not None, "answering starts after start() chose the backend"
        started = time.perf_counter()
        inflight = bool(self.inflight.ledger.ttl_s or any(request.fallback is not None for request in requests))
        both = (self.shadow.answer_with_live(self.backend, requests, self.settings.reuse, inflight=inflight,
                                             clock=self._clock) if self.shadow is not None else None)
        if both is not None:
            answers, shadows = both
        elif inflight:
            answers = self.inflight.answer(self.backend, requests, self.settings.reuse, clock=self._clock)
        else:
            answers = self.backend.answer_texts(requests, self.settings.reuse, clock=self._clock)
        elapsed = time.perf_counter() - started
        name = self.backend.name
        self.metrics.latency.labels(name, "single" if len(requests) == 1 else "batch").observe(elapsed)
        self.metrics.batch_size.observe(len(requests))
        for reason, number in answers.reason_counts.items():
            self.metrics.decisions.labels(name, reason).inc(number)
            if reason == Reason.BUDGET_EXHAUSTED:
                self.metrics.budget_exhausted.inc(number)
        if both is None and self.shadow is not None:
            shadows = self.shadow.answer(self.backend, requests, answers, clock=self._clock)
        elif both is None:
            shadows = None
        return answers, shadows

    def refuse(self, error: RequestError) -> dict:
        """Count a refused request; its error reply."""
        self.metrics.malformed.labels(error.top_field).inc()
        return error.as_json()

    async def answer(self, items: Sequence[Parsed], ack_to: Sequence[str | None] = ()) -> EncodedAnswers:
        """The JSON of each request's answer (or of the error naming its field), answers recorded in KV_DECISIONS:
        acknowledged, or published with `ack_to[position]` as the subject its caller takes the ack on."""
        parts: list[bytes] = [b""] * len(items)
        refused: set[int] = set()
        valid: list[tuple[int, ReuseRequest]] = []
        for position, item in enumerate(items):
            if isinstance(item, RequestError):
                parts[position] = json_bytes(self.refuse(item))
                refused.add(position)
            else:
                valid.append((position, item))
        # Answers go from the ranked arrays straight to JSON, the same bytes that are recorded.
        if valid:
            requests = [request for _, request in valid]
            answers, shadows = self._decide_many(requests)
            relied = shadows.relied_prefixes if shadows is not None else answers.relied_prefixes
            # Each record carries its request, for a what-if replay (one compiled call for the batch).
            asked = (request_header_texts(requests, answers.arrays, answers.targets)
                     if self.settings.decide.record_requests else None)
            for (position, _), payload in zip(valid, answers.answers):
                parts[position] = payload
            arrays = answers.arrays
            await self._record(RecordBatch(
                [request.request_id for request in requests], answers.answers, relied, asked,
                shadows.headers if shadows is not None else None,
                [ack_to[position] for position, _ in valid] if ack_to else None,
                Texts(arrays.ids, arrays.id_bounds) if arrays is not None else None,
            ))
        return EncodedAnswers(tuple(parts), frozenset(refused))

    async def _record(self, records: RecordBatch) -> None:
        """Append answers to KV_DECISIONS and wait for the acks, so a client's answer is on record."""
        assert self._recorder is not None
        await self._recorder.record(records)

    async def _answer_singles(self, singles: Sequence[SingleRequest]) -> EncodedAnswers:
        return await self.answer([single.parsed for single in singles], [single.ack_to for single in singles])

    async def _on_single(self, msg: Msg) -> None:
        # nats-py awaits one callback at a time per subscription: answering here would
        # serialise every client. The request joins the current micro-batch, whose own task
        # sends the reply once the answer is on record, or on its way there with the ack
        # going to a caller that asked to take it.
        parsed = parse_single(msg.data)
        if isinstance(parsed, RequestError):
            await self._respond(msg.reply, json_bytes(self.refuse(parsed)))
            return
        if msg.reply and msg.headers and msg.headers.get(RECORD_ACK_HEADER) == RECORD_ACK_TO_CALLER:
            single = SingleRequest(parsed, record_ack_subject(msg.reply))
            deliver = functools.partial(self._reply_taking_the_ack, msg.reply)
            # Its answer waits on no ack: alone, it is answered here, two turns of the loop
            # sooner than in a batch of one; with others waiting, or a window set, it joins them.
            if self._batcher.answers_alone and self._singles is not None and not self._singles.pending_msgs:
                await self._batcher.answer_alone(single, deliver)
            else:
                self._batcher.enqueue(single, deliver)
        else:
            self._batcher.enqueue(SingleRequest(parsed), functools.partial(self._reply, msg.reply))

    async def _reply_taking_the_ack(self, reply: str, data: bytes, answered: bool) -> None:
        """The reply to a caller that takes its record's ack; the header says an ack is coming, with an answer only."""
        await self._respond(reply, data, _CALLER_TAKES_THE_ACK if answered else None)

    async def _reply(self, reply: str, data: bytes, _answered: bool) -> None:
        await self._respond(reply, data)

    async def _respond(self, reply: str, data: bytes, headers: dict[str, str] | None = None) -> None:
        # Not `Msg.respond`: it sends the request's own headers back, and a reply's
        # headers say how its answer was recorded.
        assert self._nc is not None
        await self._nc.publish(reply, data, headers=headers)

    async def _on_batch(self, msg: Msg) -> None:
        parsed = parse_batch(msg.data)
        if isinstance(parsed, RequestError):
            await self._respond(msg.reply, json_bytes(self.refuse(parsed)))
            return
        try:
            reply = (await self.answer(parsed)).as_list()
        except Exception as failure:  # e.g. KV_DECISIONS unreachable: say so rather than let the client time out
            reply = _failure_reply(failure)
        await self._respond(msg.reply, reply)

    # HTTP front

    def _routes(self) -> dict[tuple[str, str], Route]:
        settings = self.settings.decide
        routes = health_routes(lambda: self.ready, self.metrics.text,
                               metrics_need_token=settings.http_token_for_metrics)
        # With a token set, a request without it is refused before its body is read: it never reaches the audit log.
        routes[("POST", "/v1/decide")] = Route(
            functools.partial(self._http_decide, batch=False), settings.http_max_request_bytes, needs_token=True,
        )
        routes[("POST", "/v1/decide/batch")] = Route(
            functools.partial(self._http_decide, batch=True), settings.http_max_batch_bytes, needs_token=True,
        )
        routes.update(self.dynamo.routes(max_request_bytes=settings.http_max_request_bytes,
                                         max_query_bytes=settings.http_max_batch_bytes))
        return routes

    async def _http_decide(self, request: Request, *, batch: bool) -> Response:
        media_type = request.media_type
        if media_type not in MEDIA_TYPES:
            return Response.json(self.settings.decide.reject_media_status_code, RequestError(
                "content-type", f"expected application/json or application/msgpack, got {media_type or 'none'!r}",
            ).as_json())
        parsed = parse_batch(request.body, media_type) if batch else parse_single(request.body, media_type)
        if isinstance(parsed, RequestError):
            return encoded_response(400, self.refuse(parsed), media_type)
        if batch:
            return encoded_response(200, (await self.answer(parsed)).as_list(), media_type)
        part, refused = await self._batcher.submit(SingleRequest(parsed))
        return encoded_response(400 if refused else 200, part, media_type)


def _hand_back_compiler_memory() -> None:
    """Once every kernel is loaded, what only compiling needs: the IR numba keeps beside each kernel kept as
    bitcode (`release_linking_ir`) and LLVM's pages reclaimed (`page_out_compiler`); about 90 MB less resident."""
    released = release_linking_ir()
    asked = page_out_compiler()
    log.info("decide: the linking IR of %d kernel libraries kept as bitcode, %.0f MB of the compiler's mappings "
             "handed back", released, asked / 1e6)


def compile_every_kernel(reuse: ReuseSettings, *, side_by_side: bool = False) -> None:
    """Every kernel decide may compile before it answers, whatever it is configured to do (`_compile_kernels` and
    `_fork_readers` compile those of its configuration): the service image compiles them all into its kernel
    cache, so that a new container loads them and is ready in seconds.

    `side_by_side`: half of them compiled by a second process at the same time (numba compiles on one core; the
    two halves share few kernels: 80 s against 131 s on two cores), which writes them to the kernel cache,
    where this process then loads them. The kernel cache must be one both processes see (it is by default)."""
    if side_by_side:
        try:
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                second_half = pool.submit(_compile_second_half, reuse)
                _compile_first_half(reuse)
                second_half.result()
            _compile_second_half(reuse)  # loaded from the kernel cache
            return
        except (OSError, BrokenProcessPool) as error:  # no second process here: this one compiles both halves
            log.warning("decide: kernels compiled in one process (no second one: %s)", error)
    _compile_first_half(reuse)
    _compile_second_half(reuse)


def _compile_first_half(reuse: ReuseSettings) -> None:
    compile_single_request_kernels(reuse)
    compile_record_kernels()
    compile_answer_kernels(read_only_view(InventoryIndex()))  # the index readers'


def _compile_second_half(reuse: ReuseSettings) -> None:
    compile_batch_kernels(reuse)
    compile_answer_kernels(InventoryIndex())
    compile_shadow_kernels(reuse, reuse)


def _failure_reply(failure: Exception) -> bytes:
    """The error reply to requests whose answers could not be given or recorded (called while handling `failure`)."""
    log.exception("decide: request failed")
    return json_bytes(error_reply(None, f"internal error: {type(failure).__name__}: {failure}"))


# --- the command ---------------------------------------------------------------------------------


async def serve(settings: Settings) -> None:
    """Run until SIGINT or SIGTERM, then shut down cleanly."""
    stop = asyncio.Event()
    install_stop_signals(stop)
    async with DecideService(settings):
        await stop.wait()


def run(settings: Settings) -> int:
    # uvloop's loop (libuv) under the HTTP front's protocol and NATS: less CPU per router query than asyncio's
    # own loop (bench/router_index.py runs decide this way).
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return run_stage("decide", lambda: serve(settings), refusals=(StartupError,))
