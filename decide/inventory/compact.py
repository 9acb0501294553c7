"""Plain workers' native records in flat arrays instead of Python objects: decide's memory per residency.

Nearly every worker of a fleet announces only the plain case: native blocks of KV-cache
group 0 without an ownership, on the device, host and disk tiers. `InventoryIndex` keeps
those workers' records here, one 36-byte table entry per (worker, tier, engine hash)
— engine hash, sequence hash, parent, local (content) hash, and a 32-bit tag packing the
owner, the references and whether there is a parent — where the fold spent about 400 bytes of objects
and dict entries; the fold still runs every sequence rule for them (`InventoryFold.begin`).

The first announcement that leaves the plain case — a retained batch, another group or
ownership, an unknown tier, an unresolvable placeholder, a re-parented block, a second
engine hash for one sequence hash, a tier-scoped clear of an uncertain worker, a block
stored more than 511 times over — promotes
the worker: its entries become `BlockRecord`s in the fold and the fold applies that
announcement and every later one itself. So a promoted worker is folded exactly as the
fold folds it, and a plain one as the fold would (the index tests compare both).

What promoted records cannot carry back: the stream seq they were stored at (0: copies of
one block agree while compact, so which is latest never mattered). The local hash is kept
though decide ranks on sequence hashes: Dynamo's `/dump` names each block by it
(decide/routers/dynamo_indexer.py).

The table: open addressing with linear probing over numpy arrays, an entry's owner
`slot * 4 + tier + 1` (0: empty; so at most 2**20 workers are held here, the rest are
promoted), deletions by backward shift (no tombstones). The
kernels below are compiled by numba, as `decide.kernels` are, and cached with them.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from kvledger.core.events import Provenance, Tier, WorkerId
from kvledger.core.fold import BlockRecord
from kvledger.runtime.memory import mapped_zeros

from kvledger.decide.compiled import compiled as _compiled, inlined as _inlined
from kvledger.decide.inventory.chain import chain_hash
from kvledger.decide.inventory.rows import has_bit
from kvledger.decide.inventory.table import probe


TIERS: tuple[Tier, ...] = (Tier.DEVICE, Tier.HOST, Tier.DISK)
TIER_CODE = {tier: code for code, tier in enumerate(TIERS)}
_TIER_COUNT = 3

# Results of `store_blocks`.
STORED, NOT_PLAIN, FULL = 0, 1, 2

_OWNER_MULTIPLIER = np.uint64(0xD6E8FEB86659FD93)
_HASH_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)
_S32 = np.uint64(32)
# An entry's tag: owner in bits 0-21, references in bits 22-30, whether it has a parent in bit 31.
_OWNER = np.uint32((1 << 22) - 1)
_REF_SHIFT = np.uint32(22)
_ONE_REF = np.uint32(1 << 22)
REFS_MAX = 511
_HAS_PARENT = np.uint32(1 << 31)
MAX_SLOTS = 1 << 20  # owners fit 22 bits
# Grown by a quarter past 80 % full, so the table stays 64-80 % full (linear probing stays
# short there) and a residency costs 45-56 bytes, not up to 72.
_MAX_LOAD = 0.8
_GROWTH = 1.25
_MIN_SIZE = 4096


@_inlined
def _home(owner, key, size):
    """The entry's first position: the top 32 bits of a mixed hash scaled to the table's size (any size)."""
    mixed = (key ^ (np.uint64(owner) * _OWNER_MULTIPLIER)) * _HASH_MULTIPLIER
    return np.int64(((mixed >> _S32) * np.uint64(size)) >> _S32)


@_inlined
def _next(position, size):
    position += 1
    return 0 if position == size else position


@_inlined
def _refs(tag):
    return (tag >> _REF_SHIFT) & np.uint32(REFS_MAX)


@_inlined
def find_entry(keys, tags, owner, key):
    """The entry's position, or -1."""
    size = keys.size
    position = _home(owner, key, size)
    while True:
        held = tags[position] & _OWNER
        if held == 0:
            return -1
        if held == owner and keys[position] == key:
            return position
        position = _next(position, size)


@_inlined
def _free_position(keys, tags, owner, key):
    size = keys.size
    position = _home(owner, key, size)
    while tags[position] != 0:
        position = _next(position, size)
    return position


@_inlined
def _delete(keys, tags, sequences, parents, local_hashes, position):
    """Empty one entry, shifting later entries of its probe run back (linear probing's deletion)."""
    size = keys.size
    tags[position] = 0
    hole = position
    probe_at = position
    while True:
        probe_at = _next(probe_at, size)
        if tags[probe_at] == 0:
            return
        home = _home(tags[probe_at] & _OWNER, keys[probe_at], size)
        # The entry may move into the hole unless its home lies cyclically in (hole, probe_at].
        if hole <= probe_at:
            stays = hole < home <= probe_at
        else:
            stays = home > hole or home <= probe_at
        if stays:
            continue
        keys[hole] = keys[probe_at]
        tags[hole] = tags[probe_at]
        sequences[hole] = sequences[probe_at]
        parents[hole] = parents[probe_at]
        local_hashes[hole] = local_hashes[probe_at]
        tags[probe_at] = 0
        hole = probe_at


