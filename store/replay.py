"""What-if replay: the recorded decision requests answered again, under other reuse settings,
over the recorded event timeline (docs/audit.md, "What-if replay").

Each decision in KV_DECISIONS carries the request it answered (`decision_requests`, from the
record's `Kvledger-Request` header) and the inventory seq it was answered at. From SQL, the
replay reads those requests and every native or retained stay on a local tier that overlaps
the window (`block_residency`), then answers each request with the reference model
(`kvledger/reuse.py`) against the inventory as of its own inventory seq, once per settings
file, and judges every answer at its horizon with the quality rule (`store.quality.judge`),
against what was held at the audit's horizon seq: the replayed decisions get the stale-hint
and lost-credit rates they would have had, judged as `decision_quality` judges the recorded
ones.

Deterministic: the lookup budget never runs out (the replay's clock stands still), decisions
are taken in KV_DECISIONS order, and nothing depends on the database beyond the rows read.
What is not replayed: in-flight credit (a decision whose target in-flight credit chose is
answered again by native credit); a request longer than 16 384 blocks is answered on its
recorded first blocks. A decision's inventory seq is a KV_EVENTS seq and the stays' seqs are
ledger seqs: they are mapped through `stream_generations` as known when the decision was
made (equal until the stream first loses messages).
"""

from __future__ import annotations

import bisect
import collections
import math
import struct
from collections.abc import Iterable, Sequence

import attrs
import sqlalchemy as sa

from kvledger import reuse
from kvledger.decision_codec import MAX_RELIED_BLOCKS
from kvledger.events import Provenance, Tier, WorkerId
from kvledger.reuse import Decision, ReuseRequest
from kvledger.settings import ReuseSettings, settings_digest
from store.audit import Query, run
from store.pruning import pruned_through
from store.quality import judge
from store.tables import to_signed

# Each recorded decision in the window with its request, and its horizon seq as the quality
# audit computes it (the seq just before the first event ingested at or after decided_ts +
# :horizon_s; NULL while no event has come that late).
REPLAY_REQUESTS = Query(
    "replay_requests",
    "The decisions of a window with the requests they answered, and each one's horizon seq",
    """SELECT d.stream_seq, d.request_id, d.decided_ts, d.inventory_seq, d.target, d.reason, d.baseline_blocks,
       d.chosen_source, d.chosen_dp_rank, d.chosen_tier, d.chosen_prefix_blocks, d.chosen_transfer_blocks,
       d.chosen_saving_ms, d.target_prefix_blocks,
       r.block_size, r.blocks, r.requested_target, r.fallback, r.local_hashes,
       (SELECT MIN(e.stream_seq) FROM event_log e WHERE e.ingest_ts >= d.decided_ts + :horizon_s) - 1 AS horizon_seq
FROM decisions d
JOIN decision_requests r ON r.stream_seq = d.stream_seq
WHERE d.decided_ts >= :from_ts AND d.decided_ts < :to_ts
ORDER BY d.stream_seq;""",
    ("horizon_s", "from_ts", "to_ts"),
)

# Decisions of the window recorded without their request (before migration 0007): not replayed.
UNREPLAYABLE = Query(
    "replay_unreplayable",
    "Decisions of a window recorded without their request",
    """SELECT COUNT(*) AS decisions
FROM decisions d
WHERE d.decided_ts >= :from_ts AND d.decided_ts < :to_ts
  AND NOT EXISTS (SELECT 1 FROM decision_requests r WHERE r.stream_seq = d.stream_seq);""",
    ("from_ts", "to_ts"),
)

# Every stay on a local tier that was open at some seq of [:first_seq, :last_seq]. A retained
# stay stops being indexed at conflict_since (kvledger/precedence.py, rule 1).
REPLAY_STAYS = Query(
    "replay_stays",
    "Stays on local tiers open at some seq of a window: the timeline a replay answers and judges against",
    """SELECT publisher, dp_rank, provenance, tier, sequence_hash, stored_seq, removed_seq, conflict_since
FROM block_residency
WHERE tier IN ('device', 'host', 'disk') AND NOT unresolved
  AND stored_seq <= :last_seq AND (removed_seq IS NULL OR removed_seq > :first_seq);""",
    ("first_seq", "last_seq"),
)

REPLAY_WORKERS = Query(
    "replay_workers",
    "Every worker and the first seq it was seen at",
    """SELECT publisher, dp_rank, first_stream_seq
FROM workers
ORDER BY publisher, dp_rank;""",
    (),
)

