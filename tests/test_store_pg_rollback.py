"""store when PostgreSQL goes back to an older backup while KV_EVENTS and KV_DECISIONS keep everything.

The fault: store projects a first part of both streams, a backup is taken (pg_basebackup of
the whole cluster, or pg_dump of the database), store projects a second part, then the
backup is restored under a running store (its connections break, or, for a dump restored in
place, stay open) or under a store killed with SIGKILL and started again; a third part
follows. SQL has then gone back to the backup's checkpoints while the streams hold more: store
must read the streams again from what SQL holds, so that SQL ends equal to a fresh projection
of both streams, every batch, decision and verdict once.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator

import attrs
import pytest
import sqlalchemy as sa

import services
from engines import wait_until
from kvledger.core.events import EventBatch
from services import LocalPostgresCluster, ServiceUnavailable, libpq_url
from kvledger.store import database, tables
from kvledger.store.changes import VERDICT_COLUMNS
from store_harness import RunningStore, StoreProcess, checkpoint, content_digest, publish, store_settings
from test_store_stream_loss import _assert_healed, _batches, _generations, _local, _publish_decisions

pytestmark = pytest.mark.service

BACKED_UP = 600  # batches projected when the backup is taken
RESTORED_AT = 1200  # batches projected when it is restored
DECISIONS = 40  # decisions published with each part
HORIZON_MS = 100.0
DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalPostgresCluster]:
    """A PostgreSQL cluster of this module's own: a base backup restore replaces its data folder."""
    bin_dir = services.find_postgres_bin_dir()
    if bin_dir is None:
        services.missing_service("no local PostgreSQL binaries (initdb, pg_basebackup) to run a cluster of its own",
                                 os.environ)
    try:
        server = LocalPostgresCluster(bin_dir).start()
    except ServiceUnavailable as error:
        services.missing_service(str(error), os.environ)
    with server:
        yield server


@pytest.fixture
def databases(cluster: LocalPostgresCluster) -> Iterator[tuple[str, str]]:
    """(the database rolled back, one for the fresh projection), both upgraded."""
    names = [f"kvledger_rollback_{uuid.uuid4().hex[:12]}" for _ in range(2)]
    urls = [cluster.create_database(name) for name in names]
    for url in urls:
        with database.opened(url) as engine:
            database.upgrade(engine)
    yield urls[0], urls[1]
    cluster.ensure_running()
    for name in names:
        cluster.drop_database(name)


# --- backups -------------------------------------------------------------------------------


def _tool(cluster: LocalPostgresCluster, name: str) -> str:
    # initdb may be a link on PATH into the versioned folder, which alone holds the backup tools.
    return str((cluster.bin_dir / "initdb").resolve().parent / name)


class BaseBackup:
    """pg_basebackup of the whole cluster; restored as an operator does: stop, replace the data folder, start."""

    def __init__(self, cluster: LocalPostgresCluster, url: str) -> None:
        self.cluster = cluster
        self.folder = cluster.root / f"backup-{uuid.uuid4().hex[:8]}"

    def take(self) -> None:
        command = [
            _tool(self.cluster, "pg_basebackup"), "-h", "127.0.0.1", "-p", str(self.cluster.port),
            "-U", LocalPostgresCluster.SUPERUSER, "-D", str(self.folder), "-X", "stream", "-c", "fast", "--no-sync",
        ]  # fmt: skip
        subprocess.run(command, check=True, capture_output=True, cwd=self.cluster.root, **self.cluster._run_as)

    def restore(self) -> None:
        self.cluster.stop()
        shutil.rmtree(self.cluster.data_dir)
        self.folder.rename(self.cluster.data_dir)
        self.cluster.restart()


class DatabaseDump:
    """pg_dump of the database alone; restored in place (pg_restore --clean in one transaction): store's
    connections stay open, so nothing but SQL's own content says it went back."""

    def __init__(self, cluster: LocalPostgresCluster, url: str) -> None:
        self.cluster = cluster
        self.url = url
        self.file = cluster.root / f"dump-{uuid.uuid4().hex[:8]}.pgdump"

    def take(self) -> None:
        subprocess.run([_tool(self.cluster, "pg_dump"), "-Fc", "-f", str(self.file), libpq_url(self.url)],
                       check=True, capture_output=True)

    def restore(self) -> None:
        subprocess.run([
            _tool(self.cluster, "pg_restore"), "--clean", "--if-exists", "--single-transaction",
            "-d", libpq_url(self.url), str(self.file),
        ], check=True, capture_output=True)  # fmt: skip


# --- traffic and what SQL holds --------------------------------------------------------------


async def _traffic(nats_url: str, batches: list[EventBatch], request_ids: list[str]) -> tuple[list[EventBatch], int, int]:
    """Decisions, then batches ingested after their horizon (so they judge them): the batches as published,
    and the last stream seq of each stream."""
    decisions_seq = await _publish_decisions(nats_url, request_ids)
    start = time.time() + 2 * HORIZON_MS / 1000
    timed = [attrs.evolve(batch, ingest_ts=start + n * 1e-4) for n, batch in enumerate(batches)]
    return timed, await publish(nats_url, timed), decisions_seq


