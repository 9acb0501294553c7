"""Decision quality as it happens: was each decision still true at its horizon?

`kvledger audit quality` answers this from SQL for any horizon. Here store answers it for
one horizon (`store.quality_horizon_s`) as the events arrive, without querying: each
decision the decisions projector commits waits, with the blocks it relies on, until the
events projector is about to apply the first event ingested at or after decided_ts +
horizon. The events fold then holds exactly the inventory as of the seq before it — the
audit's horizon seq — and is asked whether the chosen source still holds the transferred
blocks on its tier (else the hint was *stale*) and whether the target still holds its
credited blocks on some local tier (else the credit was *lost*). Removals of chosen blocks
on the way give the time from the decision to the first eviction.

The fold answers with the residency rule of `kvledger/residency.py`; the SQL audit counts a
block held while any KV-cache group holds it, so for hybrid models the two can differ.
Decisions that reach store after their horizon has passed in the fold (as after a restart,
when the fold is rebuilt from SQL past them) are counted as not judged (`late`); the SQL
audit judges them all.
"""

from __future__ import annotations

import collections
import heapq
import itertools
from collections.abc import Callable, Iterable, Sequence

import attrs

from kvledger.events import Provenance, Tier, WorkerId
from kvledger.fold import BlockRemovedFact, InventoryClearedFact, InventoryFold
from kvledger.reuse import LOCAL_TIERS
from kvledger.runtime.metrics import MetricSet
from store import tables

NATIVE = Provenance.NATIVE
BlockAt = tuple[WorkerId, Tier, int]  # (worker, tier, sequence hash)
# How long, in stream time beyond the horizon, removals are remembered for decisions that
# reach store after the events projector has already passed their inventory seq.
_REMEMBER_EXTRA_S = 1.0


class QualityMetrics:
    """The decision-quality families, declared on store's metrics."""

    def __init__(self, metrics: MetricSet) -> None:
        self.hints = metrics.counter(
            "kvledger_store_decision_hints", "Decisions with a chosen source, judged at the quality horizon",
            ["worker", "tier"])
        self.stale_hints = metrics.counter(
            "kvledger_store_decision_stale_hints",
            "Judged hints whose source no longer held every transferred block at the horizon", ["worker", "tier"])
        self.credits = metrics.counter(
            "kvledger_store_decision_credits", "Decisions whose target held a credited prefix, judged at the horizon",
            ["worker", "reason"])
        self.lost_credits = metrics.counter(
            "kvledger_store_decision_lost_credits",
            "Judged credits whose target no longer held every credited block at the horizon", ["worker", "reason"])
        self.first_eviction = metrics.histogram(
            "kvledger_store_decision_first_eviction_seconds",
            "Time from a decision to the first eviction of a chosen block, within the horizon", ["tier"],
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0))
        self.unjudged = metrics.counter(
            "kvledger_store_decision_quality_unjudged", "Decisions the quality metrics could not judge, by why", ["reason"])
        self.watched = metrics.counter(
            "kvledger_store_decision_quality_watched", "Decisions taken in to wait for their horizon")


NativeHolds = Callable[[WorkerId, Tier, int], bool]  # (worker, tier, sequence hash) held natively at the horizon


def judge(
    holds: NativeHolds, source: WorkerId | None, source_tier: Tier | None, source_hashes: Sequence[int],
    target: WorkerId | None, target_hashes: Sequence[int],
) -> tuple[bool | None, bool | None]:
    """The quality rule at a decision's horizon (docs/audit.md, "Decision quality"), given what was natively held
    there: (stale, lost). The hint is stale when the source no longer held every transferred block on its tier;
    the credit is lost when the target no longer held every credited block on some local tier. None: nothing to
    judge (no chosen source, or nothing credited). The live metrics ask the fold; a what-if replay
    (store/replay.py) asks the recorded timeline at the audit's horizon seq."""
    stale = None
    if source is not None and source_hashes:
        stale = not all(holds(source, source_tier, h) for h in source_hashes)
    lost = None
    if target is not None and target_hashes:
        lost = not all(any(holds(target, tier, h) for tier in LOCAL_TIERS) for h in target_hashes)
    return stale, lost


