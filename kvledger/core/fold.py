"""The inventory fold: canonical batches in, per-worker block inventory and facts out.

A pure state machine shared by store (which writes the facts to SQL) and decide (which
indexes the state). docs/core.md gives the rules; each is marked where it is applied.
"""

from __future__ import annotations

import base64
import enum
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import attrs
import msgspec

from kvledger.core.events import (
    Cleared,
    Event,
    EventBatch,
    Gap,
    GapReason,
    Provenance,
    Reachability,
    Removed,
    Stored,
    Tier,
    WorkerId,
    decode_batch,
    encode_batch,
)
from kvledger.core import precedence
from kvledger.core.hashing import chain_hash, sequence_hashes
from kvledger.core.residency import ResidencyRule, rule_for

NATIVE = Provenance.NATIVE
RETAINED = Provenance.RETAINED


class RemovalCause(enum.Enum):
    REMOVED = "removed"
    CLEARED = "cleared"
    RESTART = "restart"
    RESOLVED = "resolved"  # an unresolved record replaced by its resolved copy, stored at that seq


# A block's identity within one provenance and tier of a worker: (group_idx, ownership,
# engine hash). A removal in one KV-cache group or offload ownership never touches another.
# Kept as the plain engine hash for group 0 without ownership, nearly every block: a
# tuple per held block cost 80 bytes in every inventory dict keyed by it.
BlockKey = int | tuple[int, str | None, int]


def block_key(group_idx: int, ownership: str | None, engine_hash: int) -> BlockKey:
    """The key a block is held under: `(group_idx, ownership, engine_hash)`, or the engine hash alone for (0, None)."""
    return engine_hash if group_idx == 0 and ownership is None else (group_idx, ownership, engine_hash)


class BlockRecord(msgspec.Struct, frozen=True, gc=False):
    """One block held by a worker on one tier, group and ownership, as announced with one provenance.

    `conflict` marks a retained record whose topology disagrees with the engine's own;
    `unresolved` a store without tokens whose block the worker's engine-hash map did not
    know (its hashes are unknown, recorded as 0). Both are kept for audit, never indexed.
    `refs` counts repeated announcements of the same block: an engine may store one hash
    twice (vLLM's offloading connector re-announces shared chunks) and remove it once per store.

    A Struct the garbage collector does not track (it holds no containers, so no cycles):
    a fleet's inventory is millions of records, and tracked ones made each full collection
    scan them all (0.8 s at a million residencies, every store and decide stalled by it).
    """

    worker: WorkerId
    tier: Tier
    provenance: Provenance
    engine_hash: int
    sequence_hash: int
    parent_hash: int | None
    local_hash: int
    stream_seq: int
    conflict: bool = False
    group_idx: int = 0
    ownership: str | None = None
    spec_kind: str | None = None
    sliding_window: int | None = None
    refs: int = 1
    unresolved: bool = False

    @property
    def key(self) -> BlockKey:
        return block_key(self.group_idx, self.ownership, self.engine_hash)

    @property
    def indexable(self) -> bool:
        return not (self.conflict or self.unresolved)


# --- facts: what one batch changed, in order --------------------------------------------


# Facts are Structs the garbage collector does not track, like the records they carry: one is
# made per block stored or removed, and msgspec makes one in a fifth of the time attrs's frozen
# __init__ takes (about 0.2 microseconds less per block).


class BlockStoredFact(msgspec.Struct, frozen=True, gc=False):
    record: BlockRecord


class BlockRemovedFact(msgspec.Struct, frozen=True, gc=False):
    record: BlockRecord
    cause: RemovalCause
    stream_seq: int


class BlockReferencedFact(msgspec.Struct, frozen=True, gc=False):
    """A held block was announced again, or removed once of several times: `record.refs` changed."""

    record: BlockRecord
    stream_seq: int


class InventoryClearedFact(msgspec.Struct, frozen=True, gc=False):
    """Every block of `provenance` on the worker (on `tier`, or every tier) went away at once."""

    worker: WorkerId
    provenance: Provenance
    cause: RemovalCause
    stream_seq: int
    blocks: int
    tier: Tier | None = None


class RetainedConflictFact(msgspec.Struct, frozen=True, gc=False):
    """A retained record lost to native topology after it was stored; now audit-only."""

    record: BlockRecord
    stream_seq: int


class UncertaintyFact(msgspec.Struct, frozen=True, gc=False):
    worker: WorkerId
    provenance: Provenance
    uncertain: bool
    reason: str
    stream_seq: int


class ReachabilityFact(msgspec.Struct, frozen=True, gc=False):
    """ingest lost (or found again) the engine behind one provenance of a worker.

    `since_ts` is the event's (when the change began); the inventory is kept either way:
    an unreachable worker is not credited, and when it is back ingest's incarnation check
    says whether its inventory still stands (a continuation) or was emptied (a restart Gap).
    """

    worker: WorkerId
    provenance: Provenance
    reachable: bool
    reason: str
    since_ts: float
    stream_seq: int


Fact = (
    BlockStoredFact | BlockRemovedFact | BlockReferencedFact | InventoryClearedFact | RetainedConflictFact
    | UncertaintyFact | ReachabilityFact
)


COUNTER_NAMES = (
    "unknown_parent",  # stored with a parent the worker does not hold: a new chain starts
    "unknown_remove",  # removed a block the worker does not hold
    "duplicate_store",  # stored a block already held on that tier, group and ownership: one more reference
    "unresolved_store",  # a store without tokens whose block the worker's engine-hash map did not know
    "retained_conflict",  # retained record disagreeing with native topology
    "native_reparent",  # the engine re-announced a block under a different parent
    "duplicate_batch",  # (epoch, seq) not after the worker's last one, and not a seq a hole skipped
    "late_batch",  # (epoch, seq) not after the worker's last one, but a seq a hole skipped: dropped
    "sequence_hole",  # seq more than one past the last one, with no Gap saying why: uncertain
    "held_batch",  # a batch held back behind a hole (applied once the hole fills or is given up on)
    "healed_hole",  # a hole filled by its missing batches (fetched again by ingest): the uncertainty ends
    "hole_given_up",  # a hole waited for HOLE_WAIT_MESSAGES messages or HOLE_MAX_HELD batches: applied over it
    "stale_epoch",  # batch from an epoch older than the worker's current one
    "implicit_restart",  # epoch rose without a Gap(publisher_restart) first
    "redelivered",  # stream seq not after the fold's last one
)


class _TopologyEntry(msgspec.Struct, gc=False):
    """Where one engine hash sits in the chain, and how many indexable records hold it (untracked, as records are)."""

    sequence_hash: int
    parent_hash: int | None
    local_hash: int
    refs: int


