"""Decision verdicts as they happen: was each decision still true at its horizon?

store judges every decision once per configured horizon (`store.quality_horizons_ms`) as the
events arrive, without querying: each decision the decisions projector commits waits, with
the blocks it relies on, until the events projector is about to write the first event
ingested at or after decided_ts + horizon. The events fold then holds exactly the inventory
as of the seq before it — the audit's horizon seq — and is asked whether the chosen source
still holds the transferred blocks on its tier (else the hint was *stale*), whether the
target still holds its credited blocks on some local tier (else the credit was *lost*), the
shadow source its would-be transfer, and the target its in-flight blocks. Removals of the
relied-on blocks on the way (each stay's end, clears included) give the times
`store/verdicts.py`'s SQL judge derives from the stays. The verdict is a row of
`decision_verdicts` in the transaction that writes that event, so it is written exactly
once: a transaction that fails takes its verdicts with it, and the fold rebuilt from SQL
keeps waiting only on the decisions whose window it sees whole (taken at or after the seq it
was rebuilt at); the SQL judge settles the others (`store/verdicts.py`).

A block counts as held while any KV-cache group holds it natively (a stay in SQL), the SQL
judge's rule, so the two always agree. Decisions that reach store after their horizon has
passed in the fold (as after a restart) are left to the SQL judge (`late`), as are those
whose inventory seq lies before the removals the tracker still remembers.
"""

from __future__ import annotations

import collections
import heapq
import itertools
from collections.abc import Callable, Iterable, Sequence

import attrs

from kvledger.core.events import EventBatch, Provenance, Removed, Stored, Tier, WorkerId, worker_of
from kvledger.core.fold import BlockRemovedFact, BlockStoredFact, InventoryClearedFact, InventoryFold
from kvledger.core.reuse import LOCAL_TIERS
from kvledger.runtime.metric_set import MetricSet

NATIVE = Provenance.NATIVE
# The sequence hashes (unsigned, in position order) a decision relies on, by role: "source", "target",
# "shadow_source", "inflight" (the roles of decision_blocks rows).
RelyOn = dict[str, Sequence[int]]
# A stay's end as the tracker sees it: (worker, tier, sequence hash, stored seq).
StayEnd = tuple[WorkerId, Tier, int, int]
# How long, in stream time beyond the horizon, removals are remembered for decisions that
# reach store after the events projector has already passed their inventory seq.
_REMEMBER_EXTRA_S = 1.0
_ONE_TIER = {tier.value: (tier,) for tier in Tier}  # a decision row's tier name → its role's tiers


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
            "kvledger_store_decision_quality_unjudged",
            "Decisions the events fold could not judge, by why (the SQL judge settles them)", ["reason"])
        self.verdicts = metrics.counter(
            "kvledger_store_decision_verdicts", "Decision verdicts written to SQL, by who judged them (fold | sql)",
            ["judged_by"])
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
    (store/whatif_reference.py) asks the recorded timeline at the audit's horizon seq."""
    stale = None
    if source is not None and source_hashes:
        stale = not all(holds(source, source_tier, h) for h in source_hashes)
    lost = None
    if target is not None and target_hashes:
        lost = not all(any(holds(target, tier, h) for tier in LOCAL_TIERS) for h in target_hashes)
    return stale, lost



@attrs.define(eq=False, slots=True, frozen=True)
class _Role:
    """The blocks one decision relies on one worker for, on which tiers."""

    worker: WorkerId
    tiers: tuple[Tier, ...]
    hashes: tuple[int, ...]


@attrs.define(eq=False, slots=True)
class _Pending:
    stream_seq: int
    decided_ts: float
    deadline: float
    horizon_ms: float
    inventory_seq: int
    reason: str
    source: _Role | None
    target: _Role | None
    shadow: _Role | None
    inflight: _Role | None
    with_metrics: bool  # the metrics' horizon
    order: int = 0  # its place in the tracker's queues


def _role(hashes: Sequence[int], worker: WorkerId | None, tiers: tuple[Tier, ...]) -> _Role | None:
    if worker is None:
        return None
    return _Role(worker, tiers, tuple(hashes))


