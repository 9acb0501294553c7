"""Store's writer process: opened through the driver alone, its secret never on a command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

from kvledger.store import database
from kvledger.store.changes import ChangeSet
from kvledger.store.fold_loader import read_checkpoint
from kvledger.store.writer import RecorderProcess, WriterError, encode_changes


def test_the_writer_process_imports_no_sqlalchemy() -> None:
    # What `python -m kvledger.store.writer` and an unpickled ChangeSet import: SQLAlchemy's import
    # alone took longer than the rest of the writer's start.
    probe = (
        "import sys; import kvledger.store.writer, kvledger.store.transactions, kvledger.store.gc_policy, "
        "kvledger.store.changes; print(sorted(m for m in sys.modules if m.split('.')[0] in ('sqlalchemy', 'alembic')))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def _commit_one(url: str, seq: int) -> None:
    writer = RecorderProcess(url, "KV_EVENTS")
    try:
        writer.wait_ready()
        writer.write(encode_changes(ChangeSet(first_seq=1, last_seq=seq)))  # the first: no checkpoint below it
    finally:
        writer.close()


@pytest.mark.service
@pytest.mark.parametrize("secret", ["s3cret-writer-password", "p@ss w'rd\\:/?#=%"])
def test_a_password_reaches_the_writer_down_its_pipe_and_the_writer_commits(postgres_url: str, secret: str) -> None:
    with database.opened(postgres_url) as engine:
        database.upgrade(engine)
    # The test server trusts local connections, so any password opens it; the point is where it travels.
    with_password = sa.make_url(postgres_url).set(password=secret).render_as_string(hide_password=False)
    writer = RecorderProcess(with_password, "KV_EVENTS")
    try:
        writer.wait_ready()  # connected: its command line is the one it runs with
        command_line = Path(f"/proc/{writer._process.pid}/cmdline").read_bytes()
        assert secret.encode() not in command_line and b"w'rd" not in command_line
        assert b"***" in command_line  # the URL shown, its password hidden
        writer.write(encode_changes(ChangeSet(first_seq=1, last_seq=7)))
    finally:
        writer.close()
    with database.opened(postgres_url) as engine, engine.connect() as connection:
        assert read_checkpoint(connection, "events") == 7


def test_an_sqlite_writer_opens_the_file_in_wal_mode_and_commits(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    with database.opened(url) as engine:
        database.upgrade(engine)
    _commit_one(url, 3)
    with database.opened(url) as engine, engine.connect() as connection:
        assert read_checkpoint(connection, "events") == 3
        assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"


def test_a_writer_that_cannot_open_its_database_says_why(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'missing-folder' / 'ledger.db'}"  # not upgraded: no tables
    writer = RecorderProcess(url, "KV_EVENTS")
    try:
        writer.wait_ready()
        with pytest.raises(WriterError, match="no such table"):
            writer.write(encode_changes(ChangeSet(first_seq=1, last_seq=1)))
    finally:
        writer.close()


def test_a_writer_refuses_a_transaction_folded_on_a_checkpoint_sql_no_longer_holds(tmp_path: Path) -> None:
    # SQL went back (a restored backup) under the projector: writing seqs 9-12 over checkpoint 3 would leave 4-8 out.
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    with database.opened(url) as engine:
        database.upgrade(engine)
    _commit_one(url, 3)
    writer = RecorderProcess(url, "KV_EVENTS")
    try:
        writer.wait_ready()
        with pytest.raises(WriterError, match="CheckpointMoved: checkpoint 'events' of KV_EVENTS is at ledger seq 3"):
            writer.write(encode_changes(ChangeSet(first_seq=9, last_seq=12)))
    finally:
        writer.close()
    writer = RecorderProcess(url, "KV_EVENTS")
    try:
        writer.wait_ready()
        writer.write(encode_changes(ChangeSet(first_seq=4, last_seq=12)))  # folded on from SQL's checkpoint
    finally:
        writer.close()
    with database.opened(url) as engine, engine.connect() as connection:
        assert read_checkpoint(connection, "events") == 12
