"""A hole mid-stream waited for and healed (docs/core.md, "Holes healed"): the batches after it held back
until the missing ones come, then applied in engine order, as if nothing had been lost."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.core.events import Cleared, Gap, GapReason, Provenance, Tier, WorkerId
from kvledger.core.fold import HOLE_MAX_HELD, HoleToFetch, InventoryFold, UncertaintyFact
from kvledger.core.snapshot import decode_snapshot, encode_snapshot
from builders import Stream, removed, stored

NATIVE = Provenance.NATIVE
W = WorkerId("vllm-a")
OTHER = WorkerId("vllm-b")


def inventory(fold: InventoryFold, worker: WorkerId = W) -> list[tuple]:
    """Every record of the worker, as (tier, engine hash, sequence hash, parent hash)."""
    return sorted((record.tier.value, record.engine_hash, record.sequence_hash, record.parent_hash)
                  for provenance in Provenance for tier in Tier for record in fold.records(worker, provenance, tier))


def engine_batches() -> list[tuple]:
    """Seqs 0..7 of one worker: a chain stored, partly removed, stored again."""
    return [
        (stored([1, 2]),), (stored([3], parent=2),), (removed([3]),), (stored([4, 5], parent=2),),
        (stored([6], parent=5),), (removed([1, 2]),), (stored([7], parent=6), removed([4])), (stored([8], parent=7),),
    ]


def in_order() -> InventoryFold:
    s = Stream()
    fold = InventoryFold()
    fold.apply_all([s.batch(W, *events, seq=seq) for seq, events in enumerate(engine_batches())])
    return fold


def test_the_batches_after_a_hole_wait_for_it_and_the_fold_ends_as_if_nothing_was_lost() -> None:
    s = Stream()
    fold = InventoryFold()
    batches = engine_batches()
    fold.apply_all([s.batch(W, *batches[seq], seq=seq) for seq in range(3)])
    before = inventory(fold)
    # Seq 3 is missing from the stream: 4..7 come and are held back, the worker uncertain meanwhile.
    facts = fold.apply_all([s.batch(W, *batches[seq], seq=seq) for seq in range(4, 8)])
    assert facts == [UncertaintyFact(W, NATIVE, True, "hole: seq 3", 4)]
    assert fold.is_uncertain(W) and inventory(fold) == before
    assert fold.take_holes() == [HoleToFetch(W, NATIVE, 0, 3, 4)] and fold.take_holes() == []
    assert fold.counters["held_batch"] == 4 and fold.counters["sequence_hole"] == 1
    # Another worker goes on meanwhile.
    assert fold.apply(*s.batch(OTHER, stored([1])))
    # Seq 3 fetched again lands later in the stream: it and the held ones apply, in engine order, at its seq.
    facts = fold.apply(*s.batch(W, *batches[3], seq=3))
    assert UncertaintyFact(W, NATIVE, False, "hole healed", s.stream_seq) in facts
    assert not fold.is_uncertain(W) and inventory(fold) == inventory(in_order())
    assert fold.counters["healed_hole"] == 1 and fold.worker_state(W).by_provenance[NATIVE].seq == 7
    # What was held and is fetched again once more is a duplicate.
    assert fold.apply(*s.batch(W, *batches[5], seq=5)) == []
    assert fold.counters["duplicate_batch"] == 1


def test_a_hole_ingest_cannot_fill_is_a_gap_the_held_batches_apply_after_it_and_the_worker_stays_uncertain() -> None:
    s = Stream()
    fold = InventoryFold()
    batches = engine_batches()
    fold.apply_all([s.batch(W, *batches[seq], seq=seq) for seq in (0, 1, 2, 5, 6, 7)])
    assert fold.take_holes() == [HoleToFetch(W, NATIVE, 0, 3, 5)]
    # The engine no longer buffers seqs 3 and 4: ingest says so with a Gap(stream_lost) at seq 4.
    fold.apply(*s.batch(W, Gap(3, 5, GapReason.STREAM_LOST), seq=4))
    assert fold.is_uncertain(W) and fold.worker_state(W).by_provenance[NATIVE].seq == 7
    assert fold.counters["held_batch"] == 3 and fold.counters["healed_hole"] == 1
    # The held batches applied over the loss (seq 4 stored 6): 7 and 8 stored, 1 and 2 removed.
    engines = {engine for _, engine, _, _ in inventory(fold)}
    assert {7, 8} <= engines and not engines & {1, 2, 6}


def test_a_hole_waited_for_too_long_is_given_up_the_held_batches_apply_and_the_late_one_is_dropped() -> None:
    s = Stream()
    fold = InventoryFold(hole_wait_messages=3)
    over = InventoryFold(hole_wait_messages=0)
    batches = engine_batches()
    stream = [s.batch(W, *batches[seq], seq=seq) for seq in (0, 1, 2, 4, 5)]
    stream += [s.batch(OTHER, stored([9])) for _ in range(3)]
    stream += [s.batch(W, *batches[6], seq=6), s.batch(W, *batches[7], seq=7), s.batch(W, *batches[3], seq=3)]
    fold.apply_all(stream)
    over.apply_all(stream)
    assert fold.counters["hole_given_up"] == 1 and fold.counters["late_batch"] == 1
    assert fold.is_uncertain(W) and inventory(fold) == inventory(over)


def test_too_many_held_batches_give_the_hole_up() -> None:
    s = Stream()
    fold = InventoryFold()
    fold.apply(*s.batch(W, stored([1]), seq=0))
    fold.apply_all([s.batch(W, stored([10 + seq]), seq=seq) for seq in range(2, 3 + HOLE_MAX_HELD)])
    assert fold.counters["hole_given_up"] == 1
    assert fold.worker_state(W).by_provenance[NATIVE].seq == 2 + HOLE_MAX_HELD and fold.is_uncertain(W)
    assert len(inventory(fold)) == 2 + HOLE_MAX_HELD


def test_a_new_epoch_drops_what_was_held_behind_a_hole_of_the_old_one() -> None:
    s = Stream()
    fold = InventoryFold()
    fold.apply_all([s.batch(W, stored([1]), seq=0), s.batch(W, stored([2], parent=1), seq=2)])
    fold.apply(*s.batch(W, Gap(3, 3, GapReason.PUBLISHER_RESTART), stored([5]), epoch=1, seq=0))
    assert [engine for _, engine, _, _ in inventory(fold)] == [5]
    assert fold.counters["stale_epoch"] == 1 and not fold.is_uncertain(W)


def test_a_snapshot_keeps_what_is_held_and_the_restored_fold_heals_the_same() -> None:
    s = Stream()
    fold = InventoryFold()
    batches = engine_batches()
    fold.apply_all([s.batch(W, *batches[seq], seq=seq) for seq in (0, 1, 2, 4, 5, 6, 7)])
    restored = decode_snapshot(encode_snapshot(fold))
    assert restored.is_uncertain(W) and inventory(restored) == inventory(fold)
    late = s.batch(W, *batches[3], seq=3)
    fold.apply(*late)
    restored.apply(*late)
    assert inventory(restored) == inventory(fold) == inventory(in_order()) and not restored.is_uncertain(W)


def test_a_cleared_inventory_after_a_hole_is_not_held_and_the_late_batch_is_dropped() -> None:
    s = Stream()
    fold = InventoryFold()
    fold.apply_all([s.batch(W, stored([1]), seq=0), s.batch(W, Cleared(), seq=2), s.batch(W, stored([2]), seq=3)])
    assert [engine for _, engine, _, _ in inventory(fold)] == [2] and not fold.is_uncertain(W)
    assert fold.apply(*s.batch(W, stored([3], parent=1), seq=1)) == []
    assert fold.counters["late_batch"] == 1 and [engine for _, engine, _, _ in inventory(fold)] == [2]


@settings(max_examples=60, deadline=None)
@given(st.permutations(range(1, 8)))
def test_any_order_of_one_workers_batches_folds_to_the_in_order_inventory(order) -> None:
    """However KV_EVENTS stored seqs 1..7 (seq 0 first: it starts the worker), within the wait the fold
    ends exactly where the in-order fold does, and certain."""
    s = Stream()
    fold = InventoryFold()
    batches = engine_batches()
    fold.apply(*s.batch(W, *batches[0], seq=0))
    for seq in order:
        fold.apply(*s.batch(W, *batches[seq], seq=seq))
    assert inventory(fold) == inventory(in_order()) and not fold.is_uncertain(W)


def test_a_batch_that_clears_every_tier_ends_the_wait_the_batches_before_it_no_longer_matter() -> None:
    s = Stream()
    fold = InventoryFold()
    fold.apply_all([s.batch(W, stored([1]), seq=0), s.batch(W, stored([2], parent=1), seq=2),
                    s.batch(W, stored([3], parent=2), seq=3)])
    assert fold.is_uncertain(W) and [engine for _, engine, _, _ in inventory(fold)] == [1]
    # seq 5 clears everything: 1 and 4 are not waited for, the held 2 and 3 are dropped, 6 after it applies.
    fold.apply_all([s.batch(W, stored([6]), seq=6), s.batch(W, Cleared(), stored([5]), seq=5)])
    assert [engine for _, engine, _, _ in inventory(fold)] == [5, 6] and not fold.is_uncertain(W)
    assert fold.counters["late_batch"] == 2 and fold.worker_state(W).by_provenance[NATIVE].seq == 6
    # seq 1 or 4 coming now is late: dropped.
    assert fold.apply(*s.batch(W, stored([7]), seq=4)) == []
