"""What-if replay: the recorded decision requests answered again, under other reuse settings,
over the recorded event timeline (docs/audit.md, "What-if replay").

Each decision in KV_DECISIONS carries the request it answered (`decision_requests`, from the
record's `Kvledger-Request` header) and the inventory seq it was answered at. From SQL
(`replay`), the replay reads those requests and every native or retained stay on a local tier
that overlaps the window (`block_residency`); from the streams (`replay_stream`, for a window
whose SQL history was pruned), it reads the records of KV_DECISIONS and folds KV_EVENTS from
its first seq. Either way it answers each request with the reference model
(`kvledger/core/reuse.py`) against the inventory as of its own inventory seq, once per settings
file, and judges every answer at its horizon with the quality rule (`store.quality.judge`),
against what was held at the audit's horizon seq: the replayed decisions get the stale-hint
and lost-credit rates they would have had, judged as `decision_quality` judges the recorded
ones. Both sources tally in one place (`_report`), so they give the same report.

Deterministic: the lookup budget never runs out (the replay's clock stands still), decisions
are taken in KV_DECISIONS order, and nothing depends on the database beyond the rows read.
What is not replayed: in-flight credit (a decision whose target in-flight credit chose is
answered again by native credit); a request longer than 16 384 blocks is answered on its
recorded first blocks. From SQL, a decision's inventory seq is a KV_EVENTS seq and the stays'
seqs are ledger seqs: they are mapped through `stream_generations` as known when the decision
was made (equal until the stream first loses messages); the stream's fold needs no mapping.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import gc
import math
import operator
import struct
from collections.abc import Iterable, Sequence

import attrs
import msgspec
import numba
import numpy as np
import sqlalchemy as sa
from nats.js import JetStreamContext

from kvledger.core import reuse
from kvledger.core.decision_codec import (
    ANSWER_DECODER, MAX_RELIED_BLOCKS, RELIED_PREFIX_HEADER, REQUEST_HEADER, relied_prefix_from_header,
    request_from_header,
)
from kvledger.core.events import (
    EVENTS_SUBJECT_PREFIX, EventBatch, Provenance, RecordError, Tier, WorkerId, decode_batch, worker_of,
)
from kvledger.core.fold import InventoryFold
from kvledger.core.reuse import Decision, ReuseRequest
from kvledger.core.settings import ReuseSettings, StreamSettings, settings_digest
from kvledger.runtime.streams import DECISIONS_SUBJECT
from kvledger.store import tables
from kvledger.store.audit import Query, run
from kvledger.store.pruning import DECISIONS_PRUNED, pruned_through
from kvledger.store.quality import judge
from kvledger.store.tables import STAYS_FLAGGED, to_signed
from kvledger.store.verdicts import first_seq_at_or_after

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

# The same without the horizon seq, which `read_window` finds from `replay_ingest_times` instead: the
# correlated MIN above scans event_log once per decision (a replay's time grew with decisions × events).
# `read_columns` runs it as a LEFT JOIN without its ORDER BY: one statement reads the window's decisions and
# counts those without a request (`replay_unreplayable`'s) in the same snapshot, and it sorts the rows itself:
# they come in decided_ts order off the index, nearly the seqs' order, which Python sorts in one pass where
# SQLite builds a B-tree. (Read apart as rows and matched by seq, the two tables took longer; a window of much of
# an SQLite ledger is read apart as aggregated texts, `_scanned_window`.)
_REPLAY_DECISIONS_JOINED = """SELECT d.stream_seq, d.request_id, d.decided_ts, d.inventory_seq, d.target, d.reason, d.baseline_blocks,
       d.chosen_source, d.chosen_dp_rank, d.chosen_tier, d.chosen_prefix_blocks, d.chosen_transfer_blocks,
       d.chosen_saving_ms, d.target_prefix_blocks,
       r.block_size, r.blocks, r.requested_target, r.fallback, r.local_hashes
FROM decisions d
{join} decision_requests r ON r.stream_seq = d.stream_seq
WHERE d.decided_ts >= :from_ts AND d.decided_ts < :to_ts"""
REPLAY_DECISIONS = Query(
    "replay_decisions",
    "The decisions of a window with the requests they answered",
    _REPLAY_DECISIONS_JOINED.format(join="JOIN") + "\nORDER BY d.stream_seq;",
    ("from_ts", "to_ts"),
)

REPLAY_INGEST_TIMES = Query(
    "replay_ingest_times",
    "Every event batch's ingest time in seq order: a decision's horizon seq is the seq before the first event "
    "ingested at or after its horizon (a batch's events share its ingest time: its first event stands for it)",
    """SELECT stream_seq, ingest_ts
