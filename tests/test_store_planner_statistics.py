"""Store keeps PostgreSQL's planner statistics up with what it wrote (store/planner_statistics.py)."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from builders import Stream, stored
from kvledger.core.events import WorkerId
from kvledger.store import database
from kvledger.store.planner_statistics import LEAST_ROWS, analyze_due

from store_harness import RunningStore, checkpoint, poll, publish, store_settings


@pytest.mark.parametrize(
    ("written", "rows_at_last", "caught_up", "due"),
    [
        (LEAST_ROWS - 1, 0, True, False),  # too few rows to be worth a sample
        (LEAST_ROWS, 0, True, True),
        (LEAST_ROWS, 50_000, True, True),  # a fifth more, caught up
        (LEAST_ROWS, 50_000, False, False),  # still catching up: waits until it has caught up
        (10 * LEAST_ROWS, 0, False, False),
        (90_000, 1_000_000, True, False),  # under a tenth of a large table
        (100_000, 1_000_000, True, True),
    ],
)
def test_analyze_is_due_once_caught_up_after_a_tenth_more_rows(
    written: int, rows_at_last: int, caught_up: bool, due: bool
) -> None:
    assert analyze_due(written, rows_at_last, caught_up) is due


def _stream(batches: int, start: int = 0) -> list:
    stream = Stream()
    workers = [WorkerId(f"engine-{n}") for n in range(4)]
    out = []
    for n in range(start, start + batches):
        worker = workers[n % len(workers)]
        first = 1 + 16 * n
        out.append(stream.batch(worker, stored(list(range(first, first + 16))), seq=n // len(workers))[0])
    return out


def _analyzed(url: str) -> tuple:
    with database.opened(url) as engine, engine.connect() as connection:
        return connection.execute(sa.text(
            "SELECT s.analyze_count, c.reltuples, (SELECT COUNT(*) FROM block_stays) "
            "FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid WHERE s.relname = 'block_stays'"
        )).one()


@pytest.mark.service
async def test_a_caught_up_store_analyzes_what_it_wrote_and_a_restart_with_little_new_does_not(
    nats_server, postgres_url: str
) -> None:
    with database.opened(postgres_url) as engine:
        database.upgrade(engine)
    settings = store_settings(nats_server.url, postgres_url)
    first = _stream(800)  # 12 800 stays and 800 event-log rows
    last = await publish(nats_server.url, first, settings)
    async with RunningStore(settings) as running:
        await running.until(lambda: checkpoint(postgres_url) >= last, f"checkpoint {last}")
        # (the counter moves once all four tables are analyzed; block_stays is the first of them)
        await poll(lambda: running.service.metrics.analyzes.value >= 1, "an ANALYZE counted", watch=running.task)
        assert _analyzed(postgres_url)[0] >= 1
    count, estimate, stays = _analyzed(postgres_url)
    assert stays == 800 * 16
    assert estimate == stays  # a table under the sample's size is read whole: the estimate is exact

    # A restarted store starts from those statistics: 1 600 rows more are under a tenth.
    more = await publish(nats_server.url, _stream(100, start=800), settings)
    async with RunningStore(settings) as running:
        await running.until(lambda: checkpoint(postgres_url) >= more, f"checkpoint {more}")
        assert running.service.metrics.analyzes.value == 0
    # Only store's own ANALYZE counts here: PostgreSQL's autovacuum may sample the table on its own
    # (1 600 rows pass its threshold of 50 + a tenth of 12 800) and move the estimate without it.
    assert _analyzed(postgres_url)[0] == count


@pytest.mark.service
async def test_sqlite_is_never_analyzed(nats_server, sqlite_url: str) -> None:
    with database.opened(sqlite_url) as engine:
        database.upgrade(engine)
    settings = store_settings(nats_server.url, sqlite_url)
    last = await publish(nats_server.url, _stream(800), settings)
    async with RunningStore(settings) as running:
        await running.until(lambda: checkpoint(sqlite_url) >= last, f"checkpoint {last}")
        assert running.service.metrics.analyzes.value == 0
    with database.opened(sqlite_url) as engine, engine.connect() as connection:
        assert connection.exec_driver_sql("SELECT name FROM sqlite_master WHERE name = 'sqlite_stat1'").all() == []
