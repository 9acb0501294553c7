"""The decide index: every worker's inventory as a hash table from sequence hash to bitmasks.

One row per sequence hash holds four classes of worker bitmasks (native device, native
host, native disk, retained device), `words` 64-bit words per class so any number of
workers fits. The index owns its own `InventoryFold`; after each batch it re-reads the
fold's `holds` for the (worker, sequence hash) pairs the batch touched, so every fold rule
(retained conflicts, reference counting, restarts) is inherited rather than re-implemented.

The lookup table is open addressing with linear probing over numpy arrays, probed by
`decide.kernels.probe` and mirrored on the device with the same probe sequence; changes
since the device last synced are kept as dirty table slots and dirty rows.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from kvledger.events import EventBatch, Provenance, Tier, WorkerId
from kvledger.fold import (
    BlockRecord,
    BlockRemovedFact,
    BlockStoredFact,
    Fact,
    InventoryClearedFact,
    InventoryFold,
    RetainedConflictFact,
    UncertaintyFact,
)

from decide.kernels import fill_table

NATIVE, RETAINED = Provenance.NATIVE, Provenance.RETAINED

# The four stored classes, in the order of a row's bitmask planes.
CLASSES: tuple[tuple[Provenance, Tier], ...] = (
    (NATIVE, Tier.DEVICE),
    (NATIVE, Tier.HOST),
    (NATIVE, Tier.DISK),
    (RETAINED, Tier.DEVICE),
)
NATIVE_DEVICE, NATIVE_HOST, NATIVE_DISK, RETAINED_DEVICE = range(4)
_CLASS_OF = {key: position for position, key in enumerate(CLASSES)}
_CLASS_COUNT = len(CLASSES)

# Fibonacci hashing: the slot is the top bits of key × 2^64/φ. Sequence hashes are XXH3
# outputs already, but a request can carry arbitrary local hashes, so they are mixed once.
HASH_MULTIPLIER = 0x9E3779B97F4A7C15
_U64 = (1 << 64) - 1
EMPTY_ROW = -1
MISSING_ROW = 0  # row 0 is all zeros: a hash nobody holds reads as "no worker"
_MAX_LOAD = 0.5
_MIN_TABLE_BITS = 10


def slot_of(key: int, bits: int) -> int:
    return ((key * HASH_MULTIPLIER) & _U64) >> (64 - bits)


class InventoryIndex:
    """Sequence hash → per-class worker bitmasks, following an `InventoryFold`."""

    def __init__(self, fold: InventoryFold | None = None) -> None:
        self.fold = fold if fold is not None else InventoryFold()
        self.inventory_seq = self.fold.inventory_seq
        self.workers: list[WorkerId] = []  # by slot, in order of first appearance
        self._slot_of_worker: dict[WorkerId, int] = {}
        # The same by (publisher, dp_rank): hashing a WorkerId (attrs) costs far more than its fields.
        self.slot_by_key: dict[tuple[str, int], int] = {}
        self.slots_in_order = np.zeros(0, dtype=np.int32)  # worker slots sorted by worker order
        self.order_rank = np.zeros(0, dtype=np.int32)  # slot -> its position in worker order
        self.words = 1
        self._row_of: dict[int, int] = {}
        self._row_hash: list[int] = [0]
        self._row_bits: list[int] = [0]  # bits set in each row, over every class and worker
        self._free_rows: list[int] = []
        self._set_masks(np.zeros((1024, len(CLASSES), self.words), dtype=np.uint64))
        self.table_bits = _MIN_TABLE_BITS
        self._set_table(_MIN_TABLE_BITS)
        # What the device mirror has not seen yet; `generation` changes when the arrays
        # are reallocated, which forces a whole upload instead of a scatter.
        self.generation = 0
        self.track_dirty = False  # set by a device mirror; cpu alone needs no change lists
        self.dirty_rows: set[int] = set()
        self.dirty_table_slots: set[int] = set()
        self._uncertain_cache: tuple[str, ...] | None = None
        for worker in self.fold.workers():
            self._add_worker(worker)
        self._index_all_records(self.fold.iter_records())

    # --- following the fold ------------------------------------------------------------

    def apply(self, batch: EventBatch, stream_seq: int) -> list[Fact]:
        """Fold one KV_EVENTS batch and bring the bitmasks up to date with what it touched."""
        rules_before = self._residency_rules(batch.worker)
        facts = self.fold.apply(batch, stream_seq)
        self.inventory_seq = max(self.inventory_seq, stream_seq)
        if batch.worker not in self._slot_of_worker and self.fold.worker_state(batch.worker) is not None:
            self._add_worker(batch.worker)
        # (slot, sequence hash, class) of each record the batch changed: a fact's record is of
        # one class, and whether a worker holds a block in one class depends on that class's
        # records alone (and the residency rules, handled below), so only that bit is re-read.
        touched: dict[tuple[int, int, int], None] = {}
        slot_of_worker = self._slot_of_worker
        for fact in facts:
            kind = type(fact)
            if kind is BlockStoredFact or kind is RetainedConflictFact or kind is BlockRemovedFact:
                record = fact.record
                position = _CLASS_OF.get((record.provenance, record.tier))
                if position is not None:
                    touched[(slot_of_worker[record.worker], record.sequence_hash, position)] = None
            elif kind is InventoryClearedFact:
                slot = slot_of_worker[fact.worker]
                for position, (provenance, _tier) in enumerate(CLASSES):
                    if provenance is fact.provenance:
                        for sequence_hash in self._hashes_with_bit(slot, position):
                            touched[(slot, sequence_hash, position)] = None
        if facts and self._residency_rules(batch.worker) != rules_before:
            # A group appeared on a tier or declared another kind: what its other blocks count
            # as changed too (kvledger.residency), so every record of the worker is re-read.
            slot = slot_of_worker[batch.worker]
            for record in self.fold.iter_worker_records(batch.worker):
                position = _CLASS_OF.get((record.provenance, record.tier))
                if position is not None:
                    touched[(slot, record.sequence_hash, position)] = None
        for slot, sequence_hash, position in touched:
            self._refresh(slot, sequence_hash, position)
        # Every change of a worker's uncertainty is a fact of its own; other batches leave the
        # names as they were (answers read them per batch, and listing them sorts every worker).
        if any(type(fact) is UncertaintyFact for fact in facts):
            self._uncertain_cache = None
        return facts

    def _residency_rules(self, worker: WorkerId) -> tuple:
        state = self.fold.worker_state(worker)
        if state is None:
            return ()
        return state.residency_rules()

    def skip(self, stream_seq: int) -> None:
        """A stream message that could not be decoded still moves the index past its seq."""
        self.inventory_seq = max(self.inventory_seq, stream_seq)

    def _refresh(self, slot: int, sequence_hash: int, position: int) -> None:
        provenance, tier = CLASSES[position]
        wanted = self.fold.holds(self.workers[slot], provenance, tier, sequence_hash)
        row = self._row_of.get(sequence_hash)
        word, bit = divmod(slot, 64)
        if row is None:
            if not wanted:
                return
            row = self._new_row(sequence_hash)
        at = (row * _CLASS_COUNT + position) * self.words + word
        if wanted == bool(self._mask_words[at] >> bit & 1):
            return
        if wanted:
            self._mask_words[at] |= 1 << bit
            self._row_bits[row] += 1
        else:
            self._mask_words[at] &= ~(1 << bit) & _U64
            self._row_bits[row] -= 1
        if self.track_dirty:
            self.dirty_rows.add(row)
        if not self._row_bits[row]:
            self._release_row(sequence_hash, row)

    def _hashes_with_bit(self, slot: int, position: int) -> list[int]:
        """The sequence hashes whose row has this worker's bit in this class: what a Cleared re-reads.

        A scan of one bitmask column (rare: a clear or a restart), where a set per worker and
        class kept beside the bits cost tens of bytes per residency.
        """
        word, bit = divmod(slot, 64)
        rows = np.flatnonzero(self.masks[:, position, word] & np.uint64(1 << bit))
        row_hash = self._row_hash
        return [row_hash[row] for row in rows.tolist()]

    def _index_all_records(self, records: Iterable[BlockRecord]) -> None:
        holds = self.fold.holds
        for record in records:
            position = _CLASS_OF.get((record.provenance, record.tier))
            if position is None or not record.indexable:
                continue  # external tier, or audit-only records (retained conflicts, unresolved stores)
            if not holds(record.worker, record.provenance, record.tier, record.sequence_hash):
                continue  # a group that does not decide residency (kvledger.residency)
            slot = self._slot_of_worker[record.worker]
            row = self._row_of.get(record.sequence_hash)
            if row is None:
                row = self._new_row(record.sequence_hash)
            word, bit = divmod(slot, 64)
            at = (row * _CLASS_COUNT + position) * self.words + word
            if self._mask_words[at] >> bit & 1:
                continue  # the same block in another group
            self._mask_words[at] |= 1 << bit
            self._row_bits[row] += 1
        self.generation += 1

    # --- workers -------------------------------------------------------------------------

    def _add_worker(self, worker: WorkerId) -> None:
        slot = len(self.workers)
        self.workers.append(worker)
        self._slot_of_worker[worker] = slot
        self.slot_by_key[(worker.publisher, worker.dp_rank)] = slot
        if len(self.workers) > self.words * 64:
            grown = np.zeros((self.masks.shape[0], len(CLASSES), self.words * 2), dtype=np.uint64)
            grown[:, :, : self.words] = self.masks
            self.words *= 2
            self._set_masks(grown)
            self.generation += 1
        ordered = sorted(range(len(self.workers)), key=self.workers.__getitem__)
        self.slots_in_order = np.array(ordered, dtype=np.int32)
        rank = np.empty(len(ordered), dtype=np.int32)
        rank[self.slots_in_order] = np.arange(len(ordered), dtype=np.int32)
        self.order_rank = rank
        self._uncertain_cache = None

    def slot(self, worker: WorkerId) -> int | None:
        return self._slot_of_worker.get(worker)

    @property
    def worker_count(self) -> int:
        return len(self.workers)

    def uncertain_names(self) -> tuple[str, ...]:
        if self._uncertain_cache is None:
            self._uncertain_cache = tuple(worker.name for worker in self.fold.uncertain_workers())
        return self._uncertain_cache

    # --- rows and the hash table ---------------------------------------------------------

    @property
    def size(self) -> int:
        """Sequence hashes held by at least one worker in at least one class."""
        return len(self._row_of)

    def _new_row(self, sequence_hash: int) -> int:
        if self._free_rows:
            row = self._free_rows.pop()
            self._row_hash[row] = sequence_hash
        else:
            row = len(self._row_hash)
            self._row_hash.append(sequence_hash)
            self._row_bits.append(0)
            if row >= self.masks.shape[0]:
                grown = np.zeros((self.masks.shape[0] * 2, len(CLASSES), self.words), dtype=np.uint64)
                grown[: self.masks.shape[0]] = self.masks
                self._set_masks(grown)
                self.generation += 1
        self._row_of[sequence_hash] = row
        if len(self._row_of) + self._dead_slots > _MAX_LOAD * len(self.table_keys):
            # Past the load limit: purge the dead slots at the same size while they are a good
            # part of it; only live keys make the table grow (else churn alone doubles it).
            grow = len(self._row_of) > _MAX_LOAD * len(self.table_keys) / 2
            self._rebuild_table(self.table_bits + 1 if grow else self.table_bits)
        else:
            self._table_insert(sequence_hash, row)
        return row

    def _release_row(self, sequence_hash: int, row: int) -> None:
        # Linear probing cannot simply empty a slot (later keys would become unreachable),
        # so the key stays pointing at the all-zero row 0 until the next rebuild.
        del self._row_of[sequence_hash]
        self._free_rows.append(row)
        position = self._table_find(sequence_hash)
        self._table_row_items[position] = MISSING_ROW
        if self.track_dirty:
            self.dirty_table_slots.add(position)
        self._dead_slots += 1
        if self._dead_slots > len(self._row_of) and self._dead_slots > 4096:
            self._rebuild_table(self.table_bits)

    _dead_slots = 0

    def _set_masks(self, masks: np.ndarray) -> None:
        self.masks = masks
        # The same memory as Python ints: one item costs far less than a numpy scalar.
        self._mask_words = memoryview(masks).cast("B").cast("Q")

    def _set_table(self, bits: int) -> None:
        self.table_keys = np.zeros(1 << bits, dtype=np.uint64)
        self.table_rows = np.full(1 << bits, EMPTY_ROW, dtype=np.int32)
        self._table_key_items = memoryview(self.table_keys).cast("B").cast("Q")
        self._table_row_items = memoryview(self.table_rows).cast("B").cast("i")

    def _table_find(self, key: int) -> int:
        mask = len(self._table_key_items) - 1
        position = slot_of(key, self.table_bits)
        keys, rows = self._table_key_items, self._table_row_items
        while True:
            if rows[position] == EMPTY_ROW or keys[position] == key:
                return position
            position = (position + 1) & mask

    def _table_insert(self, key: int, row: int) -> None:
        position = self._table_find(key)
        if self._table_row_items[position] == MISSING_ROW and self._table_key_items[position] == key:
            self._dead_slots -= 1
        self._table_key_items[position] = key
        self._table_row_items[position] = row
        if self.track_dirty:
            self.dirty_table_slots.add(position)

    def _rebuild_table(self, bits: int) -> None:
        self.table_bits = max(bits, _MIN_TABLE_BITS)
        self._set_table(self.table_bits)
        self._dead_slots = 0
        count = len(self._row_of)
        keys = np.fromiter(self._row_of.keys(), dtype=np.uint64, count=count)
        rows = np.fromiter(self._row_of.values(), dtype=np.int32, count=count)
        fill_table(keys, rows, self.table_keys, self.table_rows, self.table_bits)
        self.generation += 1
        self.dirty_table_slots.clear()

    def take_dirty(self) -> tuple[np.ndarray, np.ndarray]:
        """Hand the device mirror the table slots and rows changed since the last call."""
        slots = np.fromiter(self.dirty_table_slots, dtype=np.int64, count=len(self.dirty_table_slots))
        rows = np.fromiter(self.dirty_rows, dtype=np.int64, count=len(self.dirty_rows))
        self.dirty_table_slots.clear()
        self.dirty_rows.clear()
        return np.sort(slots), np.sort(rows)


def index_from_batches(batches: Iterable[tuple[EventBatch, int]]) -> InventoryIndex:
    index = InventoryIndex()
    for batch, stream_seq in batches:
        index.apply(batch, stream_seq)
    return index
