"""Store shards (`store.shard` K/N): N stores split KV_EVENTS by publisher into one PostgreSQL.

Two shards must leave the database as one store would (every table but the checkpoints),
project decisions and dead letters once, and survive a kill -9 of one of them exactly
once, like the single store in test_store_faults.py.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import attrs
import nats
import pytest
import sqlalchemy as sa

from builders import BLOCK_SIZE, local_hashes
from kvledger.core.decision_codec import decision_to_json
from kvledger.core.events import Cleared, EventBatch, Provenance, WorkerId
from kvledger.core.reuse import ReuseRequest, decide
from kvledger.core.settings import ReuseSettings, Settings
from kvledger.runtime.streams import DECISIONS_SUBJECT, decisions_stream, ensure_stream
from kvledger.store import database
from kvledger.store.fold_loader import load_fold
from kvledger.store.sharding import Shard, ShardError, parse_shard
from test_store_faults import TRANSACTION_MESSAGES, _writers_of
from store_harness import (
    StoreProcess,
    RunningStore,
    checkpoint,
    fold_rows,
    poll,
    project,
    publish,
    recorded_stream,
    reference_folds,
    store_settings,
)

pytestmark = pytest.mark.service

SHARDS = (Shard(0, 2), Shard(1, 2))
LEDGER_TABLES = ("event_log", "block_residency", "workers", "uncertain_periods", "dead_letters")


def several_publishers(seed: int, batches: int) -> list[EventBatch | bytes]:
    """Two recorded streams interleaved, the second's publishers renamed: eng-a, eng-b, eng-c,
    eng-d (and the bad records' kv.ev.broken), which shards 0/2 and 1/2 both get some of;
    each worker's stream ends with clears, so no worker is left uncertain."""
    renamed = {"eng-a": "eng-c", "eng-b": "eng-d"}
    second = [
        item if isinstance(item, bytes) else attrs.evolve(item, worker=WorkerId(renamed[item.worker.publisher], item.worker.dp_rank))
        for item in recorded_stream(seed + 1, batches // 2)
    ]
    first = recorded_stream(seed, batches - len(second))
    stream = [item for pair in zip(first, second) for item in pair] + first[len(second):]
    last: dict[tuple[WorkerId, Provenance], EventBatch] = {}
    for item in stream:
        if isinstance(item, EventBatch):
            last[(item.worker, item.provenance)] = item
    for batch in last.values():
        stream.append(attrs.evolve(batch, seq=batch.seq + 1, events=(Cleared(),)))
    publishers = {worker.publisher for worker, _ in last}
    assert all(any(shard.owns_publisher(name) for name in publishers) for shard in SHARDS), "a shard with no publisher"
    return stream


def ledger_digest(url: str) -> tuple[dict[str, int], str]:
    """Row counts and a digest of what the events projector writes, checkpoints aside (shards have their own)."""
    counts, digest = {}, hashlib.sha256()
    with database.opened(url) as engine, engine.connect() as connection:
        for table in LEDGER_TABLES:
            meta = sa.Table(table, sa.MetaData(), autoload_with=connection)
            # block_residency is a view: no key to order by, and its placement ids are numbered in the order
            # each projector met them
            columns = [c for c in meta.columns if c.name not in ("recorded_ts", "placement_id")]
            keys = list(meta.primary_key.columns) or [meta.c.stored_seq, meta.c.slot]
            rows = connection.execute(sa.select(*columns).order_by(*keys)).all()
            counts[table] = len(rows)
            for row in rows:
                digest.update(repr(tuple(bytes(v) if isinstance(v, memoryview) else v for v in row)).encode())
    return counts, digest.hexdigest()


def scalar(url: str, sql: str):
    with database.opened(url) as engine, engine.connect() as connection:
        return connection.execute(sa.text(sql)).scalar()


def checkpoint_names(url: str) -> set[str]:
    with database.opened(url) as engine, engine.connect() as connection:
        return set(connection.execute(sa.text("SELECT name FROM checkpoints")).scalars())


def event_count(stream: list[EventBatch | bytes]) -> int:
    return sum(len(item.events) for item in stream if isinstance(item, EventBatch))


async def publish_decisions(nats_url: str, stream: list[EventBatch | bytes], count: int) -> None:
    fold, _ = reference_folds(stream, every=len(stream))
    reuse = ReuseSettings(enable_decode_to_prefill_reuse=True, minimum_transfer_prefix_blocks=1)
    connection = await nats.connect(nats_url)
    try:
        js = connection.jetstream()
        await ensure_stream(js, decisions_stream(Settings().stream))
        for k in range(count):
            decision = decide(fold, ReuseRequest(f"req-{k}", local_hashes(range(1, 5)), BLOCK_SIZE, WorkerId("eng-a")), reuse)
            body = json.dumps(decision_to_json(decision)).encode()
            await js.publish(DECISIONS_SUBJECT, body, headers={"Nats-Msg-Id": f"req-{k}"})
    finally:
        await connection.close()


@pytest.mark.parametrize("db_pair", ["postgres"], indirect=True)
async def test_two_shards_write_what_one_store_writes_and_project_decisions_once(nats_server, db_pair) -> None:
    sharded, single = db_pair
    stream = several_publishers(seed=21, batches=2000)
    last = await publish(nats_server.url, stream)
    await publish_decisions(nats_server.url, stream, 3)

    settings = store_settings(nats_server.url, single, batch_size=64)
    async with RunningStore(settings) as running:
        await running.until(lambda: checkpoint(single) >= last and checkpoint(single, "decisions") >= 3, "the single store")

    stores = [RunningStore(store_settings(nats_server.url, sharded, batch_size=64, shard=str(shard))) for shard in SHARDS]
    async with stores[0], stores[1]:
        await stores[0].until(
            lambda: checkpoint(sharded) >= last and checkpoint(sharded, "decisions") >= 3, "both shards and decisions"
        )
        await stores[1].until(lambda: all(store.service.is_ready() for store in stores), "both shards ready")
        folded = [set(store.service.events.fold.workers()) for store in stores]
        passed_over = [
            store.service.metrics.other_shards.labels("KV_EVENTS").value for store in stores
        ]

    assert ledger_digest(sharded) == ledger_digest(single)
    counts, _ = ledger_digest(sharded)
    assert counts["event_log"] == event_count(stream)
    assert scalar(sharded, "SELECT COUNT(*) FROM decisions") == scalar(single, "SELECT COUNT(*) FROM decisions") == 3
    assert checkpoint_names(sharded) == {"events-0-of-2", "events-1-of-2", "decisions"}
    assert checkpoint(sharded, "events-0-of-2") == checkpoint(sharded, "events-1-of-2") == last
    # Each shard folded its own publishers only, and passed over the other's messages.
    assert folded[0] and folded[1] and not folded[0] & folded[1]
    assert all(SHARDS[k].owns_publisher(worker.publisher) for k in (0, 1) for worker in folded[k])
    assert all(count > 0 for count in passed_over)
    # A shard's fold rebuilt from SQL holds its own workers' inventory, and together they hold all of it.
    expected, _ = reference_folds(stream, every=len(stream))
    with database.opened(sharded) as engine:
        rebuilt = [load_fold(engine, shard)[0] for shard in SHARDS]
    assert all(fold.inventory_seq == last for fold in rebuilt)
    assert [set(fold.workers()) for fold in rebuilt] == folded
    rows = [fold_rows(fold) for fold in rebuilt]
    assert not rows[0] & rows[1] and rows[0] | rows[1] == fold_rows(expected)


class ShardProcess(StoreProcess):
    """`kvledger store --shard K/N` as a child process, projecting TRANSACTION_MESSAGES messages per transaction."""

    def __init__(self, nats_url: str, db_url: str, log_path: Path, shard: Shard) -> None:
        super().__init__(nats_url, db_url, log_path, args=("--shard", str(shard)),
                         environment={"KVLEDGER_STORE_BATCH_SIZE": str(TRANSACTION_MESSAGES)})
        self.shard = shard


def writers_of_shard(url: str, shard: Shard) -> list[int]:
    """The live SQL writer children of one shard: the checkpoint they advance is on their command line."""
    return [pid for pid in _writers_of(url) if shard.checkpoint_name.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()]


@pytest.mark.parametrize("db_pair", ["postgres"], indirect=True)
async def test_kill_9_of_one_shard_mid_stream_loses_and_duplicates_nothing(nats_server, db_pair, tmp_path) -> None:
    faulty, clean = db_pair
    stream = several_publishers(seed=23, batches=6000)
    last = await publish(nats_server.url, stream)
    await project(store_settings(nats_server.url, clean, batch_size=128), last)

    victim = SHARDS[1]
    name = victim.checkpoint_name
    survivor = ShardProcess(nats_server.url, faulty, tmp_path / "shard-0.log", SHARDS[0])
    first = ShardProcess(nats_server.url, faulty, tmp_path / "shard-1-first.log", victim)
    second = None
    try:
        def quarter() -> bool:
            for process in (survivor, first):
                assert process.alive(), f"shard {process.shard} exited:\n{process.log()}"
            return checkpoint(faulty, name) >= last // 4

        await poll(quarter, "shard 1/2 through a quarter of the stream")
        assert writers_of_shard(faulty, victim), "shard 1/2's SQL writer child should be running"
        first.kill()
        await poll(lambda: not writers_of_shard(faulty, victim), "the writer process to die with its shard")
        at_kill = checkpoint(faulty, name)
        assert 0 < at_kill < last, "shard 1/2 finished before it could be killed; make the stream longer"

        second = ShardProcess(nats_server.url, faulty, tmp_path / "shard-1-second.log", victim)

        def everything() -> bool:
            for process in (survivor, second):
                assert process.alive(), f"shard {process.shard} exited:\n{process.log()}"
            return checkpoint(faulty) >= last

        await poll(everything, "both shards through the whole stream after the restart")
    finally:
        if first.alive():
            first.kill()
        codes = [(process.terminate(), process.log()) for process in (survivor, second) if process is not None]
    assert all(code == 0 for code, _ in codes), codes
    assert "fold rebuilt from SQL at stream seq" in second.log()

    assert ledger_digest(faulty) == ledger_digest(clean)
    counts, _ = ledger_digest(faulty)
    assert counts["event_log"] == event_count(stream)
    assert counts["event_log"] == scalar(faulty, "SELECT COUNT(*) FROM (SELECT DISTINCT stream_seq, event_idx FROM event_log) AS once")
    assert counts["dead_letters"] == sum(1 for item in stream if isinstance(item, bytes))
    assert counts["workers"] == len({item.worker for item in stream if isinstance(item, EventBatch)})
    uncertain = "SELECT COUNT(*) FROM workers WHERE uncertain_since IS NOT NULL OR retained_uncertain_since IS NOT NULL"
    assert scalar(faulty, uncertain) == 0
    assert scalar(faulty, "SELECT COUNT(*) FROM uncertain_periods WHERE until_seq IS NULL") == 0


@pytest.mark.parametrize("text", ["2/2", "a/b", "0/0", "0/65", "1", "-1/2", ""])
def test_parse_shard_refuses_what_is_not_k_of_n_naming_the_setting(text: str) -> None:
    with pytest.raises(ShardError, match=r"^setting store\.shard: "):
        parse_shard(text)


def test_parse_shard_and_the_shards_names() -> None:
    assert parse_shard("0/1") == Shard(0, 1) and parse_shard(" 3 / 8 ") == Shard(3, 8)
    single, second = parse_shard("0/1"), parse_shard("1/2")
    assert (single.durable("kvledger-store-events"), single.checkpoint_name) == ("kvledger-store-events", "events")
    assert (second.durable("kvledger-store-events"), second.checkpoint_name) == (
        "kvledger-store-events-1-of-2", "events-1-of-2",
    )
    # A subject without a publisher token belongs to shard 0; every publisher to exactly one shard.
    assert parse_shard("0/2").owns("kv.ev") and not second.owns("kv.ev")
    for publisher in ("eng-a", "eng-b", "broken", "prefill-7"):
        subject = f"kv.ev.{publisher}.0.retained"
        assert sum(Shard(k, 4).owns(subject) for k in range(4)) == 1
        assert single.owns(subject)