KV_EVENTS_GENERATIONS = Query(
    "replay_generations",
    "Where KV_EVENTS lost acknowledged messages: from which stream seq its seqs map to ledger seqs, since when",
    """SELECT generation, first_stream_seq, ledger_offset, detected_ts
FROM stream_generations
WHERE stream = 'KV_EVENTS'
ORDER BY generation;""",
    (),
)

QUERIES = (REPLAY_REQUESTS, UNREPLAYABLE, REPLAY_STAYS, REPLAY_WORKERS, KV_EVENTS_GENERATIONS)

_NATIVE, _RETAINED = Provenance.NATIVE, Provenance.RETAINED
_FOREVER = math.inf


class ReplayRefused(RuntimeError):
    """The window cannot be replayed from SQL (its history was pruned); the message says why."""


class Timeline:
    """The recorded stays, as the inventory at any seq: `at(seq)` is an `InventoryView` for the model."""

    def __init__(self, stays: Iterable[dict], workers: Iterable[dict]) -> None:
        spans: dict[tuple, list[tuple[float, float]]] = collections.defaultdict(list)
        for stay in stays:
            end = _FOREVER if stay["removed_seq"] is None else stay["removed_seq"]
            provenance = Provenance(stay["provenance"])
            if provenance is _RETAINED and stay["conflict_since"] is not None:
                end = min(end, stay["conflict_since"])
            if stay["stored_seq"] < end:
                key = (stay["publisher"], stay["dp_rank"], provenance, Tier(stay["tier"]), stay["sequence_hash"])
                spans[key].append((stay["stored_seq"], end))
        # A block stored and evicted over and over has hundreds of stays: held at a seq is then
        # (stays stored by it) - (stays ended by it) > 0, two binary searches.
        self._spans: dict[tuple, tuple[list[float], list[float]]] = {
            key: (sorted(start for start, _ in found), sorted(end for _, end in found)) for key, found in spans.items()
        }
        # Workers in worker order (publisher, then dp_rank), each from the seq it was first seen.
        known = sorted(((row["publisher"], row["dp_rank"]), row["first_stream_seq"] or 0) for row in workers)
        self._workers = [(WorkerId(publisher, rank), first) for (publisher, rank), first in known]

    def held(self, worker: WorkerId, provenance: Provenance, tier: Tier, sequence_hash: int, seq: int) -> bool:
        """Whether some stay of the block was open at `seq`: `stored_seq <= seq < removed_seq`."""
        spans = self._spans.get((worker.publisher, worker.dp_rank, provenance, tier, to_signed(sequence_hash)))
        if spans is None:
            return False
        starts, ends = spans
        return bisect.bisect_right(starts, seq) > bisect.bisect_right(ends, seq)

    def at(self, seq: int) -> _InventoryAt:
        return _InventoryAt(self, seq)

    def workers_at(self, seq: int) -> list[WorkerId]:
        return [worker for worker, first in self._workers if first <= seq]


class _InventoryAt:
    """The inventory as of one seq, as `kvledger.reuse.decide` reads it (each answer is looked up once)."""

    def __init__(self, timeline: Timeline, seq: int) -> None:
        self.timeline, self.inventory_seq = timeline, seq
        self._held: dict[tuple, bool] = {}

    def workers(self) -> list[WorkerId]:
        return self.timeline.workers_at(self.inventory_seq)

    def uncertain_workers(self) -> list[WorkerId]:
        return []  # reported by answers, never weighed by the model

    def holds(self, worker: WorkerId, provenance: Provenance, tier: Tier, sequence_hash: int) -> bool:
        key = (worker, provenance, tier, sequence_hash)
        held = self._held.get(key)
        if held is None:
            held = self._held[key] = self.timeline.held(worker, provenance, tier, sequence_hash, self.inventory_seq)
        return held


def _still() -> float:
    return 0.0


def answer_again(view: reuse.InventoryView, request: ReuseRequest, settings: ReuseSettings) -> Decision:
    """The answer decide gives `request` without in-flight credit: as asked, then, when the request named no
    target and nobody had credit, for its fallback (decide/inflight.py). The lookup budget never runs out."""
    decision = reuse.decide(view, request, settings, clock=_still, backend="replay")
    if request.target is None and request.fallback is not None and decision.credited_blocks == 0 \
            and decision.target != request.fallback.name:
        decision = reuse.decide(view, attrs.evolve(request, target=request.fallback), settings, clock=_still,
                                backend="replay")
    return decision


