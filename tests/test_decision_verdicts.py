"""Decision verdicts (store/quality.py, store/verdicts.py): judged once per horizon, kept in SQL, equal to SQL's judgement.

Hypothesis writes event streams (three workers storing, removing and re-storing chains of
blocks on two tiers, clearing, restarting under a new epoch; ingest times a little off the
wall clock, now and then behind the batch before) interleaved with requests to a real decide
(reuse on, shadow decisions and in-flight credit on), all through a real nats-server into a
real store on SQLite and PostgreSQL. store judges the decisions at three horizons as it
folds, or in SQL for those that reach it too late; a fourth horizon is configured only after
the ledger is written, so the SQL judge settles all of it. Then, for every horizon, the
verdict rows must be exactly the set-based SQL judge's over the whole ledger (every column,
floats to the last bit), which must agree with the audit's former per-block statement
(tests/quality_reference.py); and each decision has one verdict per horizon, no more.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid

import attrs
import nats
import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

from builders import Stream, local_hashes, publish, removed, stored
from kvledger.decide.serving.service import DecideService
from engines import wait_until
from kvledger.core.events import Cleared, Tier, WorkerId
from kvledger.core.settings import load_settings
from kvledger.runtime.streams import DECIDE_BATCH_SUBJECT, ensure_stream, events_stream
from quality_reference import reference_verdicts
from kvledger.store import database, tables
from kvledger.store.changes import VERDICT_COLUMNS
from kvledger.store.projector import DecisionsHold, VerdictsBacklogHold
from kvledger.store.verdicts import judge_into
from store_harness import RunningStore, StoreProcess, checkpoint, poll, store_settings

pytestmark = pytest.mark.service

WORKERS = (WorkerId("a"), WorkerId("b", 1), WorkerId("c"))
LIVE_HORIZONS_MS = (60.0, 250.0, 500.0)
LATER_HORIZON_MS = 120.0
DEADLINE_S = 30.0

step = st.one_of(
    st.tuples(st.just("store"), st.sampled_from(WORKERS), st.integers(1, 10), st.sampled_from([Tier.DEVICE, Tier.HOST])),
    st.tuples(st.just("remove"), st.sampled_from(WORKERS), st.lists(st.integers(1, 10), min_size=1, max_size=4),
              st.sampled_from([Tier.DEVICE, Tier.HOST])),
    st.tuples(st.just("clear"), st.sampled_from(WORKERS), st.none(), st.sampled_from([Tier.DEVICE, None])),
    st.tuples(st.just("restart"), st.sampled_from(WORKERS), st.none(), st.none()),
    st.tuples(st.just("decide"), st.sampled_from(WORKERS), st.integers(1, 12), st.none()),
)
timed_step = st.tuples(step, st.integers(0, 60), st.floats(-0.04, 0.02))  # (step, ms to wait, ingest skew in s)


def decide_settings(url: str):
    return load_settings(environ={}, overrides={
        "nats.url": url, "decide.http_port": 0, "decide.backend": "cpu", "decide.shadow": True,
        "decide.inflight_ttl_ms": 400.0, "reuse.enable_decode_to_prefill_gpu_reuse": True,
        "reuse.enable_decode_to_prefill_reuse": True, "reuse.transfer_source_prefill_token_us": 1000.0,
        "reuse.minimum_transfer_prefix_blocks": 1, "reuse.minimum_estimated_ttft_saving_ms": 0.0,
    }).settings


def fresh_database(request: pytest.FixtureRequest, kind: str, tmp_path) -> str:
    if kind == "sqlite":
        url = f"sqlite:///{tmp_path / f'ledger-{uuid.uuid4().hex[:8]}.db'}"
    else:
        url = request.getfixturevalue("postgres_server").create_database(f"kvledger_verdicts_{uuid.uuid4().hex[:12]}")
    with database.opened(url) as engine:
        database.upgrade(engine)
    return url


async def clean_streams(js) -> None:
    for name in await js.streams_info():
        await js.delete_stream(name.config.name)


class LiveStore:
    """store in this process for the whole workload (the fold judges what comes in time)."""

    def __init__(self, nats_url: str, db_url: str) -> None:
        self.running = RunningStore(store_settings(nats_url, db_url, quality_horizons_ms=list(LIVE_HORIZONS_MS)))

    async def __aenter__(self) -> LiveStore:
        await self.running.__aenter__()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.running.__aexit__(*exc_info)

    async def until(self, condition, what: str) -> None:
        await self.running.until(condition, what)

    async def after_step(self, index: int) -> None:
        pass


class ShardedStore:
    """Two store shards (store.shard 0/2 and 1/2) in this process: no fold holds the whole inventory, so the
    SQL judge settles every decision once both shards are past its horizon seq."""

    def __init__(self, nats_url: str, db_url: str) -> None:
        self.shards = [RunningStore(store_settings(nats_url, db_url, quality_horizons_ms=list(LIVE_HORIZONS_MS),
                                                   shard=f"{index}/2")) for index in range(2)]

    async def __aenter__(self) -> ShardedStore:
        for shard in self.shards:
            await shard.__aenter__()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        for shard in self.shards:
            await shard.__aexit__(*exc_info)

    async def until(self, condition, what: str) -> None:
        await self.shards[0].until(condition, what)

    async def after_step(self, index: int) -> None:
        pass


class KilledStore:
    """`kvledger store` as a child process, SIGKILLed and started again after each of `kill_after` steps."""

    def __init__(self, nats_url: str, db_url: str, log_path, kill_after: set[int]) -> None:
        self.args = (nats_url, db_url, log_path)
        self.kill_after = kill_after
        self.kills = 0
        self.process: StoreProcess | None = None

    def _start(self) -> None:
        horizons = ",".join(f"{h:g}" for h in LIVE_HORIZONS_MS)
        self.process = StoreProcess(*self.args, environment={"KVLEDGER_STORE_QUALITY_HORIZONS_MS": horizons})

    async def __aenter__(self) -> KilledStore:
        self._start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.process.stop()

    async def until(self, condition, what: str) -> None:
        await wait_until(lambda: asyncio.to_thread(condition), DEADLINE_S, what, interval=0.05)

    async def after_step(self, index: int) -> None:
        if index in self.kill_after:
            await asyncio.sleep(0.05 * (index % 4))  # mid-transaction, now and then
            self.process.kill()
            self.kills += 1
            self._start()


class BacklogStore:
    """store started only once the whole workload is in the streams (a store catching up on a backlog), judging
    at `horizon_ms`, its fold keeping at most `max_pending` decisions waiting, its transactions `batch_size`
    messages."""

    def __init__(self, nats_url: str, db_url: str, *, horizon_ms: float, max_pending: int, batch_size: int) -> None:
        self.running = RunningStore(store_settings(
            nats_url, db_url, quality_horizons_ms=[horizon_ms], quality_max_pending=max_pending,
            batch_size=batch_size))
        self.started = False

    async def __aenter__(self) -> BacklogStore:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self.started:
            await self.running.__aexit__(*exc_info)

    async def until(self, condition, what: str) -> None:
        if not self.started:
            self.started = True
            await self.running.__aenter__()
        await self.running.until(condition, what)

    async def after_step(self, index: int) -> None:
        pass


async def run_workload(nats_url: str, db_url: str, steps, store=None) -> int:
    """The steps published and asked, store and decide running; returns the number of decisions."""
    stream = Stream()
    epochs = {worker: 0 for worker in WORKERS}
    decisions = 0
    base = stored([1])  # every worker known from the start, so decide ranks them all
    store = store or LiveStore(nats_url, db_url)
    async with await nats.connect(nats_url) as nc:
        js = nc.jetstream()
        await clean_streams(js)
        settings = decide_settings(nats_url)
        await ensure_stream(js, events_stream(settings.stream))
        await publish(js, [at(stream.batch(worker, base), time.time()) for worker in WORKERS])
        async with store as running, DecideService(settings) as decide:
            await decide.wait_ready(DEADLINE_S)
            for index, ((kind, worker, value, tier), wait_ms, skew) in enumerate(steps):
                await asyncio.sleep(wait_ms / 1000)
                await running.after_step(index)
                if kind == "decide":
                    ask = [{"request_id": f"r{decisions}", "target": worker.name, "block_size": 4,
                            "local_hashes": [str(h) for h in local_hashes(list(range(1, value + 1)))]}]
                    await nc.request(DECIDE_BATCH_SUBJECT, json.dumps(ask).encode(), timeout=10)
                    decisions += 1
                    continue
                if kind == "store":
                    event = stored(list(range(1, value + 1)), tier=tier)
                elif kind == "remove":
                    event = removed(value, tier)
                elif kind == "clear":
                    event = Cleared(tier)
                else:
                    epochs[worker] += 1
                    event = stored([1, 2])
                batch = stream.batch(worker, event, epoch=epochs[worker], seq=0 if kind == "restart" else None)
                await publish(js, [at(batch, time.time() + skew)])
            # Every decision in SQL first, so the last ones wait in the fold for their horizon; then an
            # event far past every horizon settles them all.
            await running.until(lambda: checkpoint(db_url, "decisions") >= decisions, "every decision in SQL")
            last = stream.batch(WORKERS[0], stored([1]), epoch=epochs[WORKERS[0]])
            await publish(js, [at(last, time.time() + 5.0)])
            await running.until(lambda: checkpoint(db_url) >= last[1], "every event in SQL")
            await running.until(lambda: pending(db_url) == 0, "every verdict written")
    return decisions


def at(batch_and_seq, ingest_ts: float):
    batch, seq = batch_and_seq
    return attrs.evolve(batch, ingest_ts=ingest_ts, engine_ts=ingest_ts), seq


def pending(url: str) -> int:
    with database.opened(url) as engine, engine.connect() as connection:
        return connection.execute(sa.select(sa.func.count()).select_from(tables.verdicts_pending)).scalar_one()


def stored_verdicts(connection: sa.Connection, horizon_ms: float) -> list[tuple]:
    v = tables.decision_verdicts
    return [tuple(row) for row in connection.execute(
        sa.select(*[v.c[name] for name in VERDICT_COLUMNS]).where(v.c.horizon_ms == horizon_ms).order_by(v.c.stream_seq))]


def sql_verdicts(connection: sa.Connection, horizon_ms: float) -> list[tuple]:
    """The set-based SQL judge over every decision, into a temporary table."""
    connection.exec_driver_sql("CREATE TEMPORARY TABLE judged_here AS SELECT * FROM decision_verdicts WHERE 1 = 0")
    d = tables.decisions.c
    judge_into(connection, "judged_here", [(seq, horizon_ms, ts + horizon_ms / 1000)
                                           for seq, ts in connection.execute(sa.select(d.stream_seq, d.decided_ts))])
    rows = connection.exec_driver_sql(f"SELECT {', '.join(VERDICT_COLUMNS)} FROM judged_here ORDER BY stream_seq").all()
    connection.exec_driver_sql("DROP TABLE judged_here")
    return [tuple(row) for row in rows]


def without_judge(rows: list[tuple]) -> list[tuple]:
    return [row[:-1] for row in rows]


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
# Each example runs real services for seconds: no shrinking, a failure prints its steps as found.
@settings(max_examples=3, deadline=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(steps=st.lists(timed_step, min_size=12, max_size=40))
def test_verdicts_equal_the_sql_judgement_of_the_whole_ledger(nats_server, request, tmp_path, kind, steps) -> None:
    steps = [*steps, ((("decide", WORKERS[1], 6, None)), 0, 0.0)]  # at least one decision
    db_url = fresh_database(request, kind, tmp_path)
    decisions = asyncio.run(run_workload(nats_server.url, db_url, steps))
    # A horizon configured after the fact: the SQL judge settles every decision recorded so far.
    later = store_settings(nats_server.url, db_url, quality_horizons_ms=[*LIVE_HORIZONS_MS, LATER_HORIZON_MS])

    def later_judged() -> int:
        with database.opened(db_url) as engine, engine.connect() as connection:
            return len(stored_verdicts(connection, LATER_HORIZON_MS))

    async def backfill() -> None:
        async with RunningStore(later) as running:
            await running.until(lambda: later_judged() == decisions and pending(db_url) == 0, "the later horizon judged")

    asyncio.run(backfill())
    judged_by = assert_verdicts_are_the_sql_judgement(db_url, decisions, (*LIVE_HORIZONS_MS, LATER_HORIZON_MS))
    assert set(judged_by[LATER_HORIZON_MS]) == {"sql"}
    assert "fold" in [judge for horizon in LIVE_HORIZONS_MS for judge in judged_by[horizon]]  # judged live


def assert_verdicts_are_the_sql_judgement(db_url: str, decisions: int, horizons) -> dict[float, list[str]]:
    """One verdict per decision and horizon, equal to the SQL judge's and the former statement's; who judged each."""
    judged_by = {}
    with database.opened(db_url) as engine, engine.connect() as connection:
        for horizon_ms in horizons:
            stored_rows = stored_verdicts(connection, horizon_ms)
            assert len(stored_rows) == decisions, f"one verdict per decision at {horizon_ms} ms"
            assert without_judge(stored_rows) == without_judge(sql_verdicts(connection, horizon_ms))
            assert reference_verdicts(connection, horizon_ms / 1000) == {
                row[0]: (row[3], row[5], row[6], row[7], row[8], row[10], row[11]) for row in stored_rows}
            judged_by[horizon_ms] = [row[-1] for row in stored_rows]
        total = connection.execute(sa.select(sa.func.count()).select_from(tables.decision_verdicts)).scalar_one()
        assert total == decisions * len(horizons)
    return judged_by


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_verdicts_are_written_once_across_kill_9_of_store(nats_server, request, tmp_path, kind) -> None:
    # A fixed random workload; store SIGKILLed four times while events and decisions flow. What a
    # killed transaction held is rolled back with its events; the restarted store's fold no longer
    # holds what it waited on, so the SQL judge settles it: never twice, never missing.
    chooser = random.Random(42)
    steps = []
    kinds = ["store", "store", "remove", "decide", "decide", "clear", "restart"]
    for _ in range(48):
        kind = chooser.choice(kinds)
        worker = chooser.choice(WORKERS)
        tier = chooser.choice([Tier.DEVICE, Tier.HOST])
        value = {"store": chooser.randint(1, 10), "remove": [chooser.randint(1, 10)], "decide": chooser.randint(1, 12),
                 "clear": None, "restart": None}[kind]
        steps.append(((kind, worker, value, tier if kind in ("store", "remove") else None), chooser.randint(0, 40),
                      chooser.uniform(-0.02, 0.01)))
    db_url = fresh_database(request, kind, tmp_path)
    store = KilledStore(nats_server.url, db_url, tmp_path / "store.log", kill_after={8, 19, 30, 41})
    decisions = asyncio.run(run_workload(nats_server.url, db_url, steps, store))
    assert store.kills == 4
    assert_verdicts_are_the_sql_judgement(db_url, decisions, LIVE_HORIZONS_MS)


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_sharded_stores_leave_every_verdict_to_the_sql_judge_once_all_shards_are_past_it(
        nats_server, request, tmp_path, kind) -> None:
    chooser = random.Random(7)
    steps = []
    for _ in range(30):
        kind_of_step = chooser.choice(["store", "store", "remove", "decide", "decide", "clear"])
        worker = chooser.choice(WORKERS)
        value = {"store": chooser.randint(1, 10), "remove": [chooser.randint(1, 10)], "decide": chooser.randint(1, 12),
                 "clear": None}[kind_of_step]
        tier = Tier.DEVICE if kind_of_step in ("store", "remove") else None
        steps.append(((kind_of_step, worker, value, tier), chooser.randint(0, 30), 0.0))
    db_url = fresh_database(request, kind, tmp_path)
    decisions = asyncio.run(run_workload(nats_server.url, db_url, steps, ShardedStore(nats_server.url, db_url)))
    judged_by = assert_verdicts_are_the_sql_judgement(db_url, decisions, LIVE_HORIZONS_MS)
    assert {judge for judges in judged_by.values() for judge in judges} == {"sql"}


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
def test_a_backlog_is_judged_by_the_fold_however_far_its_decisions_run_ahead(nats_server, request, tmp_path, kind) -> None:
    # store starts after every event and decision of a workload (45 decisions over about a second) is in the
    # streams. Its decisions projector (a few rows a decision) would run far ahead of the events fold, which
    # keeps few decisions waiting (store.quality_max_pending 8, where a 60 ms horizon needs about 3 at a time;
    # transactions of two messages): each beyond would be left to the SQL judge. The projectors wait for each
    # other instead: every verdict by the fold.
    chooser = random.Random(7)
    steps = []
    for index in range(90):
        kind_of_step = "decide" if index % 2 else chooser.choice(["store", "store", "remove"])
        worker = chooser.choice(WORKERS)
        tier = chooser.choice([Tier.DEVICE, Tier.HOST])
        value = {"store": chooser.randint(1, 10), "remove": [chooser.randint(1, 10)],
                 "decide": chooser.randint(1, 12)}[kind_of_step]
        steps.append(((kind_of_step, worker, value, None if kind_of_step == "decide" else tier),
                      chooser.randint(0, 25), 0.0))
    db_url = fresh_database(request, kind, tmp_path)
    horizon_ms = LIVE_HORIZONS_MS[0]
    store = BacklogStore(nats_server.url, db_url, horizon_ms=horizon_ms, max_pending=8, batch_size=2)
    decisions = asyncio.run(run_workload(nats_server.url, db_url, steps, store))
    unjudged = store.running.service.metrics.quality.unjudged
    assert {sample.labels["reason"]: sample.value for metric in unjudged.collect() for sample in metric.samples
            if sample.value} == {}
    judged_by = assert_verdicts_are_the_sql_judgement(db_url, decisions, (horizon_ms,))
    assert set(judged_by[horizon_ms]) == {"fold"}


@attrs.define
class FoldSeen:
    """What VerdictsBacklogHold reads of the events projector (store.projector.EventsProjector's fields)."""

    ready: bool = True
    caught_up: bool = False
    waiting_for_decisions: bool = False
    draining: bool = False
    folded_fetches: int = 0
    folded: asyncio.Event = attrs.field(factory=asyncio.Event)


@attrs.define
class PendingSeen:
    """What VerdictsBacklogHold reads of the fold's QualityTracker: decisions waiting, and its limit."""

    waiting: int
    max_pending: int = 100
    horizons_ms: tuple[float, ...] = (60.0,)


async def test_decisions_wait_for_a_fold_that_goes_on_slowly_and_not_for_one_that_has_stopped() -> None:
    # A fold on a large backlog can take longer than the stall limit to make room, one step after another:
    # the decisions projector waits for it as long as it folds (else its decisions would go to the SQL
    # judge), and gives up only on a fold that has folded nothing for the limit.
    fold, pending = FoldSeen(), PendingSeen(waiting=100)
    hold = VerdictsBacklogHold(fold, pending, transaction_decisions=10)
    hold.STALL_S = 0.3

    async def slow_fold() -> None:
        for _ in range(8):  # 8 steps of 0.15 s: 1.2 s in all, four times the limit, each step within it
            await asyncio.sleep(0.15)
            fold.folded_fetches += 1
            fold.folded.set()
        pending.waiting = 0  # the last step settled the decisions waiting
        fold.folded_fetches += 1
        fold.folded.set()

    assert hold.holds()
    folding = asyncio.create_task(slow_fold())
    started = time.monotonic()
    await hold.wait()
    assert pending.waiting == 0 and time.monotonic() - started > 1.0  # it waited for the room, not the limit
    await folding

    pending.waiting = 100  # the fold stops: the decisions go on after the limit
    assert hold.holds()
    started = time.monotonic()
    await hold.wait()
    assert 0.3 <= time.monotonic() - started < 1.0 and pending.waiting == 100
    assert not hold.holds()  # until the fold folds again
    fold.folded_fetches += 1
    assert hold.holds()


def test_events_go_on_when_the_decisions_projector_cannot_write(nats_server, request, tmp_path) -> None:
    # The events fold waits for decisions that could still fall within its horizon (DecisionsHold), but not for a
    # decisions projector that cannot write them (here its table is gone): once it has made no progress for
    # DecisionsHold.STALL_S the events are projected, and the decisions wait in their stream.
    db_url = fresh_database(request, "sqlite", tmp_path)
    with database.opened(db_url) as engine, engine.begin() as connection:
        connection.exec_driver_sql("ALTER TABLE decisions RENAME TO decisions_elsewhere")
    stream = Stream()

    async def scenario() -> None:
        async with await nats.connect(nats_server.url) as nc:
            js = nc.jetstream()
            await clean_streams(js)
            settings = decide_settings(nats_server.url)
            await ensure_stream(js, events_stream(settings.stream))
            await publish(js, [at(stream.batch(worker, stored([1, 2, 3])), time.time()) for worker in WORKERS])
            async with DecideService(settings) as decide:
                await decide.wait_ready(DEADLINE_S)
                for number in range(3):
                    ask = [{"request_id": f"r{number}", "target": WORKERS[0].name, "block_size": 4,
                            "local_hashes": [str(h) for h in local_hashes([1, 2, 3])]}]
                    await nc.request(DECIDE_BATCH_SUBJECT, json.dumps(ask).encode(), timeout=10)
            last = [at(stream.batch(worker, stored([4])), time.time() + 5.0) for worker in WORKERS]
            await publish(js, last)
            async with RunningStore(store_settings(nats_server.url, db_url, quality_horizons_ms=[60.0])) as running:
                # ingested 5 s after the decisions, the last events pass their horizon: without the stall rule
                # they would wait for those decisions for ever
                await poll(lambda: checkpoint(db_url) >= last[-1][1], "every event in SQL",
                           deadline_s=4 * DecisionsHold.STALL_S, watch=running.task)
                assert checkpoint(db_url, "decisions") <= 0
                # (its `ready` flag is true again for a moment after each retry binds the consumer: a race to read)
                assert running.service.metrics.database_errors.value > 0

    asyncio.run(scenario())
