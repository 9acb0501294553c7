"""Migrations on both engines, and the refusals at startup: old schema, conflicting stream."""

from __future__ import annotations

import asyncio

import nats
import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from kvledger.app.cli import main
from kvledger.core.settings import Settings
from kvledger.runtime.streams import StreamSpec, events_stream
from kvledger.runtime.streams import StreamConflictError, ensure_stream
from kvledger.store import database
from kvledger.store.database import SchemaError
from kvledger.store.service import StoreService
from kvledger.store.tables import metadata
from store_harness import store_settings

pytestmark = pytest.mark.service


@pytest.fixture(params=["sqlite", "postgres"])
def empty_db(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "postgres_url")


def test_upgrade_an_empty_database_to_head_then_downgrade_one_step(empty_db, capsys) -> None:
    assert main(["db", "upgrade", "--db", empty_db]) == 0
    assert "empty -> 0015" in capsys.readouterr().out
    with database.opened(empty_db) as engine:
        assert database.current_revision(engine) == database.head_revision() == "0015"
        with engine.connect() as connection:
            # The migrations build exactly the tables the code writes to.
            # (an index made on one engine only is compared there only)
            context = MigrationContext.configure(connection, opts={"include_object": _made_on(connection.dialect.name)})
            assert compare_metadata(context, metadata) == []
            views = set(sa.inspect(connection).get_view_names())
            assert {"block_residency", "current_inventory", "block_history", "decision_block_stays"} <= views
            # A hash above 2**63 reads back unsigned through the views.
            _insert_stays(connection)
            shown = connection.execute(sa.text(
                "SELECT engine_hash, parent_hash, removal_cause, refs FROM current_inventory")).one()
            assert (int(shown[0]), shown[1], shown[2], shown[3]) == ((1 << 64) - 2, None, "stored", 1)
            connection.execute(sa.text("INSERT INTO decision_blocks (stream_seq, role, position, sequence_hash) "
                                       "VALUES (2, 'target', 0, -5), (1, 'source', 3, 7), (1, 'target', 0, 9)"))
            assert _decision_blocks(connection) == EXPECTED_DECISION_BLOCKS
            if connection.dialect.name == "sqlite":
                assert not _decision_blocks_have_rowids(connection)
            connection.commit()
    with database.opened(empty_db) as engine, engine.connect() as connection:
        # PostgreSQL finds a worker's stays by a deduplicated index and keeps no key beside it;
        # SQLite's table is its key
        # SQLite's table is its key; the flagged stays have a partial index of their own on both
        flagged = {"ix_stays_flagged": ["placement_id", "stored_seq", "slot"]}
        if connection.dialect.name == "postgresql":
            assert _stays_keys(connection) == ({"ix_stays_placement": ["placement_id", "stored_seq"], **flagged}, [])
        else:
            assert _stays_keys(connection) == (flagged, ["placement_id", "stored_seq", "slot"])
    assert main(["db", "downgrade", "--db", empty_db]) == 0
    with database.opened(empty_db) as engine, engine.connect() as connection:
        assert database.current_revision(engine) == "0014"
        # 0014's decision_blocks (SQLite: a rowid table beside its key's index), the rows as they were
        assert _decision_blocks(connection) == EXPECTED_DECISION_BLOCKS
        if connection.dialect.name == "sqlite":
            assert _decision_blocks_have_rowids(connection)
        assert _views(connection) >= {"block_residency", "current_inventory", "block_history", "decision_block_stays"}
    with database.opened(empty_db) as engine:
        database.upgrade(engine)
        with engine.connect() as connection:
            assert _decision_blocks(connection) == EXPECTED_DECISION_BLOCKS  # and forward again
            assert connection.dialect.name != "sqlite" or not _decision_blocks_have_rowids(connection)
        database.downgrade(engine, "0013")
        assert database.current_revision(engine) == "0013"
        assert "ix_stays_flagged" not in {i["name"] for i in sa.inspect(engine).get_indexes("block_stays")}
        database.downgrade(engine, "0012")
        assert database.current_revision(engine) == "0012"
        assert "unreachable_periods" not in set(sa.inspect(engine).get_table_names())
        assert "unreachable_since" not in {c["name"] for c in sa.inspect(engine).get_columns("workers")}
        database.downgrade(engine, "0011")
        assert database.current_revision(engine) == "0011"
        assert not {"decision_verdicts", "verdicts_pending", "verdict_horizons"} & set(sa.inspect(engine).get_table_names())
        database.downgrade(engine, "0010")
        assert database.current_revision(engine) == "0010"
        with engine.connect() as connection:
            # 0010's key on both engines, the stays as they were
            assert _stays_keys(connection) == ({}, ["placement_id", "stored_seq", "slot"])
            assert _residency(connection) == EXPECTED_STAYS
        database.downgrade(engine, "0009")
        assert database.current_revision(engine) == "0009"
        with engine.connect() as connection:
            # 0009's layout again: a removal row per stay, keyed by the stay
            columns = [c["name"] for c in sa.inspect(connection).get_columns("block_removals")]
            assert columns == ["stored_seq", "removed_seq", "removed_ts", "slot", "removal_cause"]
            assert _residency(connection) == EXPECTED_STAYS
        database.downgrade(engine, "0008")
        with engine.connect() as connection:
            # 0008's layout: the placement leads both keys, removals carry it
            columns = [c["name"] for c in sa.inspect(connection).get_columns("block_removals")]
            assert columns[:3] == ["placement_id", "stored_seq", "slot"]
            assert _residency(connection) == EXPECTED_STAYS
        database.upgrade(engine)
        assert database.current_revision(engine) == "0015"
        with engine.connect() as connection:
            assert _residency(connection) == EXPECTED_STAYS  # and forward again
        database.downgrade(engine, "0007")
        with engine.connect() as connection:
            # 0007's schema: block_residency a table, the stays moved back into it
            inspector = sa.inspect(connection)
            assert "block_residency" in inspector.get_table_names()
            assert not {"placements", "block_stays", "block_removals"} & set(inspector.get_table_names())
            assert "decision_block_stays" in inspector.get_view_names()
            assert _residency(connection) == EXPECTED_STAYS
        database.upgrade(engine)
        with engine.connect() as connection:
            assert _residency(connection) == EXPECTED_STAYS


