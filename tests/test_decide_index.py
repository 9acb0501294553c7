"""decide's hash table: the compiled probe agrees with the index's own row dictionary, dead slots included."""

from __future__ import annotations

import random

import numpy as np

from kvledger.events import Removed, Stored, Tier, WorkerId
from kvledger.hashing import sequence_hashes
from builders import BLOCK_SIZE, Stream

from decide.index import MISSING_ROW, InventoryIndex
from decide.kernels import probe


def crowded_index() -> tuple[InventoryIndex, list[int]]:
    """20 000 sequence hashes in 40 chains, then a quarter removed: their keys stay in the table as dead slots."""
    rng = random.Random(5)
    stream, index = Stream(), InventoryIndex()
    dead: list[int] = []
    for chain in range(40):
        worker = WorkerId(f"w{chain % 8}")
        engine = [rng.getrandbits(64) for _ in range(500)]
        local = tuple(rng.getrandbits(64) for _ in range(500))
        index.apply(*stream.batch(worker, Stored(Tier.DEVICE, tuple(engine), None, BLOCK_SIZE, local)))
        index.apply(*stream.batch(worker, Removed(Tier.DEVICE, tuple(engine[375:]))))
        dead.extend(sequence_hashes(local)[375:])
    return index, dead


def test_the_probe_finds_what_the_row_dictionary_holds() -> None:
    index, dead = crowded_index()
    live = list(index._row_of)
    assert len(live) == 40 * 375
    rng = random.Random(6)
    strangers = [rng.getrandbits(64) for _ in range(5000)] + [0, 2**64 - 1]
    keys = live + dead + strangers + live[:100]
    rng.shuffle(keys)
    def row_of(key: int) -> int:
        return int(probe(index.table_keys, index.table_rows, index.table_bits, np.uint64(key)))

    assert [row_of(key) for key in keys] == [index._row_of.get(key, MISSING_ROW) for key in keys]
    assert {row_of(key) for key in dead} == {MISSING_ROW}
