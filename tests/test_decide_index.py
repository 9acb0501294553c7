"""decide's index: the compiled probe finds the rows, and the index (plain workers held compactly) agrees with the fold."""

from __future__ import annotations

import copy
import random

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from decide_inventories import batches, plain_batches
from kvledger.core.events import Cleared, Provenance, Removed, Stored, Tier, WorkerId
from kvledger.core.fold import BlockRecord, InventoryFold
from kvledger.core.hashing import sequence_hashes
from builders import BLOCK_SIZE, Stream, local_hashes

from kvledger.decide.inventory.compact import REFS_MAX
from kvledger.decide.inventory.index import CLASSES, MISSING_ROW, InventoryIndex
from kvledger.decide.inventory.rows import spilled_into
from kvledger.decide.inventory.table import probe


def crowded_index() -> tuple[InventoryIndex, dict[int, int], list[int]]:
    """20 000 sequence hashes in 40 chains, then a quarter removed: their keys stay in the table
    as dead slots. Returns the index, the slot holding each live hash, and the dead hashes."""
    rng = random.Random(5)
    stream, index = Stream(), InventoryIndex()
    holder: dict[int, int] = {}
    dead: list[int] = []
    for chain in range(40):
        worker = WorkerId(f"w{chain % 8}")
        engine = [rng.getrandbits(64) for _ in range(500)]
        local = tuple(rng.getrandbits(64) for _ in range(500))
        index.apply(*stream.batch(worker, Stored(Tier.DEVICE, tuple(engine), None, BLOCK_SIZE, local)))
        index.apply(*stream.batch(worker, Removed(Tier.DEVICE, tuple(engine[375:]))))
        chained = sequence_hashes(local)
        holder.update(dict.fromkeys(chained[:375], index.slot(worker)))
        dead.extend(chained[375:])
    return index, holder, dead


def test_the_probe_finds_the_row_each_hash_was_given() -> None:
    index, holder, dead = crowded_index()
    live = index.sequence_hashes()
    assert sorted(live) == sorted(holder) and len(live) == 40 * 375
    rng = random.Random(6)
    strangers = [rng.getrandbits(64) for _ in range(5000)] + [0, 2**64 - 1]
    keys = live + dead + strangers + live[:100]
    rng.shuffle(keys)
    def row_of(key: int) -> int:
        return int(probe(index.table_keys, index.table_rows, index.table_bits, np.uint64(key)))

    found = [row_of(key) for key in keys]
    assert [index.row_of(key) for key in keys] == found
    # Each live hash has a row of its own, which lists the one worker that stored it, and nothing else has one.
    rows_of_live = {key: row for key, row in zip(keys, found) if key in holder}
    assert len(set(rows_of_live.values())) == len(holder) and MISSING_ROW not in rows_of_live.values()
    planes = index.dense_rows(np.array(list(rows_of_live.values())))
    for (key, _), row_planes in zip(rows_of_live.items(), planes):
        word, bit = divmod(holder[key], 64)
        assert int(row_planes[0, word]) == 1 << bit and not row_planes[1:].any() and not np.delete(row_planes[0], word).any()
    assert {row for key, row in zip(keys, found) if key not in holder} == {MISSING_ROW}


def held_by_class(index: InventoryIndex) -> dict[tuple[int, str, int], int]:
    """Every set bit of the index as (sequence hash, worker name, class) -> 1, read through the probe
    and the rows as the ranking walk reads them (listed holders or a bitmask row)."""
    held = {}
    for sequence_hash in index.sequence_hashes():
        row = int(probe(index.table_keys, index.table_rows, index.table_bits, np.uint64(sequence_hash)))
        [planes] = index.dense_rows(np.array([row]))
        for slot, worker in enumerate(index.workers):
            word, bit = divmod(slot, 64)
            for position in range(len(CLASSES)):
                if int(planes[position, word]) >> bit & 1:
                    held[(sequence_hash, worker.name, position)] = 1
    return held