def _projected(url: str, events_seq: int, decisions_seq: int) -> bool:
    if checkpoint(url) < events_seq or checkpoint(url, "decisions") < decisions_seq:
        return False
    with database.opened(url) as engine, engine.connect() as connection:
        return connection.execute(sa.select(sa.func.count()).select_from(tables.verdicts_pending)).scalar_one() == 0


def _decision_tables(url: str) -> dict[str, list[tuple]]:
    """Every row of the decision tables (verdicts without who judged them: the fold or SQL, both are right)."""
    verdict_columns = [name for name in VERDICT_COLUMNS if name != "judged_by"]
    out = {}
    with database.opened(url) as engine, engine.connect() as connection:
        for table in (tables.decisions, tables.decision_blocks, tables.decision_requests, tables.decision_verdicts,
                      tables.verdicts_pending, tables.recovered_batches, tables.stream_generations):
            columns = [table.c[name] for name in verdict_columns] if table is tables.decision_verdicts else list(table.c)
            out[table.name] = sorted(tuple(row) for row in connection.execute(sa.select(*columns)))
    return out


def _store_process(nats_url: str, db_url: str, tmp_path) -> StoreProcess:
    """`kvledger store` as a child process (to be killed with SIGKILL), judging at the test's horizon."""
    return StoreProcess(nats_url, db_url, tmp_path / "store.log",
                        environment={"KVLEDGER_STORE_QUALITY_HORIZONS_MS": f"{HORIZON_MS:g}"})


async def _until(condition, what: str, store=None) -> None:
    if store is not None:
        await store.until(condition, what)
    else:
        await wait_until(lambda: asyncio.to_thread(condition), DEADLINE_S, what, interval=0.05)


# --- the tests -------------------------------------------------------------------------------


@pytest.mark.parametrize("backup_kind", [BaseBackup, DatabaseDump], ids=["pg_basebackup", "pg_dump"])
@pytest.mark.parametrize("store_during_restore", ["running", "restarted"])
async def test_sql_restored_from_an_older_backup_is_projected_again_from_the_stream(
    nats_server, cluster, databases, tmp_path, backup_kind, store_during_restore,
) -> None:
    server = _local(nats_server)
    url, clean_url = databases
    batches = _batches()
    ids = [f"req-{n}" for n in range(3 * DECISIONS)]
    settings = store_settings(server.url, url, batch_size=64, quality_horizons_ms=[HORIZON_MS])
    backup = backup_kind(cluster, url)
    running = store_during_restore == "running"
    store = await RunningStore(settings).__aenter__() if running else None
    process = None if running else _store_process(server.url, url, tmp_path)
    published: list[EventBatch] = []
    try:
        part, events_seq, decisions_seq = await _traffic(server.url, batches[:BACKED_UP], ids[:DECISIONS])
        published += part
        await _until(lambda: _projected(url, events_seq, decisions_seq), "the first part projected", store)
        backup.take()
        backed_up_at = checkpoint(url), checkpoint(url, "decisions")
        part, events_seq, decisions_seq = await _traffic(server.url, batches[BACKED_UP:RESTORED_AT],
                                                         ids[DECISIONS:2 * DECISIONS])
        published += part
        await _until(lambda: _projected(url, events_seq, decisions_seq), "the second part projected", store)
        if process is not None:
            process.kill()
        backup.restore()
        assert (checkpoint(url), checkpoint(url, "decisions")) == backed_up_at  # SQL went back; the streams did not
        if process is not None:
            process = _store_process(server.url, url, tmp_path)
        part, events_seq, decisions_seq = await _traffic(server.url, batches[RESTORED_AT:], ids[2 * DECISIONS:])
        published += part
        await _until(lambda: _projected(url, events_seq, decisions_seq), "everything projected", store)
    finally:
        if store is not None:
            await store.__aexit__(None, None, None)
        if process is not None:
            await process.stop()
    _assert_healed(url, published)  # the inventory as the whole stream folds, every batch once
    assert _generations(url) == []  # the streams lost nothing: SQL was only behind them
    async with RunningStore(store_settings(server.url, clean_url, batch_size=64, quality_horizons_ms=[HORIZON_MS])) as fresh:
        await fresh.until(lambda: _projected(clean_url, events_seq, decisions_seq), "the fresh projection")
    assert content_digest(url) == content_digest(clean_url)
    held = _decision_tables(url)
    assert held == _decision_tables(clean_url)
    request_ids = tables.decisions.columns.keys().index("request_id")
    assert sorted(row[request_ids] for row in held["decisions"]) == sorted(ids)  # each decision once
    assert len(held["decision_verdicts"]) == len(ids)  # one verdict per decision