def _stay_ends(facts: Sequence[object], open_before: dict | None) -> list[StayEnd]:
    """The native stays `facts` ended, each once: removals, and the blocks a clear found open.

    `open_before` is the batch's worker's native records before the batch (taken only for a
    batch that can clear); the facts' stores and removals are played over it in order, so a
    clear ends exactly the stays open at that moment, as SQL's clear statement does.
    """
    ends: list[StayEnd] = []
    mirror = None
    for fact in facts:
        kind = type(fact)
        if kind is BlockRemovedFact:
            record = fact.record
            if record.provenance is NATIVE:
                ends.append((record.worker, record.tier, record.sequence_hash, record.stream_seq))
                if mirror is not None:
                    mirror.get(record.tier, {}).pop(record.key, None)
        elif kind is BlockStoredFact:
            if mirror is not None and fact.record.provenance is NATIVE:
                record = fact.record
                mirror.setdefault(record.tier, {})[record.key] = record
        elif kind is InventoryClearedFact and fact.provenance is NATIVE:
            if mirror is None:
                mirror = {tier: dict(records) for tier, records in (open_before or {}).items()}
            tiers = list(mirror) if fact.tier is None else [fact.tier]
            for tier in tiers:
                for record in mirror.pop(tier, {}).values():
                    ends.append((record.worker, record.tier, record.sequence_hash, record.stream_seq))
    return ends


def may_clear(batch: EventBatch, fold: InventoryFold) -> bool:
    """Whether applying `batch` can clear its worker's native inventory (a clear, a gap, a new epoch)."""
    if batch.provenance is not NATIVE:
        return False
    for event in batch.events:
        kind = type(event)
        if kind is not Stored and kind is not Removed:
            return True
    state = fold.worker_state(batch.worker)
    return state is not None and state.epoch is not None and batch.epoch != state.epoch


def open_native_records(batch: EventBatch, fold: InventoryFold) -> dict | None:
    """The worker's native records before `batch`, by tier, when the batch can clear them (else None)."""
    if not may_clear(batch, fold):
        return None
    state = fold.worker_state(batch.worker)
    if state is None:
        return None
    return {tier: dict(records) for tier, records in state.by_provenance[NATIVE].records.items() if records}


