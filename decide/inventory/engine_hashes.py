"""Who holds a block by engine hash: per worker, as SGLang's indexer keys its placements.

An engine hash names a block as its engine published it; the rows rank on sequence hashes,
which differ between two workers whose chains began at different blocks (a worker ingest
joined mid-chain). So a plain worker's compact records are probed by engine hash directly,
and a promoted worker's chain (the fold's, by engine hash) names the sequence hash whose row
says on which tiers it holds the block. This reads the compact store and the fold the index
keeps: it belongs to the index's room, and readers elsewhere ask it (decide/inventory/view.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvledger.core.events import Provenance, Tier

from kvledger.decide.compiled import compiled
from kvledger.decide.inventory.compact import TIER_CODE, find_entry
from kvledger.decide.inventory.index import MISSING_ROW, NATIVE_DEVICE, NATIVE_DISK, NATIVE_HOST, InventoryIndex
from kvledger.decide.inventory.rows import dense_planes
from kvledger.decide.inventory.table import lookup_rows

# The native classes, device, host, disk: the tiers `native_holders` answers by.
NATIVE_TIERS = (NATIVE_DEVICE, NATIVE_HOST, NATIVE_DISK)
# The same tiers as the compact records' owner offsets.
_TIER_CODES = np.array([TIER_CODE[tier] for tier in (Tier.DEVICE, Tier.HOST, Tier.DISK)], dtype=np.uint32)


@compiled
def _plain_held(keys, tags, first_owners, tier_codes, engines, valid, prefix_only, out):
    """out[block, tier, worker]: whether the plain worker holds the engine hash on the tier.

    With `prefix_only`, a worker's scan stops at the first block it holds on no tier: a
    prefix question costs the prefixes found, not blocks × workers.
    """
    for worker in range(first_owners.size):
        for block in range(engines.size):
            held = False
            if valid[block]:
                for tier in range(tier_codes.size):
                    if find_entry(keys, tags, first_owners[worker] + tier_codes[tier], engines[block]) >= 0:
                        out[block, tier, worker] = True
                        held = True
            if prefix_only and not held:
                break



def native_holders(index: InventoryIndex, engines: Sequence[int | None], *, prefix_only: bool = False) -> np.ndarray:
    """blocks × native tiers (device, host, disk) × worker slots: whether the worker holds the engine hash natively
    on that tier (None: a hash held by nobody). With `prefix_only` a worker's blocks after the first it lacks may
    read as not held."""
    workers = len(index.workers)
    bits = np.zeros((len(engines), len(NATIVE_TIERS), workers), dtype=np.bool_)
    if not engines or not workers:
        return bits
    values = np.array([0 if value is None else value for value in engines], dtype=np.uint64)
    valid = np.array([value is not None for value in engines], dtype=np.bool_)
    promoted = index.promoted_workers
    promoted_slots = [index.slot(worker) for worker in promoted]
    plain = np.delete(np.arange(workers), promoted_slots) if promoted else np.arange(workers)
    if plain.size:
        held = np.zeros((len(engines), len(NATIVE_TIERS), plain.size), dtype=np.bool_)
        first_owners = index.compact.first_owner(plain).astype(np.uint32)  # its arithmetic, over the array
        _plain_held(index.compact.keys, index.compact.tags, first_owners, _TIER_CODES, values, valid, prefix_only,
                    held)
        bits[:, :, plain] = held
    for worker, slot in zip(promoted, promoted_slots):
        state = index.fold.worker_state(worker)
        if state is None:
            continue
        topology = state.by_provenance[Provenance.NATIVE].topology
        entries = [topology.get(int(value)) if ok else None for value, ok in zip(values.tolist(), valid.tolist())]
        known = np.array([entry is not None for entry in entries], dtype=np.bool_)
        if not known.any():
            continue
        sequences = np.array([entry.sequence_hash if entry is not None else 0 for entry in entries], dtype=np.uint64)
        rows = lookup_rows(index.table_keys, index.table_rows, index.table_bits, sequences).astype(np.int64)
        rows[~known] = MISSING_ROW
        planes = dense_planes(index.holders, index.spilled, rows, index.words)  # blocks × classes × words
        word, bit = divmod(slot, 64)
        for tier, position in enumerate(NATIVE_TIERS):
            bits[:, tier, slot] = (planes[:, position, word] >> np.uint64(bit)) & np.uint64(1) == 1
    return bits
