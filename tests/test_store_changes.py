"""What a transaction writes, without a database: runs of removals, and the stays' two encodings.

The recorders write new stays either as rows (SQLite) or as PostgreSQL's binary COPY built
from the columns; both must say the same thing, rare values included.
"""

from __future__ import annotations

import struct
from array import array

from kvledger.store.changes import STAY_COLUMNS, NewStays, removal_runs
from kvledger.store.transactions import stays_copy_binary

U64 = 1 << 64


def test_consecutive_ends_of_one_batch_at_one_seq_for_one_cause_are_one_run_in_any_order() -> None:
    ends = [
        # (placement_id, stored_seq, slot, removed_seq, removed_ts, cause)
        (1, 10, 2, 50, 5.0, "removed"), (1, 10, 0, 50, 5.0, "removed"), (1, 10, 1, 50, 5.0, "removed"),
        (1, 10, 4, 50, 5.0, "removed"),  # slot 3 stays: a second run
        (1, 10, 5, 51, 5.1, "removed"),  # next to the run, but ended at another seq
        (2, 10, 6, 50, 5.0, "removed"),  # another placement
        (1, 11, 0, 50, 5.0, "cleared"), (1, 11, 1, 50, 5.0, "removed"),  # another cause
    ]  # fmt: skip
    assert removal_runs(ends) == [
        # (stored_seq, removed_seq, removed_ts, placement_id, first_slot, last_slot, removal_cause)
        (10, 50, 5.0, 1, 0, 2, "removed"),
        (10, 50, 5.0, 1, 4, 4, "removed"),
        (10, 51, 5.1, 1, 5, 5, "removed"),
        (11, 50, 5.0, 1, 0, 0, "cleared"),
        (11, 50, 5.0, 1, 1, 1, "removed"),
        (10, 50, 5.0, 2, 6, 6, "removed"),
    ]


def _stays() -> NewStays:
    stays = NewStays()
    for row in range(5):
        stays.stored_seq.append(7 + row // 3)
        stays.slot.append(row % 3)
        stays.placement_id.append(3)
        stays.engine_hash.append(U64 - 1 - row)  # above 2**63: stored signed
        stays.sequence_hash.append(1000 + row)
        stays.parent_hash.append(0 if row == 0 else U64 - row)
        stays.local_hash.append(row)
        stays.stored_ts.append(1.5 + row)
    stays.no_parent.add(0)
    stays.conflict_since[1] = 9
    stays.refs[2] = 3
    stays.unresolved.add(4)
    stays.refs[4] = 2
    return stays


def _read_copy_binary(payload: bytes) -> list[tuple]:
    """PostgreSQL's binary COPY format back into rows (the stays' column types)."""
    assert payload.startswith(b"PGCOPY\n\xff\r\n\x00") and payload.endswith(b"\xff\xff")
    formats = {0: ">q", 1: ">q", 2: ">q", 3: ">q", 4: ">q", 5: ">d", 6: ">q", 7: ">i", 8: ">i", 9: ">i", 10: ">?"}
    at, rows = 19, []
    while True:
        (fields,) = struct.unpack_from(">h", payload, at)
        at += 2
        if fields == -1:
            return rows
        row = []
        for column in range(fields):
            (length,) = struct.unpack_from(">i", payload, at)
            at += 4
            if length == -1:
                row.append(None)
                continue
            (value,) = struct.unpack_from(formats[column], payload, at)
            at += length
            row.append(value)
        rows.append(tuple(row))


def test_the_binary_copy_and_the_rows_say_the_same_rare_values_included() -> None:
    stays = _stays()
    rows = stays.rows()
    assert len(STAY_COLUMNS) == len(rows[0]) == 11
    assert rows[0] == (7, -1, 1000, None, 0, 1.5, None, 0, 3, None, None)
    assert rows[1][6] == 9 and rows[2][9] == 3 and rows[4][9:] == (2, True)
    assert rows[1][3] == -1  # 2**64 - 1, signed
    # The COPY groups rows by which rare values they carry; the table's row order does not matter.
    assert sorted(_read_copy_binary(stays_copy_binary(stays)), key=lambda row: (row[0], row[7])) == rows


def test_stays_without_rare_values_are_one_group() -> None:
    stays = NewStays(
        stored_seq=array("q", [1, 1]), slot=array("i", [0, 1]), placement_id=array("i", [1, 1]),
        engine_hash=array("Q", [5, 6]), sequence_hash=array("Q", [7, 8]), parent_hash=array("Q", [4, 5]),
        local_hash=array("Q", [9, 10]), stored_ts=array("d", [2.0, 2.0]),
    )  # fmt: skip
    assert _read_copy_binary(stays_copy_binary(stays)) == stays.rows()