@attrs.frozen
class Outcome:
    """One decision's answer (recorded, or replayed under some settings), reduced to what the report counts."""

    target: str | None
    reason: str
    source: WorkerId | None
    tier: Tier | None
    prefix_blocks: int
    transfer_blocks: int
    saving_ms: float
    stale: bool | None  # None: no hint judged (nothing chosen, or horizon not reached)
    lost: bool | None  # None: no credit judged

    @property
    def choice(self) -> tuple:
        return (self.target, self.source, self.tier, self.prefix_blocks)


@attrs.define
class Tally:
    """Per settings: what its answers would have done, judged at the horizon."""

    name: str
    digest: str
    decisions: int = 0
    changed: int = 0
    hints: int = 0
    estimated_ttft_saved_ms: float = 0.0
    blocks_moved: int = 0
    tokens_moved: int = 0
    judged_hints: int = 0
    stale_hints: int = 0
    fresh_ttft_saved_ms: float = 0.0
    credited: int = 0
    lost_credit: int = 0
    pending: int = 0
    changes: list[dict] = attrs.field(factory=list)

    def add(self, outcome: Outcome, block_size: int, recorded: Outcome | None, request_id: str, pending: bool) -> None:
        self.decisions += 1
        self.pending += pending
        if outcome.source is not None:
            self.hints += 1
            self.estimated_ttft_saved_ms += outcome.saving_ms
            self.blocks_moved += outcome.transfer_blocks
            self.tokens_moved += outcome.transfer_blocks * block_size
        if outcome.stale is not None:
            self.judged_hints += 1
            self.stale_hints += outcome.stale
            if not outcome.stale:
                self.fresh_ttft_saved_ms += outcome.saving_ms
        if outcome.lost is not None:
            self.credited += 1
            self.lost_credit += outcome.lost
        if recorded is not None and outcome.choice != recorded.choice:
            self.changed += 1
            self.changes.append({"request_id": request_id, "recorded": _choice_text(recorded),
                                 "replayed": _choice_text(outcome)})

    def row(self) -> dict:
        return {
            "settings": self.name, "digest": self.digest, "decisions": self.decisions, "changed": self.changed,
            "hints": self.hints, "estimated_ttft_saved_ms": self.estimated_ttft_saved_ms,
            "blocks_moved": self.blocks_moved, "tokens_moved": self.tokens_moved,
            "judged_hints": self.judged_hints, "stale_hints": self.stale_hints,
            "stale_hint_rate": self.stale_hints / self.judged_hints if self.judged_hints else None,
            "fresh_ttft_saved_ms": self.fresh_ttft_saved_ms, "credited": self.credited,
            "lost_credit": self.lost_credit,
            "lost_credit_rate": self.lost_credit / self.credited if self.credited else None,
            "pending": self.pending,
        }


def _choice_text(outcome: Outcome) -> str:
    chosen = "no transfer" if outcome.source is None else \
        f"{outcome.source.name} {outcome.tier.value} {outcome.prefix_blocks} blocks"
    return f"target {outcome.target}: {chosen} ({outcome.reason})"


@attrs.frozen
class Report:
    """A replay's answer: the recorded decisions' own figures, then one tally per settings."""

    window: tuple[float, float]
    horizon_s: float
    source: str  # where the timeline came from
    replayed: int
    unreplayable: int
    truncated: int
    recorded: Tally
    settings: tuple[Tally, ...]


class _Generations:
    """KV_EVENTS seqs to ledger seqs, with the losses a decision could have known of."""

    def __init__(self, rows: Sequence[dict]) -> None:
        self._rows = list(rows)

    def ledger_seq(self, inventory_seq: int, decided_ts: float) -> int:
        offset = 0
        for row in self._rows:  # by generation: the newest known one at or below the seq wins
            if row["detected_ts"] <= decided_ts and row["first_stream_seq"] <= inventory_seq:
                offset = row["ledger_offset"]
        return inventory_seq + offset


