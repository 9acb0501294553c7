"""The index's hash table, compiled: sequence hash → row, open addressing with linear probing; the cpu
kernels, the routers' APIs and what-if replay probe it, and the cuda backend mirrors it with the same probe."""

from __future__ import annotations

import numpy as np

from kvledger.decide.compiled import compiled as _compiled, inlined as _inlined

_HASH_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)
_ONE = np.uint64(1)
_ZERO = np.uint64(0)
_ALL_BITS = np.uint64(0xFFFFFFFFFFFFFFFF)
_EMPTY_ROW = -1
_MISSING_ROW = 0


@_inlined
def probe(table_keys, table_rows, table_bits, key):
    """The row of `key` (the all-zero row 0 when nobody holds it): `InventoryIndex.lookup` for one key."""
    mask = table_keys.size - 1
    position = np.int64((key * _HASH_MULTIPLIER) >> np.uint64(64 - table_bits))
    while True:
        row = table_rows[position]
        if row == _EMPTY_ROW:
            return _MISSING_ROW
        if table_keys[position] == key:
            return row
        position = (position + 1) & mask


@_compiled
def fill_table(keys, rows, table_keys, table_rows, table_bits):
    """Insert every (key, row) into an empty table (rows `_EMPTY_ROW`), probing as `probe` does:
    the index's rebuild, which in Python stalled decide for a tenth of a second per 100 000 keys."""
    mask = table_keys.size - 1
    for item in range(keys.size):
        key = keys[item]
        position = np.int64((key * _HASH_MULTIPLIER) >> np.uint64(64 - table_bits))
        while table_rows[position] != _EMPTY_ROW and table_keys[position] != key:
            position = (position + 1) & mask
        table_keys[position] = key
        table_rows[position] = rows[item]


@_compiled
def fill_distinct(keys, table_keys, table_rows, table_bits):
    """Insert the distinct keys of `keys` into an empty table, probing as `probe` does, with rows 1, 2, … in
    order of first sight; the count of rows, or -1 (the table left part filled) once more than half of the
    table would be taken: the caller tries again with a table twice the size."""
    mask = table_keys.size - 1
    rows = 0
    for item in range(keys.size):
        key = keys[item]
        position = np.int64((key * _HASH_MULTIPLIER) >> np.uint64(64 - table_bits))
        while table_rows[position] != _EMPTY_ROW and table_keys[position] != key:
            position = (position + 1) & mask
        if table_rows[position] == _EMPTY_ROW:
            rows += 1
            if 2 * rows > table_keys.size:
                return -1
            table_keys[position] = key
            table_rows[position] = rows
    return rows


@_compiled
def lookup_rows(table_keys, table_rows, table_bits, sequences):
    """The row of each sequence hash (`_MISSING_ROW` for none): one call per batch of keys, not a probe per key."""
    rows = np.empty(sequences.size, dtype=np.int32)
    for item in range(sequences.size):
        rows[item] = probe(table_keys, table_rows, table_bits, sequences[item])
    return rows