def _fold_of(stream) -> InventoryFold:
    fold = InventoryFold()
    for batch, stream_seq in stream:
        fold.apply(batch, stream_seq)
    return fold


def _agrees_with_the_fold(index: InventoryIndex, fold: InventoryFold) -> None:
    """The index equals one built from `fold` (every bit and row), and its own fold stands where `fold` does."""
    rebuilt = InventoryIndex(copy.deepcopy(fold))  # an index takes plain workers' records out of the fold it is given
    assert held_by_class(index) == held_by_class(rebuilt)
    assert set(index.sequence_hashes()) == set(rebuilt.sequence_hashes())
    assert index.uncertain_names() == rebuilt.uncertain_names()
    assert index.fold.workers() == fold.workers()
    for worker in fold.workers():
        for provenance in Provenance:
            assert index.fold.worker_state(worker).position(provenance) == fold.worker_state(worker).position(provenance)


def _records_as_decide_keeps_them(fold: InventoryFold, worker: WorkerId) -> list[tuple]:
    """A worker's records without the stored-at seq, which promoted records cannot carry back."""
    return sorted(
        (record.provenance.value, record.tier.value, record.engine_hash, record.local_hash, record.group_idx,
         record.ownership or "",
         record.sequence_hash, record.parent_hash if record.parent_hash is not None else -1, record.refs,
         record.conflict, record.unresolved, record.spec_kind or "", record.sliding_window or 0)
        for record in fold.iter_worker_records(worker)
    )


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=batches(max_batches=60))
def test_the_index_followed_batch_by_batch_equals_one_built_from_the_fold_at_the_end(stream) -> None:
    """Only what each batch changed is re-read or set; nothing else may have changed."""
    index = InventoryIndex()
    for batch, stream_seq in stream:
        index.apply(batch, stream_seq)
    _agrees_with_the_fold(index, _fold_of(stream))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=plain_batches(max_batches=60))
def test_plain_workers_held_compactly_are_indexed_as_the_fold_indexes_them(stream) -> None:
    """Batch by batch, and after every plain worker is promoted its records are the fold's own."""
    index, fold = InventoryIndex(), InventoryFold()
    for batch, stream_seq in stream:
        index.apply(batch, stream_seq)
        fold.apply(batch, stream_seq)
        _agrees_with_the_fold(index, fold)
    event(f"promoted {len(index.promoted_workers)} of {index.worker_count} workers")
    for slot in range(index.worker_count):
        index._promote(slot)
    assert index.compact.count == 0
    for worker in fold.workers():
        assert _records_as_decide_keeps_them(index.fold, worker) == _records_as_decide_keeps_them(fold, worker)
    _agrees_with_the_fold(index, fold)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=plain_batches(max_batches=60),
       moves=st.lists(st.tuples(st.integers(0, 59), st.integers(1, 12)), max_size=6))
def test_batches_stored_out_of_order_are_held_and_healed_as_the_fold_heals_them(stream, moves) -> None:
    """KV_EVENTS holding a worker's batches out of engine order (a batch moved later in the stream): decide's
    index holds the batches behind each hole and applies them once it fills, as the fold does."""
    batches = [batch for batch, _ in stream]
    for at, later in moves:
        if at < len(batches):
            batches.insert(min(at + later, len(batches)), batches.pop(at))
    index, fold = InventoryIndex(), InventoryFold()
    for stream_seq, batch in enumerate(batches, 1):
        index.apply(batch, stream_seq)
        fold.apply(batch, stream_seq)
    event(f"healed {fold.counters['healed_hole']}, held {fold.counters['held_batch']}")
    _agrees_with_the_fold(index, fold)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=plain_batches(max_batches=60))
