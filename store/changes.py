"""What one SQL transaction writes: fold facts turned into rows, with no SQL in sight.

`ChangeBuilder` keeps, for every block the fold holds, the key of its open stay
`(stored_seq, slot, placement_id)`, so a removal becomes part of a `block_removals` run
without a lookup in the database. A stay is written once; its end is part of a run of its
own (store/tables.py). New stays are kept column by column (`NewStays`): arrays travel to
the writer as bytes, and PostgreSQL loads them as one binary COPY built without a Python
object per value.
"""

from __future__ import annotations

import json
import time
from array import array
from collections.abc import Callable
from itertools import repeat

import attrs

from kvledger.core.events import Cleared, EventBatch, Gap, Provenance, Reachability, Removed, Stored, Tier, WorkerId
from kvledger.core.fold import (
    BlockKey,
    BlockReferencedFact,
    BlockRemovedFact,
    BlockStoredFact,
    Fact,
    InventoryClearedFact,
    InventoryFold,
    ReachabilityFact,
    RetainedConflictFact,
    UncertaintyFact,
)

RowKey = tuple[int, int, int]  # (stored_seq, slot, placement_id)
# (worker, provenance) -> tier -> (group, ownership, engine hash) -> key of the open residency row
ResidencyIndex = dict[tuple[WorkerId, Provenance], dict[Tier, dict[BlockKey, RowKey]]]

# Positions in a stay row (the column order of store.tables.block_stays).
STAY_COLUMNS = (
    "stored_seq", "engine_hash", "sequence_hash", "parent_hash", "local_hash", "stored_ts", "conflict_since", "slot",
    "placement_id", "refs", "unresolved",
)  # fmt: skip
REMOVAL_COLUMNS = ("stored_seq", "removed_seq", "removed_ts", "placement_id", "first_slot", "last_slot", "removal_cause")
# What a placement is (store.tables.placements without its id), in this order.
PLACEMENT_COLUMNS = (
    "publisher", "dp_rank", "provenance", "tier", "group_idx", "ownership", "kv_cache_spec_kind", "sliding_window",
)  # fmt: skip
PlacementIds = Callable[[tuple], int]  # a placement's values -> its id (store.fold_loader.PlacementIds)
EVENT_LOG_COLUMNS = (
    "stream_seq", "event_idx", "publisher", "dp_rank", "epoch", "engine_seq", "provenance", "kind", "tier",
    "block_count", "gap_reason", "gap_expected_seq", "gap_received_seq", "engine_ts", "ingest_ts",
    "group_idx", "ownership",
)  # fmt: skip
# The columns of a decision_verdicts row, in order (store.tables.decision_verdicts).
VERDICT_COLUMNS = (
    "stream_seq", "horizon_ms", "horizon_seq", "stale", "source_blocks", "source_gone", "source_gone_after_ms",
    "first_eviction_ms", "lost_credit", "target_blocks", "target_gone", "target_gone_after_ms", "shadow_stale",
    "shadow_source_blocks", "shadow_source_gone", "shadow_source_gone_after_ms", "shadow_first_eviction_ms",
    "inflight_blocks", "inflight_gone", "judged_by",
)  # fmt: skip
UNCERTAIN_COLUMNS = ("publisher", "dp_rank", "provenance", "since_seq", "since_ts", "reason", "until_seq", "until_ts", "resolved_by")
UNREACHABLE_COLUMNS = ("publisher", "dp_rank", "provenance", "since_seq", "since_ts", "reason", "until_seq", "until_ts")
DEAD_LETTER_COLUMNS = (
    "source", "stream_seq", "subject", "publisher", "dp_rank", "endpoint", "reason", "frames", "raw", "ingest_ts", "recorded_ts",
)  # fmt: skip
WORKER_COLUMNS = (
    "publisher", "dp_rank", "epoch", "engine_seq", "uncertain_since", "retained_epoch", "retained_engine_seq",
    "retained_uncertain_since", "first_stream_seq", "last_stream_seq", "last_ingest_ts", "counters", "kv_cache_groups",
    "unreachable_since", "retained_unreachable_since",
)  # fmt: skip