@_inlined
def _copy_of(keys, tags, first_owner, key):
    """Position of the block's entry on any tier of the worker (copies agree while compact), or -1."""
    for tier in range(_TIER_COUNT):
        position = find_entry(keys, tags, first_owner + np.uint32(tier), key)
        if position >= 0:
            return position
    return -1


@_compiled
def store_blocks(keys, tags, sequences, parents, local_hashes, count, limit, first_owner, tier,
                 engines, local, has_tokens, parent_engine, has_parent,
                 index_keys, index_rows, index_bits, holders, spilled, position, slot,
                 out_sequences, out_new, counts):
    """One plain `Stored` event of one worker, as `InventoryFold._store` applies it.

    Checks every block first and changes nothing unless the whole event is plain
    (returns NOT_PLAIN), or when the table needs to grow first (FULL). `out_new[i]` says
    whether block i is newly held (its bit goes up in the index), `out_sequences[i]` its
    sequence hash; `counts` gets [unknown_parent, duplicate_store]. Returns (result, added).
    """
    blocks = engines.size
    if count + blocks > limit:
        return FULL, 0
    owner = first_owner + np.uint32(tier)
    found = np.empty(blocks, dtype=np.int64)
    block_parents = np.empty(blocks, dtype=np.uint64)
    block_locals = np.empty(blocks, dtype=np.uint64)
    block_has_parent = np.zeros(blocks, dtype=np.bool_)
    parent_sequence = np.uint64(0)
    chained = False
    unknown_parent = 0
    if has_tokens and has_parent:
        parent_at = _copy_of(keys, tags, first_owner, parent_engine)
        if parent_at >= 0:
            parent_sequence = sequences[parent_at]
            chained = True
        else:
            unknown_parent = 1
    parent = parent_engine
    parent_known = has_parent
    added = 0
    for block in range(blocks):
        engine = engines[block]
        held = find_entry(keys, tags, owner, engine)
        found[block] = held
        if held >= 0 and _refs(tags[held]) + blocks > REFS_MAX:
            return NOT_PLAIN, 0  # more references than a tag counts
        if has_tokens:
            sequence = chain_hash(parent_sequence, local[block]) if chained else local[block]
            block_parents[block] = parent
            block_locals[block] = local[block]
            block_has_parent[block] = parent_known
        else:
            copy = held if held >= 0 else _copy_of(keys, tags, first_owner, engine)
            if copy < 0:
                return NOT_PLAIN, 0  # an unresolved placeholder
            sequence = sequences[copy]
            block_parents[block] = parents[copy]
            block_locals[block] = local_hashes[copy]
            block_has_parent[block] = (tags[copy] & _HAS_PARENT) != 0
        out_sequences[block] = sequence
        out_new[block] = held < 0
        if held < 0:
            added += 1
            copy = _copy_of(keys, tags, first_owner, engine)
            if copy >= 0 and (sequences[copy] != sequence or parents[copy] != block_parents[block]
                              or ((tags[copy] & _HAS_PARENT) != 0) != block_has_parent[block]):
                return NOT_PLAIN, 0  # the engine re-parented a block it holds on another tier
            if has_bit(holders, spilled, probe(index_keys, index_rows, index_bits, sequence), position, slot):
                return NOT_PLAIN, 0  # another engine hash already holds this sequence hash here
        if has_tokens:
            parent_sequence, chained = sequence, True
            parent, parent_known = engine, True
    if added > 1:
        # Within one event, new blocks must differ in engine hash and in sequence hash.
        new_engines = np.empty(added, dtype=np.uint64)
        new_sequences = np.empty(added, dtype=np.uint64)
        at = 0
        for block in range(blocks):
            if out_new[block]:
                new_engines[at] = engines[block]
                new_sequences[at] = out_sequences[block]
                at += 1
        new_engines.sort()
        new_sequences.sort()
        for at in range(1, added):
            if new_engines[at] == new_engines[at - 1] or new_sequences[at] == new_sequences[at - 1]:
                return NOT_PLAIN, 0
    duplicates = 0
    for block in range(blocks):
        held = found[block]
        if held >= 0:
            tags[held] += _ONE_REF
            duplicates += 1
        else:
            at = _free_position(keys, tags, owner, engines[block])
            keys[at] = engines[block]
            tags[at] = owner | _ONE_REF | (_HAS_PARENT if block_has_parent[block] else np.uint32(0))
            sequences[at] = out_sequences[block]
            parents[at] = block_parents[block]
            local_hashes[at] = block_locals[block]
    counts[0] = unknown_parent
    counts[1] = duplicates
    return STORED, added


