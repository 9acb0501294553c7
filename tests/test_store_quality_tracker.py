"""The live quality tracker on a real fold, for decisions that reach store after the evictions they must see.

The decisions projector and the events projector run apart, so a decision is often committed
after the events projector already applied removals past its inventory seq. The tracker keeps
recent batches' facts for that, and looks through them only when such a decision comes.
"""

from __future__ import annotations

import pytest

from builders import stored
from kvledger.core.events import Cleared, EventBatch, Provenance, Removed, Tier, WorkerId
from kvledger.core.fold import InventoryFold
from kvledger.store.projector import StoreMetrics
from kvledger.store.quality import QualityTracker, open_native_records

HORIZON_S = 0.5
SOURCE, OTHER, TARGET = WorkerId("source"), WorkerId("other"), WorkerId("target")


class Feed:
    """A fold and the tracker around it, fed as the events projector feeds them."""

    def __init__(self) -> None:
        self.fold = InventoryFold()
        self.metrics = StoreMetrics()
        self.tracker = QualityTracker(self.metrics.quality, [HORIZON_S * 1000], 1000, HORIZON_S * 1000)
        self.verdicts: list[tuple] = []
        self.seq = 0
        self.engine_seqs: dict[WorkerId, int] = {}

    def apply(self, worker: WorkerId, ingest_ts: float, *events) -> int:
        self.seq += 1
        engine_seq = self.engine_seqs[worker] = self.engine_seqs.get(worker, -1) + 1
        batch = EventBatch(worker, 0, engine_seq, ingest_ts, ingest_ts, Provenance.NATIVE, events)
        settling = self.tracker.due(ingest_ts)
        verdicts = self.tracker.judge(settling, self.fold, self.seq - 1)
        open_before = open_native_records(batch, self.fold)
        facts, accepted = self.fold.begin(batch, self.seq)
        assert accepted
        for event in events:
            self.fold.apply_event(worker, Provenance.NATIVE, event, self.seq, facts)
        self.tracker.after_event(facts, self.seq, ingest_ts, open_before)
        self.tracker.settled(settling, verdicts)
        self.verdicts += verdicts
        return self.seq

    def sequence_hashes(self, worker: WorkerId, engine_hashes: list[int]) -> list[int]:
        records = self.fold.worker_state(worker).by_provenance[Provenance.NATIVE].records[Tier.DEVICE]
        return [records[h].sequence_hash for h in engine_hashes]

    def decide(self, stream_seq: int, decided_ts: float, inventory_seq: int, source_hashes: list[int]) -> None:
        row = {
            "stream_seq": stream_seq, "decided_ts": decided_ts, "inventory_seq": inventory_seq, "reason": "chosen",
            "chosen_source": SOURCE.publisher, "chosen_dp_rank": 0, "chosen_tier": "device",
            "target_publisher": TARGET.publisher, "target_dp_rank": 0,
        }
        self.tracker.decisions_committed([row], [{"source": source_hashes}])

    def sample(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize("evicted_by", ["removal", "clear"])
def test_a_decision_committed_after_its_source_evicted_is_stale_with_the_eviction_time(evicted_by: str) -> None:
    feed = Feed()
    before = feed.apply(SOURCE, 10.00, stored([1, 2, 3]))
    feed.apply(OTHER, 10.01, stored([1, 2]))
    hashes = feed.sequence_hashes(SOURCE, [1, 2])
    if evicted_by == "removal":
        feed.apply(OTHER, 10.05, Removed(Tier.DEVICE, (2,)))  # another worker's removal of the same block: not it
        feed.apply(SOURCE, 10.10, Removed(Tier.DEVICE, (2,)))
    else:
        feed.apply(SOURCE, 10.10, Cleared(Tier.DEVICE))
    feed.decide(1, decided_ts=10.02, inventory_seq=before, source_hashes=hashes)  # committed only now
    feed.apply(OTHER, 10.60, stored([7]))  # the first event past the horizon: judged before it
    assert feed.sample("kvledger_store_decision_hints_total", worker="source", tier="device") == 1
    assert feed.sample("kvledger_store_decision_stale_hints_total", worker="source", tier="device") == 1
    assert feed.sample("kvledger_store_decision_first_eviction_seconds_sum", tier="device") == pytest.approx(0.08)


def test_evictions_before_the_inventory_seq_or_past_the_memory_are_not_the_decisions() -> None:
    feed = Feed()
    feed.apply(SOURCE, 10.00, stored([1, 2, 3]))
    hashes = feed.sequence_hashes(SOURCE, [1, 2])
    feed.apply(SOURCE, 10.01, Removed(Tier.DEVICE, (3,)))  # not a chosen block
    seen = feed.apply(SOURCE, 10.02, Removed(Tier.DEVICE, (2,)))  # at or before the decision's inventory seq
    # Chosen on an inventory that already lacked block 2: stale at its horizon, but evicted by nobody after it.
    feed.decide(1, decided_ts=10.03, inventory_seq=seen, source_hashes=hashes)
    feed.apply(OTHER, 10.60, stored([7]))
    assert feed.sample("kvledger_store_decision_hints_total", worker="source", tier="device") == 1
    assert feed.sample("kvledger_store_decision_stale_hints_total", worker="source", tier="device") == 1
    assert feed.sample("kvledger_store_decision_first_eviction_seconds_count", tier="device") == 0

    # A decision older than the horizon plus a second of stream time is late: not judged at all.
    feed.apply(SOURCE, 12.00, Removed(Tier.DEVICE, (1,)))
    feed.decide(2, decided_ts=10.04, inventory_seq=seen, source_hashes=[hashes[0]])
    assert feed.sample("kvledger_store_decision_quality_unjudged_total", reason="late") == 1


def test_a_decision_already_waiting_sees_the_eviction_as_it_is_applied() -> None:
    feed = Feed()
    before = feed.apply(SOURCE, 10.00, stored([1, 2, 3]))
    hashes = feed.sequence_hashes(SOURCE, [1, 2, 3])
    feed.decide(1, decided_ts=10.00, inventory_seq=before, source_hashes=hashes)
    feed.apply(SOURCE, 10.20, Removed(Tier.DEVICE, (3,)))
    feed.apply(SOURCE, 10.30, Removed(Tier.DEVICE, (1,)))  # the first eviction was 3's
    feed.apply(OTHER, 10.50, stored([7]))
    assert feed.sample("kvledger_store_decision_stale_hints_total", worker="source", tier="device") == 1
    assert feed.sample("kvledger_store_decision_first_eviction_seconds_sum", tier="device") == pytest.approx(0.20)