def test_a_workers_native_blocks_read_alike_from_the_compact_store_and_the_fold(stream) -> None:
    """What Dynamo's /dump lists (decide/inventory/blocks.py): the same blocks whether a worker is plain or
    promoted, each after its parent."""
    from kvledger.decide.inventory.blocks import native_blocks

    index = InventoryIndex()
    for batch, stream_seq in stream:
        index.apply(batch, stream_seq)
    before = {worker: native_blocks(index, worker) for worker in index.workers}
    for slot in range(index.worker_count):
        index._promote(slot)
    after = {worker: native_blocks(index, worker) for worker in index.workers}
    assert {worker: set(blocks) for worker, blocks in before.items()} == \
        {worker: set(blocks) for worker, blocks in after.items()}
    for blocks in after.values():
        listed: set[int] = set()
        for block in blocks:
            assert block.parent_hash is None or block.parent_hash in listed
            listed.add(block.engine_hash)


def test_a_plain_fleet_stays_out_of_the_fold() -> None:
    """Stores, placeholders, repeats, removals and a restart of plain workers leave no record in decide's fold."""
    stream, index = Stream(), InventoryIndex()
    workers = [WorkerId(f"w{number}") for number in range(3)]
    rng = random.Random(3)
    for worker in workers:
        engine = tuple(rng.getrandbits(64) for _ in range(64))
        local = tuple(rng.getrandbits(64) for _ in range(64))
        index.apply(*stream.batch(worker, Stored(Tier.DEVICE, engine, None, BLOCK_SIZE, local)))
        index.apply(*stream.batch(worker, Stored(Tier.HOST, engine[:32], None, BLOCK_SIZE, ())))  # offload placeholders
        index.apply(*stream.batch(worker, Stored(Tier.DEVICE, engine[:8], None, BLOCK_SIZE, local[:8])))  # repeated
        index.apply(*stream.batch(worker, Removed(Tier.DEVICE, engine[:40])))
    assert index.promoted_workers == []
    assert sum(1 for _ in index.fold.iter_records()) == 0
    assert index.compact.count == 3 * (8 + 24 + 32)  # device: 8 repeated + 24 never removed; host: 32
    assert index.fold.counters["duplicate_store"] == 3 * 8


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=plain_batches(max_batches=60), split=st.floats(0.0, 1.0))
def test_an_index_started_from_a_fold_takes_its_plain_workers_out_of_it(stream, split: float) -> None:
    """A warm start (decide from a snapshot's fold): plain workers go to the compact arrays and follow the stream as before."""
    first = int(len(stream) * split)
    fold = _fold_of(stream[:first])
    started = InventoryIndex(_fold_of(stream[:first]))
    event(f"{started.worker_count - len(started.promoted_workers)} of {started.worker_count} workers taken out")
    assert sum(1 for _ in started.fold.iter_records()) == sum(
        1 for worker in started.promoted_workers for _ in fold.iter_worker_records(worker))
    _agrees_with_the_fold(started, fold)
    for batch, stream_seq in stream[first:]:
        started.apply(batch, stream_seq)
        fold.apply(batch, stream_seq)
    _agrees_with_the_fold(started, fold)


def test_a_restored_worker_whose_tier_saw_another_group_stays_in_the_fold() -> None:
    """Group 1 stored on the device tier and left it: the tier's rule still wants group 1 too
    (kvledger.core.residency), which the compact arrays cannot express, so the worker is not taken out."""
    stream, fold = Stream(), InventoryFold()
    worker = WorkerId("hybrid")
    local = local_hashes([1, 2, 3])
    fold.apply(*stream.batch(worker, Stored(Tier.DEVICE, (11, 12), None, BLOCK_SIZE, local[:2])))
    fold.apply(*stream.batch(worker, Stored(Tier.DEVICE, (21,), None, BLOCK_SIZE, local[:1], group_idx=1)))
    fold.apply(*stream.batch(worker, Removed(Tier.DEVICE, (21,), group_idx=1)))
    index = InventoryIndex(copy.deepcopy(fold))
    assert index.promoted_workers == [worker]
    later = stream.batch(worker, Stored(Tier.DEVICE, (13,), 12, BLOCK_SIZE, local[2:]))
    index.apply(*later)
    fold.apply(*later)
    _agrees_with_the_fold(index, fold)


