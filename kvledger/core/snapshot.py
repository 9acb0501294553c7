"""Fold snapshots: the whole inventory as compact arrays, so a reader can warm-start.

store writes one to the `KV_SNAPSHOTS` object store every N events; decide loads the
newest and replays `KV_EVENTS` after it. Restoring then folding the rest gives exactly the
state of folding everything.

A snapshot's `inventory_seq` is store's ledger seq, which equals the KV_EVENTS seq until the
stream first loses acknowledged messages (store/cursor.py); where the stream stood is kept
beside it as a `StreamPosition`: the seq of the last message folded and its Nats-Msg-Id, so
a reader can check that the stream still holds that message before trusting the snapshot.
"""

from __future__ import annotations

import msgspec
import numpy as np

from kvledger.core.events import Provenance, Tier, WorkerId
from kvledger.core.fold import BlockRecord, InventoryFold, ProvenancePosition

SNAPSHOT_VERSION = 2  # 2: each record's group, ownership, cache spec, references, resolution
_TIER_CODES = {tier: code for code, tier in enumerate(Tier)}
_TIERS = list(Tier)


class SnapshotError(ValueError):
    """A snapshot could not be read; the message says why."""


class _ProvenanceWire(msgspec.Struct, array_like=True):
    provenance: str
    epoch: int | None
    seq: int | None
    uncertain_since: int | None
    tiers: bytes  # uint8 per record
    engine_hashes: bytes  # uint64
    sequence_hashes: bytes  # uint64
    parent_hashes: bytes  # uint64, meaningful where has_parent
    has_parent: bytes  # bool
    local_hashes: bytes  # uint64
    stream_seqs: bytes  # int64
    conflicts: bytes  # bool
    group_idxs: bytes  # uint32
    refs: bytes  # uint32
    unresolved: bytes  # bool
    # per record an index into `names` (0: none) for its ownership and its group's spec kind
    ownerships: bytes  # uint32
    spec_kinds: bytes  # uint32
    sliding_windows: bytes  # int64, -1: none
    names: list[str]
    kv_cache_groups: dict[str, dict]  # kvledger.core.fold.ProvenancePosition.groups


class _WorkerWire(msgspec.Struct, array_like=True):
    publisher: str
    dp_rank: int
    counters: dict[str, int]
    provenances: list[_ProvenanceWire]


class StreamPosition(msgspec.Struct, frozen=True):
    """The KV_EVENTS message a snapshot's fold ends with: its stream seq and its Nats-Msg-Id."""

    seq: int
    msg_id: str


class _SnapshotWire(msgspec.Struct):
    v: int
    inventory_seq: int
    counters: dict[str, int]
    workers: list[_WorkerWire]
    # Absent in snapshots written before streams could lose messages: readers then take
    # inventory_seq for the stream seq and cannot check the message.
    position: StreamPosition | None = None


class _PositionWire(msgspec.Struct):
    v: int
    inventory_seq: int
    position: StreamPosition | None = None


def encode_snapshot(fold: InventoryFold, position: StreamPosition | None = None) -> bytes:
    """Serialise the fold's entire state (inventory, epochs, uncertainty, counters) and where the stream stood."""
    workers = []
    for worker in fold.workers():
        state = fold.worker_state(worker)
        provenances = []
        for provenance in Provenance:
            held = state.position(provenance)
            records = sorted(
                state.records(provenance),
                key=lambda r: (r.stream_seq, _TIER_CODES[r.tier], r.engine_hash, r.group_idx, r.ownership or ""),
            )
            names: dict[str | None, int] = {None: 0}
            for record in records:
                names.setdefault(record.ownership, len(names))
                names.setdefault(record.spec_kind, len(names))
            provenances.append(
                _ProvenanceWire(
                    provenance.value, held.epoch, held.seq, held.uncertain_since,
                    np.array([_TIER_CODES[r.tier] for r in records], dtype=np.uint8).tobytes(),
                    np.array([r.engine_hash for r in records], dtype=np.uint64).tobytes(),
                    np.array([r.sequence_hash for r in records], dtype=np.uint64).tobytes(),
                    np.array([r.parent_hash or 0 for r in records], dtype=np.uint64).tobytes(),
                    np.array([r.parent_hash is not None for r in records], dtype=np.bool_).tobytes(),
                    np.array([r.local_hash for r in records], dtype=np.uint64).tobytes(),
                    np.array([r.stream_seq for r in records], dtype=np.int64).tobytes(),
                    np.array([r.conflict for r in records], dtype=np.bool_).tobytes(),
                    np.array([r.group_idx for r in records], dtype=np.uint32).tobytes(),
                    np.array([r.refs for r in records], dtype=np.uint32).tobytes(),
                    np.array([r.unresolved for r in records], dtype=np.bool_).tobytes(),
                    np.array([names[r.ownership] for r in records], dtype=np.uint32).tobytes(),
                    np.array([names[r.spec_kind] for r in records], dtype=np.uint32).tobytes(),
                    np.array([-1 if r.sliding_window is None else r.sliding_window for r in records], dtype=np.int64).tobytes(),
                    [name for name in names if name is not None],
                    held.groups,
                )
            )
        workers.append(_WorkerWire(worker.publisher, worker.dp_rank, dict(state.counters), provenances))
    return msgspec.msgpack.encode(
        _SnapshotWire(SNAPSHOT_VERSION, fold.inventory_seq, dict(fold.counters), workers, position)
    )