FROM event_log
WHERE event_idx = 0
ORDER BY stream_seq;""",
    (),
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
# stay stops being indexed at conflict_since (kvledger/core/precedence.py, rule 1).
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

QUERIES = (REPLAY_REQUESTS, REPLAY_DECISIONS, REPLAY_INGEST_TIMES, UNREPLAYABLE, REPLAY_STAYS, REPLAY_WORKERS,
           KV_EVENTS_GENERATIONS)

_NATIVE, _RETAINED = Provenance.NATIVE, Provenance.RETAINED
_FOREVER = math.inf


class ReplayRefused(RuntimeError):
    """The window cannot be replayed from this source (SQL pruned it, or a stream's retention dropped it): the
    message says why."""


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
    """The inventory as of one seq, as `kvledger.core.reuse.decide` reads it (each answer is looked up once)."""

    def __init__(self, timeline: Timeline, seq: int) -> None:
        self.timeline, self.inventory_seq = timeline, seq
        self._held: dict[tuple, bool] = {}

    def workers(self) -> list[WorkerId]:
        return self.timeline.workers_at(self.inventory_seq)

    def uncertain_workers(self) -> list[WorkerId]:
        return []  # reported by answers, never weighed by the model

    def unreachable_workers(self) -> list[WorkerId]:
        return []  # a replay answers on the inventory as recorded, every worker reachable (docs/audit.md)

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
    target and nobody had credit, for its fallback (decide/serving/inflight.py). The lookup budget never runs out."""
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


# --- the window as columns, tallied without an object per decision ---------------------------
#
# The replay at decide's speed (kvledger/app/replay.py) reads the window and tallies its report as columns: at a
# million decisions an object per decision and outcome cost more than answering them. The tallies equal
# `Tally.add`'s, added in the same order, to the last float (tests/test_replay_speed.py).

TIERS = (Tier.DEVICE, Tier.HOST, Tier.DISK)  # a tier code in columns is its place here
NO_CODE = -1  # no worker, name or tier


class Codes(dict):
    """Values to dense codes in order of first sight (`values`); None is NO_CODE."""

    def __init__(self, values: Iterable = ()) -> None:
        super().__init__({None: NO_CODE})
        self.values: list = []
        self.of(values)

    def __missing__(self, value) -> int:
        code = self[value] = len(self.values)
        self.values.append(value)
        return code

    def of(self, values: Iterable) -> np.ndarray:
        values = values if isinstance(values, (list, tuple)) else list(values)
        return np.fromiter(map(self.__getitem__, values), dtype=np.int32, count=len(values))


@attrs.frozen(eq=False)
class OutcomeColumns:
    """`Outcome` per decision as columns: the target's name, the reason and the source as codes (into a report's
    names, reasons and workers), the tier as a code into TIERS; NO_CODE for none. stale and lost: 1, 0, or -1 for
    None."""

    target: np.ndarray
    reason: np.ndarray
    source: np.ndarray
    tier: np.ndarray  # NO_CODE wherever source is
    prefix: np.ndarray
    transfer: np.ndarray
    saving: np.ndarray
    stale: np.ndarray
    lost: np.ndarray

    def choice_text(self, decision: int, names: Sequence, reasons: Sequence[str], workers: Sequence[WorkerId]) -> str:
        """`_choice_text` of this decision's outcome."""
        source = int(self.source[decision])
        chosen = "no transfer" if source == NO_CODE else \
            f"{workers[source].name} {TIERS[self.tier[decision]].value} {int(self.prefix[decision])} blocks"
        target = self.target[decision]
        return f"target {None if target == NO_CODE else names[target]}: {chosen} ({reasons[self.reason[decision]]})"


@attrs.frozen(eq=False)
class RecordedColumns:
    """A window's recorded decisions as columns, in KV_DECISIONS order: `Recorded` without an object per decision.
    Workers (requests' targets and fallbacks, recorded sources and targets) are codes into `workers`, the
    recorded answers' target names and reasons codes into `names` and `reasons` (NO_CODE: none)."""

    workers: Codes  # WorkerId -> code
    names: Codes  # target name -> code
    reasons: Codes
    request_ids: list[str]
    inventory_seq: np.ndarray  # int64
    horizon_seq: np.ndarray  # int64, -1: no event yet at the horizon
    local: np.ndarray  # uint64, every request's local hashes end to end
    offsets: np.ndarray  # int64, decisions + 1
    block_size: np.ndarray  # int64
    blocks: np.ndarray  # int64, the request's length (more than recorded when it was recorded truncated)
    requested_target: np.ndarray  # int32 worker code
    fallback: np.ndarray  # int32 worker code
    recorded: OutcomeColumns  # the recorded answers, stale and lost -1 (judged by the replay)
    baseline: np.ndarray  # int64
    target_worker: np.ndarray  # int32 worker code of the recorded target
    target_prefix: np.ndarray  # int64, 0 where none

    def __len__(self) -> int:
        return self.inventory_seq.size

    @classmethod
    def of(cls, *, request_ids: list[str], inventory_seqs, horizon_seqs, local: np.ndarray, lengths: np.ndarray,
           block_sizes, blocks, requested_targets, fallbacks, targets: list, reasons: list, baselines,
           sources: list, tiers: list, prefixes, transfers, savings, target_prefixes,
           workers: Codes | None = None) -> RecordedColumns:
        """From per-decision columns: requested targets and fallbacks are workers or names (None: none), targets
        names, sources workers (None: nothing chosen), tiers tier values; None reads 0 in the integer columns."""
        count = len(request_ids)
        workers = Codes() if workers is None else workers
        names, reason_codes = Codes(), Codes()

        def worker_codes(values: list) -> np.ndarray:
            by_value = {value: workers[value if value is None or isinstance(value, WorkerId)
                                       else WorkerId.parse(value)] for value in set(values)}
            return np.fromiter(map(by_value.__getitem__, values), dtype=np.int32, count=count)

        def integers(values, dtype=np.int64, none=0) -> np.ndarray:
            if isinstance(values, np.ndarray):
                return values.astype(dtype).reshape(count)
            if None not in values:  # numpy converts a list of numbers in one call
                return np.array(values, dtype=dtype).reshape(count)
            return np.fromiter((none if value is None else value for value in values), dtype=dtype, count=count)

        offsets = np.zeros(count + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        source = worker_codes(sources)
        tier_code = {None: NO_CODE, **{tier.value: code for code, tier in enumerate(TIERS)},
                     **{tier: code for code, tier in enumerate(TIERS)}}
        tier = np.fromiter(map(tier_code.__getitem__, tiers), dtype=np.int8, count=count)
        tier[source == NO_CODE] = NO_CODE
        recorded = OutcomeColumns(
            names.of(targets), reason_codes.of(reasons), source, tier, integers(prefixes), integers(transfers),
            integers(savings, np.float64, 0.0),
            np.full(count, -1, np.int8), np.full(count, -1, np.int8))
        return cls(workers, names, reason_codes, request_ids, integers(inventory_seqs),
                   integers(horizon_seqs, none=-1),
                   local, offsets, integers(block_sizes), integers(blocks), worker_codes(requested_targets),
                   worker_codes(fallbacks), recorded, integers(baselines), worker_codes(targets),
                   integers(target_prefixes))

    @classmethod
    def of_recorded(cls, decisions: Sequence[Recorded]) -> RecordedColumns:
        """The columns of `Recorded` values (the streams' window)."""
        requests = [decision.request for decision in decisions]
        local = [request.local_hashes for request in requests]
        lengths = np.fromiter(map(len, local), dtype=np.int64, count=len(local))
        return cls.of(
            request_ids=[decision.request_id for decision in decisions],
            inventory_seqs=[decision.inventory_seq for decision in decisions],
            horizon_seqs=[decision.horizon_seq for decision in decisions],
            local=np.fromiter((h for hashes in local for h in hashes), dtype=np.uint64, count=int(lengths.sum())),
            lengths=lengths, block_sizes=[request.block_size for request in requests],
            blocks=[decision.blocks for decision in decisions],
            requested_targets=[request.target for request in requests],
            fallbacks=[request.fallback for request in requests],
            targets=[decision.target for decision in decisions], reasons=[decision.reason for decision in decisions],
            baselines=[decision.baseline_blocks for decision in decisions],
            sources=[decision.source for decision in decisions], tiers=[decision.tier for decision in decisions],
            prefixes=[decision.prefix_blocks for decision in decisions],
            transfers=[decision.transfer_blocks for decision in decisions],
            savings=[decision.saving_ms for decision in decisions],
            target_prefixes=[decision.target_prefix_blocks for decision in decisions])


def _sequential_sum(values: np.ndarray) -> float:
    """0.0 plus each value in turn, as `Tally.add` adds them (not numpy's pairwise sum, which rounds otherwise)."""
    return float(np.cumsum(np.concatenate([[0.0], values]))[-1])


def tally_of_columns(name: str, digest: str, outcome: OutcomeColumns, window: RecordedColumns,
                     recorded: OutcomeColumns | None) -> Tally:
    """`Tally.add` of every decision's outcome, in KV_DECISIONS order (changes against `recorded`, unless None)."""
    hint, fresh = outcome.source != NO_CODE, outcome.stale == 0
    transfer = outcome.transfer[hint]
    tally = Tally(
        name, digest, decisions=len(window), hints=int(hint.sum()),
        estimated_ttft_saved_ms=_sequential_sum(outcome.saving[hint]), blocks_moved=int(transfer.sum()),
        tokens_moved=int((transfer * window.block_size[hint]).sum()), judged_hints=int((outcome.stale >= 0).sum()),
        stale_hints=int((outcome.stale == 1).sum()), fresh_ttft_saved_ms=_sequential_sum(outcome.saving[fresh]),
        credited=int((outcome.lost >= 0).sum()), lost_credit=int((outcome.lost == 1).sum()),
        pending=int((window.horizon_seq < 0).sum()))
    if recorded is not None:
        changed = np.flatnonzero((outcome.target != recorded.target) | (outcome.source != recorded.source)
                                 | (outcome.tier != recorded.tier) | (outcome.prefix != recorded.prefix))
        vocabulary = (window.names.values, window.reasons.values, window.workers.values)
        tally.changed = int(changed.size)
        tally.changes = [{"request_id": window.request_ids[decision],
                          "recorded": recorded.choice_text(decision, *vocabulary),
                          "replayed": outcome.choice_text(decision, *vocabulary)} for decision in changed.tolist()]
    return tally


def report_of_columns(window_bounds: tuple[float, float], horizon_s: float, source: str, window: RecordedColumns,
                      recorded: OutcomeColumns, replayed: Sequence[OutcomeColumns], unreplayable: int,
                      settings: Sequence[tuple[str, ReuseSettings]]) -> Report:
    """`_report` of a window answered and judged as columns: the same report to the last float."""
    truncated = int((window.blocks > np.diff(window.offsets)).sum())
    return Report(window_bounds, horizon_s, source, len(window), unreplayable, truncated,
                  tally_of_columns("recorded", "", recorded, window, None),
                  tuple(tally_of_columns(name, settings_digest(value), outcome, window, recorded)
                        for (name, value), outcome in zip(settings, replayed)))


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


@attrs.frozen
class Recorded:
    """One recorded decision with the request it answered, as SQL's rows or its KV_DECISIONS record give it."""

    request_id: str
    decided_ts: float
    inventory_seq: int  # the seq its inventory is read at (a ledger seq from SQL, a KV_EVENTS seq from the stream)
    horizon_seq: int | None  # None: no event yet at the horizon
    request: ReuseRequest
    blocks: int  # the request's length; more than len(request.local_hashes) when it was recorded truncated
    target: str | None
    reason: str
    baseline_blocks: int
    source: WorkerId | None
    tier: Tier | None
    prefix_blocks: int | None
    transfer_blocks: int | None
    saving_ms: float | None
    target_prefix_blocks: int | None


def _answers(view: reuse.InventoryView, recorded: Recorded, settings: Sequence[tuple[str, ReuseSettings]],
             placed: bool) -> list[Decision]:
    """The decision's request answered again under each settings, at the view's seq."""
    request = recorded.request
    if placed and request.target is None and request.fallback is not None:
        request = attrs.evolve(request, target=request.fallback)
    return [answer_again(view, request, value) for _, value in settings]


def _judged(recorded: Recorded, answers: Sequence[Decision], holds) -> tuple[Outcome, list[Outcome]]:
    """The recorded answer's outcome and the replayed ones', judged with `holds` (what was natively held at the
    horizon seq; None when the horizon is not reached)."""
    sequence = recorded.request.sequence_hashes
    return _recorded_outcome(recorded, sequence, holds), [_outcome(decision, sequence, holds) for decision in answers]


def _report(window: tuple[float, float], horizon_s: float, source: str, decisions: Sequence[Recorded],
            judged: Sequence[tuple[Outcome, list[Outcome]]], unreplayable: int,
            settings: Sequence[tuple[str, ReuseSettings]]) -> Report:
    """The tallies, added in KV_DECISIONS order whichever source answered: the same report to the last float."""
    recorded = Tally("recorded", "")
    tallies = [Tally(name, settings_digest(value)) for name, value in settings]
    for decision, (mine, outcomes) in zip(decisions, judged):
        pending = decision.horizon_seq is None
        recorded.add(mine, decision.request.block_size, None, decision.request_id, pending)
        for outcome, tally in zip(outcomes, tallies):
            tally.add(outcome, decision.request.block_size, mine, decision.request_id, pending)
    truncated = sum(decision.blocks > len(decision.request.local_hashes) for decision in decisions)
    return Report(window, horizon_s, source, len(decisions), unreplayable, truncated, recorded, tuple(tallies))


def _native_at(view: reuse.InventoryView):
    def native(worker: WorkerId, tier: Tier, sequence_hash: int) -> bool:
        return view.holds(worker, _NATIVE, tier, sequence_hash)
    return native


def sql_refusal(connection: sa.Connection, first_seq: int | None, from_ts: float) -> str | None:
    """Why SQL no longer holds a window (None: it does): its history before `first_seq` (the window's first
    inventory seq) was pruned, or decisions of the window were (`store.history_retention_s`)."""
    pruned = pruned_through(connection)
    if first_seq is not None and pruned and pruned >= first_seq:
        return (f"history at or before KV_EVENTS seq {pruned} was pruned (store.history_retention_s); "
                f"the window's first decision was answered at seq {first_seq}: replay a later window")
    decisions_pruned = pruned_through(connection, DECISIONS_PRUNED)
    if decisions_pruned:
        kept = connection.execute(sa.select(sa.func.min(tables.decisions.c.decided_ts))).scalar()
        if kept is None or from_ts < kept:
            return (f"decisions at or before KV_DECISIONS seq {decisions_pruned} were pruned "
                    f"(store.history_retention_s)" + (f": replay from {kept!r} on" if kept is not None else ""))
    return None


@attrs.frozen
class Window:
    """The recorded decisions of a window as SQL holds them, and the seqs their timeline spans."""

    decisions: list[Recorded]
    unreplayable: int
    first_seq: int
    last_seq: int


def read_window(connection: sa.Connection, *, horizon_s: float, from_ts: float = -math.inf,
                to_ts: float = math.inf, horizons_in_sql: bool = True) -> Window:
    """The decisions of [from_ts, to_ts) with their requests; raises ReplayRefused when SQL no longer holds the
    window. `horizons_in_sql`: each horizon seq by `replay_requests`' own subquery (the reference), else from
    one pass over the events' ingest times (`_horizon_seqs`, as the streams find it), the same seq."""
    window = {"from_ts": max(from_ts, -1e18), "to_ts": min(to_ts, 1e18)}
    if horizons_in_sql:
        rows = run(connection, REPLAY_REQUESTS, horizon_s=horizon_s, **window)
    else:
        rows = run(connection, REPLAY_DECISIONS, **window)
        if rows:
            times = connection.execute(sa.text(REPLAY_INGEST_TIMES.sql.rstrip(";"))).all()
            found = first_seq_at_or_after(times, [row["decided_ts"] + horizon_s for row in rows])
            for row, horizon in zip(rows, found):
                row["horizon_seq"] = horizon
    unreplayable = run(connection, UNREPLAYABLE, **window)[0]["decisions"]
    generations = _Generations(run(connection, KV_EVENTS_GENERATIONS))
    decisions = [_recorded_of(row, generations.ledger_seq(row["inventory_seq"], row["decided_ts"])) for row in rows]
    seqs = [decision.inventory_seq for decision in decisions]
    first = min(seqs, default=0)
    last = max([*seqs, *(d.horizon_seq for d in decisions if d.horizon_seq is not None)], default=0)
    refusal = sql_refusal(connection, first if decisions else None, from_ts)
    if refusal is not None:
        raise ReplayRefused(refusal)
    return Window(decisions, unreplayable, first, last)


@attrs.frozen(eq=False)
class ColumnWindow:
    """`Window` with its decisions as columns (`read_columns`)."""

    decisions: RecordedColumns
    unreplayable: int
    first_seq: int
    last_seq: int


@contextlib.contextmanager
def _collection_paused():
    """Python's cycle collector held off while a read builds a driver tuple per row: a full collection walks every
    tracked object, and a window's millions of tuples would make each one long (a fifth of a 1 M window's read)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@_collection_paused()  # millions of tuples that hold no cycles: each full collection would walk them all
def read_columns(connection: sa.Connection, *, horizon_s: float, from_ts: float = -math.inf,
                 to_ts: float = math.inf) -> ColumnWindow:
    """`read_window` (its horizon seqs from the events' ingest times) as columns, each request's hashes one slice of
    a single buffer: on SQLite, where the window spans much of the ledger, each table scanned once with its columns
    aggregated in SQL (`_scanned_window`); else the driver's tuples read in bulk. Raises ReplayRefused as
    `read_window` does."""
    window = {"from_ts": max(from_ts, -1e18), "to_ts": min(to_ts, 1e18)}
    columns = _scanned_window(connection, window) if connection.dialect.name == "sqlite" else None
    if columns is None:
        columns = _fetched_window(connection, window)
    (unreplayable, request_ids, decided, inventory_seqs, targets, reasons, baselines, chosen_sources, chosen_ranks,
     tiers, prefixes, transfers, savings, target_prefixes, block_sizes, blocks, requested_targets, fallbacks, local,
     lengths) = columns
    times = _fetched(connection, REPLAY_INGEST_TIMES.sql.rstrip(";"), {}) if len(request_ids) else []
    horizons = np.full(decided.size, -1, dtype=np.int64)
    if times:
        event_seqs = np.fromiter(map(operator.itemgetter(0), times), dtype=np.int64, count=len(times))
        # As `first_seq_at_or_after`: ingest times need not rise with the seq; their running maximum does.
        running = np.maximum.accumulate(np.fromiter(map(operator.itemgetter(1), times), dtype=np.float64,
                                                    count=len(times)))
        at = np.searchsorted(running, decided + horizon_s, "left")
        horizons = np.where(at < event_seqs.size, event_seqs[np.minimum(at, event_seqs.size - 1)] - 1, -1)
    offsets = np.zeros(decided.size, dtype=np.int64)
    inventory = np.asarray(inventory_seqs, dtype=np.int64).reshape(decided.size)
    for generation in run(connection, KV_EVENTS_GENERATIONS):  # as `_Generations.ledger_seq`: the newest wins
        known = (generation["detected_ts"] <= decided) & (generation["first_stream_seq"] <= inventory)
        offsets[known] = generation["ledger_offset"]
    inventory = inventory + offsets
    pairs = list(zip(chosen_sources, chosen_ranks))
    by_pair = {pair: None if pair[0] is None else worker_of(*pair) for pair in set(pairs)}
    decisions = RecordedColumns.of(
        request_ids=request_ids, inventory_seqs=inventory, horizon_seqs=horizons, local=local, lengths=lengths,
        block_sizes=block_sizes, blocks=blocks, requested_targets=requested_targets, fallbacks=fallbacks,
        targets=targets, reasons=reasons, baselines=baselines, sources=list(map(by_pair.__getitem__, pairs)),
        tiers=tiers, prefixes=prefixes, transfers=transfers, savings=savings, target_prefixes=target_prefixes)
    first = int(inventory.min()) if inventory.size else 0
    last = max(int(inventory.max()) if inventory.size else 0, int(horizons.max()) if horizons.size else 0)
    refusal = sql_refusal(connection, first if inventory.size else None, from_ts)
    if refusal is not None:
        raise ReplayRefused(refusal)
    return ColumnWindow(decisions, unreplayable, first, last)


def _fetched_window(connection: sa.Connection, window: dict) -> tuple:
    """The window's columns (as `read_columns` unpacks them) from the driver's tuples: one statement joins each
    decision to its request."""
    rows = _fetched(connection, _REPLAY_DECISIONS_JOINED.format(join="LEFT JOIN"), window)
    read = len(rows)
    rows = [row for row in rows if row[-1] is not None]  # local_hashes is NOT NULL: None is no request
    unreplayable = read - len(rows)  # `replay_unreplayable`'s count, in the same snapshot as the rows
    rows.sort(key=operator.itemgetter(0))  # by seq, as `replay_decisions` orders them
    (_seq, request_ids, decided_ts, inventory_seqs, targets, reasons, baselines, chosen_sources, chosen_ranks, tiers,
     prefixes, transfers, savings, target_prefixes, block_sizes, blocks, requested_targets, fallbacks,
     local_hashes) = (list(column) for column in zip(*rows)) if rows else ([] for _ in range(19))
    buffer = bytearray().join(local_hashes)  # numpy reads it where it is, writable
    return (unreplayable, request_ids, np.array(decided_ts, dtype=np.float64), inventory_seqs, targets, reasons,
            baselines, chosen_sources, chosen_ranks, tiers, prefixes, transfers, savings, target_prefixes,
            block_sizes, blocks, requested_targets, fallbacks,
            np.frombuffer(buffer, dtype="<u8").astype(np.uint64, copy=False),
            np.fromiter(map(len, local_hashes), dtype=np.int64, count=len(local_hashes)) // 8)


# `_scanned_window`'s statements: each table read once in its own order, every integer and text column
# aggregated into one text (a text's values end to end, and each one's length in bytes, -1 for NULL), the floats
# as rows (their texts would not be exact); NOT INDEXED: a window of much of the ledger costs a seek per row off
# the decided_ts index, where a scan costs a step.
_WINDOW_INTEGERS = ("stream_seq", "inventory_seq", "baseline_blocks", "IFNULL(chosen_dp_rank, 0)",
                    "IFNULL(chosen_prefix_blocks, 0)", "IFNULL(chosen_transfer_blocks, 0)", "target_prefix_blocks")
_WINDOW_TEXTS = ("request_id", "target", "reason", "chosen_source", "chosen_tier")
_WINDOW_WHERE = "WHERE decided_ts >= :from_ts AND decided_ts < :to_ts"
_REQUEST_INTEGERS = ("stream_seq", "block_size", "blocks", "length(local_hashes)")
_REQUEST_TEXTS = ("requested_target", "fallback")


def _aggregated(integers: Sequence[str], texts: Sequence[str]) -> str:
    return ", ".join([*(f"CAST(group_concat({column}) AS BLOB)" for column in integers),
                      *(f"CAST(group_concat(IFNULL(length(CAST({column} AS BLOB)), -1)) AS BLOB), "
                        f"CAST(group_concat({column}, '') AS BLOB)" for column in texts)])


_SCANNED_DECISIONS = (f"SELECT COUNT(*), {_aggregated(_WINDOW_INTEGERS, _WINDOW_TEXTS)} "
                      f"FROM decisions NOT INDEXED {_WINDOW_WHERE}")
_SCANNED_FLOATS = f"SELECT decided_ts, IFNULL(chosen_saving_ms, 0.0) FROM decisions NOT INDEXED {_WINDOW_WHERE}"
# A request's hashes end to end: group_concat copies a BLOB's bytes as they are (a text of a UTF-8 database).
_SCANNED_REQUESTS = (f"SELECT COUNT(*), {_aggregated(_REQUEST_INTEGERS, _REQUEST_TEXTS)}, "
                     "CAST(group_concat(local_hashes, '') AS BLOB) FROM decision_requests NOT INDEXED "
                     "WHERE stream_seq >= :first AND stream_seq <= :last")
_SCANNED_SHARE = 1 / 3  # of the ledger's time at least, a window is scanned (the seeks cost about three steps a row)


def _scanned_window(connection: sa.Connection, window: dict) -> tuple | None:
    """SQLite: the window's columns (as `read_columns` unpacks them) from `decisions` and `decision_requests`
    scanned once each in one read transaction, their integers and texts aggregated in SQL (one text per
    column, parsed without the interpreter's lock, each distinct text decoded once) and matched by seq in
    numpy; None where the window spans less than a third of the ledger's time, or the database is in memory."""
    if connection.engine.url.database in (None, "", ":memory:"):
        return None
    raw = connection.connection.driver_connection
    began = not raw.in_transaction
    if began:  # one snapshot for the three statements
        raw.execute("BEGIN")
    try:
        low, high = raw.execute("SELECT MIN(decided_ts), MAX(decided_ts) FROM decisions").fetchone()
        if low is None or min(high, window["to_ts"]) - max(low, window["from_ts"]) < _SCANNED_SHARE * (high - low):
            return None
        count, *decided = raw.execute(_SCANNED_DECISIONS, window).fetchone()
        floats = raw.execute(_SCANNED_FLOATS, window).fetchall()
        seqs = _parsed(decided[0], count)
        bounds = {"first": int(seqs.min()) if count else 0, "last": int(seqs.max()) if count else -1}
        requested, *asked = raw.execute(_SCANNED_REQUESTS, bounds).fetchone()
    finally:
        if began:
            raw.execute("COMMIT")
    if len(floats) != count:
        raise RuntimeError(f"read {len(floats)} decision times of {count} decisions in one snapshot")
    integers = [seqs, *(_parsed(text, count) for text in decided[1:len(_WINDOW_INTEGERS)])]
    texts = _text_columns(decided[len(_WINDOW_INTEGERS):], count)
    times = np.array(floats, dtype=np.float64).reshape(count, 2)
    r_integers = [_parsed(text, requested) for text in asked[:len(_REQUEST_INTEGERS)]]
    r_texts = _text_columns(asked[len(_REQUEST_INTEGERS):-1], requested)
    r_seqs, block_sizes, blocks, byte_lengths = r_integers
    hashes = np.frombuffer(asked[-1] or b"", dtype=np.uint8)
    # Decisions in seq order, each with its request (the scans give the tables' rowid order: the seqs' own,
    # unless rows were written out of it), matched by seq.
    order = np.argsort(seqs, kind="stable") if np.any(seqs[1:] < seqs[:-1]) else None
    r_order = np.argsort(r_seqs, kind="stable") if np.any(r_seqs[1:] < r_seqs[:-1]) else None
    if order is not None:
        seqs = seqs[order]
    sorted_r_seqs = r_seqs if r_order is None else r_seqs[r_order]
    at = np.minimum(np.searchsorted(sorted_r_seqs, seqs), max(sorted_r_seqs.size - 1, 0))
    matched = (sorted_r_seqs[at] == seqs) if sorted_r_seqs.size else np.zeros(seqs.size, dtype=bool)
    decision_rows = np.arange(count) if order is None else order
    decision_rows, request_rows = decision_rows[matched], at[matched]
    if r_order is not None:
        request_rows = r_order[request_rows]
    local, lengths = _segments(hashes, byte_lengths, request_rows)
    request_ids, targets, reasons, sources, tiers = texts
    return (int(count - matched.sum()), request_ids.taken(decision_rows), times[decision_rows, 0],
            integers[1][decision_rows], targets.listed(decision_rows), reasons.listed(decision_rows),
            integers[2][decision_rows], sources.listed(decision_rows), integers[3][decision_rows].tolist(),
            tiers.listed(decision_rows), integers[4][decision_rows], integers[5][decision_rows],
            times[decision_rows, 1], integers[6][decision_rows], block_sizes[request_rows], blocks[request_rows],
            r_texts[0].listed(request_rows), r_texts[1].listed(request_rows), local, lengths)


class _Texts(Sequence):
    """A column of texts in one buffer of UTF-8 (a group_concat of them): row i's bytes at starts[i], lengths[i]
    long (-1: NULL). Read as a sequence, a row's text is decoded when it is asked for (a window's request ids are
    read only for the decisions a replay changes)."""

    def __init__(self, buffer: bytes, starts: np.ndarray, lengths: np.ndarray) -> None:
        self.buffer, self.starts, self.lengths = buffer, starts, lengths

    def __len__(self) -> int:
        return self.lengths.size

    def __getitem__(self, row: int) -> str | None:
        start, length = int(self.starts[row]), int(self.lengths[row])
        return None if length < 0 else self.buffer[start:start + length].decode()

    def taken(self, rows: np.ndarray) -> _Texts:
        return _Texts(self.buffer, self.starts[rows], self.lengths[rows])

    def listed(self, rows: np.ndarray) -> list:
        """The texts of `rows` as a list, each distinct text decoded once (the column holds few)."""
        codes, firsts = _text_codes(np.frombuffer(self.buffer, dtype=np.uint8), self.starts, self.lengths)
        values = [self[int(row)] for row in firsts] + [None]  # code -1 (NULL) reads the last
        return list(map(values.__getitem__, codes[rows].tolist()))


def _text_columns(texts: Sequence[bytes | None], count: int) -> list[_Texts]:
    """`_aggregated`'s texts (per column: its rows' lengths, then their bytes end to end) as `_Texts`."""
    columns = []
    for lengths_text, buffer in zip(texts[::2], texts[1::2]):
        lengths = _parsed(lengths_text, count)
        starts = np.zeros(count, dtype=np.int64)
        np.cumsum(np.maximum(lengths[:-1], 0), out=starts[1:])
        if count and int(starts[-1]) + max(int(lengths[-1]), 0) != len(buffer or b""):
            raise ValueError("a column's texts are not as long as their lengths say")
        columns.append(_Texts(buffer or b"", starts, lengths))
    return columns


@numba.njit(cache=True, nogil=True)
def _text_codes(buffer, starts, lengths):
    """Each row's code (-1 for NULL), the same for the same bytes, and the first row of each code: an open
    addressing table of FNV-1a hashes, a hit compared byte for byte."""
    count = lengths.size
    bits = 4
    while (1 << bits) < 2 * count:
        bits += 1
    table = np.full(1 << bits, -1, dtype=np.int64)  # the code at each place
    firsts = np.empty(count, dtype=np.int64)
    codes = np.full(count, -1, dtype=np.int64)
    distinct = 0
    for row in range(count):
        length = lengths[row]
        if length < 0:
            continue
        start = starts[row]
        digest = np.uint64(14695981039346656037)
        for at in range(start, start + length):
            digest = (digest ^ np.uint64(buffer[at])) * np.uint64(1099511628211)
        place = np.int64(digest & np.uint64((1 << bits) - 1))
        while True:
            code = table[place]
            if code < 0:
                table[place] = distinct
                firsts[distinct] = row
                codes[row] = distinct
                distinct += 1
                break
            first = firsts[code]
            if lengths[first] == length:
                same = True
                for offset in range(length):
                    if buffer[starts[first] + offset] != buffer[start + offset]:
                        same = False
                        break
                if same:
                    codes[row] = code
                    break
            place = (place + 1) & ((1 << bits) - 1)
    return codes, firsts[:distinct].copy()


def _segments(hashes: np.ndarray, byte_lengths: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8-byte hashes of `rows` (each row's `byte_lengths` bytes of `hashes`, end to end) in that order, a
    writable array, and each row's count of them."""
    if rows.size == byte_lengths.size and (rows.size == 0 or bool(np.all(rows == np.arange(rows.size)))):
        kept = hashes.copy()
    else:
        starts = np.zeros(byte_lengths.size, dtype=np.int64)
        np.cumsum(byte_lengths[:-1], out=starts[1:])
        kept = _gathered(hashes, starts, byte_lengths, rows)
    return kept.view("<u8").astype(np.uint64, copy=False), byte_lengths[rows] // 8


@numba.njit(cache=True, nogil=True)
def _gathered(values, starts, lengths, rows):
    out = np.empty(lengths[rows].sum(), dtype=values.dtype)
    at = 0
    for row in rows:
        out[at:at + lengths[row]] = values[starts[row]:starts[row] + lengths[row]]
        at += lengths[row]
    return out


def _fetched(connection: sa.Connection, sql: str, parameters: dict) -> list:
    """The rows of `sql` as the driver's tuples: a Row each costs a third again."""
    result = connection.execute(sa.text(sql), parameters)
    rows = result.cursor.fetchall()
    result.close()
    return rows


def stay_columns(connection: sa.Connection, first_seq: int, last_seq: int) -> tuple[list, ...]:
    """`replay_stays`' rows as columns (publisher, dp_rank, provenance, tier, sequence_hash as stored: signed,
    stored_seq, removed_seq, conflict_since), without a dict per row: a window holds many stays per decision."""
    rows = _fetched(connection, REPLAY_STAYS.sql.rstrip(";"), {"first_seq": first_seq, "last_seq": last_seq})
    return tuple(list(column) for column in zip(*rows)) if rows else tuple([] for _ in range(8))


NEVER = np.iinfo(np.int64).max  # a removed_seq or conflict_since that never came
_LOCAL_TIERS = ("device", "host", "disk")


@attrs.frozen
class Stays:
    """`replay_stays`' rows as arrays, one item per stay, read without a Python object per row (`stays_of`)."""

    placements: tuple[tuple[str, int, str, str], ...]  # (publisher, dp_rank, provenance, tier) per placement
    placement: np.ndarray  # int64, an index into `placements`
    sequence_hash: np.ndarray  # int64, as SQL keeps it (signed)
    stored_seq: np.ndarray  # int64
    removed_seq: np.ndarray  # int64, NEVER while held
    conflict_since: np.ndarray  # int64, NEVER where none
    slot: np.ndarray  # int64, its place in the batch that stored it (with stored_seq, its order of arrival)

    def __len__(self) -> int:
        return self.placement.size


@attrs.frozen(eq=False)
class StayTables:
    """What `stays_of` reads in bulk, before it knows the window: the local placements and the integer columns of
    their stays and removal runs (`stay_tables`)."""

    rows: list  # (placement_id, publisher, dp_rank, provenance, tier) of each local placement
    read_up_to: int | None  # the stays and removals stored after it were not read (None: all were)
    stays: list[np.ndarray]  # placement_id, sequence_hash, stored_seq, slot
    removals: list[np.ndarray]  # placement_id, stored_seq, first_slot, last_slot, removed_seq


def stay_tables(connection: sa.Connection, last_seq: int | None = None) -> StayTables:
    """The local placements, and their stays and removal runs stored at or before `last_seq` (None: all), as
    int64 columns (SQLite: one `group_concat` text per column, parsed by a compiled loop, each table read in its key's
    order, (placement, stored seq, slot), which makes matching a stay to its removal run a search of sorted
    keys; PostgreSQL: each row's values sent as int8s end to end, read as one numpy record array). Known the
    window or not: `kvledger replay` reads them while it reads the window."""
    rows = connection.exec_driver_sql(
        "SELECT placement_id, publisher, dp_rank, provenance, tier FROM placements ORDER BY placement_id").all()
    rows = [tuple(row) for row in rows if row[4] in _LOCAL_TIERS]
    ids = np.array([row[0] for row in rows], dtype=np.int64)
    removals = ("placement_id", "stored_seq", "first_slot", "last_slot", "removed_seq")
    if not rows:
        empty = np.zeros(0, dtype=np.int64)
        return StayTables(rows, last_seq, [empty] * 4, [empty] * 5)
    if connection.dialect.name == "postgresql":
        local = f"placement_id IN ({', '.join(str(int(value)) for value in ids)})"
        if last_seq is not None:
            local += f" AND stored_seq <= {int(last_seq)}"
        stays = _integer_columns(connection, "block_stays", ("placement_id", "sequence_hash", "stored_seq", "slot"),
                                 local)
        runs = _integer_columns(connection, "block_removals", removals, local)
    else:
        # Unfiltered where most of the ledger is wanted: SQLite spends more per row testing a WHERE than numpy
        # does. A window in the first part of a long ledger reads only its part, a range of each placement's key.
        bound = ""
        if last_seq is not None and 2 * last_seq < (connection.exec_driver_sql(
                "SELECT MAX(stream_seq) FROM event_log").scalar() or 0):
            bound = f"placement_id IN ({', '.join(str(int(value)) for value in ids)}) AND stored_seq <= {int(last_seq)}"
        stays = _concatenated(connection, "block_stays", ("placement_id", "sequence_hash", "stored_seq", "slot"),
                              ("placement_id", "stored_seq", "slot"), bound)
        runs = _concatenated(connection, "block_removals", removals, ("placement_id", "stored_seq", "first_slot"),
                             bound)
        wanted = _among(stays[0], ids)
        if last_seq is not None:
            wanted &= stays[2] <= int(last_seq)
        stays = _where(wanted, *stays)
        wanted = _among(runs[0], ids)
        if last_seq is not None:
            wanted &= runs[1] <= int(last_seq)
        runs = _where(wanted, *runs)
    return StayTables(rows, last_seq, stays, runs)


def stays_of(connection: sa.Connection, first_seq: int, last_seq: int, tables: StayTables | None = None) -> Stays:
    """`replay_stays`' rows (every stay on a local tier open at some seq of [first_seq, last_seq]) as `Stays`.

    The `block_residency` view joins every stay to its placement and its removal run a row at a time, and a
    driver's row costs a Python tuple and an int per column. Here `placements`, `block_stays` and
    `block_removals` are read apiece, their integer columns in bulk (`stay_tables`, or `tables` read so
    before), and each stay is matched to its removal run (same placement and stored seq, first_slot <= slot <=
    last_slot) by a binary search in numpy. A conflict_since is read for retained placements only: it ends
    nothing else (kvledger/core/precedence.py, rule 1)."""
    if tables is None:
        tables = stay_tables(connection, last_seq)
    rows = tables.rows
    placements = tuple((publisher, dp_rank, provenance, tier) for _, publisher, dp_rank, provenance, tier in rows)
    ids = np.array([row[0] for row in rows], dtype=np.int64)
    empty = np.zeros(0, dtype=np.int64)
    if not rows:
        return Stays(placements, empty, empty, empty, empty, empty, empty)
    pid, hashes, stored, slot = tables.stays
    r_pid, r_stored, r_first, r_last, r_removed = tables.removals
    if tables.read_up_to != last_seq:  # read unbounded, or for another window
        pid, hashes, stored, slot = _where(stored <= int(last_seq), pid, hashes, stored, slot)
        r_pid, r_stored, r_first, r_last, r_removed = _where(r_stored <= int(last_seq), r_pid, r_stored, r_first,
                                                             r_last, r_removed)
    local = f"placement_id IN ({', '.join(str(int(value)) for value in ids)}) AND stored_seq <= {int(last_seq)}"
    # The stays an unresolved parent keeps out of the index, and retained stays' conflicts: rare, NULL otherwise.
    retained = {int(pid) for pid, row in zip(ids, rows) if row[3] == Provenance.RETAINED.value}
    # Off `ix_stays_flagged`, whose terms these are (SQLite, without statistics, would scan the table's key).
    table = "block_stays INDEXED BY ix_stays_flagged" if connection.dialect.name == "sqlite" else "block_stays"
    flagged = connection.exec_driver_sql(
        f"SELECT placement_id, stored_seq, slot, unresolved, conflict_since FROM {table} "
        f"WHERE {local} AND ({STAYS_FLAGGED})").all()
    u_pid, u_stored, u_slot = (np.array([row[part] for row in flagged if row[3]], dtype=np.int64) for part in range(3))
    conflicts = [row for row in flagged if row[4] is not None and row[0] in retained]
    c_pid, c_stored, c_slot, c_since = (np.array([row[part] for row in conflicts], dtype=np.int64)
                                        for part in (0, 1, 2, 4))
    # Each stay's key (placement, stored seq, slot) as one int64 that orders as the triple does.
    stay_key, removal_key, conflict_key, unresolved_key = _stay_keys(
        (pid, stored, slot), (r_pid, r_stored, r_first), (c_pid, c_stored, c_slot), (u_pid, u_stored, u_slot))
    if r_pid.size and np.any(removal_key[1:] < removal_key[:-1]):  # read in key order: sorted already
        order = np.argsort(removal_key, kind="stable")
        removal_key, r_first, r_last, r_removed = (removal_key[order], r_first[order], r_last[order],
                                                   r_removed[order])
    removed = _removed_seqs(stay_key, pid, slot, removal_key, r_first, r_last, r_removed, NEVER)
    conflict = np.full(pid.size, NEVER, dtype=np.int64)
    kept = removed > int(first_seq)
    if c_pid.size or u_pid.size:
        order = np.argsort(stay_key, kind="stable")
        ordered = stay_key[order]
        if c_pid.size:
            at = order[np.minimum(np.searchsorted(ordered, conflict_key), order.size - 1)]
            matched = stay_key[at] == conflict_key
            conflict[at[matched]] = c_since[matched]
        if u_pid.size:
            at = order[np.minimum(np.searchsorted(ordered, unresolved_key), order.size - 1)]
            kept[at[stay_key[at] == unresolved_key]] = False
    pid, hashes, stored, removed, conflict, slot = _where(kept, pid, hashes, stored, removed, conflict, slot)
    index_of = np.zeros(int(ids[-1]) + 1, dtype=np.int64)  # each placement id's place in `ids`
    index_of[ids] = np.arange(ids.size)
    return Stays(placements, index_of[pid], hashes, stored, removed, conflict, slot)


_WALKED_RUNS = 16  # runs a stay's walk passes before it searches the rest by bisection


@numba.njit(cache=True, nogil=True)
def _removed_seqs(stay_key, stay_placement, slot, removal_key, first, last, removed_seq, never):
    """Each stay's removed seq (`never` where none): that of the removal run of its placement and stored seq whose
    slots [first, last] hold its slot, the last run keyed at or before the stay's key (`removal_key` sorted).
    Each placement's stays read in key order walk its runs once, from where its stay before stopped: SQLite
    hands the stays over in key order, PostgreSQL in the order they were stored, each placement's in key order
    but the placements interleaved (one walk for all went through every run between two placements' stays: a
    replay of 1 M decisions spent minutes here). A stay keyed below its placement's walk, or more than a few
    runs past it, is searched for."""
    removed = np.empty(stay_key.size, dtype=np.int64)
    # Per placement, the last run keyed at or before its stay before (-1: none; -2: no stay yet).
    runs = np.full(int(stay_placement.max()) + 1 if stay_placement.size else 1, -2, dtype=np.int64)
    for stay in range(stay_key.size):
        key, placement = stay_key[stay], stay_placement[stay]
        run = runs[placement]
        searched = run == -2 or (run >= 0 and removal_key[run] > key)
        steps = 0
        while not searched and run + 1 < removal_key.size and removal_key[run + 1] <= key:
            run += 1
            steps += 1
            searched = steps == _WALKED_RUNS
        if searched:
            run = np.searchsorted(removal_key, key, side="right") - 1
        runs[placement] = run
        removed[stay] = never
        if run >= 0 and removal_key[run] - first[run] == key - slot[stay] and last[run] >= slot[stay]:
            removed[stay] = removed_seq[run]
    return removed


def warm_stay_kernels() -> None:
    """The kernels a bulk read of the stays runs (`stays_of`: the texts parsed, each stay matched to its removal
    run), compiled or loaded from numba's kernel cache on a value each: a process that reads stays later (the
    demo's summary, once its traffic ends) then finds them ready, where a machine's first run would compile
    them then."""
    _parsed(b"1", 1)
    one = np.zeros(1, dtype=np.int64)
    _removed_seqs(one, one, one, one, one, one, one, NEVER)


def _where(wanted: np.ndarray, *columns: np.ndarray) -> list[np.ndarray]:
    """The columns' items where `wanted` is true: the columns themselves where it is everywhere (a window of
    the whole ledger keeps every stay, and a copy of a ledger's columns costs a pass over each)."""
    if wanted.all():
        return list(columns)
    return [column[wanted] for column in columns]


def _among(values: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """Where `values` (placement ids, never negative) are among the sorted ids `wanted`: read off a table over the
    ids' span (`np.isin` sorts the ledger's column)."""
    if not wanted.size or not values.size:
        return np.zeros(values.size, dtype=bool)
    table = np.zeros(max(int(wanted[-1]), int(values.max())) + 1, dtype=bool)
    table[wanted] = True
    return table[values]


def _stay_keys(*triples: tuple[np.ndarray, np.ndarray, np.ndarray]) -> tuple[np.ndarray, ...]:
    """(placement, stored seq, slot) triples of several tables as int64 keys that order and compare as the
    triples do, the slot (never negative: a block's place in its event) the last digit, so that a key less its
    slot is its pair's own."""
    present = [triple for triple in triples if triple[0].size]
    if not present:
        return tuple(np.zeros(0, np.int64) for _ in triples)
    low = [min(int(triple[part].min()) for triple in present) for part in range(2)]
    placement_span = max(int(triple[0].max()) for triple in present) - low[0] + 1
    seq_span = max(int(triple[1].max()) for triple in present) - low[1] + 1
    slot_span = max(int(triple[2].max()) for triple in present) + 1
    if placement_span * seq_span * slot_span < 2**62:
        # Each table's keys apart, in place: its columns are long, and each pass a copy would add costs a pass.
        keys = []
        for placement, seq, slot in triples:
            key = placement - low[0]
            key *= seq_span
            key += seq
            key -= low[1]
            key *= slot_span
            key += slot
            keys.append(key)
        return tuple(keys)
    else:  # too wide for one int64: the pairs ranked first (np.unique sorts them), then the slots beside them
        values = [np.concatenate([triple[part] for triple in triples]) for part in range(3)]
        pairs = np.unique(np.stack([values[0], values[1]], axis=1), axis=0, return_inverse=True)[1].reshape(-1)
        combined = pairs.astype(np.int64) * slot_span + values[2]
    bounds = np.cumsum([0, *(triple[0].size for triple in triples)])
    return tuple(combined[bounds[item]:bounds[item + 1]] for item in range(len(triples)))


# A group_concat text may not pass SQLite's length limit (10^9 bytes by default, 20 bytes or fewer a value): past
# this many rows a table is read in pieces of its key's order.
_ROWS_PER_TEXT = 20_000_000


def _concatenated(connection: sa.Connection, table: str, columns: Sequence[str], key: Sequence[str],
                  bound: str = "") -> list[np.ndarray]:
    """SQLite: integer columns (none NULL, `key`'s among them) of every row of `table` (block_stays or
    block_removals), or of those `bound` (an SQL condition) keeps, as int64 arrays in the order of `key`, the
    table's primary key (a WITHOUT ROWID table's rows lie in that order): one `group_concat` text per column,
    parsed by a compiled loop (`_parsed`) without a Python int per value or the interpreter's lock; in pieces
    of `_ROWS_PER_TEXT` rows, each after the last one's key, so that no text passes SQLite's length limit."""
    raw = connection.connection.driver_connection
    # As BLOBs: the driver hands them over as bytes, without decoding a text the size of the column.
    aggregated = ", ".join(f"CAST(group_concat({column}) AS BLOB)" for column in columns)
    ordered = ", ".join(key)

    def piece(after: str) -> list:
        terms = " AND ".join(term for term in (bound, after) if term)
        where = f" WHERE {terms}" if terms else ""
        # The key's order asked of a subquery: the aggregate alone would scan the smaller index that covers it.
        return raw.execute(f"SELECT COUNT(*), {aggregated} FROM (SELECT {', '.join(columns)} FROM {table}{where} "
                           f"ORDER BY {ordered} LIMIT {_ROWS_PER_TEXT})").fetchone()

    # Read in pieces whatever the table's size: a count first would cost a scan of its own.
    pieces, after = [], ""
    while True:
        count, *texts = piece(after)
        pieces.append([_parsed(text, count) for text in texts])
        if count < _ROWS_PER_TEXT:
            break
        last = _last_key([pieces[-1][columns.index(column)] for column in key])
        after = f"({ordered}) > ({', '.join(map(str, last))})"
    if len(pieces) == 1:
        return pieces[0]
    return [np.concatenate([part[item] for part in pieces]) for item in range(len(columns))]


def _last_key(parts: Sequence[np.ndarray]) -> tuple[int, ...]:
    """The greatest key among rows whose key columns are `parts` (whatever order the rows came in)."""
    rows = np.ones(parts[0].size, dtype=bool)
    last = []
    for part in parts:
        value = int(part[rows].max())
        rows &= part == value
        last.append(value)
    return tuple(last)


def _parsed(text: bytes | None, count: int) -> np.ndarray:
    """The `count` integers of a `group_concat` of integers (SQLite's texts of them, comma-separated), parsed
    without the interpreter's lock (`_integers_in`), so that the window's read goes on in the other thread."""
    if not count:
        return np.zeros(0, dtype=np.int64)
    values, parsed = _integers_in(np.frombuffer(text or b"", dtype=np.uint8), count)
    if parsed != count:
        raise ValueError(f"read {parsed} of {count} values" if parsed >= 0 else
                         f"read a text that is not {count} comma-separated integers")
    return values


@numba.njit(cache=True, nogil=True)
def _integers_in(text, count):
    """The integers of `text` (ASCII, each an optional '-' and digits, comma-separated, at most `count`) and how
    many were read, -1 where a byte is out of place. A 20-digit value wraps as int64 arithmetic does: SQLite
    writes none (its widest is -9223372036854775808, which wraps to itself)."""
    values = np.empty(count, dtype=np.int64)
    parsed, value, digits, negative = 0, 0, 0, False
    for byte in text:
        if byte == 44:  # ','
            if digits == 0 or parsed == count:
                return values, -1
            values[parsed] = -value if negative else value
            parsed += 1
            value, digits, negative = 0, 0, False
        elif 48 <= byte <= 57:
            value = value * 10 + (byte - 48)
            digits += 1
        elif byte == 45 and digits == 0 and not negative:  # '-'
            negative = True
        else:
            return values, -1
    if digits == 0 or parsed == count:
        return values, -1
    values[parsed] = -value if negative else value
    return values, parsed + 1


def _integer_columns(connection: sa.Connection, table: str, columns: Sequence[str], where: str) -> list[np.ndarray]:
    """PostgreSQL: integer columns (none NULL) of `table`'s rows matching `where`, as int64 arrays, in no set order.
    The server lays each row's values end to end as big-endian int8s, the rows one after the other in one bytea
    (`string_agg` of `int8send`), read as a numpy record array: a COPY hands the client one row per call, and a
    1 M-decision ledger's 16 M stays so cost seconds of Python a row at a time. A bytea holds at most 1 GB: the
    rows are read in pieces of at most `_PIECE_BYTES`, split on the second column (or the only one)."""
    count = connection.exec_driver_sql(f"SELECT COUNT(*) FROM {table} WHERE {where}").scalar() or 0
    record = np.dtype([(f"value{item}", ">i8") for item in range(len(columns))])
    pieces = max(1, -(-count * record.itemsize // _PIECE_BYTES))
    row = " || ".join(f"int8send({column}::bigint)" for column in columns)
    column = columns[min(1, len(columns) - 1)]
    read = []
    with connection.connection.driver_connection.cursor(binary=True) as cursor:
        for piece in range(pieces):
            split = f" AND (({column}::bigint % {pieces}) + {pieces}) % {pieces} = {piece}" if pieces > 1 else ""
            cursor.execute(f"SELECT string_agg({row}, ''::bytea) FROM {table} WHERE ({where}){split}")
            data = cursor.fetchone()[0]
            if data:
                read.append(np.frombuffer(data, dtype=record))
    rows = np.concatenate(read) if read else np.zeros(0, dtype=record)
    return [rows[f"value{item}"].astype(np.int64) for item in range(len(columns))]


_PIECE_BYTES = 1 << 28  # a quarter of a bytea's limit: the server's buffer for one doubles as it grows


def workers_of(connection: sa.Connection) -> list[tuple[WorkerId, int]]:
    """Every worker, in worker order, with the seq it was first seen at."""
    return [(WorkerId(row["publisher"], row["dp_rank"]), row["first_stream_seq"] or 0)
            for row in run(connection, REPLAY_WORKERS)]


def replay(
    connection: sa.Connection, settings: Sequence[tuple[str, ReuseSettings]], *, horizon_s: float,
    from_ts: float = -math.inf, to_ts: float = math.inf, placed: bool = False,
) -> Report:
    """Answer every recorded request decided in [from_ts, to_ts) again under each of `settings` (name, value),
    from SQL, with the reference model (kvledger/core/reuse.py, one request at a time): the reference the fast replay
    (kvledger/app/replay.py) is tested against. Raises ReplayRefused when SQL no longer holds the window
    (`replay_stream` reads the streams).

    `placed`: a request naming no target is answered for its fallback, where its load balancer placed it, as
    shadow decisions rank it (decide/serving/shadow.py): what reuse would transfer there. Otherwise as it was asked."""
    window = read_window(connection, horizon_s=horizon_s, from_ts=from_ts, to_ts=to_ts)
    decisions = window.decisions
    timeline = Timeline(run(connection, REPLAY_STAYS, first_seq=window.first_seq, last_seq=window.last_seq),
                        run(connection, REPLAY_WORKERS))
    judged = []
    for decision in decisions:
        horizon = decision.horizon_seq
        answers = _answers(timeline.at(decision.inventory_seq), decision, settings, placed)
        judged.append(_judged(decision, answers, None if horizon is None else _native_at(timeline.at(horizon))))
    return _report((from_ts, to_ts), horizon_s, "sql", decisions, judged, window.unreplayable, settings)


# --- from the streams ----------------------------------------------------------------------


@attrs.frozen
class _Message:
    seq: int
    data: bytes
    headers: dict[str, str]
    timestamp: float | None  # JetStream's, as store's decisions projector reads it (decided_ts)


async def _messages(js: JetStreamContext, stream: str, subject: str, timeout_s: float) -> tuple[int, list[_Message]]:
    """Every message of `stream` up to its last seq now, in stream order (one ordered pass), and its first seq."""
    state = (await js.stream_info(stream)).state
    found: list[_Message] = []
    if not state.last_seq or not state.messages:
        return state.first_seq or 0, found
    read_all = asyncio.Event()

    async def collect(message) -> None:
        seq = message.metadata.sequence.stream
        if seq <= state.last_seq:
            stamp = message.metadata.timestamp
            found.append(_Message(seq, message.data, dict(message.headers or {}),
                                  stamp.timestamp() if stamp else None))
        if seq >= state.last_seq:
            read_all.set()

    subscription = await js.subscribe(subject, stream=stream, cb=collect, ordered_consumer=True)
    try:
        await asyncio.wait_for(read_all.wait(), timeout_s)
    finally:
        await subscription.unsubscribe()
    return state.first_seq, found


def _recorded_from_record(message: _Message) -> Recorded | None:
    """A KV_DECISIONS record as store's decisions projector reads it (store/projector.py); None without its request."""
    answer = ANSWER_DECODER.decode(message.data)
    request = request_from_header(message.headers.get(REQUEST_HEADER))
    if request is None:
        return None
    relied = relied_prefix_from_header(message.headers.get(RELIED_PREFIX_HEADER))
    chosen = answer.chosen
    target_prefix = answer.overlaps[answer.target].any if answer.target in answer.overlaps else 0
    source = WorkerId(chosen.source, chosen.dp_rank) if chosen else None
    return Recorded(
        answer.request_id, message.timestamp, answer.inventory_seq, None, request.reuse_request(answer.request_id),
        request.blocks, answer.target, answer.reason, answer.baseline_blocks, source,
        Tier(chosen.tier) if chosen else None, chosen.prefix_blocks if chosen else None,
        chosen.transfer_blocks if chosen else None, chosen.saving_ms if chosen else None,
        min(target_prefix, len(relied)))


class _FoldView:
    """The fold as it stands, as `kvledger.core.reuse.decide` reads an inventory at one seq (as `_InventoryAt`)."""

    def __init__(self, fold: InventoryFold, seq: int) -> None:
        self.fold, self.inventory_seq = fold, seq

    def workers(self) -> list[WorkerId]:
        return self.fold.workers()

    def uncertain_workers(self) -> list[WorkerId]:
        return []  # reported by answers, never weighed by the model

    def unreachable_workers(self) -> list[WorkerId]:
        return []  # as from SQL (`_InventoryAt`): a replay answers on the inventory as recorded

    def holds(self, worker: WorkerId, provenance: Provenance, tier: Tier, sequence_hash: int) -> bool:
        return self.fold.holds_recorded(worker, provenance, tier, sequence_hash)


def _horizon_seqs(batches: Sequence[tuple[int, EventBatch]], thresholds: Sequence[float]) -> list[int | None]:
    """`replay_requests`' horizon seq on the stream: the seq before the first event ingested at or after each
    threshold (decided_ts + horizon), None while none has come that late."""
    return first_seq_at_or_after(((seq, batch.ingest_ts) for seq, batch in batches), thresholds)


async def read_streams(
    js: JetStreamContext, streams: StreamSettings, *, horizon_s: float, from_ts: float = -math.inf,
    to_ts: float = math.inf, timeout_s: float = 300.0,
) -> tuple[list[Recorded], int, list[tuple[int, EventBatch]]]:
    """The window's recorded decisions from KV_DECISIONS (each with its horizon seq on KV_EVENTS), how many lack
    their request, and every KV_EVENTS batch from seq 1. Raises ReplayRefused when the streams no longer hold the
    window (their retention dropped messages it needs)."""
    first_record, records = await _messages(js, streams.decisions_stream, DECISIONS_SUBJECT, timeout_s)
    if first_record > 1:
        known = min((m.timestamp for m in records if m.timestamp is not None), default=None)
        if known is None or from_ts < known:
            raise ReplayRefused(
                f"{streams.decisions_stream} holds records from seq {first_record} on (its retention dropped older "
                "ones)" + (f": replay from {known!r} on" if known is not None else ""))
    decisions, unreplayable = [], 0
    for message in records:
        if message.timestamp is None or not from_ts <= message.timestamp < to_ts:
            continue
        try:
            recorded = _recorded_from_record(message)
        except (msgspec.DecodeError, ValueError):
            continue  # store dead-letters it: no decision in SQL either
        if recorded is None:
            unreplayable += 1
        else:
            decisions.append(recorded)
    first_event, messages = await _messages(js, streams.events_stream, f"{EVENTS_SUBJECT_PREFIX}.>", timeout_s)
    if decisions and first_event > 1:
        raise ReplayRefused(f"{streams.events_stream} holds seqs from {first_event} on (its retention dropped older "
                            "ones): the fold needs every seq from 1")
    batches = []
    for message in messages:
        try:
            batches.append((message.seq, decode_batch(message.data)))
        except RecordError:
            continue  # store dead-letters it: no event in SQL either
    horizons = _horizon_seqs(batches, [decision.decided_ts + horizon_s for decision in decisions])
    decisions = [attrs.evolve(decision, horizon_seq=horizon) for decision, horizon in zip(decisions, horizons)]
    return decisions, unreplayable, batches


async def replay_stream(
    js: JetStreamContext, streams: StreamSettings, settings: Sequence[tuple[str, ReuseSettings]], *,
    horizon_s: float, from_ts: float = -math.inf, to_ts: float = math.inf, placed: bool = False,
    timeout_s: float = 300.0,
) -> Report:
    """`replay` from the streams instead of SQL (the reference, as `replay`): the window's records from
    KV_DECISIONS, and KV_EVENTS folded from its first seq (`kvledger.core.fold.InventoryFold`), each request answered by
    the fold as it stood right after its inventory seq and judged by the fold as it stood at its horizon seq.
    Raises ReplayRefused when the streams no longer hold the window (their retention dropped messages it needs)."""
    decisions, unreplayable, batches = await read_streams(js, streams, horizon_s=horizon_s, from_ts=from_ts,
                                                          to_ts=to_ts, timeout_s=timeout_s)
    judged = _judged_on_the_fold(batches, decisions, settings, placed)
    return _report((from_ts, to_ts), horizon_s, "stream", decisions, judged, unreplayable, settings)


def _judged_on_the_fold(batches: Sequence[tuple[int, EventBatch]], decisions: Sequence[Recorded],
                        settings: Sequence[tuple[str, ReuseSettings]], placed: bool) -> list:
    """One pass of the fold over the batches: each decision answered at its inventory seq, judged at its horizon
    seq (at its inventory seq when the horizon comes before it: a later fold cannot go back)."""
    # Points in seq order; at one seq, answers before judgements (a decision may be judged at its own seq).
    points = []
    for position, decision in enumerate(decisions):
        points.append((decision.inventory_seq, 0, position))
        if decision.horizon_seq is not None:
            points.append((max(decision.horizon_seq, decision.inventory_seq), 1, position))
    points.sort()
    fold = InventoryFold()
    answers: dict[int, list[Decision]] = {}
    judged: list = [None] * len(decisions)
    applied = 0
    for seq, kind, position in points:
        while applied < len(batches) and batches[applied][0] <= seq:
            fold.apply(batches[applied][1], batches[applied][0])
            applied += 1
        decision = decisions[position]
        if kind == 0:
            answers[position] = _answers(_FoldView(fold, seq), decision, settings, placed)
            if decision.horizon_seq is None:
                judged[position] = _judged(decision, answers.pop(position), None)
        else:
            judged[position] = _judged(decision, answers.pop(position), _native_at(_FoldView(fold, seq)))
    return judged


def _recorded_of(row: dict, inventory_seq: int) -> Recorded:
    source = worker_of(row["chosen_source"], row["chosen_dp_rank"]) if row["chosen_source"] is not None else None
    return Recorded(
        row["request_id"], row["decided_ts"], inventory_seq, row["horizon_seq"], _request_of(row), row["blocks"],
        row["target"], row["reason"], row["baseline_blocks"], source,
        Tier(row["chosen_tier"]) if source is not None else None, row["chosen_prefix_blocks"],
        row["chosen_transfer_blocks"], row["chosen_saving_ms"], row["target_prefix_blocks"])


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


def _recorded_outcome(recorded: Recorded, sequence: Sequence[int], holds) -> Outcome:
    """The recorded decision's outcome, its relied-on blocks as `decision_blocks` holds them."""
    source, tier = recorded.source, recorded.tier
    target = WorkerId.parse(recorded.target) if recorded.target else None
    source_hashes = _relied(sequence, recorded.baseline_blocks, recorded.prefix_blocks) if source else ()
    stale, lost = (None, None) if holds is None else judge(
        holds, source, tier, source_hashes, target, _relied(sequence, 0, recorded.target_prefix_blocks or 0))
    return Outcome(recorded.target, recorded.reason, source, tier, recorded.prefix_blocks or 0,
                   recorded.transfer_blocks or 0, recorded.saving_ms or 0.0, stale, lost)