@attrs.define
class NewStays:
    """Stays begun in one transaction, column by column, in the order they were stored.

    Hashes are kept unsigned, as the core has them: SQL's signed value has the same bits, so
    the writer reinterprets the arrays instead of converting each value. The rare values
    live beside the columns, by row: a root block's missing parent, a conflict, more than one
    reference, an unresolved store.
    """

    stored_seq: array = attrs.field(factory=lambda: array("q"))
    slot: array = attrs.field(factory=lambda: array("i"))
    placement_id: array = attrs.field(factory=lambda: array("i"))
    engine_hash: array = attrs.field(factory=lambda: array("Q"))
    sequence_hash: array = attrs.field(factory=lambda: array("Q"))
    parent_hash: array = attrs.field(factory=lambda: array("Q"))  # 0 where the row is in `no_parent`
    local_hash: array = attrs.field(factory=lambda: array("Q"))
    stored_ts: array = attrs.field(factory=lambda: array("d"))
    no_parent: set[int] = attrs.field(factory=set)
    conflict_since: dict[int, int] = attrs.field(factory=dict)
    refs: dict[int, int] = attrs.field(factory=dict)  # only where more than one
    unresolved: set[int] = attrs.field(factory=set)

    def __len__(self) -> int:
        return len(self.stored_seq)

    def rows(self) -> list[tuple]:
        """The stays as rows of STAY_COLUMNS, hashes signed (for a driver that takes rows)."""
        signed = [array("q", column.tobytes()) for column in (self.engine_hash, self.sequence_hash, self.parent_hash, self.local_hash)]
        parent = signed[2]
        if self.no_parent:
            parent = parent.tolist()
            for row in self.no_parent:
                parent[row] = None
        nothing = [None] * len(self)
        rows = list(zip(self.stored_seq, signed[0], signed[1], parent, signed[3], self.stored_ts, nothing, self.slot,
                        self.placement_id, nothing, nothing))  # fmt: skip
        for column, values in ((6, self.conflict_since), (9, self.refs), (10, dict.fromkeys(self.unresolved, True))):
            for row, value in values.items():
                rows[row] = (*rows[row][:column], value, *rows[row][column + 1:])
        return rows


@attrs.define
class ChangeSet:
    """Everything one transaction of the events projector writes, in the order it must be written."""

    first_seq: int
    last_seq: int = 0
    event_rows: list[tuple] = attrs.field(factory=list)
    new_stays: NewStays = attrs.field(factory=NewStays)  # stays begun in this transaction
    # block_removals runs, any stay's (ChangeBuilder.finish makes them from one row per stay)
    removals: list[tuple] = attrs.field(factory=list)
    references: list[tuple] = attrs.field(factory=list)  # (refs, placement_id, stored_seq, slot)
    conflicts: list[tuple] = attrs.field(factory=list)  # (conflict_since, placement_id, stored_seq, slot)
    # (publisher, dp_rank, provenance) -> periods opened in this transaction, oldest first
    new_uncertain: dict[tuple, list[list]] = attrs.field(factory=dict)
    # (until_seq, until_ts, resolved_by, publisher, dp_rank, provenance)
    resolved_uncertain: list[tuple] = attrs.field(factory=list)
    # unreachable_periods opened in this transaction (rows of UNREACHABLE_COLUMNS, oldest first), and
    # (until_seq, until_ts, publisher, dp_rank, provenance) ending one opened before it
    new_unreachable: list[list] = attrs.field(factory=list)
    reached_again: list[tuple] = attrs.field(factory=list)
    # worker -> (first stream seq in this transaction, last stream seq, its ingest ts)
    workers: dict[WorkerId, tuple[int, int, float]] = attrs.field(factory=dict)
    worker_rows: list[tuple] = attrs.field(factory=list)
    dead_letters: list[tuple] = attrs.field(factory=list)
    verdicts: list[tuple] = attrs.field(factory=list)  # decision_verdicts rows this transaction settles
    checkpoint_counters: str = "{}"
    blocks: int = 0  # block facts, for throughput metrics

    @property
    def uncertain_rows(self) -> list[list]:
        return [row for rows in self.new_uncertain.values() for row in rows]

    @property
    def rows(self) -> int:
        """Rows this transaction inserts into the history tables (what their statistics follow)."""
        return len(self.new_stays) + len(self.removals) + len(self.event_rows)