class _DictPerTier(dict):
    """A dict per tier, made when first written through: most workers use one or two of the
    four tiers, and a fleet of a thousand workers kept thousands of empty containers. Reads
    that must not make one use `.get`. (What is made is a class attribute: an instance
    dict would cost more than the containers saved.)"""

    __slots__ = ()
    _make: Callable[[], object] = dict

    def __missing__(self, tier: Tier):
        made = self[tier] = self._make()
        return made


class _SetPerTier(_DictPerTier):
    """A set per tier, made when first written through."""

    __slots__ = ()
    _make = set


# How long a hole mid-stream is waited for (docs/core.md, "Holes healed"): a batch stored after a hole in its
# worker's seqs is held back, with the ones after it, until the missing seqs come (ingest fetches them again
# from the engine when store or decide asks: `take_holes`) or until the worker's own batches have come this many
# KV_EVENTS messages after the hole, or this many are held; then they are applied as before, the worker
# uncertain. Counted in stream messages, not time, so that every fold of one stream decides alike.
HOLE_WAIT_MESSAGES = 20_000
HOLE_MAX_HELD = 256


@attrs.frozen
class HoleToFetch:
    """Seqs [first, end) of one provenance's epoch that the fold is waiting for: what ingest is asked to fetch."""

    worker: WorkerId
    provenance: Provenance
    epoch: int
    first: int
    end: int


@attrs.define
class BehindHole:
    """The batches held back behind a hole, in seq order, since stream seq `since`; `healable`: the hole made
    the worker uncertain (not something before it) and nothing since said the seqs are lost."""

    since: int
    healable: bool
    held: list[EventBatch] = attrs.field(factory=list)

    def state(self) -> dict:
        return {"since": self.since, "healable": self.healable,
                "held": [base64.b64encode(encode_batch(batch)).decode("ascii") for batch in self.held]}

    @classmethod
    def of_state(cls, state: dict) -> BehindHole:
        return cls(state["since"], state["healable"],
                   [decode_batch(base64.b64decode(record)) for record in state["held"]])


@attrs.define
class _ProvenanceState:
    """Everything one provenance of one worker announced."""

    records: dict[Tier, dict[BlockKey, BlockRecord]] = attrs.field(factory=_DictPerTier)
    # group -> sequence hash -> number of indexable records of that group on that tier
    # (several engine hashes or ownerships can share one sequence hash)
    held: dict[Tier, dict[int, Counter[int]]] = attrs.field(factory=_DictPerTier)
    # the groups that have stored on each tier since it was last cleared: a group whose
    # blocks all left a tier still holds none of them there (snapshots and SQL keep it)
    tier_groups: dict[Tier, set[int]] = attrs.field(factory=_SetPerTier)
    # each KV-cache group's kind as its stores last declared it (a property of the engine's
    # configuration, so it outlives the records that declared it; snapshots and SQL keep it)
    group_kinds: dict[int, str] = attrs.field(factory=dict)
    # per tier, the residency rule for the groups seen there (derived, dropped when they change)
    rules: dict[Tier, ResidencyRule] = attrs.field(factory=dict)
    # every (group, ownership) an indexable record was attached under: where the copies of
    # one engine hash can be, so finding them takes a few lookups, not a scan
    placements: set[tuple[int, str | None]] = attrs.field(factory=set)
    # engine hash -> where its unresolved records are, to resolve them once it is known
    waiting: dict[int, list[tuple[Tier, BlockKey]]] = attrs.field(factory=dict)
    # engine hash -> where it sits in the chain, for resolving parents: the record itself
    # while it is the only copy, else an entry counting the copies
    topology: dict[int, _TopologyEntry | BlockRecord] = attrs.field(factory=dict)
    epoch: int | None = None
    seq: int | None = None
    uncertain_since: int | None = None
    # The stream seq of the liveness record that said the engine is unreachable (None: reachable),
    # with that record's reason and since_ts; snapshots and SQL keep them (`_groups_state`).
    unreachable_since: int | None = None
    unreachable_reason: str = ""
    unreachable_ts: float = 0.0
    # [first, end) seq ranges of the current epoch the fold skipped over, oldest first, so a
    # late batch can be told from a repeated one; not carried by snapshots or the SQL state.
    holes: list[tuple[int, int]] = attrs.field(factory=list)
    # The first seq this fold saw in the current epoch, when past 0: nothing below it was
    # applied, so a batch below it that turns up was stored late (a hole not yet accounted).
    unseen_below: int | None = None
    # A hole in the current epoch's seqs that may yet be filled (the batches after it held back, in seq order):
    # see `BehindHole`. Snapshots and SQL keep it in the groups state.
    behind_hole: BehindHole | None = None

    def block_count(self, tier: Tier | None = None) -> int:
        if tier is not None:
            return len(self.records.get(tier, ()))
        return sum(len(blocks) for blocks in self.records.values())

    def rule(self, tier: Tier) -> ResidencyRule:
        rule = self.rules.get(tier)
        if rule is None:
            rule = self.rules[tier] = rule_for(self.tier_groups.get(tier, ()), self.group_kinds)
        return rule


@attrs.define
class WorkerState:
    worker: WorkerId
    by_provenance: dict[Provenance, _ProvenanceState] = attrs.field(
        factory=lambda: {NATIVE: _ProvenanceState(), RETAINED: _ProvenanceState()}
    )
    counters: Counter[str] = attrs.field(factory=Counter)

    @property
    def uncertain(self) -> bool:
        return any(state.uncertain_since is not None for state in self.by_provenance.values())

    @property
    def unreachable(self) -> bool:
        """ingest cannot reach the worker's engine (its native stream): decide does not credit it."""
        return self.by_provenance[NATIVE].unreachable_since is not None

    @property
    def epoch(self) -> int | None:
        return self.by_provenance[NATIVE].epoch

    def position(self, provenance: Provenance) -> ProvenancePosition:
        """Where one provenance stands beyond its records: what snapshots and SQL keep of it."""
        own = self.by_provenance[provenance]
        return ProvenancePosition(own.epoch, own.seq, own.uncertain_since, _groups_state(own))

    def records(self, provenance: Provenance) -> Iterator[BlockRecord]:
        """Every record of one provenance, on every tier (conflicting and unresolved ones included)."""
        for tier_records in self.by_provenance[provenance].records.values():
            yield from tier_records.values()

    def residency_rules(self) -> tuple[ResidencyRule, ...]:
        """The rule of every (provenance, tier): when it changes, what every block counts as may change."""
        return tuple(own.rule(tier) for own in self.by_provenance.values() for tier in Tier)