class QualityTracker:
    """Fed by both projectors: `decisions_committed` with the decisions rows; around each KV_EVENTS batch
    the events projector writes, `due` (what it settles), `judge` (on the fold before it), `settled` or
    `put_back`, and `after_event` (the stays the batch ended)."""

    def __init__(self, metrics: QualityMetrics, horizons_ms: Sequence[float], max_pending: int,
                 metrics_horizon_ms: float | None = None) -> None:
        self.metrics = metrics
        self.horizons_ms = tuple(horizons_ms)
        # The metrics follow one horizon (StoreSettings.metrics_horizon_ms; by default the first).
        self.metrics_horizon_ms = metrics_horizon_ms if metrics_horizon_ms is not None else (
            self.horizons_ms[0] if self.horizons_ms else None)
        self.max_pending = max_pending
        self.stream_ts: float | None = None  # the highest ingest time of the events applied
        self.stream_seq = 0
        self._due: list[tuple[float, int, _Pending]] = []  # heap by deadline
        self._order = itertools.count()
        # (ingest ts, stream seq, stays ended) of recently applied batches that ended stays, oldest first: what
        # to forget when they pass out of every horizon
        self._recent: collections.deque[tuple[float, int, list[StayEnd]]] = collections.deque()
        self._covered_after = 0  # every batch past this seq that ended stays is in _recent
        # The inventory seqs of the decisions waiting, least first (a heap; a judged one's entry goes when it
        # reaches the top): no end after the least is forgotten while its decision waits.
        self._waiting_seqs: list[tuple[int, int]] = []
        self._judged: set[int] = set()  # entries of _waiting_seqs whose decision was judged
        # The same ends by sequence hash, oldest first, as (stream seq, ingest ts, (publisher, dp_rank), tier,
        # stored seq): a decision looks up its own blocks' ends when it is judged. Nothing is registered per
        # decision (a decision relies on tens of blocks and most see no end within its horizon), and the keys are
        # the bare hash and a plain tuple for the worker (both hash and compare in C; a WorkerId is a Python call).
        self._recent_ends: dict[int, collections.deque[tuple[int, float, tuple[str, int], Tier, int]]] = {}

    @property
    def waiting(self) -> int:
        return len(self._due)

    # the decisions side

    def decisions_committed(self, decisions: Sequence[dict], rely_on: Sequence[RelyOn]) -> None:
        """Decisions' rows just committed, each with the sequence hashes it relies on by role."""
        if not self.horizons_ms:
            return
        for row, relied in zip(decisions, rely_on):
            for horizon_ms in self.horizons_ms:
                self._take(row, relied, horizon_ms)

    def _take(self, row: dict, relied: RelyOn, horizon_ms: float) -> None:
        deadline = row["decided_ts"] + horizon_ms / 1000
        if self.stream_ts is not None and self.stream_ts >= deadline:
            self.metrics.unjudged.labels("late").inc()
            return
        if row["inventory_seq"] < self._covered_after:
            self.metrics.unjudged.labels("before_remembered").inc()
            return
        if len(self._due) >= self.max_pending:
            self.metrics.unjudged.labels("too_many_pending").inc()
            return
        target = self._worker(row["target_publisher"], row["target_dp_rank"])
        source_hashes, target_hashes = relied.get("source"), relied.get("target")
        shadow_hashes, inflight_hashes = relied.get("shadow_source"), relied.get("inflight")
        pending = _Pending(
            row["stream_seq"], row["decided_ts"], deadline, horizon_ms, row["inventory_seq"], row["reason"],
            _role(source_hashes, self._worker(row["chosen_source"], row["chosen_dp_rank"]), _ONE_TIER[row["chosen_tier"]])
            if source_hashes else None,
            _role(target_hashes, target, LOCAL_TIERS) if target_hashes else None,
            _role(shadow_hashes, self._worker(row.get("shadow_source"), row.get("shadow_dp_rank")),
                  _ONE_TIER[row["shadow_tier"]]) if shadow_hashes else None,
            _role(inflight_hashes, target, LOCAL_TIERS) if inflight_hashes else None,
            horizon_ms == self.metrics_horizon_ms,
        )
        order = next(self._order)
        pending.order = order
        heapq.heappush(self._due, (deadline, order, pending))
        heapq.heappush(self._waiting_seqs, (pending.inventory_seq, order))
        if pending.with_metrics:
            self.metrics.watched.inc()

    @staticmethod
    def _worker(publisher: str | None, dp_rank: int | None) -> WorkerId | None:
        return None if publisher is None else worker_of(publisher, dp_rank)

    # the events side

    def resume_at(self, ingest_ts: float | None, stream_seq: int = 0) -> None:
        """The events fold was (re)built from SQL, as of `stream_seq`, whose newest event was ingested at
        `ingest_ts` (None: no event yet). A decision waiting whose window began at or after `stream_seq` keeps
        waiting: the new fold applies every batch that could end one of its stays, as for a decision taken in
        now (at a store's start, the decisions projector may hand decisions in before the events fold is
        first built). The others are left to the SQL judge (what the old fold saw of their windows went with
        it), as is every decision before `stream_seq` from now on."""
        kept = []
        for entry in self._due:
            pending = entry[2]
            if pending.inventory_seq >= stream_seq and (ingest_ts is None or ingest_ts < pending.deadline):
                kept.append(entry)
            elif pending.with_metrics:
                self.metrics.unjudged.labels("late").inc()
        heapq.heapify(kept)
        self._due = kept
        self._waiting_seqs = [(pending.inventory_seq, pending.order) for _, _, pending in kept]
        heapq.heapify(self._waiting_seqs)
        self._judged.clear()
        self._recent.clear()
        self._recent_ends.clear()
        self.stream_ts = ingest_ts
        self.stream_seq = self._covered_after = stream_seq

    def due(self, ingest_ts: float) -> list[_Pending]:
        """The decisions whose horizon a batch ingested at `ingest_ts` reaches, taken off the queue."""
        settled = []
        queue = self._due
        while queue and queue[0][0] <= ingest_ts:
            settled.append(heapq.heappop(queue)[2])
        return settled

    def put_back(self, pendings: Sequence[_Pending]) -> None:
        """Decisions `due` gave for a batch that is not written after all: they wait for the next."""
        for pending in pendings:
            heapq.heappush(self._due, (pending.deadline, pending.order, pending))

    def judge(self, pendings: Sequence[_Pending], fold: InventoryFold, horizon_seq: int) -> list[tuple]:
        """The verdict rows of `pendings` on the fold as of `horizon_seq` (the seq before the settling batch)."""
        ends = self._recent_ends
        return [_verdict(pending, fold, ends, horizon_seq) for pending in pendings]

    def settled(self, pendings: Sequence[_Pending], rows: Sequence[tuple]) -> None:
        """`pendings`' verdicts are in the transaction: stop watching them, and count them in the metrics."""
        metrics = self.metrics
        judged = self._judged
        for pending, row in zip(pendings, rows):
            judged.add(pending.order)
            if not pending.with_metrics:
                continue
            stale, lost = row[3], row[8]
            if stale is not None:
                worker, tier = pending.source.worker.name, pending.source.tiers[0].value
                metrics.hints.labels(worker, tier).inc()
                if stale:
                    metrics.stale_hints.labels(worker, tier).inc()
                if row[7] is not None:
                    metrics.first_eviction.labels(tier).observe(max(row[7] / 1000, 0.0))
            if lost is not None:
                worker = pending.target.worker.name
                metrics.credits.labels(worker, pending.reason).inc()
                if lost:
                    metrics.lost_credits.labels(worker, pending.reason).inc()
        if rows:
            metrics.verdicts.labels("fold").inc(len(rows))
        self._drop_judged()

    def _drop_judged(self) -> None:
        """Take the judged decisions off the top of the inventory-seq heap (the rest go as they reach it)."""
        waiting, judged = self._waiting_seqs, self._judged
        while waiting and waiting[0][1] in judged:
            judged.discard(heapq.heappop(waiting)[1])

    def after_event(self, facts: Sequence[object], stream_seq: int, ingest_ts: float,
                    open_before: dict | None = None) -> None:
        """A batch was applied: note the stays it ended for the decisions waiting on them."""
        if self.stream_ts is None or ingest_ts > self.stream_ts:
            self.stream_ts = ingest_ts
        self.stream_seq = stream_seq
        if facts:
            ends = _stay_ends(facts, open_before)
            if ends:
                self._recent.append((ingest_ts, stream_seq, ends))
                by_hash = self._recent_ends
                worker = ends[0][0]  # a batch's facts are its worker's
                key = (worker.publisher, worker.dp_rank)
                for _, tier, sequence_hash, stored_seq in ends:
                    kept = by_hash.get(sequence_hash)
                    if kept is None:
                        kept = by_hash[sequence_hash] = collections.deque()
                    kept.append((stream_seq, ingest_ts, key, tier, stored_seq))
        if self.horizons_ms:
            self._forget_before(self.stream_ts - max(self.horizons_ms) / 1000 - _REMEMBER_EXTRA_S)

    def _forget_before(self, ts: float) -> None:
        """Forget the ends of batches ingested before `ts`, but none after a waiting decision's inventory seq."""
        recent = self._recent
        if not recent or recent[0][0] >= ts:  # (most batches: nothing old enough to forget)
            return
        self._drop_judged()
        waiting = self._waiting_seqs
        least_waiting = waiting[0][0] if waiting else None
        by_hash = self._recent_ends
        while recent and recent[0][0] < ts and (least_waiting is None or recent[0][1] <= least_waiting):
            _, seq, ends = recent.popleft()
            self._covered_after = seq
            for _, _, sequence_hash, _ in ends:  # each hash's oldest entries are this batch's
                kept = by_hash[sequence_hash]
                kept.popleft()
                if not kept:
                    del by_hash[sequence_hash]


