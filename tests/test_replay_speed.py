"""The replay at decide's speed (kvledger/app/replay.py, decide/ranking/whatif.py) against the reference it replaces.

A demo ledger (`kvledger demo`, reuse off, recorded on SQLite or PostgreSQL) replayed under a
sweep of settings by both: the reference model one request at a time (store/whatif_reference.py's
`replay` and `replay_stream`) and decide's index and kernels in a batch per inventory seq. The
reports must be equal to the last float, tallies and every changed decision (what
`--decisions` lists), as asked and as placed, at horizons that judge and that leave pending,
from SQL and from the streams. Then the bad input the command refuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import attrs
import nats
import numpy as np
import pytest
import sqlalchemy as sa

from kvledger.app import replay as fast
from kvledger.app.cli import main as kvledger
from kvledger.core.settings import ReuseSettings, StreamSettings, reuse_settings_from
from kvledger.decide.ranking import whatif
from kvledger.runtime.embedded import EmbeddedNats
from kvledger.store import database
from kvledger.store import whatif_reference as reference

pytestmark = pytest.mark.service

SETTINGS = {
    "same.toml": "[reuse]\n",
    "on.toml": "[reuse]\nenable_decode_to_prefill_reuse = true\nenable_decode_to_prefill_gpu_reuse = true\n",
    "gpu32.toml": "[reuse]\nenable_decode_to_prefill_gpu_reuse = true\nminimum_transfer_prefix_blocks = 32\n",
    "host-cheap.toml": "[reuse]\nenable_decode_to_prefill_reuse = true\ntransfer_source_estimated_block_us = 10.0\n"
                       "minimum_transfer_prefix_blocks = 1\nminimum_estimated_ttft_saving_ms = 0.0\n",
}


def _sweep(tmp_path: Path) -> list[tuple[str, ReuseSettings]]:
    sweep = []
    for name, text in SETTINGS.items():
        path = tmp_path / name
        path.write_text(text)
        sweep.append((str(path), reuse_settings_from(path, ReuseSettings())))
    return sweep


def _demo(tmp_path: Path, db_url: str) -> Path:
    """A finished demo's data folder, its ledger in `db_url`."""
    data = tmp_path / "demo"
    env = {key: value for key, value in os.environ.items() if not key.startswith("KVLEDGER_")}
    result = subprocess.run(
        [sys.executable, "-m", "kvledger.app.cli", "demo", "--duration", "5", "--workers", "3",
         "--data-dir", str(data), "--db", db_url],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return data


def _columns_of(window) -> dict:
    """Every column of a `ColumnWindow` as plain values, to compare two reads of one window."""
    decisions = window.decisions
    columns = {name: value.tolist() if hasattr(value, "tolist") else value
               for name, value in attrs.asdict(decisions, recurse=False).items() if name != "recorded"}
    columns.update(request_ids=list(decisions.request_ids), workers=dict(decisions.workers),
                   names=dict(decisions.names), reasons=dict(decisions.reasons),
                   recorded={name: value.tolist() for name, value in attrs.asdict(decisions.recorded).items()},
                   window=(window.unreplayable, window.first_seq, window.last_seq))
    return columns


def test_a_demo_ledger_gives_the_reference_report_to_the_last_float(db_url, tmp_path, capsys, monkeypatch) -> None:
    data = _demo(tmp_path, db_url)
    sweep = _sweep(tmp_path)
    with database.opened(db_url) as engine, engine.connect() as connection:
        decisions = connection.execute(sa.text("SELECT COUNT(*) FROM decisions")).scalar()
        assert decisions > 50
        for placed in (False, True):
            for horizon_s in (0.5, 0.05, 3600.0):  # judged (late and early) and pending
                expected = reference.replay(connection, sweep, horizon_s=horizon_s, placed=placed)
                got = fast.replay(connection, sweep, horizon_s=horizon_s, placed=placed)
                assert got == expected, (placed, horizon_s)
                assert got.replayed == decisions
        # Ranked and judged in one span of points, and in five, each but the first starting from the rows as
        # they stand at its first point (decide/ranking/whatif.py `_hold_at`): the same report.
        for cores in (1, 5):
            monkeypatch.setattr(whatif, "_cores", lambda: cores)
            for placed in (False, True):
                expected = reference.replay(connection, sweep, horizon_s=0.5, placed=placed)
                assert fast.replay(connection, sweep, horizon_s=0.5, placed=placed) == expected, (cores, placed)
        # The stays read in bulk (store.whatif_reference.stays_of) are `replay_stays`' rows, every column.
        window = reference.read_columns(connection, horizon_s=0.5)
        if connection.dialect.name == "sqlite":
            # Scanned, each column aggregated in SQL (a window of much of the ledger), and read as the driver's
            # tuples (a window of less than a third of its time): the same columns.
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(reference, "_SCANNED_SHARE", 2.0)
                fetched = reference.read_columns(connection, horizon_s=0.5)
            assert isinstance(window.decisions.request_ids, reference._Texts)
            assert _columns_of(window) == _columns_of(fetched)
            later = connection.execute(sa.text("SELECT decided_ts FROM decisions ORDER BY decided_ts")).scalars().all()
            later = later[len(later) // 2]
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(reference, "_SCANNED_SHARE", 2.0)
                fetched = reference.read_columns(connection, horizon_s=0.5, from_ts=later)
            assert _columns_of(reference.read_columns(connection, horizon_s=0.5, from_ts=later)) == \
                _columns_of(fetched)
        # Its horizon seqs, from the events' ingest times, are the reference's from SQL's own subquery.
        assert window.decisions.horizon_seq.tolist() == [
            -1 if decision.horizon_seq is None else decision.horizon_seq
            for decision in reference.read_window(connection, horizon_s=0.5).decisions]
        stays = reference.stays_of(connection, window.first_seq, window.last_seq)
        rows = reference.stay_columns(connection, window.first_seq, window.last_seq)
        never = reference.NEVER
        assert sorted(zip(*rows[:6], (never if seq is None else seq for seq in rows[6]),
                          (never if seq is None else seq for seq in rows[7]))) == sorted(zip(
            *zip(*(stays.placements[item] for item in stays.placement.tolist())),
            stays.sequence_hash.tolist(), stays.stored_seq.tolist(), stays.removed_seq.tolist(),
            stays.conflict_since.tolist())) and len(stays) > 1000
        if connection.dialect.name == "sqlite":
            # Read in pieces, as a table whose texts could pass SQLite's length limit is: the same columns, in
            # the tables' key order.
            whole = reference.stay_tables(connection)
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(reference, "_ROWS_PER_TEXT", 997)
                pieces = reference.stay_tables(connection)
            assert whole.stays[0].size > 3 * 997 and whole.removals[0].size > 997
            for read_whole, read_in_pieces in zip([*whole.stays, *whole.removals], [*pieces.stays, *pieces.removals]):
                assert read_whole.tolist() == read_in_pieces.tolist()
            stays_keys = list(zip(whole.stays[0].tolist(), whole.stays[2].tolist(), whole.stays[3].tolist()))
            assert stays_keys == sorted(stays_keys)
        else:
            # Read in pieces, as tables whose rows would pass a bytea's 1 GB are: the same rows, in another order.
            whole = reference.stay_tables(connection)
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(reference, "_PIECE_BYTES", 997 * 32)
                pieces = reference.stay_tables(connection)
            assert whole.stays[0].size > 3 * 997
            for read_whole, read_in_pieces in ((whole.stays, pieces.stays), (whole.removals, pieces.removals)):
                rows = sorted(zip(*(column.tolist() for column in read_whole)))
                assert rows == sorted(zip(*(column.tolist() for column in read_in_pieces))) and rows
        # Some settings change what the demo decided, so the comparison covers chosen transfers and their verdicts.
        placed_report = fast.replay(connection, sweep, horizon_s=0.5, placed=True)
        assert placed_report.settings[1].changed > 0 and placed_report.settings[1].judged_hints > 0
        assert placed_report.settings[0].hints == 0  # reuse off: as placed, only the targets change
        # A window: the later half of the decisions.
        times = sorted(connection.execute(sa.text("SELECT decided_ts FROM decisions")).scalars())
        middle = times[len(times) // 2]
        assert fast.replay(connection, sweep, horizon_s=0.5, from_ts=middle) == \
            reference.replay(connection, sweep, horizon_s=0.5, from_ts=middle)
        # A window ending in the first half: its stays are read alone, bounded in SQL (no read of all beside).
        early = times[len(times) // 4]
        assert fast.replay(connection, sweep, horizon_s=0.5, to_ts=early) == \
            reference.replay(connection, sweep, horizon_s=0.5, to_ts=early)
        if connection.dialect.name == "sqlite":
            last_seq = reference.read_columns(connection, horizon_s=0.5, to_ts=early).last_seq
            assert 2 * last_seq < connection.execute(sa.text("SELECT MAX(stream_seq) FROM event_log")).scalar()
            whole, bounded = reference.stay_tables(connection), reference.stay_tables(connection, last_seq)
            assert 0 < bounded.stays[0].size < whole.stays[0].size
            for whole_columns, bounded_columns, stored in ((whole.stays, bounded.stays, 2),
                                                           (whole.removals, bounded.removals, 1)):
                kept = whole_columns[stored] <= last_seq
                for read_whole, read_bounded in zip(whole_columns, bounded_columns, strict=True):
                    assert read_whole[kept].tolist() == read_bounded.tolist()

    # The command's listing (--decisions --json) is the reference report's.
    args = ["replay", "--db", db_url, "--placed", "--decisions", "--json", "--source", "sql"]
    capsys.readouterr()
    assert kvledger([*args, *(arg for path, _ in sweep for arg in ("--settings", path))]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["rows"] == [placed_report.recorded.row(), *(tally.row() for tally in placed_report.settings)]
    assert printed["changes"] == {tally.name: tally.changes for tally in placed_report.settings}

    # From the streams: the demo's KV_DECISIONS and KV_EVENTS, folded by decide's index.
    store = tmp_path / "nats-copy"
    shutil.copytree(data / "nats", store)
    with EmbeddedNats(str(store)) as server:
        asyncio.run(_streams_agree(server.url, sweep))

    # Decisions recorded without their request (decide.record_requests = false) are counted, never skipped.
    with database.opened(db_url) as engine:
        with engine.begin() as connection:
            connection.execute(sa.text("DELETE FROM decision_requests WHERE stream_seq IN "
                                       "(SELECT stream_seq FROM decision_requests ORDER BY stream_seq LIMIT 10)"))
        with engine.connect() as connection:
            expected = reference.replay(connection, sweep, horizon_s=0.5)
            got = fast.replay(connection, sweep, horizon_s=0.5)
    assert got == expected and got.unreplayable == 10 and got.replayed == decisions - 10
    capsys.readouterr()
    assert kvledger(["replay", "--db", db_url, "--settings", sweep[0][0]]) == 0
    assert "10 decisions unreplayable: recorded without their request" in capsys.readouterr().out


async def _streams_agree(url: str, sweep) -> None:
    async with await nats.connect(url) as nc:
        js = nc.jetstream()
        for placed in (False, True):
            for horizon_s in (0.5, 3600.0):
                expected = await reference.replay_stream(js, StreamSettings(), sweep, horizon_s=horizon_s,
                                                         placed=placed)
                got = await fast.replay_stream(js, StreamSettings(), sweep, horizon_s=horizon_s, placed=placed)
                assert got == expected, (placed, horizon_s)
                assert got.replayed > 50


def test_an_empty_window_loads_no_kernel_and_reads_no_stay(sqlite_url, tmp_path) -> None:
    with database.opened(sqlite_url) as engine:
        database.upgrade(engine)
        with engine.connect() as connection:
            report = fast.replay(connection, _sweep(tmp_path), horizon_s=0.5)
    assert (report.replayed, report.unreplayable) == (0, 0)
    assert report == attrs.evolve(report)


def test_bad_settings_files_are_refused_naming_the_key(sqlite_url, tmp_path, capsys) -> None:
    with database.opened(sqlite_url) as engine:
        database.upgrade(engine)
    cases = {
        "unknown.toml": ("[reuse]\nenable_decode_to_prefil_reuse = true\n", "enable_decode_to_prefil_reuse"),
        "negative.toml": ("[reuse]\nminimum_transfer_prefix_blocks = -1\n", "minimum_transfer_prefix_blocks"),
        "budget.toml": ("[reuse]\ntransfer_source_lookup_budget_ms = -2.0\n", "transfer_source_lookup_budget_ms"),
        "kind.toml": ("[reuse]\ndevice_credit_weight = \"lots\"\n", "device_credit_weight"),
    }
    for name, (text, key) in cases.items():
        path = tmp_path / name
        path.write_text(text)
        capsys.readouterr()
        assert kvledger(["replay", "--db", sqlite_url, "--settings", str(path)]) == 2, name
        err = capsys.readouterr().err
        assert key in err and name in err, err


@pytest.mark.parametrize("stays_in", ["key order", "stored order", "any order"])
def test_each_stay_finds_its_removal_run_in_any_order(stays_in) -> None:
    """`stays_of`'s walks over the removal runs give what a binary search per stay gives: the run of the stay's
    placement and stored seq whose slots hold it, else none. SQLite reads the stays in key order (placement,
    stored seq, slot), PostgreSQL in stored order (each placement's in key order, the placements interleaved),
    and any other order is searched for."""

    rng = np.random.default_rng(7)
    slot_span = 64
    pairs = np.unique(rng.integers(0, 5_000, size=3_000))  # (placement, stored seq) pairs as one number
    first = rng.integers(0, 40, size=pairs.size)
    last = first + rng.integers(0, 20, size=pairs.size)
    removal_key, removed_seq = pairs * slot_span + first, rng.integers(10_000, 20_000, size=pairs.size)
    stay_pair = rng.integers(0, 5_000, size=20_000)
    slot = rng.integers(0, slot_span, size=stay_pair.size)
    placement = stay_pair // 100  # a pair's placement, its stored seq pair % 100
    if stays_in == "key order":
        order = np.argsort(stay_pair * slot_span + slot, kind="stable")
    elif stays_in == "stored order":
        order = np.lexsort((slot, placement, stay_pair % 100))
    else:
        order = rng.permutation(stay_pair.size)
    stay_pair, slot, placement = stay_pair[order], slot[order], placement[order]
    stay_key = stay_pair * slot_span + slot

    run = np.searchsorted(removal_key, stay_key, "right") - 1
    at = np.maximum(run, 0)
    same = (run >= 0) & (removal_key[at] - first[at] == stay_key - slot) & (last[at] >= slot)
    expected = np.where(same, removed_seq[at], reference.NEVER)

    found = reference._removed_seqs(stay_key, placement, slot, removal_key, first, last, removed_seq,
                                    reference.NEVER)
    assert 0 < np.count_nonzero(found != reference.NEVER) < found.size
    assert np.array_equal(found, expected)


def test_sqlite_integer_texts_are_parsed_exactly_and_anything_else_is_refused() -> None:
    """`stay_tables` parses SQLite's `group_concat` of integers itself (`_parsed`, without the interpreter's
    lock): every int64 SQLite writes, the extremes included, comes back as it was stored; a text that is not the
    expected count of comma-separated integers is refused, never read short."""
    import sqlite3

    values = [0, 1, -1, 2**63 - 1, -2**63, 123_456_789, -987_654_321, 10, -10]
    with contextlib.closing(sqlite3.connect(":memory:")) as connection:
        connection.execute("CREATE TABLE numbers (value INTEGER)")
        connection.executemany("INSERT INTO numbers VALUES (?)", [(value,) for value in values])
        text, = connection.execute("SELECT CAST(group_concat(value) AS BLOB) FROM numbers").fetchone()
    assert reference._parsed(text, len(values)).tolist() == values
    assert reference._parsed(None, 0).tolist() == []
    for bad in (b"1,,2", b"1,a", b"-", b"1,2,", b"--1", b"1-2", b"1,2,3", b" 1,2"):
        with pytest.raises(ValueError, match="not 2 comma-separated integers"):
            reference._parsed(bad, 2)
    with pytest.raises(ValueError, match="read 1 of 2 values"):
        reference._parsed(b"7", 2)


def test_a_scanned_window_s_texts_and_hashes_are_each_row_s_own() -> None:
    """`store.whatif_reference._scanned_window`'s pieces: texts of a group_concat read back per row (NULLs, empty
    and repeated texts, UTF-8), and requests' hashes taken for rows in any order, some left out."""
    values = ["a", None, "", "wörker/1", "a", None, "b", "", "wörker/1"]
    encoded = [None if value is None else value.encode() for value in values]
    lengths = ",".join(str(-1 if value is None else len(value)) for value in encoded).encode()
    (texts,) = reference._text_columns([lengths, b"".join(value for value in encoded if value)], len(values))
    rows = np.array([8, 0, 1, 3, 2, 5, 6, 4, 7])
    assert texts.listed(rows) == [values[row] for row in rows]
    assert list(texts.taken(rows)) == [values[row] for row in rows] and len(texts) == len(values)
    hashes = np.arange(20, dtype="<u8")
    byte_lengths = np.array([8, 24, 0, 32, 16, 80], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(byte_lengths)[:-1]]) // 8
    for rows in ([3, 0, 5, 1], [0, 1, 2, 3, 4, 5], [5, 4, 3, 2, 1, 0], [2], []):
        rows = np.array(rows, dtype=np.int64)
        local, counts = reference._segments(hashes.view(np.uint8), byte_lengths, rows)
        expected = [value for row in rows.tolist() for value in
                    hashes[starts[row]:starts[row] + byte_lengths[row] // 8].tolist()]
        assert local.tolist() == expected and counts.tolist() == (byte_lengths[rows] // 8).tolist()
        assert local.dtype == np.uint64 and local.flags.writeable
