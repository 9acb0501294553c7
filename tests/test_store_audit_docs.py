"""docs/audit.md quotes every audit query verbatim, and each runs as written in sqlite3 and psql."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import sqlalchemy as sa

from kvledger.store import audit, database
from store_harness import project, publish, recorded_stream, run_in_shell, store_settings

pytestmark = pytest.mark.service

DOC = Path(__file__).resolve().parent.parent / "docs" / "audit.md"
VALUES = {"publisher": "eng-a", "dp_rank": 0, "tier": "device", "seq": 150, "ts": 1100.0, "hash": 5, "request_id": "x", "limit": 10, "horizon_ms": 500.0}


def test_the_doc_quotes_every_query_verbatim() -> None:
    text = DOC.read_text()
    for query in audit.QUERIES:
        assert f"```sql\n{query.sql}\n```" in text, f"docs/audit.md lacks the current {query.name} query"


async def test_every_documented_query_runs_in_the_shell_and_agrees_with_the_cli(nats_server, db_url) -> None:  # noqa: F811
    shell = "sqlite3" if db_url.startswith("sqlite") else "psql"
    if shutil.which(shell) is None:
        pytest.fail(f"{shell} is not installed; the audit docs promise it works")
    stream = recorded_stream(seed=5, batches=300)
    last = await publish(nats_server.url, stream)
    await project(store_settings(nats_server.url, db_url), last)
    with database.opened(db_url) as engine, engine.connect() as connection:
        VALUES["hash"] = connection.execute(sa.text("SELECT engine_hash FROM block_residency LIMIT 1")).scalar_one()
        for query in audit.QUERIES:
            expected = audit.run(connection, query, **{name: VALUES[name] for name in query.params})
            lines = run_in_shell(db_url, query, VALUES)
            assert len(lines) == len(expected), f"{query.name}: shell gave {len(lines)} rows, SQLAlchemy {len(expected)}"
        assert audit.run(connection, audit.INVENTORY_AT_SEQ, **{n: VALUES[n] for n in audit.INVENTORY_AT_SEQ.params})
