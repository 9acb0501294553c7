"""decide's hash table: the compiled probe agrees with the index's own row dictionary, dead slots included."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import HealthCheck, given, settings

from decide_inventories import batches
from kvledger.events import Removed, Stored, Tier, WorkerId
from kvledger.hashing import sequence_hashes
from builders import BLOCK_SIZE, Stream

from decide.index import CLASSES, MISSING_ROW, InventoryIndex
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


def held_by_class(index: InventoryIndex) -> dict[tuple[int, str, int], int]:
    """Every set bit of the index as (sequence hash, worker name, class) -> 1, read through the probe."""
    held = {}
    for sequence_hash in index._row_of:
        row = int(probe(index.table_keys, index.table_rows, index.table_bits, np.uint64(sequence_hash)))
        for slot, worker in enumerate(index.workers):
            word, bit = divmod(slot, 64)
            for position in range(len(CLASSES)):
                if int(index.masks[row, position, word]) >> bit & 1:
                    held[(sequence_hash, worker.name, position)] = 1
    return held


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=batches(max_batches=60))
def test_the_index_followed_batch_by_batch_equals_one_built_from_the_fold_at_the_end(stream) -> None:
    """Only what each batch's facts touched is re-read; nothing else may have changed."""
    index = InventoryIndex()
    for batch, stream_seq in stream:
        index.apply(batch, stream_seq)
    rebuilt = InventoryIndex(index.fold)
    assert held_by_class(index) == held_by_class(rebuilt)
    assert set(index._row_of) == set(rebuilt._row_of)