@attrs.frozen
class ProvenancePosition:
    """One provenance of a worker beyond its records: epoch, last engine seq, uncertainty, KV-cache groups.

    `groups` is JSON-ready: `kinds` (group -> declared kind) and `tiers` (tier -> the groups
    that stored there since it was last cleared).
    """

    epoch: int | None = None
    seq: int | None = None
    uncertain_since: int | None = None
    groups: dict[str, dict] = attrs.field(factory=dict)


class InventoryFold:
    """Applies canonical batches in stream order and keeps every worker's inventory."""

    def __init__(self, hole_wait_messages: int = HOLE_WAIT_MESSAGES) -> None:
        self._workers: dict[WorkerId, WorkerState] = {}
        self.inventory_seq = 0
        self.counters: Counter[str] = Counter()
        # 0: a hole is not waited for (its later batches apply at once, the worker uncertain)
        self.hole_wait_messages = hole_wait_messages
        self._holes: list[HoleToFetch] = []
        # the batches `begin` let go, to apply before and after the batch it was given (`batches_to_apply`)
        self._before: list[EventBatch] = []
        self._after: list[EventBatch] = []

    # --- applying ------------------------------------------------------------------

    def apply(self, batch: EventBatch, stream_seq: int) -> list[Fact]:
        """Fold one batch (KV_EVENTS stream seq `stream_seq`); return the facts it produced.

        Redelivered stream seqs and engine seqs not after the worker's last one (repeated, or
        late after a hole) produce nothing, so applying the same stream twice is harmless.
        """
        facts, accepted = self.begin(batch, stream_seq)
        for ready in self.batches_to_apply(batch, accepted):
            for event in ready.events:
                self.apply_event(ready.worker, ready.provenance, event, stream_seq, facts)
        return facts

    def batches_to_apply(self, batch: EventBatch, accepted: bool) -> list[EventBatch]:
        """After `begin(batch)`: the batches whose events to apply now, in order, all of `batch`'s worker and
        provenance: those it let go from behind a hole given up on, `batch` itself if accepted, then those
        its seq let go (the hole filled)."""
        ready = [*self._before, batch, *self._after] if accepted else [*self._before, *self._after]
        self._before, self._after = [], []
        return ready

    def take_holes(self) -> list[HoleToFetch]:
        """The holes found since the last call, each once: for the caller to ask ingest to fetch them again."""
        holes, self._holes = self._holes, []
        return holes

    def begin(self, batch: EventBatch, stream_seq: int) -> tuple[list[Fact], bool]:
        """`apply`'s first half: the stream and engine sequence rules for `batch`, without its events.

        Returns the facts so far (a restart's clear, an uncertainty) and whether the batch's
        events are to be applied (`apply_event`, in order); false for a redelivered, repeated,
        late or stale batch, and for one held back behind a hole. `batches_to_apply` then says
        which batches to apply: with a hole filled or given up on, the ones it held too. decide's index uses the two halves to hold plain workers' records
        outside the fold.
        """
        if stream_seq <= self.inventory_seq:
            self._count(None, "redelivered")
            return [], False
        self.inventory_seq = stream_seq
        state = self._workers.get(batch.worker)
        if state is None:
            state = self._workers[batch.worker] = WorkerState(batch.worker)
        own = state.by_provenance[batch.provenance]
        facts: list[Fact] = []
        events = batch.events
        if len(events) == 1 and type(events[0]) is Reachability:
            # A liveness record sits outside the engine's sequence (kvledger.core.events.Reachability).
            return facts, True
        behind = own.behind_hole
        if behind is not None:
            if batch.epoch != own.epoch:
                # A new epoch clears what the old one held: its held batches no longer matter.
                self._count(state, "stale_epoch", len(behind.held))
                own.behind_hole = None
            elif (stream_seq - behind.since >= self.hole_wait_messages or len(behind.held) >= HOLE_MAX_HELD) \
                    and batch.seq > own.seq + 1:
                self._give_up_hole(state, own)
        if batch.epoch == own.epoch:
            if batch.seq <= own.seq:
                self._not_after_last(state, own, batch, stream_seq, facts)
                return facts, False
            if batch.seq != own.seq + 1:
                has_gap = any(type(event) is Gap for event in batch.events)
                # A batch that starts by clearing every tier needs nothing before it: it is not held.
                if self.hole_wait_messages > 0 and not has_gap and not _starts_with_full_clear(batch):
                    return self._hold(state, own, batch, stream_seq, facts), False
                self._hole(state, own, own.seq + 1, batch, stream_seq, facts)
                if own.behind_hole is not None:
                    own.behind_hole.healable = False  # a Gap says the seqs are lost, or a clear made them moot
            if own.behind_hole is not None:
                own.epoch, own.seq = batch.epoch, batch.seq
                self._release_behind_hole(state, own, batch.provenance, stream_seq, facts)
                return facts, True
        elif own.epoch is None:
            # A worker's first batch may start at any seq (ingest resumes mid-stream, retention
            # drops old messages, a reader starts late): not a hole, but remembered.
            if batch.seq > 0:
                own.unseen_below = batch.seq
        else:
            if batch.epoch < own.epoch:
                self._count(state, "stale_epoch")
                return facts, False
            if not _starts_with_restart(batch):
                # Every new epoch is an engine restart, announced or not: its cache is empty.
                self._count(state, "implicit_restart")
                self._clear(state, batch.provenance, RemovalCause.RESTART, stream_seq, facts)
                own = state.by_provenance[batch.provenance]
            own.holes, own.unseen_below = [], None  # the old epoch's late batches are stale_epoch now
            if batch.seq != 0:
                # ingest starts every new epoch at seq 0 or says why not with a Gap.
                self._hole(state, own, 0, batch, stream_seq, facts)
        own.epoch, own.seq = batch.epoch, batch.seq
        return facts, True

    def apply_event(self, worker: WorkerId, provenance: Provenance, event: Event, stream_seq: int, facts: list[Fact]) -> None:
        """`apply`'s second half, one event of an accepted batch: its facts are appended to `facts`."""
        state = self._workers[worker]
        kind = type(event)
        if kind is Stored:
            self._store(state, provenance, event, stream_seq, facts)
        elif kind is Removed:
            self._remove(state, provenance, event, stream_seq, facts)
        elif kind is Cleared:
            self._clear(state, provenance, RemovalCause.CLEARED, stream_seq, facts, event.tier)
        elif kind is Reachability:
            self._reachability(state, provenance, event, stream_seq, facts)
        else:
            self._gap(state, provenance, event, stream_seq, facts)

    # --- records held outside the fold (decide's compact inventories) ----------------

    def note_stored_elsewhere(self, worker: WorkerId, provenance: Provenance, event: Stored, attached: bool) -> None:
        """What `apply_event` keeps of a store besides its records, for one whose records another holder keeps.

        The group's declared kind, and (`attached`: it held at least one new block) the group
        among those seen on the tier: residency rules read both, and they outlive the records.
        """
        own = self._workers[worker].by_provenance[provenance]
        _declare_kind(own, event.group_idx, event.spec_kind)
        if attached:
            _saw_group(own, event.tier, event.group_idx)
            own.placements.add((event.group_idx, event.ownership))

    def adopt_records(self, worker: WorkerId, records: Iterable[BlockRecord]) -> None:
        """Hold records another holder kept until now, beside what the worker's state already has."""
        by_provenance = self._workers[worker].by_provenance
        for record in records:
            _attach_record(by_provenance[record.provenance], record)

    def release_records(self, worker: WorkerId, provenance: Provenance) -> None:
        """Forget one provenance's records (another holder has taken them), keeping everything else of it."""
        own = self._workers[worker].by_provenance[provenance]
        own.records = _DictPerTier()
        own.held = _DictPerTier()
        own.topology = {}
        own.waiting = {}

    def add_counts(self, worker: WorkerId, counts: Mapping[str, int]) -> None:
        """Count what another holder of the worker's records met (`COUNTER_NAMES`)."""
        state = self._workers[worker]
        for name, number in counts.items():
            if number:
                self.counters[name] += number
                state.counters[name] += number

    def apply_all(self, batches: Iterable[tuple[EventBatch, int]]) -> list[Fact]:
        facts: list[Fact] = []
        for batch, stream_seq in batches:
            facts.extend(self.apply(batch, stream_seq))
        return facts

    def _store(self, state: WorkerState, provenance: Provenance, event: Stored, stream_seq: int, facts: list[Fact]) -> None:
        own = state.by_provenance[provenance]
        native = state.by_provenance[NATIVE]
        retained = state.by_provenance[RETAINED]
        group, ownership = event.group_idx, event.ownership
        tier_records = own.records[event.tier]
        _declare_kind(own, group, event.spec_kind)
        if not event.has_tokens:
            self._store_without_tokens(state, provenance, event, stream_seq, facts)
            return
        parent = event.parent_hash
        parent_sequence = self._resolve_parent(state, parent)
        if provenance is NATIVE:
            self._store_native_chain(state, event, parent, parent_sequence, stream_seq, facts)
            return
        for engine_hash, local_hash in zip(event.block_hashes, event.local_hashes):
            sequence_hash = local_hash if parent_sequence is None else chain_hash(parent_sequence, local_hash)
            held = tier_records.get(block_key(group, ownership, engine_hash))
            if held is not None:
                self._add_reference(state, own, held, stream_seq, facts)
            else:
                # kvledger/core/precedence.py, rule 1: one that disagrees with the engine's own
                # topology for this block is kept for audit and never indexed.
                native_entry = native.topology.get(engine_hash)
                conflict = native_entry is not None and precedence.contradicts(
                    native_entry.parent_hash, native_entry.sequence_hash, parent, sequence_hash
                )
                if conflict:
                    self._count(state, "retained_conflict")
                record = BlockRecord(
                    state.worker, event.tier, RETAINED, engine_hash, sequence_hash, parent,
                    local_hash, stream_seq, conflict, group, ownership, event.spec_kind, event.sliding_window,
                )
                _attach_record(retained, record)
                facts.append(BlockStoredFact(record))
            if native.waiting or retained.waiting:
                self._resolve_waiting(state, engine_hash, stream_seq, facts)
            parent, parent_sequence = engine_hash, sequence_hash

    def _store_native_chain(
        self, state: WorkerState, event: Stored, parent: int | None, parent_sequence: int | None, stream_seq: int,
        facts: list[Fact],
    ) -> None:
        """The engine's own store of a chain of blocks: nearly every event the fold sees.

        A block that is new to the worker, in its native and retained topology alike, is the
        only copy of its engine hash: it is attached here as `_attach_record` would attach it,
        with what is the same for the whole event looked up once. Any other block takes the
        general way (`_add_reference`, `_store_native`).
        """
        native = state.by_provenance[NATIVE]
        retained = state.by_provenance[RETAINED]
        tier, group, ownership = event.tier, event.group_idx, event.ownership
        spec_kind, window, worker = event.spec_kind, event.sliding_window, state.worker
        tier_records = native.records[tier]
        topology, retained_topology = native.topology, retained.topology
        plain = group == 0 and ownership is None
        counts = None  # the group's sequence-hash counts on this tier, once a block is attached here
        chained = sequence_hashes(event.local_hashes, parent_sequence)  # the event's chain, in one call
        for engine_hash, local_hash, sequence_hash in zip(event.block_hashes, event.local_hashes, chained):
            key = engine_hash if plain else (group, ownership, engine_hash)
            held = tier_records.get(key)
            if held is not None:
                self._add_reference(state, native, held, stream_seq, facts)
            else:
                record = BlockRecord(
                    worker, tier, NATIVE, engine_hash, sequence_hash, parent, local_hash, stream_seq,
                    False, group, ownership, spec_kind, window,
                )  # fmt: skip
                if engine_hash in topology or engine_hash in retained_topology:
                    self._store_native(state, record, stream_seq, facts)
                else:
                    if counts is None:
                        counts = _group_counts(native, tier, group)
                        native.placements.add((group, ownership))
                    tier_records[key] = record
                    counts[sequence_hash] = counts.get(sequence_hash, 0) + 1
                    topology[engine_hash] = record
                    facts.append(BlockStoredFact(record))
            if native.waiting or retained.waiting:
                self._resolve_waiting(state, engine_hash, stream_seq, facts)
            parent = engine_hash

    def _store_without_tokens(
        self, state: WorkerState, provenance: Provenance, event: Stored, stream_seq: int, facts: list[Fact],
    ) -> None:
        """A store that names blocks by engine hash alone (an offload placeholder, a connector's store).

        Its hashes and parent come from the block the worker already holds under that engine
        hash on another tier or group, native topology first. An unknown one is kept for
        audit, unindexed, and counted.
        """
        own = state.by_provenance[provenance]
        tier_records = own.records[event.tier]
        group, ownership = event.group_idx, event.ownership
        for engine_hash in event.block_hashes:
            held = tier_records.get(block_key(group, ownership, engine_hash))
            if held is not None:
                self._add_reference(state, own, held, stream_seq, facts)
                continue
            entry = state.by_provenance[NATIVE].topology.get(engine_hash)
            if entry is None:
                entry = state.by_provenance[RETAINED].topology.get(engine_hash)
            if entry is None:
                self._count(state, "unresolved_store")
                record = BlockRecord(
                    state.worker, event.tier, provenance, engine_hash, 0, event.parent_hash, 0, stream_seq,
                    False, group, ownership, event.spec_kind, event.sliding_window, unresolved=True,
                )
                _attach_record(own, record)
                facts.append(BlockStoredFact(record))
                continue
            record = BlockRecord(
                state.worker, event.tier, provenance, engine_hash, entry.sequence_hash, entry.parent_hash,
                entry.local_hash, stream_seq, False, group, ownership, event.spec_kind, event.sliding_window,
            )
            if provenance is NATIVE:
                self._store_native(state, record, stream_seq, facts)
            else:
                _attach_record(own, record)
                facts.append(BlockStoredFact(record))
            if state.by_provenance[NATIVE].waiting or state.by_provenance[RETAINED].waiting:
                self._resolve_waiting(state, engine_hash, stream_seq, facts)

    def _resolve_waiting(self, state: WorkerState, engine_hash: int, stream_seq: int, facts: list[Fact]) -> None:
        """Stores without tokens that came before their block was known take its hashes now.

        (A sliding-window group's null-block store ahead of the full-attention group's in one
        batch, a placeholder ahead of the store it copies.) The unresolved record leaves with
        cause `resolved` and its resolved copy is stored, so the audit keeps both stays.
        """
        entry = state.by_provenance[NATIVE].topology.get(engine_hash) or state.by_provenance[RETAINED].topology.get(engine_hash)
        if entry is None:
            return
        for own in state.by_provenance.values():
            for tier, key in list(own.waiting.get(engine_hash, ())):
                held = own.records[tier][key]
                _detach(own, held)
                resolved = msgspec.structs.replace(
                    held, sequence_hash=entry.sequence_hash, parent_hash=entry.parent_hash, local_hash=entry.local_hash,
                    stream_seq=stream_seq, unresolved=False,
                )
                _attach_record(own, resolved)
                facts.append(BlockRemovedFact(held, RemovalCause.RESOLVED, stream_seq))
                facts.append(BlockStoredFact(resolved))

    def _add_reference(
        self, state: WorkerState, own: _ProvenanceState, held: BlockRecord, stream_seq: int, facts: list[Fact],
    ) -> None:
        self._count(state, "duplicate_store")
        record = msgspec.structs.replace(held, refs=held.refs + 1)
        own.records[record.tier][record.key] = record
        facts.append(BlockReferencedFact(record, stream_seq))

    def _store_native(self, state: WorkerState, record: BlockRecord, stream_seq: int, facts: list[Fact]) -> None:
        native = state.by_provenance[NATIVE]
        engine_hash, parent, sequence_hash = record.engine_hash, record.parent_hash, record.sequence_hash
        entry = native.topology.get(engine_hash)
        if entry is not None and precedence.contradicts(entry.parent_hash, entry.sequence_hash, parent, sequence_hash):
            self._count(state, "native_reparent")
        _attach_record(native, record)
        facts.append(BlockStoredFact(record))
        # kvledger/core/precedence.py, rule 1: retained records of this block that disagree become audit-only.
        retained = state.by_provenance[RETAINED]
        if engine_hash not in retained.topology:
            return
        for held in _copies(retained, engine_hash):
            if precedence.contradicts(parent, sequence_hash, held.parent_hash, held.sequence_hash):
                _detach(retained, held)
                demoted = msgspec.structs.replace(held, conflict=True)
                _attach_record(retained, demoted)
                self._count(state, "retained_conflict")
                facts.append(RetainedConflictFact(demoted, stream_seq))

    def _resolve_parent(self, state: WorkerState, parent: int | None) -> int | None:
        """Sequence hash of the parent block, native topology first; None starts a new chain."""
        if parent is None:
            return None
        for provenance in precedence.PARENT_LOOKUP:
            entry = state.by_provenance[provenance].topology.get(parent)
            if entry is not None:
                return entry.sequence_hash
        self._count(state, "unknown_parent")
        return None

    def _remove(self, state: WorkerState, provenance: Provenance, event: Removed, stream_seq: int, facts: list[Fact]) -> None:
        # A removal touches only its own provenance, group and ownership: a retained layer
        # dropping a block never detaches the engine's copy, a sliding-window group's
        # eviction leaves the full-attention group's copy, and one offload tier's another's.
        own = state.by_provenance[provenance]
        tier_records = own.records[event.tier]
        group, ownership = event.group_idx, event.ownership
        plain = group == 0 and ownership is None
        topology, by_group = own.topology, None
        for engine_hash in event.block_hashes:
            key = engine_hash if plain else (group, ownership, engine_hash)
            record = tier_records.get(key)
            if record is None:
                self._count(state, "unknown_remove")
                continue
            if record.refs > 1:
                record = msgspec.structs.replace(record, refs=record.refs - 1)
                tier_records[key] = record
                facts.append(BlockReferencedFact(record, stream_seq))
                continue
            if topology.get(engine_hash) is record:
                # The only copy of its engine hash (so indexable): `_detach`'s work, its lookups made once.
                del tier_records[key]
                if by_group is None:
                    by_group = own.held[event.tier]  # there already: it counts this record
                _uncount(by_group, group, record.sequence_hash)
                del topology[engine_hash]
            else:
                _detach(own, record)
            facts.append(BlockRemovedFact(record, RemovalCause.REMOVED, stream_seq))

    def _clear(
        self, state: WorkerState, provenance: Provenance, cause: RemovalCause, stream_seq: int, facts: list[Fact],
        tier: Tier | None = None,
    ) -> None:
        own = state.by_provenance[provenance]
        blocks = own.block_count(tier)
        if tier is not None:
            # A tier-scoped clear (vLLM's reset of its GPU pool): other tiers keep their blocks.
            for record in list(own.records.get(tier, {}).values()):
                _detach(own, record)
            own.held.pop(tier, None)
            own.tier_groups.pop(tier, None)
            own.rules.pop(tier, None)
            facts.append(InventoryClearedFact(state.worker, provenance, cause, stream_seq, blocks, tier))
            if own.uncertain_since is not None and not own.block_count():
                own.uncertain_since = None
                facts.append(UncertaintyFact(state.worker, provenance, False, cause.value, stream_seq))
            return
        if own.unseen_below is not None:
            # What came before an empty cache cannot matter: a batch below is late, not a hole.
            _remember_hole(own, 0, own.unseen_below)
        # A restarted engine may run another configuration; a cleared one keeps its groups.
        kinds = own.group_kinds if cause is RemovalCause.CLEARED else {}
        fresh = _ProvenanceState(
            epoch=own.epoch, seq=own.seq, holes=own.holes, group_kinds=kinds, unreachable_since=own.unreachable_since,
            unreachable_reason=own.unreachable_reason, unreachable_ts=own.unreachable_ts,
        )
        state.by_provenance[provenance] = fresh
        facts.append(InventoryClearedFact(state.worker, provenance, cause, stream_seq, blocks))
        if own.uncertain_since is not None:
            # An empty cache is known exactly: the uncertainty a gap left is over.
            facts.append(UncertaintyFact(state.worker, provenance, False, cause.value, stream_seq))

    def _gap(self, state: WorkerState, provenance: Provenance, event: Gap, stream_seq: int, facts: list[Fact]) -> None:
        if event.reason is GapReason.PUBLISHER_RESTART:
            self._clear(state, provenance, RemovalCause.RESTART, stream_seq, facts)
            return
        own = state.by_provenance[provenance]
        if own.uncertain_since is None:
            own.uncertain_since = stream_seq
            facts.append(UncertaintyFact(state.worker, provenance, True, event.reason.value, stream_seq))

    def _reachability(
        self, state: WorkerState, provenance: Provenance, event: Reachability, stream_seq: int, facts: list[Fact],
    ) -> None:
        """The engine became unreachable or reachable again; a repeated announcement changes nothing."""
        own = state.by_provenance[provenance]
        if (own.unreachable_since is None) == event.reachable:
            return
        if event.reachable:
            own.unreachable_since, own.unreachable_reason, own.unreachable_ts = None, "", 0.0
        else:
            own.unreachable_since, own.unreachable_reason, own.unreachable_ts = stream_seq, event.reason, event.since_ts
        facts.append(ReachabilityFact(state.worker, provenance, event.reachable, event.reason, event.since_ts, stream_seq))

    def _hold(
        self, state: WorkerState, own: _ProvenanceState, batch: EventBatch, stream_seq: int, facts: list[Fact],
    ) -> list[Fact]:
        """Hold `batch` back behind a hole before it (found now, or held for already): the worker uncertain
        until the hole fills, and the hole noted for ingest to fetch again (`take_holes`)."""
        behind = own.behind_hole
        if behind is None:
            behind = own.behind_hole = BehindHole(stream_seq, own.uncertain_since is None)
            self._count(state, "sequence_hole")
            if own.uncertain_since is None:
                own.uncertain_since = stream_seq
                facts.append(UncertaintyFact(state.worker, batch.provenance, True, hole_reason(own.seq + 1, batch.seq),
                                             stream_seq))
        held = behind.held
        position = len(held)
        while position and held[position - 1].seq > batch.seq:
            position -= 1
        if position and held[position - 1].seq == batch.seq:
            self._count(state, "duplicate_batch")
            return facts
        first_missing = own.seq + 1 if position == 0 else held[position - 1].seq + 1
        if batch.seq > first_missing:
            self._holes.append(HoleToFetch(state.worker, batch.provenance, own.epoch, first_missing, batch.seq))
        held.insert(position, batch)
        self._count(state, "held_batch")
        return facts

    def _release_behind_hole(self, state: WorkerState, own: _ProvenanceState, provenance: Provenance,
                             stream_seq: int, facts: list[Fact]) -> None:
        """Let go the held batches that now follow on (own.seq just advanced); once none is held, the hole is
        healed: the uncertainty it caused ends."""
        behind = own.behind_hole
        held = behind.held
        while held and held[0].seq <= own.seq + 1:
            batch = held.pop(0)
            if batch.seq <= own.seq:
                self._count(state, "late_batch")  # held behind a batch that made it moot (a Gap, a clear)
                continue
            own.seq = batch.seq
            self._after.append(batch)
        if held:
            return
        own.behind_hole = None
        self._count(state, "healed_hole")
        if behind.healable and own.uncertain_since is not None:
            own.uncertain_since = None
            facts.append(UncertaintyFact(state.worker, provenance, False, "hole healed", stream_seq))

    def _give_up_hole(self, state: WorkerState, own: _ProvenanceState) -> None:
        """The hole was waited for long enough: its held batches are applied now, in order, over the holes;
        the worker stays uncertain, and a missing batch that comes later is late."""
        behind, own.behind_hole = own.behind_hole, None
        self._count(state, "hole_given_up")
        for batch in behind.held:
            if batch.seq > own.seq + 1:
                _remember_hole(own, own.seq + 1, batch.seq)
            own.seq = batch.seq
            self._before.append(batch)

    def _hole(
        self, state: WorkerState, own: _ProvenanceState, expected: int, batch: EventBatch, stream_seq: int,
        facts: list[Fact],
    ) -> None:
        """`batch` skips seqs [expected, batch.seq): a missed range, as after a Gap(missed).

        ingest publishes every seq (a lost one as a Gap), so a hole is a batch stored out of
        order: when it comes it is dropped, and its stores and removals are lost to this fold.
        """
        _remember_hole(own, expected, batch.seq)
        if any(type(event) is Gap for event in batch.events):
            return  # ingest's own account of the discontinuity: its Gap decides, as always
        self._missed(state, own, batch.provenance, hole_reason(expected, batch.seq), stream_seq, facts)

    def _not_after_last(
        self, state: WorkerState, own: _ProvenanceState, batch: EventBatch, stream_seq: int, facts: list[Fact],
    ) -> None:
        """A batch at or before the last seq: dropped, as late (a seq never applied) or duplicate."""
        if _fill_hole(own, batch.seq):
            self._count(state, "late_batch")
        elif own.unseen_below is not None and batch.seq < own.unseen_below:
            # The fold's first batch was not the worker's first: this one was stored after it,
            # so the range below the first batch is a hole after all, noticed now.
            _remember_hole(own, 0, own.unseen_below)
            own.unseen_below = None
            _fill_hole(own, batch.seq)
            self._count(state, "late_batch")
            self._missed(state, own, batch.provenance, hole_reason(batch.seq, batch.seq + 1), stream_seq, facts)
        else:
            self._count(state, "duplicate_batch")

    def _missed(
        self, state: WorkerState, own: _ProvenanceState, provenance: Provenance, reason: str, stream_seq: int,
        facts: list[Fact],
    ) -> None:
        """A hole no Gap accounts for: uncertain until the next Cleared or restart (docs/core.md, the fold)."""
        self._count(state, "sequence_hole")
        if own.uncertain_since is None:
            own.uncertain_since = stream_seq
            facts.append(UncertaintyFact(state.worker, provenance, True, reason, stream_seq))

    def _count(self, state: WorkerState | None, name: str, amount: int = 1) -> None:
        self.counters[name] += amount
        if state is not None:
            state.counters[name] += amount

    def restore_worker(
        self,
        worker: WorkerId,
        positions: Mapping[Provenance, ProvenancePosition],
        records: Iterable[BlockRecord],
        counters: Mapping[str, int] = {},
    ) -> None:
        """Rebuild one worker from what a snapshot or SQL kept: the one way state comes back.

        `records` must come in the order they were stored (stream seq first), so the
        topology ends as it was after folding.
        """
        state = WorkerState(worker)
        state.counters.update(counters)
        for provenance, position in positions.items():
            own = state.by_provenance[provenance]
            own.epoch, own.seq, own.uncertain_since = position.epoch, position.seq, position.uncertain_since
            _restore_groups(own, position.groups)
        for record in records:
            _attach_record(state.by_provenance[record.provenance], record)
        self._workers[worker] = state

    def adopt_worker(self, state: WorkerState) -> None:
        """Take over a worker another fold holds (to merge folds of disjoint workers)."""
        self._workers[state.worker] = state

    # --- reading ---------------------------------------------------------------------

    def workers(self) -> list[WorkerId]:
        """Every worker seen, in worker order (publisher, then dp_rank)."""
        # Keyed by plain tuples: WorkerId's own ordering is a Python call per comparison.
        return sorted(self._workers, key=_worker_order)

    def worker_state(self, worker: WorkerId) -> WorkerState | None:
        return self._workers.get(worker)

    def holds(self, worker: WorkerId, provenance: Provenance, tier: Tier, sequence_hash: int) -> bool:
        """Whether the worker holds an indexable block with this sequence hash, by the residency rule, for an
        answer to credit: nothing native while its engine is unreachable (its records wait for its return)."""
        state = self._workers.get(worker)
        if state is None or (provenance is NATIVE and state.unreachable):
            return False
        return _holds(state.by_provenance[provenance], tier, sequence_hash)

    def holds_recorded(self, worker: WorkerId, provenance: Provenance, tier: Tier, sequence_hash: int) -> bool:
        """`holds` whatever the engine's reachability: the inventory as recorded (SQL's stays)."""
        state = self._workers.get(worker)
        return state is not None and _holds(state.by_provenance[provenance], tier, sequence_hash)

    def holds_in_any_group(self, worker: WorkerId, provenance: Provenance, tier: Tier, sequence_hash: int) -> bool:
        """Whether some KV-cache group of the worker holds a record with this sequence hash on the tier: the
        SQL ledger's rule for a held block (an open stay in any group), where `holds` asks every deciding group."""
        state = self._workers.get(worker)
        if state is None:
            return False
        by_group = state.by_provenance[provenance].held.get(tier)
        return bool(by_group) and any(counts.get(sequence_hash, 0) > 0 for counts in by_group.values())

    def holds_each(
        self, worker: WorkerId, sequence_hash: int, classes: Sequence[tuple[Provenance, Tier]]
    ) -> list[bool]:
        """`holds` for each (provenance, tier) of `classes`, the worker looked up once."""
        state = self._workers.get(worker)
        if state is None:
            return [False] * len(classes)
        by_provenance = state.by_provenance
        return [_holds(by_provenance[provenance], tier, sequence_hash) for provenance, tier in classes]

    def is_unreachable(self, worker: WorkerId) -> bool:
        state = self._workers.get(worker)
        return state is not None and state.unreachable

    def unreachable_workers(self) -> list[WorkerId]:
        """Workers whose engine ingest cannot reach (native stream), in worker order."""
        return [worker for worker in self.workers() if self._workers[worker].unreachable]

    def is_uncertain(self, worker: WorkerId) -> bool:
        state = self._workers.get(worker)
        return state is not None and state.uncertain

    def uncertain_workers(self) -> list[WorkerId]:
        return [worker for worker in self.workers() if self._workers[worker].uncertain]

    def records(self, worker: WorkerId, provenance: Provenance, tier: Tier) -> list[BlockRecord]:
        """The worker's records on one tier (conflicting retained ones included), by engine hash."""
        state = self._workers.get(worker)
        if state is None:
            return []
        return sorted(state.by_provenance[provenance].records.get(tier, {}).values(), key=_record_order)

    def iter_worker_records(self, worker: WorkerId) -> Iterator[BlockRecord]:
        for provenance in Provenance:
            for tier in Tier:
                yield from self.records(worker, provenance, tier)

    def iter_records(self) -> Iterator[BlockRecord]:
        for worker in self.workers():
            yield from self.iter_worker_records(worker)