@_compiled
def remove_blocks(keys, tags, sequences, parents, local_hashes, owner, engines, out_sequences, out_gone):
    """One plain `Removed` event, as `InventoryFold._remove` applies it: returns (unknown removals, blocks gone)."""
    unknown = 0
    gone = 0
    for block in range(engines.size):
        out_gone[block] = False
        position = find_entry(keys, tags, owner, engines[block])
        if position < 0:
            unknown += 1
            continue
        if _refs(tags[position]) > 1:
            tags[position] -= _ONE_REF
            continue
        out_sequences[block] = sequences[position]
        out_gone[block] = True
        gone += 1
        _delete(keys, tags, sequences, parents, local_hashes, position)
    return unknown, gone


@_compiled
def drop_entries(keys, tags, sequences, parents, local_hashes, first, last):
    """Delete every entry whose owner is in [first, last], in place; returns how many.

    One pass: a deletion shifts later entries of the run back into the freed position,
    which is therefore looked at again; an entry only ever moves back towards the scan, or
    (wrapping) from the table's start, already scanned, to its end, still to come.
    """
    dropped = 0
    position = 0
    while position < keys.size:
        owner = tags[position] & _OWNER
        if owner != 0 and first <= owner <= last:
            _delete(keys, tags, sequences, parents, local_hashes, position)
            dropped += 1
        else:
            position += 1
    return dropped


@_compiled
def move_entries(keys, tags, sequences, parents, local_hashes, new_keys, new_tags, new_sequences, new_parents,
                 new_locals):
    """Insert every entry into the empty new table (a larger one); returns how many."""
    moved = 0
    for position in range(keys.size):
        owner = tags[position] & _OWNER
        if owner == 0:
            continue
        at = _free_position(new_keys, new_tags, owner, keys[position])
        new_keys[at] = keys[position]
        new_tags[at] = tags[position]
        new_sequences[at] = sequences[position]
        new_parents[at] = parents[position]
        new_locals[at] = local_hashes[position]
        moved += 1
    return moved


@_compiled
def insert_entries(keys, tags, sequences, parents, local_hashes, new_tags, new_keys, new_sequences, new_parents,
                   new_locals):
    """Insert entries known to be absent (a fold's records, taken over at startup)."""
    for item in range(new_keys.size):
        at = _free_position(keys, tags, new_tags[item] & _OWNER, new_keys[item])
        keys[at] = new_keys[item]
        tags[at] = new_tags[item]
        sequences[at] = new_sequences[item]
        parents[at] = new_parents[item]
        local_hashes[at] = new_locals[item]


def entries_of(tags: np.ndarray, first: int, last: int) -> np.ndarray:
    """Positions of the entries whose owner is in [first, last]."""
    owners = tags & _OWNER
    return np.flatnonzero((owners >= first) & (owners <= last))


