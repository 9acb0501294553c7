"""The store's test harness: a recorded stream with every kind of event, the fold it must
give, publishing it, the store run in this process, and what SQL holds; for the store tests
on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import attrs
import msgspec
import nats
import sqlalchemy as sa

from builders import BLOCK_SIZE, local_hashes
from engines import wait_until
from kvledger.core.events import (
    Cleared,
    EventBatch,
    Gap,
    GapReason,
    Provenance,
    Removed,
    Stored,
    Tier,
    WorkerId,
    encode_batch,
)
from kvledger.core.fold import InventoryFold
from kvledger.core.settings import Settings, load_settings
from kvledger.runtime.streams import events_stream
from kvledger.runtime.streams import ensure_stream
from kvledger.store import audit, database
from kvledger.store.service import StoreService
from services import libpq_url

DEADLINE_S = 60.0
BAD_RECORD = b"\x93not a kvledger record"
TIERS = (Tier.DEVICE, Tier.HOST, Tier.DISK)


# --- the recorded stream ------------------------------------------------------------------


def recorded_stream(seed: int, batches: int) -> list[EventBatch | bytes]:
    """A deterministic stream of canonical batches exercising every fold rule; bytes = a bad record."""
    rng = random.Random(seed)
    workers = [WorkerId("eng-a"), WorkerId("eng-a", 1), WorkerId("eng-b")]
    epoch = {w: 0 for w in workers}
    seq = {(w, p): -1 for w in workers for p in Provenance}
    held: dict[WorkerId, dict[Tier, list[int]]] = {w: {t: [] for t in TIERS} for w in workers}
    next_id = {w: 1 for w in workers}
    out: list[EventBatch | bytes] = []

    def engine_hash(worker: WorkerId, block_id: int) -> int:
        # eng-b's hashes all sit above 2**63, where signed storage matters.
        base = (1 << 63) if worker.publisher == "eng-b" else 0
        return base + (worker.dp_rank << 32) + block_id

    def batch(worker: WorkerId, provenance: Provenance, *events) -> EventBatch:
        seq[(worker, provenance)] += 1
        ts = 1000.0 + len(out)
        return EventBatch(worker, epoch[worker], seq[(worker, provenance)], ts - 0.5, ts, provenance, tuple(events))

    for _ in range(batches):
        worker = rng.choice(workers)
        roll = rng.random()
        tier = rng.choice(TIERS)
        blocks = held[worker][tier]
        if roll < 0.5:
            count = rng.randint(1, 8)
            ids = list(range(next_id[worker], next_id[worker] + count))
            next_id[worker] += count
            parent = rng.choice(blocks) if blocks and rng.random() < 0.7 else None
            if rng.random() < 0.05:
                parent = engine_hash(worker, 10_000_000)  # unknown parent
            hashes = tuple(engine_hash(worker, i) for i in ids)
            event = Stored(tier, hashes, parent, BLOCK_SIZE, local_hashes([i + 7919 * worker.dp_rank for i in ids]),
                           spec_kind="full_attention")
            # A hybrid model stores each block in its sliding-window group too, under the same hashes.
            window = (msgspec.structs.replace(event, group_idx=1, spec_kind="sliding_window", sliding_window=64),) if rng.random() < 0.3 else ()
            out.append(batch(worker, Provenance.NATIVE, event, *window))
            blocks.extend(hashes)
        elif roll < 0.75:
            victims = rng.sample(blocks, min(len(blocks), rng.randint(1, 4)))
            for victim in victims:
                blocks.remove(victim)
            if rng.random() < 0.1:
                victims.append(engine_hash(worker, 20_000_000))  # unknown block
            # Sometimes the sliding-window group's eviction: the full-attention copy stays.
            group = 1 if rng.random() < 0.2 else 0
            out.append(batch(worker, Provenance.NATIVE, Removed(tier, tuple(victims), group)))
        elif roll < 0.87:
            # A retained layer announcing some of the worker's blocks, sometimes under another parent.
            pool = held[worker][Tier.DEVICE] or [engine_hash(worker, 30_000_000 + len(out))]
            pick = rng.sample(pool, min(len(pool), rng.randint(1, 3)))
            parent = rng.choice(pool) if rng.random() < 0.5 else None
            if rng.random() < 0.3:
                event = Removed(Tier.DEVICE, tuple(pick))
            else:
                event = Stored(Tier.DEVICE, tuple(pick), parent, BLOCK_SIZE, local_hashes([p % 100_000 for p in pick]))
            out.append(batch(worker, Provenance.RETAINED, event))
        elif roll < 0.9:
            if rng.random() < 0.5:
                out.append(batch(worker, Provenance.NATIVE, Cleared(Tier.DEVICE)))  # vLLM's: its GPU pool only
                held[worker][Tier.DEVICE] = []
            else:
                out.append(batch(worker, Provenance.NATIVE, Cleared()))
                held[worker] = {t: [] for t in TIERS}
        elif roll < 0.93:
            reason = rng.choice([GapReason.MISSED, GapReason.REPLAY_INCOMPLETE])
            out.append(batch(worker, Provenance.NATIVE, Gap(seq[(worker, Provenance.NATIVE)] + 1, seq[(worker, Provenance.NATIVE)] + 5, reason)))
            seq[(worker, Provenance.NATIVE)] += 4
        elif roll < 0.95:
            epoch[worker] += 1
            seq[(worker, Provenance.NATIVE)] = -1
            event = Gap(0, 0, GapReason.PUBLISHER_RESTART)
            explicit = rng.random() < 0.5
            out.append(batch(worker, Provenance.NATIVE, *((event,) if explicit else ())))
            held[worker] = {t: [] for t in TIERS}
        elif roll < 0.96:
            out.append(BAD_RECORD)
        else:
            # A batch with several events, stores and removes mixed.
            ids = list(range(next_id[worker], next_id[worker] + 3))
            next_id[worker] += 3
            hashes = tuple(engine_hash(worker, i) for i in ids)
            out.append(batch(
                worker, Provenance.NATIVE,
                # a placeholder ahead of the store it copies: unresolved, then resolved in this batch
                Stored(Tier.DISK, hashes[:1], None, 0, ()),
                Stored(tier, hashes, None, BLOCK_SIZE, local_hashes(ids)),
                Removed(tier, hashes[:1]),
                Stored(tier, hashes[:1], hashes[2], BLOCK_SIZE, local_hashes(ids[:1])),
                Stored(tier, hashes[2:], hashes[1], BLOCK_SIZE, local_hashes(ids[2:])),  # one more reference
                # offload placeholders (no tokens), one known, one not, under an ownership
                Stored(Tier.DISK, (hashes[1], engine_hash(worker, 40_000_000 + len(out))), None, 0, (), ownership="kvcr"),
                # and one for the next block this worker will store, resolved by a later transaction
                Stored(Tier.HOST, (engine_hash(worker, next_id[worker]),), None, 0, (), ownership="kvcr"),
            ))  # fmt: skip
            blocks.extend(hashes[1:])
            blocks.append(hashes[0])
    return out


def reference_folds(stream: list[EventBatch | bytes], every: int) -> tuple[InventoryFold, dict[int, set]]:
    """Fold the stream in memory; return the final fold and the inventory at every `every`-th seq."""
    fold = InventoryFold()
    at: dict[int, set] = {}
    for seq, item in enumerate(stream, start=1):
        if isinstance(item, EventBatch):
            fold.apply(item, seq)
        if seq % every == 0:
            at[seq] = fold_rows(fold, seq)
    return fold, at


def fold_rows(fold: InventoryFold, seq: int | None = None) -> set:
    return {
        (r.worker.publisher, r.worker.dp_rank, r.provenance.value, r.tier.value, r.group_idx, r.spec_kind, r.ownership,
         r.engine_hash, r.sequence_hash, r.parent_hash, r.stream_seq, int(r.conflict), int(r.unresolved))
        for r in fold.iter_records()
    }  # fmt: skip


def fold_state(fold: InventoryFold) -> dict:
    """Everything the fold knows, comparable across folds."""
    workers = {}
    for worker in fold.workers():
        state = fold.worker_state(worker)
        workers[worker.name] = (
            {p.value: attrs.astuple(state.position(p), recurse=False) for p in Provenance},
            {k: v for k, v in state.counters.items() if v},
        )
    return {
        "inventory_seq": fold.inventory_seq,
        "counters": {k: v for k, v in fold.counters.items() if v},
        "workers": workers,
        "records": fold_rows(fold),
        "references": {(r.worker, r.provenance, r.tier, r.key): r.refs for r in fold.iter_records() if r.refs > 1},
    }




def store_settings(nats_url: str, db_url: str, **store: object) -> Settings:
    overrides = {"nats.url": nats_url, "db.url": db_url, "store.http_port": 0}
    overrides.update({f"store.{key}": value for key, value in store.items()})
    return load_settings(None, environ={}, overrides=overrides).settings


async def publish(nats_url: str, stream: Iterable[EventBatch | bytes], settings: Settings | None = None) -> int:
    """Publish the stream in order (the store's stream spec); return the last stream seq."""
    connection = await nats.connect(nats_url)
    try:
        js = connection.jetstream()
        await ensure_stream(js, events_stream((settings or Settings()).stream))
        last = 0
        pending = []
        for item in stream:
            if isinstance(item, bytes):
                pending.append(js.publish("kv.ev.broken.0", item))
            else:
                pending.append(js.publish(item.subject, encode_batch(item), headers={"Nats-Msg-Id": item.msg_id}))
            if len(pending) >= 256:
                last = max(ack.seq for ack in await asyncio.gather(*pending))
                pending = []
        if pending:
            last = max(ack.seq for ack in await asyncio.gather(*pending))
        return last
    finally:
        await connection.close()


def checkpoint(url: str, name: str = "events") -> int:
    with database.opened(url) as engine, engine.connect() as connection:
        try:
            return audit.Audit(connection).checkpoint(name)
        except sa.exc.OperationalError:
            return -1


async def poll(
    condition: Callable[[], bool], what: str, deadline_s: float = DEADLINE_S, *, watch: asyncio.Task | None = None
) -> None:
    """Wait for `condition` (run off the loop: it reads SQL); fail at the deadline, or at once if the watched task ended."""

    async def met() -> bool:
        if watch is not None and watch.done():
            watch.result()
            raise AssertionError(f"the store stopped before {what}")
        return await asyncio.to_thread(condition)

    await wait_until(met, deadline_s, what, interval=0.02)


class RunningStore:
    """The store service in this process, for as long as the `async with` lasts."""

    def __init__(self, settings: Settings) -> None:
        self.service = StoreService(settings)
        self.stop = asyncio.Event()
        self.task: asyncio.Task | None = None

    async def __aenter__(self) -> RunningStore:
        self.task = asyncio.create_task(self.service.run(self.stop))
        return self

    async def until(self, condition: Callable[[], bool], what: str) -> None:
        await poll(condition, what, watch=self.task)

    async def __aexit__(self, *exc_info: object) -> None:
        self.stop.set()
        await asyncio.wait_for(self.task, 30)


async def project(settings: Settings, until_seq: int) -> None:
    async with RunningStore(settings) as running:
        await running.until(lambda: checkpoint(settings.db.url) >= until_seq, f"checkpoint {until_seq}")


def sql_inventory_at(connection: sa.Connection, workers: list[WorkerId], seq: int) -> set:
    rows = set()
    for worker in workers:
        for row in audit.Audit(connection).inventory(worker, list(Tier), seq):
            rows.add((
                row["publisher"], row["dp_rank"], row["provenance"], row["tier"], row["group_idx"],
                row["kv_cache_spec_kind"], row["ownership"], row["engine_hash"], row["sequence_hash"],
                row["parent_hash"], row["stored_seq"], int(row["conflict"]), int(row["unresolved"]),
            ))  # fmt: skip
    return rows


def content_digest(url: str) -> tuple[dict[str, int], str]:
    """Row counts and a digest of every table's deterministic content."""
    # block_residency is a view (no primary key to order by); its placement id is a number SQL assigns
    skip = {"dead_letters": {"recorded_ts"}, "checkpoints": {"updated_ts"}, "block_residency": {"placement_id"}}
    view_keys = {"block_residency": ("stored_seq", "slot")}
    counts, digest = {}, hashlib.sha256()
    with database.opened(url) as engine, engine.connect() as connection:
        for table in ("event_log", "block_residency", "workers", "uncertain_periods", "dead_letters", "checkpoints"):
            meta = sa.Table(table, sa.MetaData(), autoload_with=connection)
            columns = [c for c in meta.columns if c.name not in skip.get(table, set())]
            keys = [c for c in meta.primary_key.columns] or [meta.c[name] for name in view_keys[table]]
            rows = connection.execute(sa.select(*columns).order_by(*keys)).all()
            counts[table] = len(rows)
            for row in rows:
                digest.update(repr(tuple(bytes(v) if isinstance(v, memoryview) else v for v in row)).encode())
    return counts, digest.hexdigest()


class StoreProcess:
    """`kvledger store` as a child process (so a test can SIGKILL it), its output in a log file.

    The environment is the test's without any KVLEDGER_ variable, plus `environment`; `args`
    follow `--nats` and `--db` (e.g. `--shard K/N`).
    """

    def __init__(
        self, nats_url: str, db_url: str, log_path: Path, *, args: Sequence[str] = (),
        environment: Mapping[str, str] | None = None,
    ) -> None:
        env = {name: value for name, value in os.environ.items() if not name.startswith("KVLEDGER_")}
        env.update({"KVLEDGER_STORE_HTTP_PORT": "0", **(environment or {})})
        self.log_path = log_path
        with log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "kvledger.app.cli", "store", "--nats", nats_url, "--db", db_url, *args],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            )  # fmt: skip

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def terminate(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=30)

    async def stop(self) -> None:
        """SIGTERM, unless it already ended; it must have exited cleanly."""
        if self.alive():
            await asyncio.to_thread(self.terminate)
        assert self.process.returncode == 0, f"store exited with {self.process.returncode}:\n{self.log()}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def warnings(self) -> list[str]:
        """What store warned about (rebinding a consumer, rewinding to the checkpoint), without timestamps."""
        lines = self.log_path.read_text(errors="replace").splitlines()
        return [line.split(" WARNING ", 1)[1] for line in lines if " WARNING " in line]