def _holds(own: _ProvenanceState, tier: Tier, sequence_hash: int) -> bool:
    by_group = own.held.get(tier)
    if not by_group:
        return False
    rule = own.rule(tier)
    if len(rule.groups) == 1:
        counts = by_group.get(rule.groups[0])
        return counts is not None and counts.get(sequence_hash, 0) > 0
    return rule.holds(lambda group: sequence_hash in by_group.get(group, ()))


def _starts_with_full_clear(batch: EventBatch) -> bool:
    first = batch.events[0] if batch.events else None
    return type(first) is Cleared and first.tier is None


def _starts_with_restart(batch: EventBatch) -> bool:
    first = batch.events[0] if batch.events else None
    return type(first) is Gap and first.reason is GapReason.PUBLISHER_RESTART


# Every uncertainty reason fits this many characters: store sizes uncertain_periods.reason by it.
REASON_LIMIT = 32


def hole_reason(first: int, end: int) -> str:
    """What an uncertainty from a hole says: the missing seqs, or how many if they do not fit."""
    if end - first == 1:
        return f"hole: seq {first}"  # at most 30 characters for any u64
    reason = f"hole: seqs {first}-{end - 1}"
    return reason if len(reason) <= REASON_LIMIT else f"hole: {end - first} seqs"