def test_the_compact_table_grows_and_clears_as_the_fold_folds() -> None:
    """Tens of thousands of entries (the table grows many times), removals, a restart and a tier clear."""
    rng = random.Random(9)
    stream, index, fold = Stream(), InventoryIndex(), InventoryFold()

    def apply(batch) -> None:
        index.apply(*batch)
        fold.apply(*batch)

    workers = [WorkerId(f"w{number}") for number in range(6)]
    chains = {}
    for round_number in range(4):
        for worker in workers:
            engine = tuple(rng.getrandbits(64) for _ in range(1500))
            local = tuple(rng.getrandbits(64) for _ in range(1500))
            chains.setdefault(worker, []).append(engine)
            apply(stream.batch(worker, Stored(Tier.DEVICE, engine, None, BLOCK_SIZE, local)))
            apply(stream.batch(worker, Stored(Tier.HOST, engine[:700], None, BLOCK_SIZE, ())))
    first_size = index.compact.keys.size
    for worker in workers[:3]:
        apply(stream.batch(worker, Removed(Tier.DEVICE, chains[worker][0][200:])))
    apply(stream.batch(workers[3], Cleared(Tier.HOST)))
    apply(stream.batch(workers[4], epoch=1, seq=0))  # restarted: its inventory is gone
    assert index.promoted_workers == []
    assert first_size > 4096 * 4 and index.compact.count == sum(
        1 for worker in workers for _ in fold.iter_worker_records(worker))
    _agrees_with_the_fold(index, fold)


def test_a_block_stored_past_what_a_tag_counts_promotes_its_worker() -> None:
    stream, index, fold = Stream(), InventoryIndex(), InventoryFold()
    worker = WorkerId("repeater")
    block = Stored(Tier.DEVICE, (5,), None, BLOCK_SIZE, local_hashes([1]))
    for _ in range(REFS_MAX):
        batch = stream.batch(worker, block)
        index.apply(*batch)
        fold.apply(*batch)
    assert index.promoted_workers == []
    batch = stream.batch(worker, block)  # one reference more than a tag holds
    index.apply(*batch)
    fold.apply(*batch)
    assert index.promoted_workers == [worker]
    _agrees_with_the_fold(index, fold)
    for _ in range(REFS_MAX + 1):
        batch = stream.batch(worker, Removed(Tier.DEVICE, (5,)))
        index.apply(*batch)
        fold.apply(*batch)
    assert index.size == 0
    _agrees_with_the_fold(index, fold)


def test_workers_past_the_owner_field_are_folded_as_objects(monkeypatch) -> None:
    from kvledger.decide.inventory import index as decide_index

    monkeypatch.setattr(decide_index, "MAX_SLOTS", 2)
    stream, index, fold = Stream(), InventoryIndex(), InventoryFold()
    workers = [WorkerId(f"w{number}") for number in range(4)]
    for number, worker in enumerate(workers):
        batch = stream.batch(worker, Stored(Tier.DEVICE, (100 + number, 7), None, BLOCK_SIZE, local_hashes([1, 2])))
        index.apply(*batch)
        fold.apply(*batch)
    assert index.promoted_workers == workers[2:]
    _agrees_with_the_fold(index, fold)