EXPECTED_STAYS = [
    (1, 0, "p", 0, "device", "native", -2, None, None, None, 1),
    (2, 0, "p", 0, "device", "native", 9, 3, 1.5, "removed", 3),
    (2, 1, "p", 0, "device", "native", 10, 3, 1.5, "removed", 1),
    (2, 2, "p", 0, "device", "native", 13, 3, 1.5, "removed", 1),
]


EXPECTED_DECISION_BLOCKS = [(1, "source", 3, 7), (1, "target", 0, 9), (2, "target", 0, -5)]


def _decision_blocks(connection: sa.Connection) -> list[tuple]:
    return [tuple(row) for row in connection.execute(sa.text(
        "SELECT stream_seq, role, position, sequence_hash FROM decision_blocks ORDER BY stream_seq, role, position"))]


def _decision_blocks_have_rowids(connection: sa.Connection) -> bool:
    """Whether SQLite keeps decision_blocks as a rowid table (PostgreSQL: never asked)."""
    sql = connection.exec_driver_sql("SELECT sql FROM sqlite_master WHERE name = 'decision_blocks'").scalar_one()
    return "WITHOUT ROWID" not in sql.upper()


def _views(connection: sa.Connection) -> set[str]:
    return set(sa.inspect(connection).get_view_names())


