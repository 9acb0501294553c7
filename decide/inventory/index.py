"""The decide index: every worker's inventory as a hash table from sequence hash to its holders.

One row per sequence hash says which workers hold it in each of four classes (native
device, native host, native disk, retained device): a short list of holders, or beyond
`decide.inventory.rows.INLINE` of them a bitmask row of `words` 64-bit words per class, so any
number of workers fits and a row costs what its holders need. The index owns its own
`InventoryFold`, which runs every sequence rule for every worker. A plain worker's records
(native, group 0, no ownership: nearly every worker) are held in `decide.compact`'s arrays, whose kernels set and clear the bits as
each event is applied; the first announcement beyond the plain case promotes the worker
into the fold for good. For a promoted worker the index re-reads, after each batch, the
fold's `holds` for the (worker, sequence hash) pairs the batch touched, so every fold rule
(retained conflicts, reference counting, restarts, groups) is inherited rather than
re-implemented.

A worker whose engine ingest cannot reach (a liveness record, kvledger.core.events.Reachability)
is not credited: it is promoted, its native bits cleared, and they are set again from the
fold's records when it is reachable again (after which ingest's incarnation check has said
whether they still stand). Answers list it among the uncertain workers meanwhile.

The lookup table is open addressing with linear probing over numpy arrays, probed by
`decide.ranking.kernels.probe` and mirrored on the device with the same probe sequence; changes
since the device last synced are kept as dirty table slots and dirty rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from kvledger.core.events import (
    Cleared, EventBatch, GapReason, Provenance, Reachability, Removed, Stored, Tier, WorkerId, is_liveness,
)
from kvledger.core.fold import (
    BlockRecord,
    BlockRemovedFact,
    BlockStoredFact,
    Fact,
    HoleToFetch,
    InventoryClearedFact,
    InventoryFold,
    ReachabilityFact,
    RetainedConflictFact,
    UncertaintyFact,
)
from kvledger.core.reuse import unvouched_names

from kvledger.runtime.memory import mapped_zeros

from kvledger.decide.inventory.compact import (
    MAX_SLOTS, NOT_PLAIN, TIER_CODE, TIERS, CompactInventory, plain_placement, plain_records,
)
from kvledger.decide.inventory.table import fill_table, lookup_rows
from kvledger.decide.inventory.rows import (
    CHANGED, EMPTIED, INLINE, NO_ROOM, PLANES, UNCHANGED, change_bits, change_worker_bits, dense_planes,
    rows_with_bit, spill, spilled_into,
)

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


# What the arrays a query reads (table, holders, spilled) are allocated with: process-wide, so that decide can
# put them in memory its index reader processes map (decide/serving/readers.py).
_query_array_zeros = mapped_zeros


def allocate_query_arrays_with(zeros: Callable) -> None:
    """Allocate the query arrays of indexes made from now on (and their growth) with `zeros(shape, dtype)`."""
    global _query_array_zeros
    _query_array_zeros = zeros


def slot_of(key: int, bits: int) -> int:
    return ((key * HASH_MULTIPLIER) & _U64) >> (64 - bits)


class _Numbers:
    """Numbers of rows handed out from 1 up (0 is kept back), those given back first."""

    def __init__(self) -> None:
        self.used = 1  # every number below this has been handed out
        self.free: list[int] = []

    def take(self) -> int:
        if self.free:
            return self.free.pop()
        self.used += 1
        return self.used - 1

    def give_back(self, number: int) -> None:
        self.free.append(number)


class InventoryIndex:
    """Sequence hash → which workers hold it in each class, following an `InventoryFold`.

    Started from a fold (a snapshot's), the index owns it: its plain workers' records move
    to `compact` and leave the fold.
    """

    def __init__(self, fold: InventoryFold | None = None) -> None:
        self.fold = fold if fold is not None else InventoryFold()
        self.inventory_seq = self.fold.inventory_seq
        self.workers: list[WorkerId] = []  # by slot, in order of first appearance
        self._slot_of_worker: dict[WorkerId, int] = {}
        # The same by (publisher, dp_rank): hashing a WorkerId (attrs) costs far more than its fields.
        self.slot_by_key: dict[tuple[str, int], int] = {}
        self.rank_zero_slots: dict[str, int] = {}  # the slots of dp_rank 0 workers by publisher
        self.slots_in_order = np.zeros(0, dtype=np.int32)  # worker slots sorted by worker order
        self.order_rank = np.zeros(0, dtype=np.int32)  # slot -> its position in worker order
        self.words = 1
        # Per row: its holders (decide.rows; none: the row is free), an array, not Python
        # objects: a fleet's index has a row per distinct block. Its sequence hash is the
        # table's key that leads to it.
        self.live_rows = 0
        self._rows = _Numbers()  # row 0 is the row of hashes nobody holds: it lists no one
        self._set_holders(_query_array_zeros((1024, INLINE), np.uint32))
        # The bitmask rows of rows with more holders than a row lists (pool row 0 unused).
        self.spilled = _query_array_zeros((16, PLANES, self.words), np.uint64)
        self._pool_rows = _Numbers()
        self.table_bits = _MIN_TABLE_BITS
        self._set_table(_MIN_TABLE_BITS)
        # What the device mirror has not seen yet; `generation` changes when the arrays
        # are reallocated, which forces a whole upload instead of a scatter.
        self.generation = 0
        self.track_dirty = False  # set by a device mirror; cpu alone needs no change lists
        self.dirty_rows: set[int] = set()
        self.dirty_table_slots: set[int] = set()
        self._uncertain_cache: tuple[str, ...] | None = None
        self.compact = CompactInventory()
        # Slots whose records the fold holds (promoted, or restored with the fold); every
        # other worker's are in `compact`, under its (spec_kind, sliding_window) by slot.
        self._promoted: set[int] = set()
        self._spec_of: dict[int, tuple[str | None, int | None]] = {}
        for worker in self.fold.workers():
            self._add_worker(worker)
            self._promoted.add(self._slot_of_worker[worker])
        self._index_all_records(self.fold.iter_records())
        for worker in self.fold.workers():
            self._take_plain(worker)
        for worker in self.fold.unreachable_workers():
            self._follow_reachability(worker)

    # --- following the fold ------------------------------------------------------------

    def apply(self, batch: EventBatch, stream_seq: int) -> list[Fact]:
        """Fold one KV_EVENTS batch and bring the rows up to date with what it changed.

        Returns the fold's facts; a plain worker's stores and removals, held in `compact`,
        make none.
        """
        slot = self._slot_of_worker.get(batch.worker)
        if batch.provenance is NATIVE and slot not in self._promoted:
            facts = self._apply_plain(batch, stream_seq)
        else:
            if slot is not None:
                self._promote(slot)
            rules_before = self._residency_rules(batch.worker)
            facts = self.fold.apply(batch, stream_seq)
            self._note_worker(batch.worker, stream_seq)
            if batch.worker in self._slot_of_worker:
                self._promoted.add(self._slot_of_worker[batch.worker])
                self._follow(batch.worker, facts, rules_before)
        # Every change of a worker's uncertainty is a fact of its own; other batches leave the
        # names as they were (answers read them per batch, and listing them sorts every worker).
        if any(type(fact) is UncertaintyFact for fact in facts):
            self._uncertain_cache = None
        if is_liveness(batch) and any(type(fact) is ReachabilityFact and fact.provenance is NATIVE for fact in facts):
            self._uncertain_cache = None
            self._follow_reachability(batch.worker)
        return facts

    def take_holes(self) -> list[HoleToFetch]:
        """The holes mid-stream the fold found since the last call (`InventoryFold.take_holes`)."""
        return self.fold.take_holes()

    def _follow_reachability(self, worker: WorkerId) -> None:
        """Withdraw an unreachable worker's native bits, or set them again from its records once it is back."""
        slot = self._slot_of_worker[worker]
        if self.fold.is_unreachable(worker):
            # Its records go to the fold, where they wait, unindexed, for its return.
            self._promote(slot)
            for position in (NATIVE_DEVICE, NATIVE_HOST, NATIVE_DISK):
                for sequence_hash in self._hashes_with_bit(slot, position):
                    self._set_bit(slot, sequence_hash, position, False)
            return
        for record in list(self.fold.iter_worker_records(worker)):
            position = _CLASS_OF.get((record.provenance, record.tier))
            if position is not None and record.provenance is NATIVE and record.indexable:
                self._refresh(slot, record.sequence_hash, position)

    def _note_worker(self, worker: WorkerId, stream_seq: int) -> None:
        self.inventory_seq = max(self.inventory_seq, stream_seq)
        if worker not in self._slot_of_worker and self.fold.worker_state(worker) is not None:
            self._add_worker(worker)

    def _follow(self, worker: WorkerId, facts: list[Fact], rules_before: tuple) -> None:
        """Re-read the bits of the records a promoted worker's facts changed."""
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
        if facts and self._residency_rules(worker) != rules_before:
            # A group appeared on a tier or declared another kind: what its other blocks count
            # as changed too (kvledger.core.residency), so every record of the worker is re-read.
            slot = slot_of_worker[worker]
            for record in self.fold.iter_worker_records(worker):
                position = _CLASS_OF.get((record.provenance, record.tier))
                if position is not None:
                    touched[(slot, record.sequence_hash, position)] = None
        for slot, sequence_hash, position in touched:
            self._refresh(slot, sequence_hash, position)

    # --- plain workers -------------------------------------------------------------------

    def _apply_plain(self, batch: EventBatch, stream_seq: int) -> list[Fact]:
        """A native batch of a worker not promoted: the fold's sequence rules, its events in `compact`."""
        worker = batch.worker
        facts, accepted = self.fold.begin(batch, stream_seq)
        self._note_worker(worker, stream_seq)
        slot = self._slot_of_worker.get(worker)
        if slot is None:
            self.fold.batches_to_apply(batch, False)  # none: a worker's first batch is never held
            return facts  # a redelivered first batch: nothing of the worker exists yet
        if any(type(fact) is InventoryClearedFact for fact in facts):
            self._clear_plain(slot, None)  # a new epoch without a restart Gap: the engine restarted
        for ready in self.fold.batches_to_apply(batch, accepted):  # with those a hole held back
            self._apply_plain_events(slot, worker, ready.events, stream_seq, facts)
        return facts

    def _apply_plain_events(self, slot: int, worker: WorkerId, events, stream_seq: int, facts: list[Fact]) -> None:
        """One accepted batch's events, in `compact` while the worker stays plain, else through the fold."""
        for number, event in enumerate(events):
            if slot not in self._promoted and self._apply_plain_event(slot, worker, event, stream_seq, facts):
                continue
            # Beyond the plain case: the fold holds this worker from here on.
            self._promote(slot)
            rules_before = self._residency_rules(worker)
            rest: list[Fact] = []
            for later in events[number:]:
                self.fold.apply_event(worker, NATIVE, later, stream_seq, rest)
            self._follow(worker, rest, rules_before)
            facts.extend(rest)
            break

    def _apply_plain_event(self, slot: int, worker: WorkerId, event, stream_seq: int, facts: list[Fact]) -> bool:
        """Apply one event of a plain worker; False (nothing changed) when it is beyond the plain case."""
        kind = type(event)
        if kind is Stored:
            if not plain_placement(event.group_idx, event.ownership, event.tier):
                return False
            spec = (event.spec_kind, event.sliding_window)
            if self._spec_of.setdefault(slot, spec) != spec:
                return False  # records carry their group's spec; a worker's own stay alike while compact
            engines = np.fromiter(event.block_hashes, dtype=np.uint64, count=len(event.block_hashes))
            has_tokens = event.has_tokens
            local = np.fromiter(event.local_hashes, dtype=np.uint64, count=engines.size) if has_tokens else engines
            position = _CLASS_OF[(NATIVE, event.tier)]
            sequences = np.empty(engines.size, dtype=np.uint64)
            new = np.empty(engines.size, dtype=np.bool_)
            result = self.compact.store(
                slot, event.tier, engines, local, has_tokens, event.parent_hash,
                (self.table_keys, self.table_rows, self.table_bits, self.holders, self.spilled), position, sequences, new,
            )
            if result == NOT_PLAIN:
                return False
            unknown_parent, duplicates = self.compact.counts.tolist()
            self.fold.note_stored_elsewhere(worker, NATIVE, event, attached=duplicates < engines.size)
            if unknown_parent or duplicates:
                self.fold.add_counts(worker, {"unknown_parent": unknown_parent, "duplicate_store": duplicates})
            self._set_bits(slot, sequences[new], position, True)
            return True
        if kind is Removed:
            if not plain_placement(event.group_idx, event.ownership, event.tier):
                return False
            engines = np.fromiter(event.block_hashes, dtype=np.uint64, count=len(event.block_hashes))
            sequences = np.empty(engines.size, dtype=np.uint64)
            gone = np.empty(engines.size, dtype=np.bool_)
            unknown = self.compact.remove(slot, event.tier, engines, sequences, gone)
            if unknown:
                self.fold.add_counts(worker, {"unknown_remove": unknown})
            position = _CLASS_OF[(NATIVE, event.tier)]
            self._set_bits(slot, sequences[gone], position, False)
            return True
        if kind is Reachability:
            self.fold.apply_event(worker, NATIVE, event, stream_seq, facts)  # `apply` follows what it changed
            return True
        if kind is Cleared:
            if event.tier is not None and self.fold.is_uncertain(worker):
                return False  # whether the clear ends the uncertainty depends on the other tiers' records
            self.fold.apply_event(worker, NATIVE, event, stream_seq, facts)
            self._clear_plain(slot, event.tier)
            return True
        self.fold.apply_event(worker, NATIVE, event, stream_seq, facts)
        if event.reason is GapReason.PUBLISHER_RESTART:
            self._clear_plain(slot, None)
        return True

    def _set_bits(self, slot: int, sequences: np.ndarray, position: int, wanted: bool,
                  rows: np.ndarray | None = None) -> None:
        """`_set_bit` for each of an event's distinct sequence hashes (`rows`: theirs, when the caller
        has them): existing rows in one compiled call; rows to make (for a set bit) or to free
        (their last bit cleared) here."""
        if rows is None:
            rows = lookup_rows(self.table_keys, self.table_rows, self.table_bits, sequences)
        status = np.empty(rows.size, dtype=np.int8)
        if change_worker_bits(self.holders, self.spilled, rows, position, slot, wanted, status):
            full = np.flatnonzero(status == NO_ROOM)
            status[full] = self._change_bits(rows[full], np.full(full.size, position, np.int64),
                                             np.full(full.size, slot, np.int64), True)
        if self.track_dirty:
            self.dirty_rows.update(rows[(status == CHANGED) | (status == EMPTIED)].tolist())
        if wanted:
            for sequence_hash in sequences[rows == MISSING_ROW].tolist():
                self._set_bit(slot, sequence_hash, position, True, MISSING_ROW)
        else:
            emptied = status == EMPTIED
            for sequence_hash, row in zip(sequences[emptied].tolist(), rows[emptied].tolist()):
                self._release_row(sequence_hash, row)

    def _change_bits(self, rows: np.ndarray, positions: np.ndarray, slots: np.ndarray, wanted: bool) -> np.ndarray:
        """Set or clear a bit of each existing row (`decide.inventory.rows.change_bits`), spilling a row
        whose list of holders is full into a bitmask row; what became of each (UNCHANGED, CHANGED, EMPTIED)."""
        status = np.empty(rows.size, dtype=np.int8)
        change_bits(self.holders, self.spilled, rows, positions, slots, wanted, status)
        for item in np.flatnonzero(status == NO_ROOM).tolist():
            self._spill(int(rows[item]))
            part = slice(item, item + 1)
            change_bits(self.holders, self.spilled, rows[part], positions[part], slots[part], wanted, status[part])
        return status

    def _spill(self, row: int) -> None:
        if spilled_into(self._holder_items[row * INLINE]):
            return  # spilled already (by an earlier item of the same call)
        dense = self._pool_rows.take()
        if dense >= self.spilled.shape[0]:
            # By a quarter: at 1 024 workers a bitmask row is 512 bytes, and few rows spill.
            grown = _query_array_zeros((self.spilled.shape[0] * 5 // 4 + 1, PLANES, self.words), np.uint64)
            grown[: self.spilled.shape[0]] = self.spilled
            self.spilled = grown
        spill(self.holders, self.spilled, row, dense)

    def _clear_plain(self, slot: int, tier: Tier | None) -> None:
        """A plain worker's records on one tier (or all) went away: their bits and entries."""
        tiers = TIERS if tier is None else (tier,) if tier in TIER_CODE else ()
        if not tiers or not self.compact.held_by(slot):
            return
        # Read once: a row emptied on one tier held none of this worker's bits on the others.
        hash_of_row = self._hash_of_row()
        for cleared in tiers:
            position = _CLASS_OF[(NATIVE, cleared)]
            rows = self._rows_with_bit(slot, position).astype(np.int32)
            self._set_bits(slot, hash_of_row[rows], position, False, rows)
        self.compact.clear(slot, tier)

    def _promote(self, slot: int) -> None:
        """Move a plain worker's records into the fold, which applies everything of it from now on."""
        if slot in self._promoted:
            return
        self._promoted.add(slot)
        worker = self.workers[slot]
        if self.compact.held_by(slot):
            self.fold.adopt_records(worker, self.compact.take_records(slot, worker, self._spec_of[slot]))
        self._spec_of.pop(slot, None)

    def _take_plain(self, worker: WorkerId) -> None:
        """Hold a restored worker's records in `compact` when they are all plain (their bits stay as they are)."""
        slot = self._slot_of_worker[worker]
        if slot >= MAX_SLOTS or self.fold.is_unreachable(worker):
            return  # (an unreachable worker's records wait in the fold for its return)
        tiers_groups = self.fold.worker_state(worker).position(NATIVE).groups.get("tiers", {})
        if any(groups != [0] for groups in tiers_groups.values()):
            return  # another group stored on a tier (and may have left it): its rule is the fold's to apply
        records = list(self.fold.iter_worker_records(worker))
        spec = plain_records(records)
        if spec is None:
            return
        self.compact.put_records(slot, records)
        self.fold.release_records(worker, NATIVE)
        self._promoted.discard(slot)
        self._spec_of[slot] = spec

    @property
    def promoted_count(self) -> int:
        return len(self._promoted)

    def array_parts(self) -> dict[str, int]:
        """Bytes of the index's arrays by part: the compact records, the rows' holders, the bitmask rows, the table."""
        return {"compact": self.compact.nbytes(), "rows' holders": self.holders.nbytes,
                "bitmask rows": self.spilled.nbytes, "table": self.table_keys.nbytes + self.table_rows.nbytes}

    @property
    def array_bytes(self) -> int:
        """Bytes of the index's arrays (`array_parts`, summed)."""
        return sum(self.array_parts().values())

    @property
    def promoted_workers(self) -> list[WorkerId]:
        """Workers whose records the fold holds (the rest are in `compact`)."""
        return [self.workers[slot] for slot in sorted(self._promoted)]

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
        wanted = self.fold.holds(self.workers[slot], provenance, tier, sequence_hash)  # nothing native while unreachable
        self._set_bit(slot, sequence_hash, position, wanted)

    def _set_bit(self, slot: int, sequence_hash: int, position: int, wanted: bool, row: int | None = None) -> None:
        """Set or clear one bit; `row` when the caller has already looked it up (MISSING_ROW: none yet)."""
        if row is None:
            row = self.row_of(sequence_hash)
        if row == MISSING_ROW:
            if not wanted:
                return
            row = self._new_row(sequence_hash)
            self._holder_items[row * INLINE] = slot << 4 | 1 << position  # its first holder
            status = CHANGED
        else:
            status = self._change_bits(np.array([row], np.int32), np.array([position], np.int64),
                                       np.array([slot], np.int64), wanted)[0]
            if status == UNCHANGED:
                return
        if self.track_dirty:
            self.dirty_rows.add(row)
        if status == EMPTIED:
            self._release_row(sequence_hash, row)

    def _hashes_with_bit(self, slot: int, position: int) -> list[int]:
        """The sequence hashes whose row has this worker's bit in this class: what a Cleared re-reads.

        A scan of one bitmask column (rare: a clear or a restart), where a set per worker and
        class kept beside the bits cost tens of bytes per residency.
        """
        return self._hash_of_row()[self._rows_with_bit(slot, position)].tolist()

    def _rows_with_bit(self, slot: int, position: int) -> np.ndarray:
        return rows_with_bit(self.holders, self.spilled, self._rows.used, position, slot)

    def _index_all_records(self, records: Iterable[BlockRecord]) -> None:
        holds = self.fold.holds
        rows: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for record in records:
            position = _CLASS_OF.get((record.provenance, record.tier))
            if position is None or not record.indexable:
                continue  # external tier, or audit-only records (retained conflicts, unresolved stores)
            if not holds(record.worker, record.provenance, record.tier, record.sequence_hash):
                continue  # a group that does not decide residency (kvledger.core.residency)
            slot = self._slot_of_worker[record.worker]
            row = self.row_of(record.sequence_hash)
            if row == MISSING_ROW:
                self._set_bit(slot, record.sequence_hash, position, True, MISSING_ROW)
            else:  # set together below; a bit already set is the same block in another group
                rows.append(row)
                positions.append(position)
                slots.append(slot)
        if rows:
            self._change_bits(np.array(rows, np.int32), np.array(positions, np.int64), np.array(slots, np.int64), True)
        self.generation += 1

    # --- workers -------------------------------------------------------------------------

    def _add_worker(self, worker: WorkerId) -> None:
        slot = len(self.workers)
        self.workers.append(worker)
        self._slot_of_worker[worker] = slot
        self.slot_by_key[(worker.publisher, worker.dp_rank)] = slot
        if worker.dp_rank == 0:
            self.rank_zero_slots[worker.publisher] = slot
        if slot >= MAX_SLOTS:
            self._promoted.add(slot)  # beyond what an entry's owner field holds: folded as objects
        if len(self.workers) > self.words * 64:
            grown = _query_array_zeros((self.spilled.shape[0], PLANES, self.words * 2), np.uint64)
            grown[:, :, : self.words] = self.spilled
            self.words *= 2
            self.spilled = grown
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
        """Workers whose inventory answers cannot vouch for: uncertain ones, and unreachable ones (not credited)."""
        if self._uncertain_cache is None:
            self._uncertain_cache = unvouched_names(self.fold)
        return self._uncertain_cache

    def unreachable_names(self) -> tuple[str, ...]:
        """Workers whose engine ingest cannot reach: excluded from credit and from candidates."""
        return tuple(worker.name for worker in self.fold.unreachable_workers())

    # --- rows and the hash table ---------------------------------------------------------

    @property
    def size(self) -> int:
        """Sequence hashes held by at least one worker in at least one class."""
        return self.live_rows

    def row_of(self, sequence_hash: int) -> int:
        """The hash's row, MISSING_ROW when nobody holds it (the table's probe, from Python)."""
        row = self._table_row_items[self._table_find(sequence_hash)]
        return MISSING_ROW if row == EMPTY_ROW else row

    def sequence_hashes(self) -> list[int]:
        """Every sequence hash someone holds."""
        return self.table_keys[self.table_rows > MISSING_ROW].tolist()

    def _new_row(self, sequence_hash: int) -> int:
        row = self._rows.take()
        if row >= self.holders.shape[0]:
            holders = _query_array_zeros((self.holders.shape[0] * 2, INLINE), np.uint32)
            holders[: self.holders.shape[0]] = self.holders
            self._set_holders(holders)
            self.generation += 1
        self.live_rows += 1
        if self.live_rows + self._dead_slots > _MAX_LOAD * len(self.table_keys):
            # Past the load limit: purge the dead slots at the same size while they are a good
            # part of it; only live keys make the table grow (else churn alone doubles it).
            grow = self.live_rows > _MAX_LOAD * len(self.table_keys) / 2
            self._rebuild_table(self.table_bits + 1 if grow else self.table_bits)
        # After a rebuild too: the rebuild took the keys the table had, and this one was not among them.
        self._table_insert(sequence_hash, row)
        return row

    def _release_row(self, sequence_hash: int, row: int) -> None:
        # Linear probing cannot simply empty a slot (later keys would become unreachable),
        # so the key stays pointing at the all-zero row 0 until the next rebuild.
        self.live_rows -= 1
        self._rows.give_back(row)
        dense = spilled_into(self._holder_items[row * INLINE])
        if dense:  # its bitmask row is all zero again (an emptied listed row lists no one)
            self._pool_rows.give_back(dense)
            self._holder_items[row * INLINE] = 0
        position = self._table_find(sequence_hash)
        self._table_row_items[position] = MISSING_ROW
        if self.track_dirty:
            self.dirty_table_slots.add(position)
        self._dead_slots += 1
        if self._dead_slots > self.live_rows and self._dead_slots > 4096:
            self._rebuild_table(self.table_bits)

    _dead_slots = 0

    def _set_holders(self, holders: np.ndarray) -> None:
        self.holders = holders
        # The same memory as Python ints: one item costs far less than a numpy scalar.
        self._holder_items = memoryview(holders).cast("B").cast("I")

    def _set_table(self, bits: int) -> None:
        self.table_keys = _query_array_zeros(1 << bits, np.uint64)
        self.table_rows = _query_array_zeros(1 << bits, np.int32)
        self.table_rows[:] = EMPTY_ROW
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
        live = self.table_rows > MISSING_ROW  # the keys of live rows, taken over from the old table
        keys, rows = self.table_keys[live], self.table_rows[live]
        self.table_bits = max(bits, _MIN_TABLE_BITS)
        self._set_table(self.table_bits)
        self._dead_slots = 0
        fill_table(keys, rows, self.table_keys, self.table_rows, self.table_bits)
        self.generation += 1
        self.dirty_table_slots.clear()

    def _hash_of_row(self) -> np.ndarray:
        """Every live row's sequence hash by row, read off the table in one pass (for clears,
        which are rare: a hash kept per row cost 8 bytes a row)."""
        live = self.table_rows > MISSING_ROW
        by_row = np.zeros(self._rows.used, dtype=np.uint64)
        by_row[self.table_rows[live]] = self.table_keys[live]
        return by_row

    def dense_rows(self, rows: np.ndarray | None = None) -> np.ndarray:
        """Rows as bitmask planes (rows × PLANES × words), every row's when none are named: the device's copy."""
        if rows is None:
            rows = np.arange(self.holders.shape[0], dtype=np.int64)
        return dense_planes(self.holders, self.spilled, rows.astype(np.int64, copy=False), self.words)

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


def warm_up() -> None:
    """Compile (or load from the kernel cache) the index's kernels and its compact store's, as
    `decide.ranking.cpu.compile_kernels` does the rest: a plain worker stored, promoted to rows, emptied."""
    index = InventoryIndex()
    worker = WorkerId("warm-up")
    events = (Stored(Tier.DEVICE, (1, 2), None, 16, (3, 4)), Stored(Tier.HOST, (1,), None, 16, ()),
              Removed(Tier.DEVICE, (2,)))
    index.apply(EventBatch(worker, 0, 0, 0.0, 0.0, Provenance.NATIVE, events), 1)
    index._promote(0)
    index.compact.put_records(0, [])
