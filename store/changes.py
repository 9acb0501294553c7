"""What one SQL transaction writes: fold facts turned into rows, with no SQL in sight.

`ChangeBuilder` keeps, for every block the fold holds, the key of its open stay
`(stored_seq, slot)`, so a removal becomes a `block_removals` row without a lookup in the
database. A stay is written once; its end is a row of its own (store/tables.py).
"""

from __future__ import annotations

import json
import time

from collections.abc import Callable

import attrs

from kvledger.events import Cleared, EventBatch, Gap, Provenance, Removed, Stored, Tier, WorkerId
from kvledger.fold import (
    BlockKey,
    BlockReferencedFact,
    BlockRemovedFact,
    BlockStoredFact,
    Fact,
    InventoryClearedFact,
    InventoryFold,
    RetainedConflictFact,
    UncertaintyFact,
)

RowKey = tuple[int, int]  # (stored_seq, slot)
# (worker, provenance) -> tier -> (group, ownership, engine hash) -> key of the open residency row
ResidencyIndex = dict[tuple[WorkerId, Provenance], dict[Tier, dict[BlockKey, RowKey]]]
_U64 = 1 << 64
_I64_LIMIT = 1 << 63

# Positions in a stay row (the column order of store.tables.block_stays).
STAY_COLUMNS = (
    "stored_seq", "engine_hash", "sequence_hash", "parent_hash", "local_hash", "stored_ts", "conflict_since", "slot",
    "placement_id", "refs", "unresolved",
)  # fmt: skip
REMOVAL_COLUMNS = ("stored_seq", "removed_seq", "removed_ts", "slot", "removal_cause")
# What a placement is (store.tables.placements without its id), in this order.
PLACEMENT_COLUMNS = (
    "publisher", "dp_rank", "provenance", "tier", "group_idx", "ownership", "kv_cache_spec_kind", "sliding_window",
)  # fmt: skip
PlacementIds = Callable[[tuple], int]  # a placement's values -> its id (store.recorder.PlacementIds)
_CONFLICT, _REFS = 6, 9
_ALL_TIERS = tuple(tier.value for tier in Tier)
EVENT_LOG_COLUMNS = (
    "stream_seq", "event_idx", "publisher", "dp_rank", "epoch", "engine_seq", "provenance", "kind", "tier",
    "block_count", "gap_reason", "gap_expected_seq", "gap_received_seq", "engine_ts", "ingest_ts",
    "group_idx", "ownership",
)  # fmt: skip
UNCERTAIN_COLUMNS = ("publisher", "dp_rank", "provenance", "since_seq", "since_ts", "reason", "until_seq", "until_ts", "resolved_by")
DEAD_LETTER_COLUMNS = (
    "source", "stream_seq", "subject", "publisher", "dp_rank", "endpoint", "reason", "frames", "raw", "ingest_ts", "recorded_ts",
)  # fmt: skip
WORKER_COLUMNS = (
    "publisher", "dp_rank", "epoch", "engine_seq", "uncertain_since", "retained_epoch", "retained_engine_seq",
    "retained_uncertain_since", "first_stream_seq", "last_stream_seq", "last_ingest_ts", "counters", "kv_cache_groups",
)  # fmt: skip


@attrs.define
class ChangeSet:
    """Everything one transaction of the events projector writes, in the order it must be written."""

    first_seq: int
    last_seq: int = 0
    event_rows: list[tuple] = attrs.field(factory=list)
    # (stored_seq, slot) -> stay row, for stays begun in this transaction
    new_residency: dict[RowKey, list] = attrs.field(factory=dict)
    removals: list[tuple] = attrs.field(factory=list)  # block_removals rows, any stay's
    # (removed_seq, removed_ts, cause, publisher, dp_rank, provenance, *four tier names):
    # end every open stay of that worker on those tiers begun before this transaction
    clears: list[tuple] = attrs.field(factory=list)
    references: list[tuple] = attrs.field(factory=list)  # (refs, stored_seq, slot)
    conflicts: list[tuple] = attrs.field(factory=list)  # (conflict_since, stored_seq, slot)
    # (publisher, dp_rank, provenance) -> periods opened in this transaction, oldest first
    new_uncertain: dict[tuple, list[list]] = attrs.field(factory=dict)
    # (until_seq, until_ts, resolved_by, publisher, dp_rank, provenance)
    resolved_uncertain: list[tuple] = attrs.field(factory=list)
    # worker -> (first stream seq in this transaction, last stream seq, its ingest ts)
    workers: dict[WorkerId, tuple[int, int, float]] = attrs.field(factory=dict)
    worker_rows: list[tuple] = attrs.field(factory=list)
    dead_letters: list[tuple] = attrs.field(factory=list)
    checkpoint_counters: str = "{}"
    blocks: int = 0  # block facts, for throughput metrics

    @property
    def uncertain_rows(self) -> list[list]:
        return [row for rows in self.new_uncertain.values() for row in rows]