def snapshot_position(data: bytes) -> StreamPosition:
    """Where KV_EVENTS stood for `encode_snapshot`'s bytes, read without rebuilding the fold.

    A snapshot from before positions were kept stands at its inventory_seq with no known Msg-Id ("").
    """
    try:
        wire = msgspec.msgpack.decode(data, type=_PositionWire)
    except msgspec.DecodeError as error:
        raise SnapshotError(f"malformed kvledger snapshot: {error}") from None
    return wire.position if wire.position is not None else StreamPosition(wire.inventory_seq, "")


def decode_snapshot(data: bytes) -> InventoryFold:
    """Rebuild a fold from `encode_snapshot`'s bytes."""
    try:
        wire = msgspec.msgpack.decode(data, type=_SnapshotWire)
    except msgspec.DecodeError as error:
        raise SnapshotError(f"malformed kvledger snapshot: {error}") from None
    if wire.v != SNAPSHOT_VERSION:
        raise SnapshotError(f"snapshot version {wire.v} is not supported (expected {SNAPSHOT_VERSION})")
    fold = InventoryFold()
    fold.inventory_seq = wire.inventory_seq
    fold.counters.update(wire.counters)
    for worker_wire in wire.workers:
        worker = WorkerId(worker_wire.publisher, worker_wire.dp_rank)
        positions, records = {}, []
        for provenance_wire in worker_wire.provenances:
            positions[Provenance(provenance_wire.provenance)] = ProvenancePosition(
                provenance_wire.epoch, provenance_wire.seq, provenance_wire.uncertain_since, provenance_wire.kv_cache_groups,
            )
            columns = zip(
                np.frombuffer(provenance_wire.tiers, dtype=np.uint8).tolist(),
                np.frombuffer(provenance_wire.engine_hashes, dtype=np.uint64).tolist(),
                np.frombuffer(provenance_wire.sequence_hashes, dtype=np.uint64).tolist(),
                np.frombuffer(provenance_wire.parent_hashes, dtype=np.uint64).tolist(),
                np.frombuffer(provenance_wire.has_parent, dtype=np.bool_).tolist(),
                np.frombuffer(provenance_wire.local_hashes, dtype=np.uint64).tolist(),
                np.frombuffer(provenance_wire.stream_seqs, dtype=np.int64).tolist(),
                np.frombuffer(provenance_wire.conflicts, dtype=np.bool_).tolist(),
                np.frombuffer(provenance_wire.group_idxs, dtype=np.uint32).tolist(),
                np.frombuffer(provenance_wire.refs, dtype=np.uint32).tolist(),
                np.frombuffer(provenance_wire.unresolved, dtype=np.bool_).tolist(),
                np.frombuffer(provenance_wire.ownerships, dtype=np.uint32).tolist(),
                np.frombuffer(provenance_wire.spec_kinds, dtype=np.uint32).tolist(),
                np.frombuffer(provenance_wire.sliding_windows, dtype=np.int64).tolist(),
                strict=True,
            )
            names = [None, *provenance_wire.names]
            provenance = Provenance(provenance_wire.provenance)
            # Records go back in stream order, so topology ends as it was after folding.
            for (
                tier, engine, sequence, parent, has_parent, local, stream_seq, conflict, group, refs, unresolved,
                ownership, spec_kind, window,
            ) in columns:
                records.append(BlockRecord(
                    worker, _TIERS[tier], provenance, engine, sequence, parent if has_parent else None, local,
                    stream_seq, conflict, group, names[ownership], names[spec_kind], None if window < 0 else window,
                    refs, unresolved,
                ))
        fold.restore_worker(worker, positions, records, worker_wire.counters)
    return fold
