"""A worker's native blocks as its engine announced them: engine hash, local (content) hash, parent.

Dynamo's `/dump` (decide/routers/dynamo_indexer.py) lists a worker's blocks as stored events a
peer replays into its radix tree: each block by its engine hash and content hash, under its
parent, parents first. The rows hold sequence hashes only; the compact store (plain workers) and
the fold (promoted ones) keep the rest, so this belongs to the index's room. A block is listed
exactly when the index credits the worker with it (its bit is set in the row of its sequence
hash: an unreachable worker holds nothing, a residency rule may discount a block), and only
where its parent is listed too: a block whose parent left every tier is reached by no prefix
walk, decide's or Dynamo's, and Dynamo would take it as the root of a chain of its own. A block
the fold chained from nothing (its announced parent unknown to the worker) is listed as a root.
"""

from __future__ import annotations

import attrs
import numpy as np

from kvledger.core.events import Provenance, Tier, WorkerId

from kvledger.decide.compiled import compiled
from kvledger.decide.inventory.compact import TIERS, entries_of
from kvledger.decide.inventory.index import MISSING_ROW, NATIVE_DEVICE, NATIVE_DISK, NATIVE_HOST, InventoryIndex
from kvledger.decide.inventory.rows import has_bit
from kvledger.decide.inventory.table import lookup_rows

_POSITION_OF_TIER = {Tier.DEVICE: NATIVE_DEVICE, Tier.HOST: NATIVE_HOST, Tier.DISK: NATIVE_DISK}


@attrs.frozen
class NativeBlock:
    tier: Tier
    engine_hash: int
    local_hash: int
    parent_hash: int | None  # an engine hash, None for the first block of a chain


@compiled
def _credited(holders, spilled, rows, positions, slot):
    """Whether each (row, class position) has the worker's bit."""
    out = np.zeros(rows.size, dtype=np.bool_)
    for item in range(rows.size):
        if rows[item] != MISSING_ROW:
            out[item] = has_bit(holders, spilled, rows[item], positions[item], slot)
    return out


def native_blocks(index: InventoryIndex, worker: WorkerId) -> list[NativeBlock]:
    """The worker's credited native blocks on the device, host and disk tiers, each after its parent (a block held on
    several tiers once per tier, the parent on any of them)."""
    slot = index.slot(worker)
    if slot is None:
        return []
    if worker in index.promoted_workers:
        state = index.fold.worker_state(worker)
        records = [record for record in (index.fold.iter_worker_records(worker) if state is not None else ())
                   if record.provenance is Provenance.NATIVE and record.tier in _POSITION_OF_TIER]
        tiers = [record.tier for record in records]
        engines = [record.engine_hash for record in records]
        sequences = np.array([record.sequence_hash for record in records], dtype=np.uint64)
        locals_ = [record.local_hash for record in records]
        parents = [record.parent_hash for record in records]
    else:
        compact = index.compact
        first = compact.first_owner(slot)
        positions = entries_of(compact.tags, first, first + len(TIERS) - 1)
        tags = compact.tags[positions].astype(np.int64)
        tiers = [TIERS[code] for code in ((tags & ((1 << 22) - 1)) - first).tolist()]
        engines = compact.keys[positions].tolist()
        sequences = compact.sequences[positions]
        locals_ = compact.local_hashes[positions].tolist()
        parents = [parent if tag >> 31 else None
                   for parent, tag in zip(compact.parents[positions].tolist(), tags.tolist())]
    if not engines:
        return []
    rows = lookup_rows(index.table_keys, index.table_rows, index.table_bits, sequences).astype(np.int64)
    classes = np.array([_POSITION_OF_TIER[tier] for tier in tiers], dtype=np.int64)
    credited = _credited(index.holders, index.spilled, rows, classes, slot).tolist()
    # A block whose sequence hash is its content hash starts a chain (its announced parent was unknown to the
    # worker then, so the fold started a new chain): listed without a parent, as Dynamo must hash it.
    blocks = [NativeBlock(tier, engine, local, None if sequence == local else parent)
              for tier, engine, local, parent, sequence, kept
              in zip(tiers, engines, locals_, parents, sequences.tolist(), credited) if kept]
    return _parents_first(blocks)


def _parents_first(blocks: list[NativeBlock]) -> list[NativeBlock]:
    """The blocks by depth in their chains, a parent read on any tier (copies of one engine hash may sit under
    different parents: one stored as a chain's start on one tier, under its parent on another), in a walk from the
    roots; those it never reaches (their parent not listed) are left out."""
    children: dict[int, list[int]] = {}
    depth: list[int | None] = [None] * len(blocks)
    frontier = []
    for number, block in enumerate(blocks):
        if block.parent_hash is None:
            depth[number] = 0
            frontier.append(number)
        else:
            children.setdefault(block.parent_hash, []).append(number)
    reached: set[int] = set()
    while frontier:
        following = []
        for number in frontier:
            engine = blocks[number].engine_hash
            if engine in reached:
                continue
            reached.add(engine)
            for child in children.get(engine, ()):
                if depth[child] is None:
                    depth[child] = depth[number] + 1
                    following.append(child)
        frontier = following
    return [blocks[number] for _, number in sorted((found, number) for number, found in enumerate(depth)
                                                   if found is not None)]