class ChangeBuilder:
    """Turns (batch, stream seq, facts) into a ChangeSet, tracking open stays and placements."""

    def __init__(self, index: ResidencyIndex | None, placement_ids: PlacementIds) -> None:
        self.index: ResidencyIndex = index if index is not None else {}
        self._placement_ids = placement_ids
        self._placements: dict[tuple, int] = {}  # (worker, provenance, tier, group, ownership, kind, window) -> id

    def begin(self, first_seq: int) -> ChangeSet:
        return ChangeSet(first_seq)

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
            else:
                assert kind is Gap
                row = ("gap", None, 0, event.reason.value, event.expected_seq, event.received_seq)
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
        index, new_rows, removals = self.index, changes.new_residency, changes.removals
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
                if record.tier is not last_tier:
                    last_tier = record.tier
                    tier_held = held.get(last_tier)
                    if tier_held is None:
                        tier_held = held[last_tier] = {}
                if kind is BlockStoredFact:
                    where = (record.tier, record.group_idx, record.ownership, record.spec_kind, record.sliding_window)
                    if where != last_place:
                        last_place, place = where, self.placement(record)
                    key = (stream_seq, slot)
                    engine, sequence, parent, local = record.engine_hash, record.sequence_hash, record.parent_hash, record.local_hash
                    refs = record.refs
                    new_rows[key] = [
                        stream_seq,
                        engine - _U64 if engine >= _I64_LIMIT else engine,
                        sequence - _U64 if sequence >= _I64_LIMIT else sequence,
                        None if parent is None else (parent - _U64 if parent >= _I64_LIMIT else parent),
                        local - _U64 if local >= _I64_LIMIT else local,
                        ts, stream_seq if record.conflict else None, slot, place, None if refs == 1 else refs,
                        True if record.unresolved else None,
                    ]  # fmt: skip
                    slot += 1
                    tier_held[record.key] = key
                else:
                    key = tier_held.pop(record.key)
                    removed += 1
                    removals.append((key[0], stream_seq, ts, key[1], fact.cause.value))
            elif kind is BlockReferencedFact:
                record = fact.record
                key = index[(record.worker, record.provenance)][record.tier][record.key]
                row = new_rows.get(key)
                if row is not None:
                    row[_REFS] = None if record.refs == 1 else record.refs
                else:
                    changes.references.append((record.refs, key[0], key[1]))
            elif kind is InventoryClearedFact:
                if fact.tier is None:
                    cleared = index.pop((fact.worker, fact.provenance), None) or {}
                    if fact.worker == worker and fact.provenance is provenance:
                        held = index[owner] = {}
                    tiers = _ALL_TIERS
                else:
                    owned = index.get((fact.worker, fact.provenance)) or {}
                    cleared = {fact.tier: owned.pop(fact.tier, {})}
                    tiers = (fact.tier.value,) * len(_ALL_TIERS)
                last_tier = None
                older = False
                blocks = 0
                for key in (key for tier_held in cleared.values() for key in tier_held.values()):
                    blocks += 1
                    if key in new_rows:
                        removals.append((key[0], stream_seq, ts, key[1], fact.cause.value))
                    else:
                        older = True
                if older:
                    changes.clears.append((
                        stream_seq, ts, fact.cause.value, fact.worker.publisher, fact.worker.dp_rank,
                        fact.provenance.value, *tiers,
                    ))  # fmt: skip
                changes.blocks += blocks
            elif kind is RetainedConflictFact:
                record = fact.record
                key = index[(record.worker, record.provenance)][record.tier][record.key]
                row = new_rows.get(key)
                if row is not None:
                    row[_CONFLICT] = stream_seq
                else:
                    changes.conflicts.append((stream_seq, key[0], key[1]))
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
            ))  # fmt: skip
        changes.checkpoint_counters = json.dumps(dict(fold.counters), sort_keys=True)
        return changes