def _held_counts(fold: InventoryFold, worker: WorkerId, tiers: tuple[Tier, ...]) -> list[dict]:
    """The worker's native record counts by sequence hash, one dict per (tier, KV-cache group) of `tiers`: a
    block is held while one of them counts it (`InventoryFold.holds_in_any_group`, the worker looked up once)."""
    state = fold.worker_state(worker)
    if state is None:
        return []
    held = state.by_provenance[NATIVE].held
    return [counts for tier in tiers for counts in (held.get(tier) or {}).values() if counts]


def _gone(role: _Role, fold: InventoryFold) -> list[int]:
    """The role's blocks (sequence hashes) its worker no longer holds on any of its tiers. (The fold drops a
    count when it reaches 0, so a hash it counts is held.) Filtered in C: this runs for every role judged."""
    gone: Iterable[int] = role.hashes
    for counts in _held_counts(fold, role.worker, role.tiers):
        gone = list(itertools.filterfalse(counts.__contains__, gone))
        if not gone:
            break
    return list(gone)


def _after_ms(ts: float | None, decided_ts: float) -> float | None:
    return None if ts is None else (ts - decided_ts) * 1000


def _judged(role: _Role | None, fold: InventoryFold, ends: dict, inventory_seq: int, decided_ts: float,
            first_wanted: bool = True) -> tuple:
    """(verdict, blocks, gone, gone_after_ms, first_eviction_ms) of one role, as the SQL judge computes them:
    gone_after_ms from the earliest of the gone blocks' last stay ends after the inventory seq, first_eviction_ms
    from the first end of a stay open at the inventory seq (any of the role's blocks, where `first_wanted`)."""
    if role is None or not role.hashes:
        return None, 0, 0, None, None
    gone = _gone(role, fold)
    gone_after = first = None
    hashes = role.hashes
    # Only the role's blocks that ended a stay lately matter (most roles: none), each hash once; without the
    # first eviction, only those gone.
    ended = ends.keys() & hashes if ends and (first_wanted or gone) else None
    if ended:
        tiers, worker = role.tiers, (role.worker.publisher, role.worker.dp_rank)
        gone_hashes = set(gone)
        for sequence_hash in (ended if first_wanted else ended & gone_hashes):
            last = None
            # newest first: only the ends after the inventory seq count, and a hash shared by many workers'
            # prompts keeps a long tail of older ones
            for seq, ts, ended_worker, tier, stored_seq in reversed(ends[sequence_hash]):
                if seq <= inventory_seq:
                    break
                if ended_worker != worker or tier not in tiers:
                    continue
                if last is None or ts > last:
                    last = ts
                if stored_seq <= inventory_seq and (first is None or ts < first):
                    first = ts
            if last is not None and sequence_hash in gone_hashes and (gone_after is None or last < gone_after):
                gone_after = last
    return (int(bool(gone)), len(hashes), len(gone), _after_ms(gone_after, decided_ts), _after_ms(first, decided_ts))


def _verdict(pending: _Pending, fold: InventoryFold, ends: dict, horizon_seq: int) -> tuple:
    decided_ts, inventory_seq = pending.decided_ts, pending.inventory_seq
    stale, source_blocks, source_gone, source_after, first_eviction = _judged(
        pending.source, fold, ends, inventory_seq, decided_ts)
    lost, target_blocks, target_gone, target_after, _ = _judged(
        pending.target, fold, ends, inventory_seq, decided_ts, first_wanted=False)
    shadow_stale, shadow_blocks, shadow_gone, shadow_after, shadow_first = _judged(
        pending.shadow, fold, ends, inventory_seq, decided_ts)
    inflight = pending.inflight
    inflight_blocks = len(inflight.hashes) if inflight is not None else 0
    inflight_gone = len(_gone(inflight, fold)) if inflight is not None else 0
    return (
        pending.stream_seq, pending.horizon_ms, horizon_seq, stale, source_blocks, source_gone, source_after,
        first_eviction, lost, target_blocks, target_gone, target_after, shadow_stale, shadow_blocks, shadow_gone,
        shadow_after, shadow_first, inflight_blocks, inflight_gone, "fold",
    )
