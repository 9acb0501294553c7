"""The recorder contract, on SQLite and PostgreSQL, without NATS.

The store's SQL side alone: a recorded stream folded in memory, its changes built and
written transaction by transaction through `open_recorder`, exactly as the projector does
between a fetch and its ack. SQL must then hold what the fold holds, as of every seq; the
checkpoint must name the last seq; rebuilding the fold from SQL must give the fold back;
and how the stream is cut into transactions must not change a row.
"""

from __future__ import annotations

import uuid

import pytest

from kvledger.core.events import EventBatch, RecordError, decode_batch, encode_batch
from kvledger.core.fold import InventoryFold
from kvledger.store import database
from kvledger.store.changes import ChangeBuilder
from kvledger.store.fold_loader import PlacementIds, load_fold, open_recorder, read_checkpoint
from store_harness import content_digest, fold_rows, fold_state, recorded_stream, reference_folds, sql_inventory_at

pytestmark = pytest.mark.service

BATCHES = 400
EVERY = 50


def record_without_nats(url: str, stream: list[EventBatch | bytes], per_transaction: int) -> InventoryFold:
    """Fold `stream` (stream seqs from 1) and write it through the recorder, `per_transaction` messages at a time."""
    with database.opened(url) as engine:
        fold, index = load_fold(engine)
        builder = ChangeBuilder(index, PlacementIds(engine))
        with open_recorder(engine, "KV_EVENTS") as recorder:
            for start in range(0, len(stream), per_transaction):
                changes = builder.begin(start + 1)
                for seq, item in enumerate(stream[start:start + per_transaction], start=start + 1):
                    data = encode_batch(item) if isinstance(item, EventBatch) else item
                    try:
                        batch = decode_batch(data)
                    except RecordError as error:  # a bad record becomes a dead letter, as in the projector
                        builder.add_dead_letter(changes, seq, "kv.ev.bad.0", str(error), data)
                        fold.inventory_seq = seq
                        continue
                    builder.add_batch(changes, batch, seq, fold.apply(batch, seq), fold)
                recorder.write(builder.finish(changes, fold))
    return fold


def test_sql_holds_the_fold_as_of_every_seq_and_gives_it_back(db_url) -> None:
    stream = recorded_stream(seed=31, batches=BATCHES)
    reference, at = reference_folds(stream, EVERY)
    folded = record_without_nats(db_url, stream, per_transaction=7)
    assert fold_rows(folded) == fold_rows(reference)
    with database.opened(db_url) as engine, engine.connect() as connection:
        assert read_checkpoint(connection, "events") == len(stream)
        workers = reference.workers()
        for seq, rows in at.items():
            assert sql_inventory_at(connection, workers, seq) == rows, f"inventory as of seq {seq}"
        restored, _ = load_fold(engine)
    assert fold_state(restored) == fold_state(reference)
    assert fold_rows(restored) == fold_rows(reference)


def test_how_the_stream_is_cut_into_transactions_changes_no_row(db_url, tmp_path, request) -> None:
    stream = recorded_stream(seed=32, batches=BATCHES)
    record_without_nats(db_url, stream, per_transaction=1)
    server, name = None, f"kvledger_cut_{uuid.uuid4().hex[:12]}"
    if db_url.startswith("sqlite"):
        other = f"sqlite:///{tmp_path / 'other.db'}"
    else:
        server = request.getfixturevalue("postgres_server")
        other = server.create_database(name)
    try:
        with database.opened(other) as engine:
            database.upgrade(engine)
        record_without_nats(other, stream, per_transaction=BATCHES)
        assert content_digest(other) == content_digest(db_url)
    finally:
        if server is not None:
            server.drop_database(name)