class CompactInventory:
    """The native records of plain workers, by worker slot (see the module's docstring)."""

    def __init__(self) -> None:
        self.count = 0
        self._allocate(_MIN_SIZE)
        self.counts = np.zeros(2, dtype=np.int64)
        self._held: dict[int, int] = {}  # entries by worker slot

    def _allocate(self, size: int) -> None:
        self.keys = mapped_zeros(size, np.uint64)
        self.tags = mapped_zeros(size, np.uint32)
        self.sequences = mapped_zeros(size, np.uint64)
        self.parents = mapped_zeros(size, np.uint64)
        self.local_hashes = mapped_zeros(size, np.uint64)
        self.limit = int(size * _MAX_LOAD)

    @property
    def arrays(self) -> tuple[np.ndarray, ...]:
        return self.keys, self.tags, self.sequences, self.parents, self.local_hashes

    def nbytes(self) -> int:
        return sum(array.nbytes for array in self.arrays)

    def _grow(self, needed: int) -> None:
        """Move every entry into a table large enough for `needed`."""
        size = self.keys.size
        while needed > int(size * _MAX_LOAD):
            size = int(size * _GROWTH)
        old = self.arrays
        self._allocate(size)
        self.count = int(move_entries(*old, *self.arrays))

    @staticmethod
    def first_owner(slot: int) -> int:
        return slot * 4 + 1

    def store(self, slot: int, tier: Tier, engines: np.ndarray, local: np.ndarray, has_tokens: bool,
              parent: int | None, index_arrays: tuple, position: int,
              out_sequences: np.ndarray, out_new: np.ndarray) -> int:
        """`store_blocks` for one event, growing the table as needed: STORED or NOT_PLAIN."""
        while True:
            result, added = store_blocks(
                *self.arrays, self.count, self.limit, np.uint32(self.first_owner(slot)), TIER_CODE[tier],
                engines, local, has_tokens, np.uint64(parent or 0), parent is not None,
                *index_arrays, position, slot, out_sequences, out_new, self.counts,
            )
            if result != FULL:
                if added:
                    self.count += added
                    self._held[slot] = self._held.get(slot, 0) + added
                return result
            self._grow(self.count + engines.size)

    def remove(self, slot: int, tier: Tier, engines: np.ndarray, out_sequences: np.ndarray,
               out_gone: np.ndarray) -> int:
        """`remove_blocks` for one event: returns the unknown removals."""
        unknown, gone = remove_blocks(*self.arrays, np.uint32(self.first_owner(slot) + TIER_CODE[tier]),
                                      engines, out_sequences, out_gone)
        if gone:
            self.count -= gone
            self._held[slot] -= gone
        return int(unknown)

    def clear(self, slot: int, tier: Tier | None = None) -> None:
        """Drop the worker's entries on one tier, or on every tier."""
        first = self.first_owner(slot)
        low, high = (first, first + _TIER_COUNT - 1) if tier is None else (first + TIER_CODE[tier],) * 2
        dropped = int(drop_entries(*self.arrays, np.uint32(low), np.uint32(high)))
        self.count -= dropped
        self._held[slot] = self._held.get(slot, 0) - dropped

    def take_records(self, slot: int, worker: WorkerId, spec: tuple[str | None, int | None]) -> Iterator[BlockRecord]:
        """The worker's entries as the fold's records (see the module's docstring), then dropped from here."""
        first = self.first_owner(slot)
        positions = entries_of(self.tags, first, first + _TIER_COUNT - 1)
        spec_kind, sliding_window = spec
        records = [
            BlockRecord(
                worker, TIERS[(tag & int(_OWNER)) - first], Provenance.NATIVE, engine, sequence,
                parent if tag >> 31 else None, local, 0, False, 0, None, spec_kind, sliding_window,
                (tag >> int(_REF_SHIFT)) & REFS_MAX,
            )
            for tag, engine, sequence, parent, local in zip(
                self.tags[positions].tolist(), self.keys[positions].tolist(), self.sequences[positions].tolist(),
                self.parents[positions].tolist(), self.local_hashes[positions].tolist(),
            )
        ]
        self.clear(slot)
        return iter(records)

    def put_records(self, slot: int, records: list[BlockRecord]) -> None:
        """Hold a worker's plain records (`plain_records` said so), taken over from a fold."""
        if self.count + len(records) > self.limit:
            self._grow(self.count + len(records))
        first = self.first_owner(slot)
        insert_entries(
            *self.arrays,
            np.array([(first + TIER_CODE[record.tier]) | record.refs << int(_REF_SHIFT)
                      | (0 if record.parent_hash is None else 1 << 31) for record in records], dtype=np.uint32),
            np.array([record.engine_hash for record in records], dtype=np.uint64),
            np.array([record.sequence_hash for record in records], dtype=np.uint64),
            np.array([record.parent_hash or 0 for record in records], dtype=np.uint64),
            np.array([record.local_hash for record in records], dtype=np.uint64),
        )
        self.count += len(records)
        self._held[slot] = self._held.get(slot, 0) + len(records)

    def held_by(self, slot: int) -> int:
        """How many entries the worker has here."""
        return self._held.get(slot, 0)


def plain_placement(group_idx: int, ownership: str | None, tier: Tier) -> bool:
    """Whether a block so placed can be held here: KV-cache group 0, no ownership, device, host or disk."""
    return not group_idx and ownership is None and tier in TIER_CODE


def plain_records(records: list[BlockRecord]) -> tuple[str | None, int | None] | None:
    """The one (spec_kind, sliding_window) of a worker's records when all of them are plain, else None.

    Plain, as `store_blocks` keeps them: native, group 0, no ownership, on the device, host or
    disk tier, indexable, at most REFS_MAX references, one spec, copies of a block agreeing,
    and on each tier no sequence hash under two engine hashes.
    """
    specs = {(record.spec_kind, record.sliding_window) for record in records}
    if len(specs) > 1:
        return None
    placement: dict[int, tuple[int, int | None]] = {}
    sequences_seen: set[tuple[Tier, int]] = set()
    for record in records:
        if (record.provenance is not Provenance.NATIVE
                or not plain_placement(record.group_idx, record.ownership, record.tier)
                or not record.indexable or record.refs > REFS_MAX):
            return None
        if placement.setdefault(record.engine_hash, (record.sequence_hash, record.parent_hash)) != (
                record.sequence_hash, record.parent_hash):
            return None
        if (record.tier, record.sequence_hash) in sequences_seen:
            return None
        sequences_seen.add((record.tier, record.sequence_hash))
    return specs.pop() if specs else (None, None)