class ChangeBuilder:
    """Turns (batch, stream seq, facts) into a ChangeSet, tracking open stays and placements."""

    def __init__(self, index: ResidencyIndex | None, placement_ids: PlacementIds) -> None:
        self.index: ResidencyIndex = index if index is not None else {}
        self._placement_ids = placement_ids
        self._placements: dict[tuple, int] = {}  # (worker, provenance, tier, group, ownership, kind, window) -> id
        # This transaction's stays, turned into NewStays' columns by `finish` (a column built
        # from a list at once costs a fraction of appending each value as it comes).
        self._stored: list = []  # fold records, in the order stored
        self._stored_places: list[int] = []
        self._stored_batches: list[tuple[int, float, int]] = []  # (stored_seq, ts, stays)
        self._first_row: dict[int, int] = {}  # stored_seq -> row of its slot 0
        self._refs: dict[int, int] = {}  # row -> references, changed after the store in this transaction
        self._conflicts: dict[int, int] = {}  # row -> seq it began to conflict, likewise

    def begin(self, first_seq: int) -> ChangeSet:
        self._stored, self._stored_places, self._stored_batches = [], [], []
        self._first_row, self._refs, self._conflicts = {}, {}, {}
        return ChangeSet(first_seq)

    def _row(self, key: RowKey) -> int | None:
        """The row in this transaction's stays of the stay `key`; None for a stay stored before it."""
        first = self._first_row.get(key[0])
        return None if first is None else first + key[1]

    def placement(self, record) -> int:
        """The placement id of a fold record's worker, tier, provenance, group, ownership, kind and window."""
        key = (record.worker, record.provenance, record.tier, record.group_idx, record.ownership, record.spec_kind,
               record.sliding_window)  # fmt: skip
        found = self._placements.get(key)
        if found is None:
            worker = record.worker
            found = self._placements[key] = self._placement_ids((
                worker.publisher, worker.dp_rank, record.provenance.value, record.tier.value, record.group_idx,
                record.ownership, record.spec_kind, record.sliding_window,
            ))  # fmt: skip
        return found

    def add_batch(self, changes: ChangeSet, batch: EventBatch, stream_seq: int, facts: list[Fact], fold: InventoryFold) -> None:
        changes.last_seq = stream_seq
        worker = batch.worker
        publisher, dp_rank, provenance = worker.publisher, worker.dp_rank, batch.provenance.value
        head = (stream_seq, 0, publisher, dp_rank, batch.epoch, batch.seq, provenance)
        tail = (batch.engine_ts, batch.ingest_ts)
        for idx, event in enumerate(batch.events):
            kind = type(event)
            if kind is Stored:
                row = ("stored", event.tier.value, len(event.block_hashes), None, None, None)
                place = (event.group_idx, event.ownership)
            elif kind is Removed:
                row = ("removed", event.tier.value, len(event.block_hashes), None, None, None)
                place = (event.group_idx, event.ownership)
            elif kind is Cleared:
                row = ("cleared", None if event.tier is None else event.tier.value, 0, None, None, None)
                place = (None, None)
            elif kind is Gap:
                row = ("gap", None, 0, event.reason.value, event.expected_seq, event.received_seq)
                place = (None, None)
            else:
                assert kind is Reachability
                row = ("reachable" if event.reachable else "unreachable", None, 0, None, None, None)
                place = (None, None)
            changes.event_rows.append((stream_seq, idx, *head[2:], *row, *tail, *place))
        if facts:
            self._add_facts(changes, facts, stream_seq, batch.ingest_ts, worker, batch.provenance)
        previous = changes.workers.get(worker)
        changes.workers[worker] = (stream_seq if previous is None else previous[0], stream_seq, batch.ingest_ts)

    def _add_facts(
        self, changes: ChangeSet, facts: list[Fact], stream_seq: int, ts: float, worker: WorkerId, provenance: Provenance
    ) -> None:
        # The hot path: one batch's stores and removals all belong to its worker and provenance,
        # so their index is looked up once, and a run of stores in one placement reuses its id;
        # a removal names its stay by key alone.
        index, removals = self.index, changes.removals
        stored, places = self._stored, self._stored_places
        self._first_row[stream_seq] = len(stored)  # before the facts: a later fact may name a stay of this batch
        owner = (worker, provenance)
        held = index.get(owner)
        if held is None:
            held = index[owner] = {}
        last_tier, tier_held = None, None
        last_place, place = None, 0
        slot = removed = 0
        for fact in facts:
            kind = type(fact)
            if kind is BlockStoredFact or kind is BlockRemovedFact:
                record = fact.record
                if record.provenance is not owner[1]:
                    # A store of one provenance resolving the other's placeholders (the fold's
                    # `_resolve_waiting`) changes that provenance's records: their own index.
                    owner = (worker, record.provenance)
                    held = index.get(owner)
                    if held is None:
                        held = index[owner] = {}
                    last_tier = last_place = None
                if record.tier is not last_tier:
                    last_tier = record.tier
                    tier_held = held.get(last_tier)
                    if tier_held is None:
                        tier_held = held[last_tier] = {}
                if kind is BlockStoredFact:
                    where = (record.tier, record.group_idx, record.ownership, record.spec_kind, record.sliding_window)
                    if where != last_place:
                        last_place, place = where, self.placement(record)
                    stored.append(record)
                    places.append(place)
                    tier_held[record.key] = (stream_seq, slot, place)
                    slot += 1
                else:
                    key = tier_held.pop(record.key)
                    removed += 1
                    # (`_value_`: the member's own attribute, not Enum's `value` property, once per block)
                    removals.append((key[2], key[0], key[1], stream_seq, ts, fact.cause._value_))
            elif kind is BlockReferencedFact:
                record = fact.record
                key = index[(record.worker, record.provenance)][record.tier][record.key]
                row = self._row(key)
                if row is not None:
                    self._refs[row] = record.refs
                else:
                    changes.references.append((record.refs, key[2], key[0], key[1]))
            elif kind is InventoryClearedFact:
                if fact.tier is None:
                    cleared = index.pop((fact.worker, fact.provenance), None) or {}
                    if (fact.worker, fact.provenance) == owner:
                        held = index[owner] = {}
                else:
                    owned = index.get((fact.worker, fact.provenance)) or {}
                    cleared = {fact.tier: owned.pop(fact.tier, {})}
                last_tier = None
                # Every stay the clear ends, by its key: the index holds each open stay of the worker (load_fold
                # rebuilds it from SQL), so a clear costs what the worker held, never a scan of its history.
                cause = fact.cause.value
                blocks = len(removals)
                removals.extend((key[2], key[0], key[1], stream_seq, ts, cause)
                                for tier_held in cleared.values() for key in tier_held.values())
                changes.blocks += len(removals) - blocks
            elif kind is RetainedConflictFact:
                record = fact.record
                key = index[(record.worker, record.provenance)][record.tier][record.key]
                row = self._row(key)
                if row is not None:
                    self._conflicts[row] = stream_seq
                else:
                    changes.conflicts.append((stream_seq, key[2], key[0], key[1]))
            elif kind is ReachabilityFact:
                period = (fact.worker.publisher, fact.worker.dp_rank, fact.provenance.value)
                if not fact.reachable:
                    changes.new_unreachable.append([*period, stream_seq, fact.since_ts, fact.reason, None, None])
                else:
                    opened = [row for row in changes.new_unreachable if tuple(row[:3]) == period and row[6] is None]
                    if opened:
                        opened[-1][6], opened[-1][7] = stream_seq, fact.since_ts
                    else:
                        changes.reached_again.append((stream_seq, fact.since_ts, *period))
            else:
                assert kind is UncertaintyFact
                period = (fact.worker.publisher, fact.worker.dp_rank, fact.provenance.value)
                opened = changes.new_uncertain.setdefault(period, [])
                if fact.uncertain:
                    opened.append([*period, stream_seq, ts, fact.reason, None, None, None])
                else:
                    row = opened[-1] if opened else None
                    if row is not None and row[6] is None:
                        row[6], row[7], row[8] = stream_seq, ts, fact.reason
                    else:
                        changes.resolved_uncertain.append((stream_seq, ts, fact.reason, *period))
        if slot:
            self._stored_batches.append((stream_seq, ts, slot))
        changes.blocks += slot + removed

    def add_dead_letter(self, changes: ChangeSet, stream_seq: int, subject: str, reason: str, raw: bytes) -> None:
        changes.last_seq = stream_seq
        changes.dead_letters.append(("events", stream_seq, subject, None, None, None, reason, 1, raw, None, time.time()))

    def finish(self, changes: ChangeSet, fold: InventoryFold) -> ChangeSet:
        """Render what is per transaction rather than per batch: worker rows and counters."""
        for worker, (first, last, ingest_ts) in changes.workers.items():
            state = fold.worker_state(worker)
            native, retained = state.position(Provenance.NATIVE), state.position(Provenance.RETAINED)
            changes.worker_rows.append((
                worker.publisher, worker.dp_rank, native.epoch, native.seq, native.uncertain_since,
                retained.epoch, retained.seq, retained.uncertain_since,
                first, last, ingest_ts, json.dumps(dict(state.counters), sort_keys=True),
                json.dumps({"native": native.groups, "retained": retained.groups}, sort_keys=True),
                _unreachable_since(native), _unreachable_since(retained),
            ))  # fmt: skip
        changes.checkpoint_counters = json.dumps(dict(fold.counters), sort_keys=True)
        changes.removals = removal_runs(changes.removals)
        self._finish_stays(changes.new_stays)
        return changes

    def _finish_stays(self, stays: NewStays) -> None:
        records = self._stored
        if not records:
            return
        for stored_seq, ts, count in self._stored_batches:
            stays.stored_seq.extend(repeat(stored_seq, count))
            stays.slot.extend(range(count))
            stays.stored_ts.extend(repeat(ts, count))
        stays.placement_id.extend(self._stored_places)
        stays.engine_hash.extend([record.engine_hash for record in records])
        stays.sequence_hash.extend([record.sequence_hash for record in records])
        stays.local_hash.extend([record.local_hash for record in records])
        parents = [record.parent_hash for record in records]
        if None in parents:
            stays.no_parent.update(row for row, parent in enumerate(parents) if parent is None)
            parents = [0 if parent is None else parent for parent in parents]
        stays.parent_hash.extend(parents)
        for row in [row for row, record in enumerate(records) if record.conflict or record.unresolved or record.refs != 1]:
            record = records[row]
            if record.conflict:
                stays.conflict_since[row] = stays.stored_seq[row]
            if record.refs != 1:
                stays.refs[row] = record.refs
            if record.unresolved:
                stays.unresolved.add(row)
        stays.conflict_since.update(self._conflicts)
        for row, refs in self._refs.items():
            if refs == 1:
                stays.refs.pop(row, None)
            else:
                stays.refs[row] = refs


def _unreachable_since(position) -> int | None:
    """The stream seq since which the provenance's engine is unreachable (kept in its groups state by the fold)."""
    unreachable = position.groups.get("unreachable")
    return None if not unreachable else unreachable["since"]


def removal_runs(ends: list[tuple]) -> list[tuple]:
    """Stays' ends (placement_id, stored_seq, slot, removed_seq, removed_ts, cause) → block_removals runs.

    Consecutive slots of one stored batch in one placement, ended at one seq for one cause,
    become one row (REMOVAL_COLUMNS); the ends may come in any order.
    """
    runs: list[list] = []  # each a row of REMOVAL_COLUMNS, its last_slot growing
    for place, stored_seq, slot, removed_seq, removed_ts, cause in sorted(ends):
        run = runs[-1] if runs else None
        if (run is not None and run[3] == place and run[0] == stored_seq and run[5] == slot - 1
                and run[1] == removed_seq and run[6] == cause):
            run[5] = slot
        else:
            runs.append([stored_seq, removed_seq, removed_ts, place, slot, slot, cause])
    return [tuple(run) for run in runs]