# Enough for the holes one burst of refusals leaves; a late batch of a forgotten one counts
# as duplicate_batch (it is dropped either way).
TRACKED_HOLES = 16


def _remember_hole(own: _ProvenanceState, first: int, end: int) -> None:
    own.holes.append((first, end))
    if len(own.holes) > TRACKED_HOLES:
        del own.holes[0]


def _fill_hole(own: _ProvenanceState, seq: int) -> bool:
    """Whether `seq` lies in a hole the fold skipped; if so it is no longer missing."""
    for position, (first, end) in enumerate(own.holes):
        if first <= seq < end:
            own.holes[position:position + 1] = [(a, b) for a, b in ((first, seq), (seq + 1, end)) if a < b]
            if len(own.holes) > TRACKED_HOLES:
                del own.holes[0]
            return True
    return False


def _groups_state(own: _ProvenanceState) -> dict[str, dict]:
    """What one provenance knows of its KV-cache groups beyond its records, JSON-ready (for restores).

    An unreachable engine's liveness rides along under "unreachable": snapshots and the SQL
    workers row already carry this dict, and a reader from before liveness ignores the key.
    """
    state = {
        "kinds": {str(group): kind for group, kind in sorted(own.group_kinds.items())},
        "tiers": {tier.value: sorted(groups) for tier, groups in own.tier_groups.items() if groups},
    }
    if own.unreachable_since is not None:
        state["unreachable"] = {"since": own.unreachable_since, "reason": own.unreachable_reason, "ts": own.unreachable_ts}
    if own.behind_hole is not None:
        state["behind_hole"] = own.behind_hole.state()
    return state