def _insert_stays(connection: sa.Connection) -> None:
    place = connection.execute(sa.text(
        "INSERT INTO placements (publisher, dp_rank, provenance, tier, group_idx) "
        "VALUES ('p', 0, 'native', 'device', 0) RETURNING placement_id")).scalar_one()
    connection.execute(sa.text(
        "INSERT INTO block_stays (placement_id, stored_seq, slot, engine_hash, sequence_hash, parent_hash, local_hash, "
        "stored_ts, refs) VALUES (:p, 1, 0, -2, 5, NULL, 7, 1.0, NULL), (:p, 2, 0, 9, 6, -2, 8, 1.25, 3), "
        "(:p, 2, 1, 10, 11, 9, 12, 1.25, NULL), (:p, 2, 2, 13, 14, 10, 15, 1.25, NULL)"), {"p": place})
    connection.execute(sa.text(  # one run: slots 0..2 of seq 2, ended at seq 3
        "INSERT INTO block_removals (placement_id, stored_seq, first_slot, last_slot, removed_seq, removed_ts, "
        "removal_cause) VALUES (:p, 2, 0, 2, 3, 1.5, 'removed')"), {"p": place})


def _made_on(dialect: str):
    """Alembic's include_object: leaves out what the tables make on another engine only (`ddl_if`)."""
    def include(obj, name, type_, reflected, compare_to) -> bool:
        made_if = getattr(obj, "_ddl_if", None)
        return reflected or made_if is None or made_if.dialect in (None, dialect)
    return include


def _stays_keys(connection: sa.Connection) -> tuple[dict[str, list[str]], list[str]]:
    """block_stays' indexes other than the sequence-hash lookup, and its primary key's columns."""
    inspector = sa.inspect(connection)
    indexes = {i["name"]: i["column_names"] for i in inspector.get_indexes("block_stays")}
    indexes.pop("ix_stays_sequence_hash")
    return indexes, inspector.get_pk_constraint("block_stays")["constrained_columns"]


def _residency(connection: sa.Connection) -> list[tuple]:
    return [tuple(row) for row in connection.execute(sa.text(
        "SELECT stored_seq, slot, publisher, dp_rank, tier, provenance, engine_hash, removed_seq, removed_ts, "
        "removal_cause, refs FROM block_residency ORDER BY stored_seq, slot"))]


async def test_the_store_refuses_an_older_schema_and_says_which_command_to_run(nats_server, empty_db) -> None:
    with database.opened(empty_db) as engine:
        database.upgrade(engine, "0001")
    with pytest.raises(SchemaError, match=r"revision 0001, this kvledger needs 0015; run `kvledger db upgrade --db "):
        await StoreService(store_settings(nats_server.url, empty_db)).run(asyncio.Event())


def test_the_cli_reports_a_missing_schema_in_one_line(sqlite_url, capsys) -> None:
    assert main(["store", "--db", sqlite_url, "--nats", "nats://127.0.0.1:1"]) == 2
    assert "has no kvledger schema; run `kvledger db upgrade --db sqlite:///" in capsys.readouterr().err


async def test_a_conflicting_events_stream_is_refused_not_modified(nats_server, sqlite_url) -> None:
    with database.opened(sqlite_url) as engine:
        database.upgrade(engine)
    spec = events_stream(Settings().stream)
    other = StreamSpec(spec.name, ("kv.other.>",), spec.duplicate_window_s, 3600.0, spec.max_bytes, spec.replicas)
    connection = await nats.connect(nats_server.url)
    try:
        js = connection.jetstream()
        await ensure_stream(js, other)
        with pytest.raises(StreamConflictError, match=r"KV_EVENTS exists with different settings .*subjects.*max_age_s"):
            await StoreService(store_settings(nats_server.url, sqlite_url)).run(asyncio.Event())
        config = (await js.stream_info(spec.name)).config
        assert config.subjects == ["kv.other.>"] and config.max_age == 3600.0
    finally:
        await connection.close()


async def test_an_existing_stream_with_the_agreed_spec_is_used_as_is(nats_server) -> None:
    connection = await nats.connect(nats_server.url)
    try:
        js = connection.jetstream()
        spec = events_stream(Settings().stream)
        await ensure_stream(js, spec)
        created = (await js.stream_info(spec.name)).created
        await ensure_stream(js, spec)  # a second stage starting finds it and agrees
        info = await js.stream_info(spec.name)
        assert info.created == created, "the stream was created anew"
        assert info.config.subjects == list(spec.subjects) and info.config.num_replicas == spec.replicas
        assert info.config.duplicate_window == spec.duplicate_window_s and info.config.max_age == spec.max_age_s
    finally:
        await connection.close()
