"""Migrations on both engines, and the refusals at startup: old schema, conflicting stream."""

from __future__ import annotations

import asyncio

import nats
import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from kvledger.app.cli import main
from kvledger.settings import Settings
from kvledger.runtime.streams import StreamSpec, events_stream
from store import database
from store.database import SchemaError
from kvledger.runtime.streams import StreamConflictError, ensure_stream
from store.projector import StoreService
from store.tables import metadata
from store_harness import store_settings

pytestmark = pytest.mark.service


@pytest.fixture(params=["sqlite", "postgres"])
def empty_db(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "postgres_url")


def test_upgrade_an_empty_database_to_head_then_downgrade_one_step(empty_db, capsys) -> None:
    assert main(["db", "upgrade", "--db", empty_db]) == 0
    assert "empty -> 0007" in capsys.readouterr().out
    with database.opened(empty_db) as engine:
        assert database.current_revision(engine) == database.head_revision() == "0007"
        with engine.connect() as connection:
            # The migrations build exactly the tables the code writes to.
            assert compare_metadata(MigrationContext.configure(connection), metadata) == []
            views = set(sa.inspect(connection).get_view_names())
            assert {"current_inventory", "block_history"} <= views
            # A hash above 2**63 reads back unsigned through the views.
            connection.execute(sa.text(
                "INSERT INTO block_residency (stored_seq, slot, publisher, dp_rank, tier, provenance, engine_hash, "
                "sequence_hash, parent_hash, local_hash, stored_ts) VALUES (1, 0, 'p', 0, 'device', 'native', -2, 5, NULL, 7, 1.0)"
            ))  # fmt: skip
            shown = connection.execute(sa.text("SELECT engine_hash, parent_hash, removal_cause FROM current_inventory")).one()
            assert (int(shown[0]), shown[1], shown[2]) == ((1 << 64) - 2, None, "stored")
            connection.rollback()
    assert main(["db", "downgrade", "--db", empty_db]) == 0
    with database.opened(empty_db) as engine:
        assert database.current_revision(engine) == "0006"
        with engine.connect() as connection:
            # 0006's schema again, without what 0007 added for shadow decisions and replay
            inspector = sa.inspect(connection)
            assert "decision_requests" not in inspector.get_table_names()
            assert "shadow_source" not in {column["name"] for column in inspector.get_columns("decisions")}
            assert "decision_block_stays" in inspector.get_view_names()
            assert "stream_generations" in inspector.get_table_names()
        database.upgrade(engine)
        assert database.current_revision(engine) == "0007"


async def test_the_store_refuses_an_older_schema_and_says_which_command_to_run(nats_server, empty_db) -> None:
    with database.opened(empty_db) as engine:
        database.upgrade(engine, "0001")
    with pytest.raises(SchemaError, match=r"revision 0001, this kvledger needs 0007; run `kvledger db upgrade --db "):
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