def _restore_groups(own: _ProvenanceState, state: dict[str, dict]) -> None:
    """Adopt `_groups_state`'s output (before or after the records are attached)."""
    own.group_kinds.update({int(group): kind for group, kind in state.get("kinds", {}).items()})
    for tier_name, groups in state.get("tiers", {}).items():
        own.tier_groups[Tier(tier_name)].update(groups)
    own.rules.clear()
    unreachable = state.get("unreachable")
    if unreachable:
        own.unreachable_since = unreachable["since"]
        own.unreachable_reason, own.unreachable_ts = unreachable["reason"], unreachable["ts"]
    behind = state.get("behind_hole")
    if behind:
        own.behind_hole = BehindHole.of_state(behind)


def _worker_order(worker: WorkerId) -> tuple[str, int]:
    return (worker.publisher, worker.dp_rank)


def _record_order(record: BlockRecord) -> tuple:
    return (record.engine_hash, record.group_idx, record.ownership or "")


def _declare_kind(own: _ProvenanceState, group: int, spec_kind: str | None) -> None:
    """A store declared its group's kind: a new one changes the residency rules."""
    if spec_kind is not None and own.group_kinds.get(group) != spec_kind:
        own.group_kinds[group] = spec_kind
        own.rules.clear()


def _saw_group(own: _ProvenanceState, tier: Tier, group: int) -> None:
    """A group held a block on a tier: it is among the tier's groups until the tier is cleared."""
    seen = own.tier_groups[tier]
    if group not in seen:
        seen.add(group)
        own.rules.pop(tier, None)


