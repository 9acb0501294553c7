"""docs/audit.md quotes every audit query verbatim, and each runs as written in sqlite3 and psql."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import sqlalchemy as sa

from services import libpq_url
from store import audit, database
from store_harness import project, publish, recorded_stream, store_settings

pytestmark = pytest.mark.service

DOC = Path(__file__).resolve().parent.parent / "docs" / "audit.md"
VALUES = {"publisher": "eng-a", "dp_rank": 0, "tier": "device", "seq": 150, "ts": 1100.0, "hash": 5, "request_id": "x", "limit": 10}


def test_the_doc_quotes_every_query_verbatim() -> None:
    text = DOC.read_text()
    for query in audit.QUERIES:
        assert f"```sql\n{query.sql}\n```" in text, f"docs/audit.md lacks the current {query.name} query"


def _sqlite3(path: str, query: audit.Query) -> list[str]:
    commands = [f".parameter set :{name} {_sqlite_literal(VALUES[name])}" for name in query.params]
    script = "\n".join([".mode list", ".bail on", *commands, query.sql]) + "\n"
    done = subprocess.run(["sqlite3", path], input=script, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and "Error" not in done.stderr, done.stderr
    return [line for line in done.stdout.splitlines() if line]


def _sqlite_literal(value: object) -> str:
    return f"\"'{value}'\"" if isinstance(value, str) else str(value)


def _psql(url: str, query: audit.Query) -> list[str]:
    commands = [f"\\set {name} {_psql_literal(VALUES[name])}" for name in query.params]
    script = "\n".join(["\\set ON_ERROR_STOP on", *commands, query.sql]) + "\n"
    done = subprocess.run(
        ["psql", "-X", "-q", "-A", "-t", libpq_url(url)], input=script, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    return [line for line in done.stdout.splitlines() if line]


def _psql_literal(value: object) -> str:
    return f"'''{value}'''" if isinstance(value, str) else str(value)


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
            if shell == "sqlite3":
                lines = _sqlite3(sa.make_url(db_url).database, query)
            else:
                lines = _psql(db_url, query)
            assert len(lines) == len(expected), f"{query.name}: shell gave {len(lines)} rows, SQLAlchemy {len(expected)}"
        assert audit.run(connection, audit.INVENTORY_AT_SEQ, **{n: VALUES[n] for n in audit.INVENTORY_AT_SEQ.params})