def run_in_shell(db_url: str, query: audit.Query, values: Mapping[str, object]) -> list[str]:
    """An audit query as an auditor runs it: pasted into sqlite3 or psql with its parameters set; the output lines."""
    if db_url.startswith("sqlite"):
        commands = [f".parameter set :{name} {_sqlite_literal(values[name])}" for name in query.params]
        script = "\n".join([".mode list", ".bail on", *commands, query.sql]) + "\n"
        done = subprocess.run(["sqlite3", sa.make_url(db_url).database], input=script, capture_output=True, text=True,
                              timeout=30)
        assert done.returncode == 0 and "Error" not in done.stderr, done.stderr
    else:
        commands = [f"\\set {name} {_psql_literal(values[name])}" for name in query.params]
        script = "\n".join(["\\set ON_ERROR_STOP on", *commands, query.sql]) + "\n"
        done = subprocess.run(["psql", "-X", "-q", "-A", "-t", libpq_url(db_url)], input=script, capture_output=True,
                              text=True, timeout=30)
        assert done.returncode == 0, done.stderr
    return [line for line in done.stdout.splitlines() if line]


def assert_shell_agrees(db_url: str, query: audit.Query, values: Mapping[str, object], rows: list,
                       columns: tuple[str, ...]) -> None:
    """The shell's output for `query` is `rows`, line for line, in each of `columns` a row has."""
    lines = run_in_shell(db_url, query, values)
    assert len(lines) == len(rows), query.name
    for line, row in zip(lines, rows):
        cells = dict(zip(row, line.split("|")))
        for column in columns:
            if column in row:
                assert cells[column] == ("" if row[column] is None else str(row[column])), (query.name, column)


def _sqlite_literal(value: object) -> str:
    return f"\"'{value}'\"" if isinstance(value, str) else str(value)


def _psql_literal(value: object) -> str:
    return f"'''{value}'''" if isinstance(value, str) else str(value)
