"""Fault tests on a three-node JetStream cluster: kill -9 of one node mid-stream, then its restart.

The node killed leads, in turn, KV_EVENTS alone; KV_EVENTS and store's durable consumer
together; the consumer alone; or is the node ingest publishes through and nothing else,
each while simulated vLLM workers are sending (leaders are moved there first by graceful
stepdowns). Streams are at R3, so the cluster keeps serving; afterwards every batch must be
in KV_EVENTS once and in SQL once (SQLite and PostgreSQL), no worker uncertain, and decide,
which ran through the fault, must answer as the reference model does on a fold rebuilt
from the stream. ingest and store run as processes, as in production; decide runs here.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from pathlib import Path
from typing import Literal

import nats
import nats.errors
import pytest

from cluster import LocalNatsCluster
from kvledger.decide.serving.service import DecideService
from engines import read_stream, wait_until
from kvledger.core.decision_codec import decision_to_json
from kvledger.core.events import Gap, decode_batch
from kvledger.core.fold import InventoryFold
from kvledger.core.reuse import ReuseRequest, decide
from kvledger.runtime.nats_options import connect_options
from kvledger.sim.fleet import SimulatedFleet
from kvledger.sim.workload import DEMO_BLOCK_SIZE, Request, request_tokens, synthetic_requests
from pipeline import IngestProcess, Pipeline, pipeline_settings, truth_inventory
from kvledger.store import database
from kvledger.store.projector import EVENTS_DURABLE
from store_harness import StoreProcess

pytestmark = pytest.mark.service

REPLICAS = 3
REUSE_ON = {"reuse.enable_decode_to_prefill_reuse": True, "reuse.enable_decode_to_prefill_gpu_reuse": True,
            "reuse.transfer_source_lookup_budget_ms": 1e6}
PACE_S = 0.03  # between two requests: some 30 engine batches a second over the fleet
BEFORE_KILL = 100  # batches sent (and projected) at that pace before the burst
BURST = 200  # batches sent as fast as this loop turns; the node dies in the middle of them
AFTER_RESTART = 60  # batches sent after the node is back
FAILOVER_S = 30.0  # how long the test waits for the cluster to carry on without the killed node
SETTLE_S = 45.0
DECIDE_CHECKS = 9


class ClusterPipeline(Pipeline):
    """Pipeline against a cluster: ingest and store as processes (a store in this process would share
    the simulated engines' event loop), decide here."""

    def __init__(self, settings, fleet: SimulatedFleet, log_dir: Path) -> None:
        super().__init__(settings, fleet, ingest_as_process=True)
        self.log_dir = log_dir
        self.store_process: StoreProcess | None = None

    async def __aenter__(self) -> ClusterPipeline:
        with database.opened(self.settings.db.url) as engine:
            database.upgrade(engine)
        try:
            self.ingest = IngestProcess(self.settings, self.fleet)
            await self.ingest.start()
            self.store_process = StoreProcess(
                self.settings.nats.url, self.settings.db.url, self.log_dir / "store.log", environment={
                    "KVLEDGER_STREAM_REPLICAS": str(self.settings.stream.replicas),
                    "KVLEDGER_STORE_SNAPSHOT_EVERY_EVENTS": str(self.settings.store.snapshot_every_events),
                },
            )  # fmt: skip
            self.decide = await DecideService(self.settings).__aenter__()
            self.nc = await nats.connect(**connect_options(self.settings.nats, name="kvledger-test"),
                                         max_reconnect_attempts=-1, reconnect_time_wait=0.2)
        except BaseException as error:
            await self.__aexit__(type(error), error, error.__traceback__)
            raise
        return self

    async def __aexit__(self, exc_type, *exc_info: object) -> None:
        try:
            await super().__aexit__(exc_type, *exc_info)
        finally:
            if self.store_process is not None:
                await self.store_process.stop()
        if exc_type is not None:  # pytest shows this beside the failure
            if self.ingest is not None and self.ingest.process is not None:
                print(f"--- ingest log (tail):\n{self.ingest.process.stderr.read().decode(errors='replace')[-3000:]}")
            if self.store_process is not None:
                print(f"--- store log (tail):\n{self.store_process.log()}")


class Traffic:
    """`async with Traffic(fleet, requests):` the workers serve requests round-robin in the background."""

    def __init__(self, fleet: SimulatedFleet, requests) -> None:
        self.fleet = fleet
        self._requests = requests
        self.served: list[Request] = []
        self.pace_s = PACE_S  # 0 = as fast as this loop turns
        self._task: asyncio.Task | None = None

    @property
    def batches(self) -> int:
        return sum(worker.engine.batches_published for worker in self.fleet.workers)

    async def __aenter__(self) -> Traffic:
        self._task = asyncio.create_task(self._serve(), name="traffic")
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def _serve(self) -> None:
        workers = itertools.cycle(self.fleet.workers)
        for request in self._requests:
            await next(workers).serve(request)
            self.served.append(request)
            await asyncio.sleep(self.pace_s)

    async def sent(self, batches: int, timeout: float = 30) -> None:
        """Wait until the engines have published `batches` batches in all."""

        def enough() -> bool:
            if self._task.done():
                self._task.result()  # say why it stopped
            return self.batches >= batches

        await wait_until(enough, timeout, f"{batches} engine batches sent")

    async def stop(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass


# --- who gets killed ------------------------------------------------------------------

Role = Literal["stream leader", "stream and consumer leader", "consumer leader", "ingest's node"]


async def ingest_node(cluster: LocalNatsCluster) -> str:
    # version "kvledger-ingest" is ingest's publishing connection, not its nats-py one.
    return await wait_until(
        lambda: cluster.node_of_connection("kvledger-ingest", version="kvledger-ingest"), 10, "ingest's node"
    )


async def roles(cluster: LocalNatsCluster, settings) -> str:
    stream = await cluster.stream_leader(settings.stream.events_stream)
    consumer = await cluster.consumer_leader(settings.stream.events_stream, EVENTS_DURABLE)
    return f"meta {cluster.meta_leader()}, KV_EVENTS {stream}, consumer {consumer}, ingest {await ingest_node(cluster)}"


async def place(cluster: LocalNatsCluster, settings, role: Role) -> str:
    """Put KV_EVENTS's leader, store's consumer leader and ingest where `role` wants them; return the node to kill.

    Each role has the node to itself, except "stream and consumer leader", where both leaders share it.
    """
    stream = settings.stream.events_stream
    await cluster.consumer_leader(stream, EVENTS_DURABLE)  # store has bound its consumer
    ingest = await ingest_node(cluster)  # ingest takes the first node of its list that answers
    first, second = [name for name in cluster.nodes if name != ingest]
    stream_to, consumer_to, victim = {
        "stream leader": (first, second, first),
        "stream and consumer leader": (first, first, first),
        "consumer leader": (second, first, first),
        "ingest's node": (first, second, ingest),
    }[role]
    await cluster.move_stream_leader(stream, stream_to)
    await cluster.move_consumer_leader(stream, EVENTS_DURABLE, consumer_to)
    return victim


# --- the scenario -----------------------------------------------------------------------


async def kill_mid_stream_and_restart(cluster: LocalNatsCluster, db_url: str, role: Role, seed: int, log_dir: Path) -> None:
    requests = synthetic_requests(100_000, seed=seed)
    started = time.monotonic()

    def say(line: str) -> None:
        print(f"{time.monotonic() - started:5.1f}s {line}")

    async with SimulatedFleet(3, gpu_blocks=48, cpu_blocks=96) as fleet:
        settings = pipeline_settings(cluster.urls, db_url, **{"stream.replicas": REPLICAS, **REUSE_ON})
        async with ClusterPipeline(settings, fleet, log_dir) as pipeline:
            victim = await place(cluster, settings, role)
            async with Traffic(fleet, requests) as traffic:
                await traffic.sent(BEFORE_KILL)
                # Again: store rebinding its consumer (on any NATS error) places it anew.
                assert await place(cluster, settings, role) == victim
                say(f"{traffic.batches} batches sent, store at {_checkpoint(pipeline)}: {await roles(cluster, settings)}")
                # A burst, so that ingest and the consumer have batches in flight when the node dies.
                traffic.pace_s = 0
                await traffic.sent(traffic.batches + BURST // 2)
                sent_at_kill = traffic.batches
                cluster.kill(victim)
                say(f"killed {victim} ({role}) with {sent_at_kill} batches sent, store at {_checkpoint(pipeline)}")
                await traffic.sent(traffic.batches + BURST // 2)
                traffic.pace_s = PACE_S
                # Without the node the cluster should carry on (batches sent after the kill reach SQL). How long
                # that takes is not this test's contract, so the node is restarted after FAILOVER_S regardless.
                try:
                    await wait_until(lambda: _checkpoint(pipeline) > sent_at_kill, FAILOVER_S, "store past the kill")
                    say(f"store past the kill without {victim}: {await roles(cluster, settings)}")
                except AssertionError:
                    say(f"store not past the kill after {FAILOVER_S:.0f}s without {victim}, at {_checkpoint(pipeline)}")
                await cluster.restart_async(victim)
                say(f"{victim} back: {await roles(cluster, settings)}")
                await traffic.sent(traffic.batches + AFTER_RESTART)
            sent = traffic.batches
            last = await pipeline.settled(sent, timeout=SETTLE_S)
            say(f"settled: {sent} batches, KV_EVENTS at {last}")
            await assert_every_batch_once(pipeline, fleet, cluster, sent)
            assert pipeline.sql_inventory() == truth_inventory(fleet)
            await assert_decide_matches_the_fold(pipeline, cluster, traffic.served[-DECIDE_CHECKS:], last)
            say("decide answers as the reference does")
            say(f"store's warnings: {'; '.join(pipeline.store_process.warnings()) or 'none'}")


async def _stream_batches(cluster: LocalNatsCluster, stream: str) -> list:
    """Every batch in `stream` as (batch, stream seq); the read is retried while the cluster settles after the restart."""
    for attempt in range(20):
        try:
            messages = await read_stream(cluster.url_list, stream)
            return [(decode_batch(data), seq) for seq, _, data in messages]
        except (nats.errors.Error, TimeoutError):  # e.g. 503: a JetStream API request without a responder yet
            if attempt == 19:
                raise
            await asyncio.sleep(0.5)
    raise AssertionError("unreachable")


def _checkpoint(pipeline: ClusterPipeline) -> int:
    rows = pipeline.sql(f"SELECT stream_seq FROM checkpoints WHERE stream = '{pipeline.settings.stream.events_stream}'")
    return rows[0][0] if rows else 0


def _ranges(seqs: list[int]) -> str:
    """`[3, 4, 5, 9]` → "3-5, 9", as a hole is reported."""
    spans = []
    for _, run in itertools.groupby(enumerate(sorted(seqs)), key=lambda pair: pair[1] - pair[0]):
        values = [seq for _, seq in run]
        spans.append(f"{values[0]}-{values[-1]}" if len(values) > 1 else str(values[0]))
    return ", ".join(spans)


def _out_of_engine_order(batches: list) -> list[str]:
    """Where KV_EVENTS holds a worker's batches out of engine order: the fold takes that for a hole."""
    found = []
    by_worker: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)
    for batch, seq in sorted(batches, key=lambda pair: pair[1]):
        by_worker[batch.worker.publisher].append((seq, batch.seq))
    for publisher, seqs in sorted(by_worker.items()):
        highest, late = -1, []
        for stream_seq, engine_seq in seqs:
            if engine_seq < highest:
                late.append((stream_seq, engine_seq))
            highest = max(highest, engine_seq)
        if late:
            overtaking = min(stream for stream, engine in seqs if engine > min(e for _, e in late))
            found.append(
                f"{publisher}: KV_EVENTS holds engine seqs {_ranges([e for _, e in late])} late, at {len(late)} stream "
                f"seqs from {late[0][0]} to {late[-1][0]}, after a later engine seq already at stream seq {overtaking}"
            )
    return found


async def assert_every_batch_once(pipeline: ClusterPipeline, fleet: SimulatedFleet, cluster: LocalNatsCluster, sent: int) -> None:
    expected = {(w.worker.publisher, 0, seq) for w in fleet.workers for seq in range(w.engine.next_seq)}
    assert len(expected) == sent

    # KV_EVENTS: each (worker, epoch, engine seq), i.e. each Nats-Msg-Id, exactly once.
    batches = await _stream_batches(cluster, pipeline.settings.stream.events_stream)
    in_stream = collections.Counter((b.worker.publisher, b.epoch, b.seq) for b, _ in batches)
    assert {key: n for key, n in in_stream.items() if n > 1} == {}, "batches twice in KV_EVENTS"
    assert set(in_stream) == expected, f"KV_EVENTS lacks {sorted(expected - set(in_stream))[:20]}"
    assert [b.msg_id for b, _ in batches if any(isinstance(event, Gap) for event in b.events)] == []

    # SQL: every event of every batch once, and no worker uncertain.
    problems = _out_of_engine_order(batches)
    for worker in fleet.workers:
        publisher = worker.worker.publisher
        rows = pipeline.sql(
            f"SELECT engine_seq, COUNT(DISTINCT stream_seq) FROM event_log WHERE publisher = '{publisher}' "
            "GROUP BY engine_seq"
        )
        twice = sorted(seq for seq, count in rows if count > 1)
        missing = sorted(set(range(worker.engine.next_seq)) - {seq for seq, _ in rows})
        if missing:
            problems.append(f"{publisher}: SQL misses engine seqs {_ranges(missing)}")
        if twice:
            problems.append(f"{publisher}: SQL has engine seqs {_ranges(twice)} twice")
    events_per_seq = dict(pipeline.sql("SELECT stream_seq, COUNT(*) FROM event_log GROUP BY stream_seq"))
    absent = [seq for _, seq in batches if seq not in events_per_seq]
    if absent:
        problems.append(f"event_log lacks KV_EVENTS stream seqs {_ranges(absent)}")
    wrong = sorted(seq for b, seq in batches if seq in events_per_seq and events_per_seq[seq] != len(b.events))
    if wrong:
        problems.append(f"event_log rows differ from the batch's events at stream seqs {_ranges(wrong)}")
    uncertain = pipeline.sql(
        "SELECT publisher, dp_rank, provenance, since_seq, until_seq, reason FROM uncertain_periods ORDER BY since_seq"
    )
    if uncertain:
        problems.append(f"uncertain periods: {uncertain}")
    still = pipeline.sql("SELECT publisher, uncertain_since FROM workers WHERE uncertain_since IS NOT NULL")
    if still:
        problems.append(f"workers left uncertain: {still}")
    gaps = pipeline.sql("SELECT publisher, gap_reason FROM event_log WHERE kind = 'gap'")
    if gaps:
        problems.append(f"gap events: {gaps}")
    assert not problems, "\n".join(problems)


async def assert_decide_matches_the_fold(
    pipeline: ClusterPipeline, cluster: LocalNatsCluster, requests: list[Request], last_seq: int
) -> None:
    """decide (which lived through the fault) answers as the reference does on the stream's own fold."""
    batches = await _stream_batches(cluster, pipeline.settings.stream.events_stream)
    fold = InventoryFold()
    # Some 3 ms a batch (the fold hashes every block's tokens): off the loop decide answers on.
    await asyncio.to_thread(fold.apply_all, batches)
    probe = {"request_id": "probe", "local_hashes": [], "block_size": DEMO_BLOCK_SIZE}

    async def caught_up() -> bool:
        # An error answer (KV_DECISIONS still electing a leader: an answer not on record is not given) is a retry.
        answer = await pipeline.ask(probe)
        return answer.get("inventory_seq", -1) >= last_seq

    await wait_until(caught_up, 30, f"decide at inventory_seq {last_seq}")
    assert (await pipeline.ask(probe))["uncertain_workers"] == []
    targets = itertools.cycle([None, *(w.worker for w in pipeline.fleet.workers)])
    for number, (request, target) in enumerate(zip(requests, targets)):
        body = {"request_id": f"check-{number}", "token_ids": request_tokens(request), "block_size": DEMO_BLOCK_SIZE,
                "target": target.name if target else None}
        answer = await pipeline.ask(body)
        reference = ReuseRequest.from_tokens(body["request_id"], body["token_ids"], DEMO_BLOCK_SIZE, target)
        assert answer == decision_to_json(decide(fold, reference, pipeline.settings.reuse, backend=answer["backend"]))


# --- the tests ----------------------------------------------------------------------------


async def test_kill_9_of_the_kv_events_leader_mid_stream_loses_and_duplicates_nothing(nats_cluster, db_url, tmp_path) -> None:
    await kill_mid_stream_and_restart(nats_cluster, db_url, "stream leader", seed=21, log_dir=tmp_path)


async def test_kill_9_of_the_node_leading_kv_events_and_store_consumer_mid_stream_loses_and_duplicates_nothing(
    nats_cluster, db_url, tmp_path
) -> None:
    # Both leaders on one node, as JetStream itself often places them: the consumer loses its leader with the stream's.
    await kill_mid_stream_and_restart(nats_cluster, db_url, "stream and consumer leader", seed=24, log_dir=tmp_path)


async def test_kill_9_of_the_store_consumer_leader_mid_stream_loses_and_duplicates_nothing(nats_cluster, db_url, tmp_path) -> None:
    await kill_mid_stream_and_restart(nats_cluster, db_url, "consumer leader", seed=22, log_dir=tmp_path)


async def test_kill_9_of_the_node_ingest_publishes_through_mid_stream_loses_and_duplicates_nothing(
    nats_cluster, db_url, tmp_path
) -> None:
    await kill_mid_stream_and_restart(nats_cluster, db_url, "ingest's node", seed=23, log_dir=tmp_path)


async def test_snapshots_on_a_cluster_are_replicated_as_the_streams(nats_cluster, sqlite_url) -> None:
    # A snapshot lets decide start warm; at R1 it would vanish with the one node that holds it.
    from kvledger.store.snapshots import SnapshotWriter

    settings = pipeline_settings(nats_cluster.urls, sqlite_url, **{"stream.replicas": REPLICAS})
    with database.opened(sqlite_url) as engine:
        database.upgrade(engine)
        nc = await nats.connect(**connect_options(settings.nats, name="kvledger-test"))
        try:
            js = nc.jetstream()
            fold = InventoryFold()
            name = await SnapshotWriter(js, engine, settings.store, replicas=settings.stream.replicas).write(fold)
            info = await js.stream_info("OBJ_KV_SNAPSHOTS")
            assert info.config.num_replicas == REPLICAS
            assert name in {entry.name for entry in await (await js.object_store("KV_SNAPSHOTS")).list()}
        finally:
            await nc.close()