@attrs.define(eq=False)
class _Pending:
    stream_seq: int
    decided_ts: float
    deadline: float
    inventory_seq: int
    reason: str
    source: WorkerId | None
    source_tier: Tier | None
    source_hashes: tuple[int, ...]
    target: WorkerId | None
    target_hashes: tuple[int, ...]
    first_eviction_ts: float | None = None


class QualityTracker:
    """Fed by both projectors: `decisions_committed` with the decisions rows, and around each
    applied KV_EVENTS batch `before_event` (judging what is due) and `after_event` (removals)."""

    def __init__(self, metrics: QualityMetrics, horizon_s: float, max_pending: int) -> None:
        self.metrics = metrics
        self.horizon_s = horizon_s
        self.max_pending = max_pending
        self.stream_ts: float | None = None  # ingest time of the last event applied
        self.stream_seq = 0
        self._due: list[tuple[float, int, _Pending]] = []  # heap by deadline
        self._order = itertools.count()
        self._watchers: dict[BlockAt, list[_Pending]] = collections.defaultdict(list)
        # (ingest ts, stream seq, facts) of recently applied batches, by stream time: their removals
        # and clears are looked through only for a decision that comes after them (`_replay_recent`)
        self._recent: collections.deque[tuple[float, int, Sequence[object]]] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._due)

    # the decisions side

    def decisions_committed(self, rows: Iterable[tuple[object, dict]]) -> None:
        decisions: dict[int, dict] = {}
        blocks: dict[tuple[int, str], list[tuple[int, int]]] = collections.defaultdict(list)
        for table, row in rows:
            if table is tables.decisions:
                decisions[row["stream_seq"]] = row
            elif table is tables.decision_blocks:
                blocks[row["stream_seq"], row["role"]].append((row["position"], tables.to_unsigned(row["sequence_hash"])))
        for seq, row in decisions.items():
            source_hashes = tuple(h for _, h in sorted(blocks.get((seq, "source"), ())))
            target_hashes = tuple(h for _, h in sorted(blocks.get((seq, "target"), ())))
            if source_hashes or target_hashes:
                self._take(row, source_hashes, target_hashes)

    def _take(self, row: dict, source_hashes: tuple[int, ...], target_hashes: tuple[int, ...]) -> None:
        deadline = row["decided_ts"] + self.horizon_s
        if self.stream_ts is not None and self.stream_ts >= deadline:
            self.metrics.unjudged.labels("late").inc()
            return
        if len(self._due) >= self.max_pending:
            self.metrics.unjudged.labels("too_many_pending").inc()
            return
        source = WorkerId(row["chosen_source"], row["chosen_dp_rank"]) if source_hashes else None
        target = WorkerId(row["target_publisher"], row["target_dp_rank"]) if target_hashes else None
        pending = _Pending(
            row["stream_seq"], row["decided_ts"], deadline, row["inventory_seq"], row["reason"], source,
            Tier(row["chosen_tier"]) if source is not None else None, source_hashes, target, target_hashes,
        )
        if source is not None:
            for sequence_hash in source_hashes:
                self._watchers[source, pending.source_tier, sequence_hash].append(pending)
            self._replay_recent(pending)
        heapq.heappush(self._due, (deadline, next(self._order), pending))
        self.metrics.watched.inc()

    def _replay_recent(self, pending: _Pending) -> None:
        """Removals the events projector applied after the decision's inventory seq, before the decision arrived."""
        watched = set(pending.source_hashes)
        source, source_tier = pending.source, pending.source_tier
        recent = [(ts, facts) for ts, seq, facts in self._recent if seq > pending.inventory_seq]
        for ts, facts in recent:
            for fact in facts:
                if type(fact) is BlockRemovedFact:
                    record = fact.record
                    if record.provenance is NATIVE and record.tier is source_tier and record.sequence_hash in watched \
                            and record.worker == source:
                        pending.first_eviction_ts = ts
                        return
        for ts, facts in recent:
            for fact in facts:
                if type(fact) is InventoryClearedFact and fact.provenance is NATIVE and fact.worker == source \
                        and fact.tier in (None, source_tier):
                    pending.first_eviction_ts = ts
                    return

    # the events side

    def resume_at(self, ingest_ts: float | None) -> None:
        """The events fold was (re)built from SQL, as of an event ingested at `ingest_ts` (None: no
        event yet). Decisions whose horizon lies at or before it can no longer be judged on it."""
        self.stream_ts = ingest_ts
        while ingest_ts is not None and self._due and self._due[0][0] <= ingest_ts:
            _, _, pending = heapq.heappop(self._due)
            self._unwatch(pending)
            self.metrics.unjudged.labels("late").inc()

    def before_event(self, ingest_ts: float, fold: InventoryFold) -> None:
        """Judge every decision whose horizon this event reaches, on the fold as of the seq before it."""
        while self._due and self._due[0][0] <= ingest_ts:
            _, _, pending = heapq.heappop(self._due)
            self._judge(pending, fold)

    def after_event(self, facts: Sequence[object], stream_seq: int, ingest_ts: float) -> None:
        self.stream_ts, self.stream_seq = ingest_ts, stream_seq
        if facts:
            # Kept whole (the fold made the list for this batch alone): a decision that comes later
            # looks through them, so a batch nobody waits on costs one append, not a look at each fact.
            self._recent.append((ingest_ts, stream_seq, facts))
            if self._due:
                for fact in facts:
                    if type(fact) is BlockRemovedFact:
                        record = fact.record
                        if record.provenance is NATIVE:
                            self._removed((record.worker, record.tier, record.sequence_hash), stream_seq, ingest_ts)
                    elif type(fact) is InventoryClearedFact and fact.provenance is NATIVE:
                        self._worker_cleared(fact.worker, fact.tier, stream_seq, ingest_ts)
        self._forget_before(ingest_ts - self.horizon_s - _REMEMBER_EXTRA_S)

    def _removed(self, block: BlockAt, stream_seq: int, ingest_ts: float) -> None:
        for pending in self._watchers.get(block, ()):
            if pending.first_eviction_ts is None and stream_seq > pending.inventory_seq:
                pending.first_eviction_ts = ingest_ts

    def _worker_cleared(self, worker: WorkerId, tier: Tier | None, stream_seq: int, ingest_ts: float) -> None:
        for _, _, pending in self._due:
            if pending.source == worker and tier in (None, pending.source_tier) and pending.first_eviction_ts is None \
                    and stream_seq > pending.inventory_seq:
                pending.first_eviction_ts = ingest_ts

    def _forget_before(self, ts: float) -> None:
        recent = self._recent
        while recent and recent[0][0] < ts:
            recent.popleft()

    def _judge(self, pending: _Pending, fold: InventoryFold) -> None:
        metrics = self.metrics
        stale, lost = judge(lambda worker, tier, h: fold.holds(worker, NATIVE, tier, h), pending.source,
                            pending.source_tier, pending.source_hashes, pending.target, pending.target_hashes)
        if stale is not None:
            worker, tier = pending.source.name, pending.source_tier.value
            metrics.hints.labels(worker, tier).inc()
            if stale:
                metrics.stale_hints.labels(worker, tier).inc()
            if pending.first_eviction_ts is not None:
                metrics.first_eviction.labels(tier).observe(max(pending.first_eviction_ts - pending.decided_ts, 0.0))
        if pending.source is not None:
            self._unwatch(pending)
        if lost is not None:
            worker = pending.target.name
            metrics.credits.labels(worker, pending.reason).inc()
            if lost:
                metrics.lost_credits.labels(worker, pending.reason).inc()

    def _unwatch(self, pending: _Pending) -> None:
        for sequence_hash in pending.source_hashes:
            block = (pending.source, pending.source_tier, sequence_hash)
            watchers = self._watchers.get(block)
            if watchers is not None:
                watchers.remove(pending)
                if not watchers:
                    del self._watchers[block]
