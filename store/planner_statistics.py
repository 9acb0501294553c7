"""Planner statistics that follow what store wrote (PostgreSQL).

PostgreSQL plans every audit statement from per-table statistics that autovacuum refreshes
at most once per `autovacuum_naptime` (a minute by default), and only after a tenth of a
table changed. A store catching up writes a table's whole history in seconds; until the
statistics follow, the as-of statement is planned for the table as it was, nearly empty
(measured at 300 000 block events: a hash anti-join planned for 356 rows, 25 ms, against
12.5 ms once analyzed). So store runs `ANALYZE` itself on the tables it fills, by the rule
autovacuum uses (a tenth more rows than at the last one), as soon as it has caught up with
the stream. Not while catching up: analyzing whenever the tables had doubled during the
bench's catch-up of 300 000 block events cost the projection about 5 %
(PostgreSQL and store share the cores), and over a catch-up longer than a minute
autovacuum's own rounds keep the statistics near enough.

ANALYZE reads a sample (about 30 000 rows per table at the default statistics target) and
takes a lock that inserts do not wait for; `SKIP_LOCKED` passes over a table another
session (autovacuum, another store shard) is analyzing. SQLite's plans for the audit
statements follow from the tables' keys and need no statistics.
"""

from __future__ import annotations

import logging
import time

import sqlalchemy as sa

log = logging.getLogger("kvledger.store")

ANALYZED_TABLES = ("block_stays", "block_removals", "event_log", "placements")
# as autovacuum_analyze_threshold and autovacuum_analyze_scale_factor
LEAST_ROWS = 10_000
GROWTH = 0.1


def analyze_due(written: int, rows_at_last: int, caught_up: bool) -> bool:
    """Whether `written` rows since the last ANALYZE of tables that held `rows_at_last` call for another."""
    return caught_up and written >= max(LEAST_ROWS, GROWTH * rows_at_last)


class PlannerStatistics:
    """Counts the rows store wrote since the last ANALYZE and says when another is due."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.enabled = engine.dialect.name == "postgresql"
        self.rows_at_last = None  # rows the tables held at the last ANALYZE (read from the catalog at first)
        self.written = 0  # rows written since

    def read_catalog(self) -> None:
        """Start from the row counts PostgreSQL's last statistics hold (a restarted store)."""
        if not self.enabled or self.rows_at_last is not None:
            return
        with self.engine.connect() as connection:
            estimate = connection.exec_driver_sql(
                "SELECT COALESCE(SUM(GREATEST(reltuples, 0)), 0) FROM pg_class "
                "WHERE relnamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema()) "
                "AND relname = ANY(%(names)s)",
                {"names": list(ANALYZED_TABLES)},
            ).scalar_one()
        self.rows_at_last = int(estimate)

    def wrote(self, rows: int) -> None:
        self.written += rows

    def due(self, caught_up: bool) -> bool:
        return self.enabled and self.rows_at_last is not None and analyze_due(self.written, self.rows_at_last, caught_up)

    def analyze(self) -> float:
        """Run ANALYZE on the tables store fills; returns the seconds it took."""
        written = self.written
        started = time.perf_counter()
        with self.engine.connect() as connection:
            connection.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql(
                f"ANALYZE (SKIP_LOCKED) {', '.join(ANALYZED_TABLES)}"
            )
        self.rows_at_last = (self.rows_at_last or 0) + written
        self.written -= written  # rows counted while it ran count toward the next one
        return time.perf_counter() - started
