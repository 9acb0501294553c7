"""The inventory fold, rule by rule (docs/core.md, the fold)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.core.events import Cleared, GapReason, Provenance, Tier, WorkerId
from kvledger.core.fold import (
    BlockRemovedFact,
    BlockStoredFact,
    InventoryClearedFact,
    InventoryFold,
    RemovalCause,
    REASON_LIMIT,
    TRACKED_HOLES,
    RetainedConflictFact,
    UncertaintyFact,
    hole_reason,
)
from kvledger.core.hashing import chain_hash, sequence_hashes
from kvledger.core.snapshot import decode_snapshot, encode_snapshot
from builders import Stream, gap, local_hashes, removed, stored

NATIVE, RETAINED = Provenance.NATIVE, Provenance.RETAINED
W = WorkerId("vllm-a")
OTHER = WorkerId("vllm-b")


def held_engine_hashes(fold: InventoryFold, provenance=NATIVE, tier=Tier.DEVICE, worker=W) -> list[int]:
    return [record.engine_hash for record in fold.records(worker, provenance, tier)]


def last_seq(fold: InventoryFold, provenance=NATIVE, worker=W) -> int | None:
    return fold.worker_state(worker).by_provenance[provenance].seq


def fold_with(*batches) -> tuple[InventoryFold, list]:
    fold = InventoryFold()
    return fold, fold.apply_all(batches)


def fold_over_holes(*batches) -> tuple[InventoryFold, list]:
    """A fold that waits for no hole: the batches after one apply at once, the worker uncertain, as a fold
    that waited applies them when it gives up (tests/test_fold_holes_healed.py covers the wait)."""
    fold = InventoryFold(hole_wait_messages=0)
    return fold, fold.apply_all(batches)


def test_stored_blocks_get_chained_sequence_hashes_across_batches() -> None:
    s = Stream()
    fold, facts = fold_with(s.batch(W, stored([1, 2])), s.batch(W, stored([3], parent=2)))
    expected = sequence_hashes(local_hashes([1, 2, 3]))
    records = fold.records(W, NATIVE, Tier.DEVICE)
    assert [r.sequence_hash for r in records] == expected
    assert [r.parent_hash for r in records] == [None, 1, 2]
    assert [type(f) for f in facts] == [BlockStoredFact] * 3
    assert all(fold.holds(W, NATIVE, Tier.DEVICE, h) for h in expected)
    assert fold.inventory_seq == 2


def test_a_store_under_an_unknown_parent_starts_a_new_chain_and_is_counted() -> None:
    s = Stream()
    fold, _ = fold_with(s.batch(W, stored([7, 8], parent=999)))
    records = fold.records(W, NATIVE, Tier.DEVICE)
    local = local_hashes([7, 8])
    assert records[0].sequence_hash == local[0]
    assert records[1].sequence_hash == chain_hash(local[0], local[1])
    assert fold.counters["unknown_parent"] == 1
    assert fold.worker_state(W).counters["unknown_parent"] == 1


def test_copies_one_batch_chained_differently_leave_one_chain_position_however_the_fold_keeps_its_tiers() -> None:
    """Block 2 is stored on disk under a parent not yet held (a new chain) and on device under
    block 1 in the same batch; the host copy that last set its chain position is cleared.
    Which of the two tied copies is then the latest must not depend on the order the fold
    happens to keep its tiers in (here: which tier a harmless earlier removal touched first)."""
    children = []
    for first_touched in (Tier.DISK, Tier.DEVICE):
        s = Stream()
        fold, _ = fold_with(
            s.batch(W, removed([9], tier=first_touched)),
            s.batch(W, stored([2], parent=1, tier=Tier.DISK), stored([1, 2])),
            s.batch(W, stored([1, 2], tier=Tier.HOST)),
            s.batch(W, Cleared(Tier.HOST)),
            s.batch(W, stored([3], parent=2)),
        )
        [child] = [r for r in fold.records(W, NATIVE, Tier.DEVICE) if r.engine_hash == 3]
        children.append(child.sequence_hash)
    # The device copy wins the tie: the child chains under block 1 → 2.
    assert children == [sequence_hashes(local_hashes([1, 2, 3]))[2]] * 2


def test_removing_blocks_and_removing_unknown_blocks() -> None:
    s = Stream()
    fold, facts = fold_with(s.batch(W, stored([1, 2, 3])), s.batch(W, removed([3, 42])))
    assert held_engine_hashes(fold) == [1, 2]
    removals = [f for f in facts if isinstance(f, BlockRemovedFact)]
    assert [(f.record.engine_hash, f.cause, f.stream_seq) for f in removals] == [(3, RemovalCause.REMOVED, 2)]
    assert fold.counters["unknown_remove"] == 1
    assert not fold.holds(W, NATIVE, Tier.DEVICE, sequence_hashes(local_hashes([1, 2, 3]))[2])


def test_tiers_are_separate_inventories() -> None:
    s = Stream()
    fold, _ = fold_with(
        s.batch(W, stored([1, 2]), stored([1, 2], tier=Tier.HOST)),
        s.batch(W, removed([2], tier=Tier.DEVICE)),
    )
    assert held_engine_hashes(fold) == [1]
    assert held_engine_hashes(fold, tier=Tier.HOST) == [1, 2]


def test_cleared_empties_native_inventory_of_that_worker_only() -> None:
    s = Stream()
    fold, facts = fold_with(
        s.batch(W, stored([1, 2]), stored([5], tier=Tier.HOST)),
        s.batch(OTHER, stored([1, 2])),
        s.batch(W, stored([1, 2]), provenance=RETAINED),
        s.batch(W, Cleared()),
    )
    assert all(held_engine_hashes(fold, tier=tier) == [] for tier in Tier)
    assert held_engine_hashes(fold, worker=OTHER) == [1, 2]
    assert held_engine_hashes(fold, provenance=RETAINED) == [1, 2]
    cleared = [f for f in facts if isinstance(f, InventoryClearedFact)]
    assert cleared == [InventoryClearedFact(W, NATIVE, RemovalCause.CLEARED, 4, 3)]


def test_a_publisher_restart_empties_native_inventory_and_starts_the_new_epoch() -> None:
    s = Stream()
    fold, facts = fold_with(
        s.batch(W, stored([1, 2]), epoch=0, seq=10),
        s.batch(W, gap(GapReason.PUBLISHER_RESTART, 11, 0), stored([9]), epoch=1, seq=0),
    )
    assert held_engine_hashes(fold) == [9]
    assert fold.worker_state(W).epoch == 1
    assert InventoryClearedFact(W, NATIVE, RemovalCause.RESTART, 2, 2) in facts
    assert fold.counters["implicit_restart"] == 0


def test_a_new_epoch_without_a_restart_gap_is_still_a_restart() -> None:
    s = Stream()
    fold, facts = fold_with(s.batch(W, stored([1]), epoch=0, seq=3), s.batch(W, stored([2]), epoch=1, seq=0))
    assert held_engine_hashes(fold) == [2]
    assert fold.counters["implicit_restart"] == 1
    assert InventoryClearedFact(W, NATIVE, RemovalCause.RESTART, 2, 1) in facts


def test_a_gap_marks_the_worker_uncertain_until_cleared() -> None:
    s = Stream()
    fold, facts = fold_with(s.batch(W, stored([1])), s.batch(W, gap(GapReason.MISSED)), s.batch(OTHER, stored([1])))
    assert fold.is_uncertain(W) and not fold.is_uncertain(OTHER)
    assert fold.uncertain_workers() == [W]
    assert UncertaintyFact(W, NATIVE, True, "missed", 2) in facts
    # still holds what it held: uncertain is not empty
    assert held_engine_hashes(fold) == [1]
    # a second gap while uncertain changes nothing
    assert fold.apply(*s.batch(W, gap(GapReason.REPLAY_INCOMPLETE))) == []
    assert fold.is_uncertain(W)
    later = fold.apply(*s.batch(W, Cleared()))
    assert UncertaintyFact(W, NATIVE, False, "cleared", 5) in later
    assert not fold.is_uncertain(W) and fold.uncertain_workers() == []


def test_replay_incomplete_marks_uncertain_and_a_restart_resolves_it() -> None:
    s = Stream()
    fold, _ = fold_with(s.batch(W, gap(GapReason.REPLAY_INCOMPLETE), epoch=0))
    assert fold.is_uncertain(W)
    facts = fold.apply(*s.batch(W, gap(GapReason.PUBLISHER_RESTART), epoch=1, seq=0))
    assert UncertaintyFact(W, NATIVE, False, "restart", 2) in facts
    assert not fold.is_uncertain(W)


def test_a_retained_gpu_record_survives_a_native_eviction() -> None:
    s = Stream()
    sequence = sequence_hashes(local_hashes([1, 2]))
    fold, _ = fold_with(
        s.batch(W, stored([1, 2])),
        s.batch(W, stored([1, 2]), provenance=RETAINED),
        s.batch(W, removed([1, 2])),
    )
    assert held_engine_hashes(fold) == []
    assert held_engine_hashes(fold, provenance=RETAINED) == [1, 2]
    assert not any(fold.holds(W, NATIVE, Tier.DEVICE, h) for h in sequence)
    assert all(fold.holds(W, RETAINED, Tier.DEVICE, h) for h in sequence)


def test_a_retained_record_cannot_re_parent_a_native_block() -> None:
    s = Stream()
    fold, facts = fold_with(
        s.batch(W, stored([1, 2, 3])),  # native chain 1 -> 2 -> 3
        s.batch(W, stored([50])),  # another native root
        s.batch(W, stored([3], parent=50), provenance=RETAINED),  # claims 3 hangs under 50
    )
    native = {r.engine_hash: r for r in fold.records(W, NATIVE, Tier.DEVICE)}
    assert native[3].parent_hash == 2
    assert native[3].sequence_hash == sequence_hashes(local_hashes([1, 2, 3]))[2]
    [retained] = fold.records(W, RETAINED, Tier.DEVICE)
    assert retained.conflict and retained.parent_hash == 50  # kept for audit
    assert not fold.holds(W, RETAINED, Tier.DEVICE, retained.sequence_hash)  # ignored by the index
    assert fold.counters["retained_conflict"] == 1
    assert BlockStoredFact(retained) in facts
    # a child stored natively under 3 still chains through the native parent
    fold.apply(*s.batch(W, stored([4], parent=3)))
    native = {r.engine_hash: r for r in fold.records(W, NATIVE, Tier.DEVICE)}
    assert native[4].sequence_hash == sequence_hashes(local_hashes([1, 2, 3, 4]))[3]


def test_a_native_store_demotes_an_earlier_retained_record_that_disagrees() -> None:
    s = Stream()
    fold, _ = fold_with(
        s.batch(W, stored([60])),
        s.batch(W, stored([7], parent=60), provenance=RETAINED),  # retained: 60 -> 7
    )
    [before] = fold.records(W, RETAINED, Tier.DEVICE)
    assert not before.conflict and fold.holds(W, RETAINED, Tier.DEVICE, before.sequence_hash)
    facts = fold.apply(*s.batch(W, stored([7])))  # the engine says 7 is a root
    [after] = fold.records(W, RETAINED, Tier.DEVICE)
    assert after.conflict
    assert RetainedConflictFact(after, 3) in facts
    assert not fold.holds(W, RETAINED, Tier.DEVICE, before.sequence_hash)


def test_an_agreeing_retained_record_is_indexed_beside_the_native_one() -> None:
    s = Stream()
    fold, _ = fold_with(s.batch(W, stored([1, 2])), s.batch(W, stored([2], parent=1), provenance=RETAINED))
    [retained] = fold.records(W, RETAINED, Tier.DEVICE)
    assert not retained.conflict
    assert retained.sequence_hash == sequence_hashes(local_hashes([1, 2]))[1]
    assert fold.counters["retained_conflict"] == 0


def test_a_retained_removal_never_detaches_the_native_copy() -> None:
    s = Stream()
    fold, _ = fold_with(s.batch(W, stored([1])), s.batch(W, removed([1]), provenance=RETAINED))
    assert held_engine_hashes(fold) == [1]
    assert fold.counters["unknown_remove"] == 1


def test_a_retained_cleared_empties_only_retained_inventory() -> None:
    s = Stream()
    fold, facts = fold_with(
        s.batch(W, stored([1])),
        s.batch(W, stored([1]), provenance=RETAINED),
        s.batch(W, Cleared(), provenance=RETAINED),
    )
    assert held_engine_hashes(fold) == [1]
    assert held_engine_hashes(fold, provenance=RETAINED) == []
    assert InventoryClearedFact(W, RETAINED, RemovalCause.CLEARED, 3, 1) in facts


def test_retained_parents_resolve_when_the_engine_no_longer_knows_them() -> None:
    s = Stream()
    fold, _ = fold_with(
        s.batch(W, stored([1]), provenance=RETAINED),
        s.batch(W, stored([2], parent=1)),
    )
    [record] = fold.records(W, NATIVE, Tier.DEVICE)
    assert record.sequence_hash == sequence_hashes(local_hashes([1, 2]))[1]
    assert fold.counters["unknown_parent"] == 0


def test_repeated_batches_and_redeliveries_change_nothing() -> None:
    s = Stream()
    fold = InventoryFold()
    older, _ = s.batch(W, stored([2]), seq=4)
    assert fold.apply(older, 1)
    first, _ = s.batch(W, stored([1]), seq=5)
    assert fold.apply(first, 2)
    assert fold.apply(first, 2) == []  # redelivered stream seq
    assert fold.apply(first, 3) == []  # same engine (epoch, seq) under a new stream seq
    assert fold.apply(older, 4) == []
    stale, _ = s.batch(W, stored([3]), epoch=0, seq=9)
    restart, _ = s.batch(W, gap(GapReason.PUBLISHER_RESTART), epoch=1, seq=0)
    fold.apply(restart, 50)
    assert fold.apply(stale, 100) == []
    assert fold.counters["redelivered"] == 1
    assert fold.counters["duplicate_batch"] == 2
    assert fold.counters["stale_epoch"] == 1


def test_storing_a_held_block_again_is_counted_not_duplicated() -> None:
    s = Stream()
    fold, facts = fold_with(s.batch(W, stored([1, 2])), s.batch(W, stored([1, 2])))
    assert len([f for f in facts if isinstance(f, BlockStoredFact)]) == 2
    assert fold.counters["duplicate_store"] == 2
    assert held_engine_hashes(fold) == [1, 2]


def test_two_engine_hashes_with_one_sequence_hash_are_reference_counted() -> None:
    # e.g. two KV-cache groups announcing the same token block under different engine hashes
    s = Stream()
    fold, _ = fold_with(s.batch(W, stored([1]), stored([1], engine_offset=1000)))
    sequence = local_hashes([1])[0]
    fold.apply(*s.batch(W, removed([1])))
    assert fold.holds(W, NATIVE, Tier.DEVICE, sequence)
    fold.apply(*s.batch(W, removed([1001])))
    assert not fold.holds(W, NATIVE, Tier.DEVICE, sequence)


def test_dp_ranks_are_separate_workers_in_worker_order() -> None:
    s = Stream()
    rank1 = WorkerId("vllm-a", 1)
    fold, _ = fold_with(s.batch(rank1, stored([1])), s.batch(OTHER, stored([1])), s.batch(W, stored([2])))
    assert fold.workers() == [W, rank1, OTHER]
    assert held_engine_hashes(fold, worker=rank1) == [1]
    assert held_engine_hashes(fold) == [2]


def test_the_native_and_retained_streams_of_one_worker_count_sequences_separately() -> None:
    s = Stream()
    fold, _ = fold_with(
        s.batch(W, stored([1]), seq=0),
        s.batch(W, stored([1]), provenance=RETAINED, seq=0),
    )
    assert held_engine_hashes(fold) == [1]
    assert held_engine_hashes(fold, provenance=RETAINED) == [1]
    assert fold.counters["duplicate_batch"] == 0


# --- sequence holes: a batch stored out of order (docs/core.md: a missed range) ------------------


def test_a_batch_stored_after_later_ones_leaves_the_worker_uncertain_and_is_dropped_as_late() -> None:
    # JetStream refused seq 5 but stored 6..8; ingest's resend stored 5 after 8.
    s = Stream()
    fold, facts = fold_over_holes(
        s.batch(W, stored([1]), seq=4),
        s.batch(W, stored([3], parent=2), seq=6),
        s.batch(OTHER, stored([1])),
        s.batch(W, removed([3]), seq=7),
        s.batch(W, stored([4], parent=1), seq=8),
    )
    assert fold.is_uncertain(W) and not fold.is_uncertain(OTHER)
    assert UncertaintyFact(W, NATIVE, True, "hole: seq 5", 2) in facts
    assert [f for f in facts if isinstance(f, UncertaintyFact)] == [UncertaintyFact(W, NATIVE, True, "hole: seq 5", 2)]
    assert fold.counters["sequence_hole"] == 1 and fold.worker_state(W).counters["sequence_hole"] == 1
    late = (stored([2], parent=1), removed([1]))
    assert fold.apply(*s.batch(W, *late, seq=5)) == []
    assert fold.counters["late_batch"] == 1 and fold.counters["duplicate_batch"] == 0
    assert held_engine_hashes(fold) == [1, 4]  # 5's store of 2 and removal of 1 are lost: hence uncertain
    assert fold.is_uncertain(W) and last_seq(fold) == 8
    # the hole is filled: another copy of 5 is a plain duplicate
    assert fold.apply(*s.batch(W, *late, seq=5)) == []
    assert fold.counters["duplicate_batch"] == 1 and fold.counters["late_batch"] == 1
    # uncertainty ends as after any gap: at the next Cleared
    cleared = fold.apply(*s.batch(W, Cleared(), seq=9))
    assert UncertaintyFact(W, NATIVE, False, "cleared", 8) in cleared
    assert not fold.is_uncertain(W)


def test_every_seq_of_a_wider_hole_is_late_once_and_a_seq_applied_before_is_a_duplicate() -> None:
    s = Stream()
    fold, _ = fold_over_holes(s.batch(W, stored([1]), seq=0), s.batch(W, stored([2]), seq=1), s.batch(W, stored([5]), seq=5))
    for seq in (3, 2, 4, 3, 1, 0):
        fold.apply(*s.batch(W, stored([9]), seq=seq))
    assert fold.counters["late_batch"] == 3  # 2, 3 and 4 once each
    assert fold.counters["duplicate_batch"] == 3  # 3 again, and 1 and 0, which were applied
    assert fold.counters["sequence_hole"] == 1
    assert held_engine_hashes(fold) == [1, 2, 5]


def test_a_seq_below_the_first_batch_seen_is_a_hole_noticed_when_it_arrives() -> None:
    # the worker's seq 0 was refused and stored after seq 1: the first batch seen was not
    # the worker's first, which only the late batch shows
    s = Stream()
    fold, facts = fold_with(s.batch(W, stored([1]), seq=1), s.batch(W, stored([2]), seq=2))
    assert not fold.is_uncertain(W) and not [f for f in facts if isinstance(f, UncertaintyFact)]
    assert fold.apply(*s.batch(W, stored([5]), seq=0)) == [UncertaintyFact(W, NATIVE, True, "hole: seq 0", 3)]
    assert fold.counters["late_batch"] == 1 and fold.counters["sequence_hole"] == 1
    assert held_engine_hashes(fold) == [1, 2]
    assert fold.apply(*s.batch(W, stored([5]), seq=0)) == []  # now it was seen: a duplicate
    assert fold.counters["duplicate_batch"] == 1


def test_a_seq_below_the_first_batch_seen_after_a_cleared_is_late_but_harmless() -> None:
    s = Stream()
    fold, _ = fold_with(s.batch(W, stored([1]), seq=40), s.batch(W, Cleared(), seq=41))
    assert fold.apply(*s.batch(W, stored([2]), seq=39)) == []
    assert fold.counters["late_batch"] == 1 and fold.counters["sequence_hole"] == 0
    assert not fold.is_uncertain(W)


def test_the_first_batch_of_a_worker_may_start_at_any_seq_and_epoch() -> None:
    # ingest resumes at JetStream's last seq + 1, retention drops the oldest messages, and a
    # reader may start mid-stream: a worker's first batch is not a hole whatever its seq.
    s = Stream()
    fold, facts = fold_with(
        s.batch(W, stored([1]), epoch=3, seq=1234),
        s.batch(W, stored([1]), provenance=RETAINED, epoch=0, seq=77),
        s.batch(W, stored([2], parent=1), epoch=3, seq=1235),
    )
    assert not fold.is_uncertain(W)
    assert not [f for f in facts if isinstance(f, UncertaintyFact)]
    assert fold.counters["sequence_hole"] == 0


def test_a_new_epoch_restarts_the_sequence_at_zero_without_a_hole() -> None:
    s = Stream()
    fold, _ = fold_with(
        s.batch(W, stored([1]), epoch=0, seq=50),
        s.batch(W, gap(GapReason.PUBLISHER_RESTART, 51, 0), stored([2]), epoch=1, seq=0),
        s.batch(W, stored([3], parent=2), epoch=1, seq=1),
        s.batch(W, stored([4]), epoch=2, seq=0),  # implicit restart, still at 0
    )
    assert not fold.is_uncertain(W)
    assert fold.counters["sequence_hole"] == 0 and fold.counters["implicit_restart"] == 1
    assert held_engine_hashes(fold) == [4]


def test_a_new_epoch_whose_first_batch_was_stored_late_is_a_hole_after_the_restart() -> None:
    # epoch 1's seq 0 (carrying the restart gap) was refused, seq 1 was stored first
    s = Stream()
    fold, facts = fold_with(
        s.batch(W, stored([1]), epoch=0, seq=7),
        s.batch(W, stored([5]), epoch=1, seq=1),
    )
    assert InventoryClearedFact(W, NATIVE, RemovalCause.RESTART, 2, 1) in facts
    assert UncertaintyFact(W, NATIVE, True, "hole: seq 0", 2) in facts
    assert fold.is_uncertain(W) and held_engine_hashes(fold) == [5]
    assert fold.apply(*s.batch(W, gap(GapReason.PUBLISHER_RESTART, 8, 0), stored([4]), epoch=1, seq=0)) == []
    assert fold.counters["late_batch"] == 1
    assert fold.is_uncertain(W)  # seq 0's store of 4 is lost


def test_a_hole_in_an_old_epoch_is_forgotten_its_late_batch_is_stale() -> None:
    s = Stream()
    fold, _ = fold_over_holes(
        s.batch(W, stored([1]), epoch=0, seq=0),
        s.batch(W, stored([2]), epoch=0, seq=2),
        s.batch(W, gap(GapReason.PUBLISHER_RESTART), epoch=1, seq=0),
    )
    assert not fold.is_uncertain(W)  # the restart emptied the cache: nothing is unknown
    assert fold.apply(*s.batch(W, stored([3]), epoch=0, seq=1)) == []
    assert fold.counters["stale_epoch"] == 1 and fold.counters["late_batch"] == 0
    native = fold.worker_state(W).by_provenance[NATIVE]
    assert native.holes == [] and native.unseen_below is None


def test_a_first_batch_past_zero_is_forgotten_at_a_new_epoch() -> None:
    s = Stream()
    fold, _ = fold_with(
        s.batch(W, stored([1]), epoch=0, seq=40),
        s.batch(W, gap(GapReason.PUBLISHER_RESTART), stored([2]), epoch=1, seq=0),
        s.batch(W, stored([3]), epoch=1, seq=1),
    )
    assert fold.apply(*s.batch(W, stored([4]), epoch=1, seq=0)) == []
    assert fold.counters["duplicate_batch"] == 1 and fold.counters["sequence_hole"] == 0
    assert not fold.is_uncertain(W)


def test_a_batch_whose_gap_explains_the_skip_is_uncertain_for_the_gaps_reason_only() -> None:
    # ingest's own account: seqs 3 and 4 missed, the Gap rides on seq 5
    s = Stream()
    fold, facts = fold_with(
        s.batch(W, stored([1]), seq=2),
        s.batch(W, gap(GapReason.MISSED, 3, 5), stored([2]), seq=5),
    )
    assert [f for f in facts if isinstance(f, UncertaintyFact)] == [UncertaintyFact(W, NATIVE, True, "missed", 2)]
    assert fold.counters["sequence_hole"] == 0
    # a skipped seq that does turn up is still told from a repeat
    assert fold.apply(*s.batch(W, stored([3]), seq=4)) == []
    assert fold.counters["late_batch"] == 1


def test_a_restart_gap_on_a_new_epoch_past_zero_keeps_the_replay_gap_in_charge() -> None:
    # a restart noticed late whose replay could not go back to 0: ingest sends both gaps
    s = Stream()
    fold, facts = fold_with(
        s.batch(W, stored([1]), epoch=0, seq=9),
        s.batch(W, gap(GapReason.PUBLISHER_RESTART, 10, 3), gap(GapReason.REPLAY_INCOMPLETE, 0, 3), stored([2]),
                epoch=1, seq=3),
    )
    assert [f for f in facts if isinstance(f, UncertaintyFact)] == [UncertaintyFact(W, NATIVE, True, "replay_incomplete", 2)]
    assert fold.counters["sequence_hole"] == 0 and held_engine_hashes(fold) == [2]


def test_a_hole_while_uncertain_is_counted_without_a_second_uncertainty_fact() -> None:
    s = Stream()
    fold, _ = fold_over_holes(s.batch(W, gap(GapReason.MISSED), seq=0))
    assert fold.apply(*s.batch(W, stored([1]), seq=3)) == [BlockStoredFact(fold.records(W, NATIVE, Tier.DEVICE)[0])]
    assert fold.counters["sequence_hole"] == 1 and fold.is_uncertain(W)


def test_a_cleared_in_the_batch_after_a_hole_ends_the_uncertainty_it_opened() -> None:
    # everything before a Cleared is gone anyway, so the late batch cannot matter any more
    s = Stream()
    fold, facts = fold_over_holes(s.batch(W, stored([1]), seq=0), s.batch(W, Cleared(), stored([2]), seq=2))
    uncertainty = [f for f in facts if isinstance(f, UncertaintyFact)]
    assert uncertainty == [
        UncertaintyFact(W, NATIVE, True, "hole: seq 1", 2),
        UncertaintyFact(W, NATIVE, False, "cleared", 2),
    ]
    assert not fold.is_uncertain(W)
    assert fold.apply(*s.batch(W, stored([3]), seq=1)) == []
    assert fold.counters["late_batch"] == 1 and not fold.is_uncertain(W)


def test_a_hole_in_the_retained_stream_marks_only_that_provenance_uncertain() -> None:
    s = Stream()
    fold, facts = fold_over_holes(
        s.batch(W, stored([1]), seq=0),
        s.batch(W, stored([1]), provenance=RETAINED, seq=0),
        s.batch(W, stored([2], parent=1), seq=1),
        s.batch(W, stored([3]), provenance=RETAINED, seq=2),
    )
    assert UncertaintyFact(W, RETAINED, True, "hole: seq 1", 4) in facts
    assert fold.is_uncertain(W)
    state = fold.worker_state(W)
    assert state.by_provenance[RETAINED].uncertain_since == 4 and state.by_provenance[NATIVE].uncertain_since is None
    # native seq 1 is not retained seq 1: that one is late, not a repeat
    assert fold.apply(*s.batch(W, stored([4]), provenance=RETAINED, seq=1)) == []
    assert fold.counters["late_batch"] == 1 and fold.counters["duplicate_batch"] == 0
    assert fold.apply(*s.batch(W, Cleared(), provenance=RETAINED, seq=3))
    assert not fold.is_uncertain(W)


def test_a_redelivered_stream_seq_is_not_a_second_hole_nor_a_late_batch() -> None:
    s = Stream()
    fold = InventoryFold(hole_wait_messages=0)
    fold.apply(*s.batch(W, stored([1]), seq=0))
    jump = s.batch(W, stored([2]), seq=2)
    assert fold.apply(*jump)
    assert fold.apply(*jump) == []
    late = s.batch(W, stored([3]), seq=1)
    assert fold.apply(*late) == []
    assert fold.apply(*late) == []
    assert fold.counters["redelivered"] == 2
    assert fold.counters["sequence_hole"] == 1 and fold.counters["late_batch"] == 1
    assert fold.counters["duplicate_batch"] == 0


def test_only_the_newest_holes_are_tracked_an_older_ones_late_batch_counts_as_duplicate() -> None:
    s = Stream()
    fold = InventoryFold(hole_wait_messages=0)
    for number in range(TRACKED_HOLES + 2):  # one hole more than is tracked
        fold.apply(*s.batch(W, stored([number + 1]), seq=2 * number))
    assert fold.counters["sequence_hole"] == TRACKED_HOLES + 1
    fold.apply(*s.batch(W, stored([99]), seq=1))  # the first hole, forgotten
    fold.apply(*s.batch(W, stored([99]), seq=3))
    assert fold.counters["duplicate_batch"] == 1 and fold.counters["late_batch"] == 1


def test_a_warm_start_from_a_snapshot_keeps_the_hole_uncertainty_and_the_last_seq() -> None:
    s = Stream()
    head = InventoryFold(hole_wait_messages=0)
    head.apply_all([s.batch(W, stored([1]), seq=0), s.batch(W, stored([2], parent=1), seq=2)])
    restored = decode_snapshot(encode_snapshot(head))
    assert restored.is_uncertain(W) and last_seq(restored) == 2
    # contiguous after the snapshot: no new hole; a later skip still is one
    assert restored.apply(*s.batch(W, stored([3], parent=2), seq=3))
    restored.apply(*s.batch(W, Cleared(), seq=4))
    assert not restored.is_uncertain(W)
    facts = restored.apply(*s.batch(W, stored([4]), seq=6))
    assert UncertaintyFact(W, NATIVE, True, "hole: seq 5", 5) in facts
    assert restored.counters["sequence_hole"] == 2
    # holes are not part of a snapshot: seq 1, skipped before it, now counts as a duplicate
    assert restored.apply(*s.batch(W, stored([5]), seq=1)) == []
    assert restored.counters["duplicate_batch"] == 1 and restored.counters["late_batch"] == 0


def test_a_hole_reason_fits_the_audit_column_for_any_seqs() -> None:
    assert hole_reason(5, 6) == "hole: seq 5"
    assert hole_reason(5, 10) == "hole: seqs 5-9"
    assert hole_reason(2**63, 2**63 + 1) == f"hole: seq {2**63}"
    assert hole_reason(2**63, 2**64 - 1) == f"hole: {2**64 - 1 - 2**63} seqs"
    widest = [hole_reason(0, 2**64 - 1), hole_reason(2**64 - 2, 2**64 - 1), hole_reason(10**9, 10**10)]
    assert all(len(reason) <= REASON_LIMIT for reason in widest)


@settings(deadline=None, max_examples=100)
@given(st.integers(1, 30), st.data())
def test_each_batch_stored_one_place_late_is_one_hole_and_one_late_batch(length: int, data: st.DataObject) -> None:
    # JetStream refusing batch k and storing k+1 first swaps two neighbours of the log
    swapped = data.draw(st.lists(st.integers(0, max(0, length - 2)), unique=True))
    swapped = sorted(k for k in swapped if k + 1 < length)
    swapped = [k for i, k in enumerate(swapped) if i == 0 or k > swapped[i - 1] + 1]  # disjoint pairs
    order = list(range(length))
    for k in swapped:
        order[k], order[k + 1] = order[k + 1], order[k]
    s = Stream()
    fold, _ = fold_over_holes(*(s.batch(W, stored([seq + 1]), seq=seq) for seq in order))
    assert fold.counters["sequence_hole"] == len(swapped)
    assert fold.counters["late_batch"] == len(swapped)
    assert fold.counters["duplicate_batch"] == 0
    assert fold.is_uncertain(W) == bool(swapped)