def replay(
    connection: sa.Connection, settings: Sequence[tuple[str, ReuseSettings]], *, horizon_s: float,
    from_ts: float = -math.inf, to_ts: float = math.inf, placed: bool = False,
) -> Report:
    """Answer every recorded request decided in [from_ts, to_ts) again under each of `settings` (name, value).

    `placed`: a request naming no target is answered for its fallback, where its load balancer placed it, as
    shadow decisions rank it (decide/shadow.py): what reuse would transfer there. Otherwise as it was asked."""
    window = {"from_ts": max(from_ts, -1e18), "to_ts": min(to_ts, 1e18)}
    decisions = run(connection, REPLAY_REQUESTS, horizon_s=horizon_s, **window)
    unreplayable = run(connection, UNREPLAYABLE, **window)[0]["decisions"]
    generations = _Generations(run(connection, KV_EVENTS_GENERATIONS))
    seqs = [generations.ledger_seq(row["inventory_seq"], row["decided_ts"]) for row in decisions]
    first = min(seqs, default=0)
    last = max([*seqs, *(row["horizon_seq"] for row in decisions if row["horizon_seq"] is not None)], default=0)
    pruned = pruned_through(connection)
    if decisions and pruned and pruned >= first:
        raise ReplayRefused(f"history at or before KV_EVENTS seq {pruned} was pruned (store.history_retention_s); "
                            f"the window's first decision was answered at seq {first}: replay a later window")
    timeline = Timeline(run(connection, REPLAY_STAYS, first_seq=first, last_seq=last), run(connection, REPLAY_WORKERS))
    recorded = Tally("recorded", "")
    tallies = [Tally(name, settings_digest(value)) for name, value in settings]
    truncated = 0
    for row, seq in zip(decisions, seqs):
        request = _request_of(row)
        if placed and request.target is None and request.fallback is not None:
            request = attrs.evolve(request, target=request.fallback)
        truncated += row["blocks"] > len(request.local_hashes)
        sequence = request.sequence_hashes
        horizon = row["horizon_seq"]

        at_horizon = timeline.at(horizon if horizon is not None else 0)

        def native_at_horizon(worker: WorkerId, tier: Tier, sequence_hash: int) -> bool:
            return at_horizon.holds(worker, _NATIVE, tier, sequence_hash)

        mine = _recorded_outcome(row, sequence, native_at_horizon)
        recorded.add(mine, request.block_size, None, row["request_id"], horizon is None)
        view = timeline.at(seq)
        for (_, value), tally in zip(settings, tallies):
            decision = answer_again(view, request, value)
            tally.add(_outcome(decision, sequence, native_at_horizon if horizon is not None else None),
                      request.block_size, mine, row["request_id"], horizon is None)
    return Report((from_ts, to_ts), horizon_s, "sql", len(decisions), unreplayable, truncated, recorded, tuple(tallies))


def _request_of(row: dict) -> ReuseRequest:
    data = bytes(row["local_hashes"])
    local = struct.unpack(f"<{len(data) // 8}Q", data)
    target = WorkerId.parse(row["requested_target"]) if row["requested_target"] else None
    fallback = WorkerId.parse(row["fallback"]) if row["fallback"] else None
    return ReuseRequest(row["request_id"], local, row["block_size"], target, None, fallback)


def _relied(sequence: Sequence[int], first: int, end: int) -> Sequence[int]:
    # The blocks a record names (at most MAX_RELIED_BLOCKS), as store keeps them in decision_blocks.
    return sequence[first:min(end, MAX_RELIED_BLOCKS)]


def _outcome(decision: Decision, sequence: Sequence[int], holds) -> Outcome:
    """A replayed answer's outcome; its relied-on blocks are those store would have kept for it."""
    chosen = decision.chosen
    target = WorkerId.parse(decision.target) if decision.target else None
    target_prefix = decision.overlaps[decision.target].any if decision.target in decision.overlaps else 0
    source_hashes = _relied(sequence, decision.baseline_blocks, chosen.prefix_blocks) if chosen else ()
    stale, lost = (None, None) if holds is None else judge(
        holds, chosen.worker if chosen else None, chosen.tier if chosen else None, source_hashes, target,
        _relied(sequence, 0, target_prefix))
    return Outcome(decision.target, decision.reason, chosen.worker if chosen else None, chosen.tier if chosen else None,
                   chosen.prefix_blocks if chosen else 0, chosen.transfer_blocks if chosen else 0,
                   chosen.saving_ms if chosen else 0.0, stale, lost)


def _recorded_outcome(row: dict, sequence: Sequence[int], holds) -> Outcome:
    """The recorded decision's outcome, its relied-on blocks as `decision_blocks` holds them."""
    source = WorkerId(row["chosen_source"], row["chosen_dp_rank"]) if row["chosen_source"] is not None else None
    tier = Tier(row["chosen_tier"]) if source is not None else None
    target = WorkerId.parse(row["target"]) if row["target"] else None
    source_hashes = _relied(sequence, row["baseline_blocks"], row["chosen_prefix_blocks"]) if source else ()
    stale, lost = (None, None) if row["horizon_seq"] is None else judge(
        holds, source, tier, source_hashes, target, _relied(sequence, 0, row["target_prefix_blocks"] or 0))
    return Outcome(row["target"], row["reason"], source, tier, row["chosen_prefix_blocks"] or 0,
                   row["chosen_transfer_blocks"] or 0, row["chosen_saving_ms"] or 0.0, stale, lost)
