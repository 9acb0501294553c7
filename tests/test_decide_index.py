"""decide's hash table: a batch lookup agrees with the index's own row dictionary, probe tails included."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvledger.events import Removed, Stored, Tier, WorkerId
from kvledger.hashing import sequence_hashes
from builders import BLOCK_SIZE, Stream

import decide.index
from decide.index import MISSING_ROW, InventoryIndex


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


@pytest.mark.parametrize("dictionary_keys", [0, 64, 1 << 30])
def test_batch_lookup_equals_the_row_dictionary(monkeypatch: pytest.MonkeyPatch, dictionary_keys: int) -> None:
    # 0: every probe round in numpy; 1 << 30: all but the first round from the dictionary.
    monkeypatch.setattr(decide.index, "_DICTIONARY_KEYS", dictionary_keys)
    index, dead = crowded_index()
    live = list(index._row_of)
    assert len(live) == 40 * 375
    rng = random.Random(6)
    strangers = [rng.getrandbits(64) for _ in range(5000)] + [0, 2**64 - 1]
    keys = live + dead + strangers + live[:100]
    rng.shuffle(keys)
    rows = index.lookup(np.array(keys, dtype=np.uint64))
    assert rows.tolist() == [index._row_of.get(key, MISSING_ROW) for key in keys]
    assert set(index.lookup(np.array(dead, dtype=np.uint64)).tolist()) == {MISSING_ROW}
    assert index.lookup(np.zeros(0, dtype=np.uint64)).tolist() == []