def _group_counts(own: _ProvenanceState, tier: Tier, group: int) -> Counter[int]:
    """The sequence-hash counts of one group's indexable records on a tier, made when its first one comes."""
    by_group = own.held[tier]
    counts = by_group.get(group)
    if counts is None:
        counts = by_group[group] = Counter()
        _saw_group(own, tier, group)
    return counts


def _attach_record(own: _ProvenanceState, record: BlockRecord) -> None:
    """Hold `record` in one provenance's inventory (the fold's and every restore's one way in)."""
    tier, group = record.tier, record.group_idx
    key = record.key
    own.records[tier][key] = record
    if record.unresolved:
        own.waiting.setdefault(record.engine_hash, []).append((tier, key))
        return
    if record.conflict:
        return
    counts = _group_counts(own, tier, group)
    # (dict.get, not Counter's __missing__: most hashes are new, and that is a Python call each)
    counts[record.sequence_hash] = counts.get(record.sequence_hash, 0) + 1
    own.placements.add((group, record.ownership))
    entry = own.topology.get(record.engine_hash)
    if entry is None:
        # A block's only copy is its own chain position (record and entry read alike), so
        # an entry is made only for a second copy: most blocks are held once.
        own.topology[record.engine_hash] = record
    elif type(entry) is BlockRecord:
        own.topology[record.engine_hash] = _TopologyEntry(record.sequence_hash, record.parent_hash, record.local_hash, 2)
    else:
        entry.sequence_hash, entry.parent_hash, entry.local_hash = record.sequence_hash, record.parent_hash, record.local_hash
        entry.refs += 1


