"""Snapshots: restoring then folding the rest equals folding everything."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.core.events import Cleared, GapReason, Provenance, Tier, WorkerId
from kvledger.core.fold import InventoryFold
from kvledger.core.snapshot import SnapshotError, decode_snapshot, encode_snapshot
from builders import Stream, gap, removed, stored

WORKERS = [WorkerId("a"), WorkerId("a", 1), WorkerId("b")]

EVENT = st.one_of(
    st.builds(lambda ids, parent, tier: stored(ids, parent=parent, tier=tier),
              st.lists(st.integers(1, 30), min_size=1, max_size=4, unique=True),
              st.one_of(st.none(), st.integers(1, 30)), st.sampled_from([Tier.DEVICE, Tier.HOST])),
    st.builds(lambda ids, tier: removed(ids, tier=tier), st.lists(st.integers(1, 30), max_size=4), st.sampled_from([Tier.DEVICE, Tier.HOST])),
    st.just(Cleared()),
    st.builds(gap, st.sampled_from([GapReason.MISSED, GapReason.REPLAY_INCOMPLETE])),
)
STEP = st.tuples(st.sampled_from(WORKERS), st.sampled_from(list(Provenance)), st.lists(EVENT, min_size=1, max_size=3))


def state_of(fold: InventoryFold) -> tuple:
    return (
        fold.inventory_seq,
        sorted(fold.counters.items()),
        list(fold.iter_records()),
        [(w, fold.worker_state(w).epoch, fold.is_uncertain(w), sorted(fold.worker_state(w).counters.items())) for w in fold.workers()],
    )


@settings(deadline=None, max_examples=60)
@given(st.lists(STEP, min_size=1, max_size=25), st.data())
def test_snapshot_then_rest_equals_folding_everything(steps: list, data: st.DataObject) -> None:
    stream = Stream()
    batches = [stream.batch(worker, *events, provenance=provenance) for worker, provenance, events in steps]
    cut = data.draw(st.integers(0, len(batches)))
    whole = InventoryFold()
    whole.apply_all(batches)
    head = InventoryFold()
    head.apply_all(batches[:cut])
    restored = decode_snapshot(encode_snapshot(head))
    assert state_of(restored) == state_of(head)
    restored.apply_all(batches[cut:])
    assert state_of(restored) == state_of(whole)
    for worker in WORKERS:
        for record in whole.iter_records():
            assert restored.holds(worker, record.provenance, record.tier, record.sequence_hash) == whole.holds(
                worker, record.provenance, record.tier, record.sequence_hash)


def test_a_broken_snapshot_is_refused_clearly() -> None:
    with pytest.raises(SnapshotError, match="malformed kvledger snapshot"):
        decode_snapshot(b"nonsense")
