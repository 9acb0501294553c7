"""What the index's readers may read: the ranking backends (cpu, cuda), what-if replay, the routers'
APIs, the service and the benchmarks take an `IndexReader`, not the index's insides.

The rows and their hash table are here as the compiled kernels take them (arrays, read only;
the index replaces an array when it grows, so a reader takes them afresh for each call and
holds none across an `apply`). The compact store of plain workers, the fold the index keeps
for promoted ones and how workers move between the two are the index's own: a question about
them is a function of this room (`decide.inventory.engine_hashes` answers by engine hash).
tests/test_layers.py holds every reader outside this room to these names.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from kvledger.core.events import EventBatch, WorkerId
from kvledger.core.fold import Fact, HoleToFetch


class IndexReader(Protocol):
    """The index as its readers see it."""

    # The rows (`decide.inventory.rows`) and their table (`decide.inventory.table`): a sequence hash's row
    # by `probe(table_keys, table_rows, table_bits, hash)`, its holders per class in `holders` (inline)
    # or `spilled` (bitmask rows), `words` 64-slot words per class.
    table_keys: np.ndarray
    table_rows: np.ndarray
    table_bits: int
    holders: np.ndarray
    spilled: np.ndarray
    words: int
    # The workers, by slot (order of first appearance), and the kernels' worker order.
    workers: list[WorkerId]
    worker_count: int
    slots_in_order: np.ndarray
    order_rank: np.ndarray
    rank_zero_slots: dict
    slot_by_key: dict
    # Where the inventory stands.
    inventory_seq: int
    size: int
    promoted_count: int
    array_bytes: int

    def slot(self, worker: WorkerId) -> int | None: ...

    def uncertain_names(self) -> tuple[str, ...]: ...

    def array_parts(self) -> dict[str, int]: ...

    # The device mirror (decide.ranking.cuda): whether to note changes, which table slots and rows changed
    # since it last took them, and a count that moves when the arrays themselves were replaced.
    track_dirty: bool
    generation: int

    def take_dirty(self) -> tuple[np.ndarray, np.ndarray]: ...

    def dense_rows(self, rows: np.ndarray | None = None) -> np.ndarray: ...


class IndexWriter(IndexReader, Protocol):
    """The index as the service and what-if replay fold batches into it."""

    def apply(self, batch: EventBatch, stream_seq: int) -> list[Fact]: ...

    def skip(self, stream_seq: int) -> None: ...

    # The holes mid-stream its fold found since the last call: for the service to ask ingest for them.
    def take_holes(self) -> list[HoleToFetch]: ...


READER_NAMES = frozenset(name for name in dir(IndexReader) if not name.startswith("_")) | frozenset(
    IndexReader.__annotations__)
WRITER_NAMES = READER_NAMES | {"apply", "skip", "take_holes"}