def _copies(own: _ProvenanceState, engine_hash: int) -> list[BlockRecord]:
    """Every indexable record of one engine hash in one provenance, on any tier, group and ownership."""
    found = []
    for tier_records in own.records.values():
        if tier_records:
            for group, ownership in own.placements:
                record = tier_records.get(block_key(group, ownership, engine_hash))
                if record is not None and record.indexable:
                    found.append(record)
    return found


_TIER_ORDER = {tier: position for position, tier in enumerate(reversed(Tier))}


def _latest_first(record: BlockRecord) -> tuple:
    """Which copy of a block is the latest: the highest stream seq; copies one batch stored
    (a tie) by their content, device first, never by where the fold keeps them. Dict and set
    order differ between a fold that saw the events and one that adopted or restored the same
    records, and a tie broken by that order gave two folds different chain positions."""
    return (record.stream_seq, _TIER_ORDER[record.tier], record.group_idx, record.ownership or "",
            record.sequence_hash, record.parent_hash if record.parent_hash is not None else -1)


def _uncount(by_group: dict[int, Counter[int]], group: int, sequence_hash: int) -> None:
    """One indexable record of `group` with this sequence hash left the tier."""
    held = by_group[group]
    left = held[sequence_hash] - 1
    if left > 0:
        held[sequence_hash] = left
        return
    held.pop(sequence_hash)  # (not `del`: Counter's __delitem__ is a Python call)
    if not held:
        del by_group[group]


def _detach(own: _ProvenanceState, record: BlockRecord) -> None:
    del own.records[record.tier][record.key]
    if record.unresolved:
        places = own.waiting[record.engine_hash]
        places.remove((record.tier, record.key))
        if not places:
            del own.waiting[record.engine_hash]
        return
    if record.conflict:
        return
    _uncount(own.held[record.tier], record.group_idx, record.sequence_hash)
    entry = own.topology[record.engine_hash]
    if type(entry) is BlockRecord:  # the only copy
        del own.topology[record.engine_hash]
        return
    entry.refs -= 1
    if entry.refs <= 0:
        del own.topology[record.engine_hash]
        return
    if (entry.sequence_hash, entry.parent_hash) == (record.sequence_hash, record.parent_hash):
        # The copy that set the chain position left: it is the latest remaining copy's, as
        # restoring in stored order leaves it (copies disagree only after a re-parenting).
        latest = max(_copies(own, record.engine_hash), key=_latest_first)
        entry.sequence_hash, entry.parent_hash, entry.local_hash = latest.sequence_hash, latest.parent_hash, latest.local_hash