def test_clearing_a_worker_in_place_leaves_every_other_entry_reachable() -> None:
    """A full table (80 %, probe runs wrapping past its end): one worker's entries are dropped
    in place, and every other entry is still found where a lookup probes for it."""
    from kvledger.decide.inventory.compact import CompactInventory

    rng = random.Random(4)
    compact = CompactInventory()
    held: dict[tuple[int, Tier], list[int]] = {}
    for slot in range(5):
        for tier in (Tier.DEVICE, Tier.HOST):
            engines = [rng.getrandbits(64) for _ in range(780)]
            held[(slot, tier)] = engines
            compact.put_records(slot, [
                BlockRecord(WorkerId(f"w{slot}"), tier, Provenance.NATIVE, engine, engine ^ 1, None, 0, 0)
                for engine in engines])
    assert compact.count > 0.75 * compact.keys.size
    compact.clear(2)
    compact.clear(3, Tier.HOST)
    assert compact.held_by(2) == 0 and compact.held_by(3) == 780 and compact.count == 7 * 780
    for (slot, tier), engines in held.items():
        gone = slot == 2 or (slot, tier) == (3, Tier.HOST)
        array = np.array(engines, dtype=np.uint64)
        sequences, removed = np.empty(array.size, dtype=np.uint64), np.empty(array.size, dtype=np.bool_)
        unknown = compact.remove(slot, tier, array, sequences, removed)
        assert unknown == (len(engines) if gone else 0)
        assert gone or sequences.tolist() == [engine ^ 1 for engine in engines]
    assert compact.count == 0


def test_rows_held_by_many_workers_spill_into_bitmask_rows_and_give_them_back() -> None:
    """150 workers (three mask words) on shared prefixes: rows listing a few holders, rows past
    `INLINE` holders in bitmask rows, a promoted worker beside plain ones, removals and clears
    that empty rows again; batch by batch the index equals one built from the fold."""
    rng = random.Random(15)
    stream, index, fold = Stream(), InventoryIndex(), InventoryFold()

    def apply(batch) -> None:
        index.apply(*batch)
        fold.apply(*batch)

    workers = [WorkerId(f"w{number:03d}") for number in range(150)]
    prefixes = [tuple(rng.getrandbits(64) for _ in range(6)) for _ in range(5)]
    for number, worker in enumerate(workers):
        prefix = prefixes[0] if number % 2 else prefixes[1 + number % 4]  # half the fleet shares prefix 0
        apply(stream.batch(worker, Stored(Tier.DEVICE, tuple(range(1, 7)), None, BLOCK_SIZE, prefix)))
        apply(stream.batch(worker, Stored(Tier.HOST, (1, 2), None, BLOCK_SIZE, ())))
    apply(stream.batch(workers[7], Stored(Tier.DEVICE, (99,), None, BLOCK_SIZE, (5,), group_idx=1)))  # promoted
    _agrees_with_the_fold(index, fold)
    assert index.promoted_workers == [workers[7]]
    spilled_rows = {spilled_into(int(first)) for first in index.holders[1:index._rows.used, 0]} - {0}
    assert len(spilled_rows) >= 8  # prefix 0's six blocks, and the host copies of two blocks of several prefixes
    in_pool = index._pool_rows.used

    for number, worker in enumerate(workers):
        if number % 3 == 0:
            apply(stream.batch(worker, Removed(Tier.DEVICE, (4, 5, 6))))
        elif number % 3 == 1:
            apply(stream.batch(worker, Cleared(Tier.HOST)))
        if number % 25 == 0:
            _agrees_with_the_fold(index, fold)
    for worker in workers:
        apply(stream.batch(worker, Cleared(None)))
    _agrees_with_the_fold(index, fold)
    assert index.size == 0 and not index.holders[1:index._rows.used].any() and not index.spilled.any()
    assert sorted(index._pool_rows.free) == list(range(1, in_pool))  # every bitmask row given back

    for worker in workers[:20]:  # rows made again reuse them
        apply(stream.batch(worker, Stored(Tier.DEVICE, tuple(range(1, 7)), None, BLOCK_SIZE, prefixes[0])))
    _agrees_with_the_fold(index, fold)
    assert index._pool_rows.used == in_pool
