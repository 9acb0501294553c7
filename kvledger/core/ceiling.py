"""The ceiling: the prefix hit rate and TTFT saving an oracle would have reached on the same
requests and fleet capacity, beside round-robin and what kvledger's routing achieved.

Three policies over one ordered stream of requests (each a list of sequence hashes):

- `ORACLE`: one pooled cache of C = the sum of the workers' capacities, replaced by Belady's
  offline-optimal rule with bypass (MIN: on a miss keep the block only if some cached block is
  next used later than it, and then evict the one used farthest ahead), counting every block
  hit, not only prefix hits.
- `ROUND_ROBIN`: request i goes to worker i mod W; each worker is an LRU cache of its own
  capacity, serving as the demo's `EngineCache` does (the prefix found cached is the hit, then
  every block of the request becomes most recent and the oldest are evicted down to capacity).
- `ACHIEVED`: the prefix hits kvledger's decisions recorded (given, one count per request).

Each gives requests, request blocks, hit blocks, the prefix hit rate (hit blocks / request
blocks, the demo's definition) and the TTFT saving: the hit blocks' prefill, costed by
`kvledger/core/cost.py` at `reuse.transfer_source_prefill_token_us`.

Why the oracle is an upper bound on the prefix hits of any routing, with or without
decode-to-prefill transfers, over per-worker caches of capacities c_w (sum C) fed by these
requests. Let S_w(t) be worker w's cached set before request t: |S_w(t)| <= c_w, and
S_w(t+1) is a subset of S_w(t), plus R_t's blocks on the worker that served it (an engine
computes a whole request at once, then keeps what it keeps). The union U(t) of the S_w(t)
holds at most C blocks and grows only by R_t's blocks, so it is the state of one cache of
size C; a request's prefix hits, on its target or transferred from another worker, are
blocks of U(t), at most its longest prefix held in U(t). That pooled cache, taking a
request's blocks one at a time, is matched by a demand-paging cache of size C with bypass:
it takes the request's held prefix as hits first, and afterwards inserts each block the
pooled cache keeps at that block's own access, evicting one the pooled cache drops (there is
always one, or U(t+1) would exceed C). So its block hits are at least the routing's prefix
hits, and MIN maximises the block hits of every such cache (it is the greedy that keeps the
most reuse intervals, each block's span from one access to its next, with at most C open at
once; Belady 1966, and the interval-scheduling argument of Carlisle and Lloyd 1995). Prefix
hits <= block hits closes the chain. The bound holds for caches that start as the oracle
does (`initial`: the fleet's holdings at the window's start, or empty) and that only these
requests fill; blocks brought in by traffic the stream does not contain can lift a recorded
figure above it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence

import attrs
import numba
import numpy as np

from kvledger.core import cost
from kvledger.core.settings import ReuseSettings


class Policy(enum.Enum):
    ORACLE = "oracle"
    ROUND_ROBIN = "round_robin"
    ACHIEVED = "achieved"


def _newest_last(blocks: Iterable[int]) -> list[int]:
    """Distinct blocks, each where it last appears: oldest first."""
    order: dict[int, None] = {}
    for block in blocks:
        order.pop(block, None)
        order[block] = None
    return list(order)


def _as_hashes(values: Iterable[int]) -> np.ndarray:
    """Sequence hashes as uint64 (negative ints, as SQL stores them signed, are read as two's complement)."""
    return np.array([value & 0xFFFFFFFFFFFFFFFF for value in values], dtype=np.uint64)


@attrs.frozen(eq=False)
class Requests:
    """Requests in decision order, end to end: request i's sequence hashes are
    `hashes[offsets[i]:offsets[i + 1]]`; `blocks[i]` is its length as asked (more than it has
    hashes when its record kept only its first blocks)."""

    hashes: np.ndarray  # uint64
    offsets: np.ndarray  # int64, one more than there are requests
    block_sizes: np.ndarray  # int64, per request
    blocks: np.ndarray  # int64, per request

    @classmethod
    def of(cls, sequences: Iterable[Sequence[int]], block_size: int | Sequence[int],
           blocks: Sequence[int] | None = None) -> Requests:
        """From each request's sequence hashes; one block size for all, or one per request."""
        sequences = [_as_hashes(sequence) for sequence in sequences]
        lengths = np.array([len(sequence) for sequence in sequences], dtype=np.int64)
        offsets = np.zeros(len(sequences) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        hashes = np.concatenate(sequences) if sequences else np.zeros(0, dtype=np.uint64)
        sizes = np.broadcast_to(np.asarray(block_size, dtype=np.int64), lengths.shape).copy()
        asked = lengths if blocks is None else np.asarray(blocks, dtype=np.int64)
        return cls(hashes, offsets, sizes, np.maximum(asked, lengths))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


@attrs.frozen
class Figure:
    """What one policy reached on the requests."""

    policy: Policy
    requests: int
    request_blocks: int
    hit_blocks: int
    ttft_saving_ms: float

    @property
    def prefix_hit_rate(self) -> float | None:
        """Hit blocks over request blocks (None without blocks); the oracle's is a bound on it."""
        return self.hit_blocks / self.request_blocks if self.request_blocks else None

    def row(self) -> dict:
        return {"policy": self.policy.value, "requests": self.requests, "request_blocks": self.request_blocks,
                "hit_blocks": self.hit_blocks, "prefix_hit_rate": self.prefix_hit_rate,
                "ttft_saving_ms": self.ttft_saving_ms}


@attrs.frozen
class Ceiling:
    """The three figures on one stream of requests, and the fleet capacity they were reached with."""

    oracle: Figure
    round_robin: Figure
    achieved: Figure
    capacities: tuple[int, ...]  # per worker, in round-robin order

    @property
    def capacity_blocks(self) -> int:
        return sum(self.capacities)

    def rows(self) -> list[dict]:
        return [figure.row() for figure in (self.oracle, self.round_robin, self.achieved)]


def _figure(policy: Policy, requests: Requests, hits_per_request: np.ndarray, settings: ReuseSettings) -> Figure:
    hits = np.asarray(hits_per_request, dtype=np.int64)
    saving = 0.0
    for block_size in np.unique(requests.block_sizes):  # each block size's hits through the one cost model
        blocks = int(hits[requests.block_sizes == block_size].sum())
        saving += cost.recompute_ms(blocks, int(block_size), settings.transfer_source_prefill_token_us)
    return Figure(policy, len(requests), int(requests.blocks.sum()), int(hits.sum()), saving)


def _per_request(requests: Requests, hit: np.ndarray) -> np.ndarray:
    running = np.zeros(len(hit) + 1, dtype=np.int64)
    np.cumsum(hit, out=running[1:])
    return running[requests.offsets[1:]] - running[requests.offsets[:-1]]


# --- the oracle: MIN over one pooled cache ----------------------------------------------------


@numba.njit(cache=True, nogil=True)
def _slot(table, slot_keys, key):
    """Where `key` sits in the open-addressing `table` of block ids (or the empty slot it would take); each
    slot keeps its key beside its id, so a probe reads one place."""
    mask = np.uint64(table.shape[0] - 1)
    mixed = key * np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing, high bits folded into the low ones
    slot = (mixed ^ (mixed >> np.uint64(29))) & mask
    while table[slot] >= 0 and slot_keys[slot] != key:
        slot = (slot + np.uint64(1)) & mask
    return slot


@numba.njit(cache=True, nogil=True)
def _index_accesses(hashes):
    """One pass over the stream with a hash table: each access's block id and next use, each block's first
    use. A stable sort of 20 M hashes took several times as long."""
    n = hashes.shape[0]
    table = np.full(1 << 16, -1, dtype=np.int64)
    slot_keys = np.zeros(1 << 16, dtype=np.uint64)
    keys = np.empty(max(n, 1), dtype=np.uint64)
    first_use = np.empty(max(n, 1), dtype=np.int64)
    last_use = np.empty(max(n, 1), dtype=np.int64)
    next_use = np.full(n, -1, dtype=np.int64)
    ids = np.empty(n, dtype=np.int64)
    blocks = 0
    for t in range(n):
        key = hashes[t]
        slot = _slot(table, slot_keys, key)
        block = table[slot]
        if block < 0:
            block = blocks
            blocks += 1
            keys[block] = key
            first_use[block] = t
            table[slot] = block
            slot_keys[slot] = key
            if 2 * blocks > table.shape[0]:  # at most half full: short probes
                table = np.full(2 * table.shape[0], -1, dtype=np.int64)
                slot_keys = np.zeros(table.shape[0], dtype=np.uint64)
                for known in range(blocks):
                    moved = _slot(table, slot_keys, keys[known])
                    table[moved] = known
                    slot_keys[moved] = keys[known]
        else:
            next_use[last_use[block]] = t
        last_use[block] = t
        ids[t] = block
    return next_use, ids, keys[:blocks], first_use[:blocks], table, slot_keys


@numba.njit(cache=True, nogil=True)
def _lookup(table, slot_keys, wanted):
    found = np.empty(wanted.shape[0], dtype=np.int64)
    for k in range(wanted.shape[0]):
        found[k] = table[_slot(table, slot_keys, wanted[k])]
    return found


@attrs.frozen(eq=False)
class _Accesses:
    """The stream's accesses, indexed once: each access's next use and block id, each block's first use."""

    next_use: np.ndarray  # int64: the position of the same block's next access, -1 when none
    ids: np.ndarray  # int64: block ids, 0 .. blocks - 1 in order of first use
    keys: np.ndarray  # uint64: block id k is the sequence hash keys[k]
    first_use: np.ndarray  # int64: each block's first access
    table: np.ndarray  # the hash table: block ids by slot (-1: empty)
    slot_keys: np.ndarray  # and each slot's sequence hash

    @classmethod
    def of(cls, hashes: np.ndarray) -> _Accesses:
        return cls(*_index_accesses(np.ascontiguousarray(hashes, dtype=np.uint64)))

    @property
    def blocks(self) -> int:
        return len(self.keys)

    def find(self, blocks: Iterable[int]) -> np.ndarray:
        """The ids of `blocks` in the given order, -1 for each the stream never accesses."""
        return _lookup(self.table, self.slot_keys, _as_hashes(blocks))


@numba.njit(cache=True, nogil=True)
def _sift_down(heap, size, position):
    value = heap[position]
    while True:
        child = 2 * position + 1
        if child >= size:
            break
        if child + 1 < size and heap[child + 1] > heap[child]:
            child += 1
        if heap[child] <= value:
            break
        heap[position] = heap[child]
        position = child
    heap[position] = value


@numba.njit(cache=True, nogil=True)
def _push(heap, size, value):
    position = size
    while position > 0:
        parent = (position - 1) // 2
        if heap[parent] >= value:
            break
        heap[position] = heap[parent]
        position = parent
    heap[position] = value
    return size + 1


@numba.njit(cache=True, nogil=True)
def _pop(heap, size):
    top = heap[0]
    size -= 1
    if size > 0:
        heap[0] = heap[size]
        _sift_down(heap, size, 0)
    return top, size


@numba.njit(cache=True, nogil=True)
def _belady(next_use, initial_ends, capacity):
    """MIN with bypass as interval scheduling: each access opens the span to its block's next use, at most
    `capacity` spans stay open, and on overflow the one ending farthest ahead is dropped. An access is a hit
    when the span ending at it survived. A max-heap of span ends (unique: one span ends at each access);
    spans already ended stay in it until the heap is rebuilt without them."""
    n = next_use.shape[0]
    kept = np.zeros(n, dtype=np.bool_)
    room = min(n + initial_ends.shape[0], 2 * capacity + 64) + 1
    heap = np.empty(room, dtype=np.int64)
    size = 0
    live = 0
    for end in initial_ends:  # the cache's first contents: spans from before the stream to their first use
        size = _push(heap, size, end)
        kept[end] = True
        live += 1
    while live > capacity:
        end, size = _pop(heap, size)
        kept[end] = False
        live -= 1
    for t in range(n):
        if kept[t]:
            live -= 1  # its span ends here; its heap entry is now stale
        following = next_use[t]
        if following < 0:
            continue
        if size + 1 >= room:  # only spans still open (ending after t) are kept
            kept_size = 0
            for k in range(size):
                if heap[k] > t:
                    heap[kept_size] = heap[k]
                    kept_size += 1
            size = kept_size
            for k in range(size // 2 - 1, -1, -1):
                _sift_down(heap, size, k)
        size = _push(heap, size, following)
        kept[following] = True
        live += 1
        if live > capacity:
            # With an open span the heap's top is open: ended spans end before t, open ones after it.
            end, size = _pop(heap, size)
            kept[end] = False
            live -= 1
    return kept


def belady_hits(hashes: np.ndarray, capacity: int, initial: Iterable[int] = ()) -> np.ndarray:
    """Which accesses of `hashes` (uint64, in order) hit in one cache of `capacity` blocks run by Belady's MIN
    with bypass, starting with the blocks `initial` (at most `capacity` of them are kept, those used soonest)."""
    accesses = _Accesses.of(np.asarray(hashes, dtype=np.uint64))
    return _min_of(accesses, capacity, initial)


def _min_of(accesses: _Accesses, capacity: int, initial: Iterable[int]) -> np.ndarray:
    # A first block the stream never accesses is the first MIN would drop: leaving it out changes no hit.
    found = accesses.find(initial)
    initial_ends = np.unique(accesses.first_use[found[found >= 0]])
    return _belady(accesses.next_use, initial_ends, max(int(capacity), 0))


def oracle(requests: Requests, capacity: int, settings: ReuseSettings, initial: Iterable[int] = (),
           *, _accesses: _Accesses | None = None) -> Figure:
    """The upper bound: every block hit of one pooled cache of `capacity` blocks under MIN."""
    accesses = _Accesses.of(requests.hashes) if _accesses is None else _accesses
    return _figure(Policy.ORACLE, requests, _per_request(requests, _min_of(accesses, capacity, initial)), settings)


# --- round-robin: an LRU cache per worker -----------------------------------------------------


@numba.njit(cache=True, nogil=True)
def _evict(stamp_of, block_of, oldest, cached, capacity):
    """The oldest cached blocks evicted down to `capacity`; returns the new oldest stamp."""
    while cached > capacity:
        block = block_of[oldest]
        if stamp_of[block] == oldest:
            stamp_of[block] = -1
            cached -= 1
        oldest += 1
    return oldest


@numba.njit(cache=True, nogil=True)
def _lru(ids, offsets, first, step, capacity, initial_ids, stamp_of, hits):
    """One worker's LRU over requests first, first + step, ...: prefix hits into `hits`. Stamps count
    touches; a block's latest stamp is in `stamp_of` (-1: not cached), so the oldest live stamp is the LRU
    block and eviction scans stamps in order, skipping superseded ones. `stamp_of` is left all -1."""
    requests = offsets.shape[0] - 1
    touches = initial_ids.shape[0]
    for r in range(first, requests, step):
        touches += offsets[r + 1] - offsets[r]
    block_of = np.empty(touches, dtype=np.int64)
    stamp = 0
    oldest = 0
    cached = 0
    for block in initial_ids:
        if stamp_of[block] < 0:
            cached += 1
        stamp_of[block] = stamp
        block_of[stamp] = block
        stamp += 1
    oldest = _evict(stamp_of, block_of, oldest, cached, capacity)
    cached = min(cached, capacity)
    for r in range(first, requests, step):
        start, end = offsets[r], offsets[r + 1]
        hit = 0
        while start + hit < end and stamp_of[ids[start + hit]] >= 0:
            hit += 1
        hits[r] = hit
        for k in range(start, end):  # the whole request computed, then kept most recent
            block = ids[k]
            if stamp_of[block] < 0:
                cached += 1
            stamp_of[block] = stamp
            block_of[stamp] = block
            stamp += 1
        oldest = _evict(stamp_of, block_of, oldest, cached, capacity)
        cached = min(cached, capacity)
    for k in range(oldest, stamp):
        stamp_of[block_of[k]] = -1


def round_robin(requests: Requests, capacities: Sequence[int], settings: ReuseSettings,
                initial: Sequence[Iterable[int]] = (), *, _accesses: _Accesses | None = None) -> Figure:
    """Request i on worker i mod len(capacities), each worker an LRU of its capacity, starting with its
    `initial` blocks (oldest first); prefix hits."""
    accesses = _Accesses.of(requests.hashes) if _accesses is None else _accesses
    hits = np.zeros(len(requests), dtype=np.int64)
    firsts = []
    for worker in range(len(capacities)):
        # A first block no request accesses still takes room until it is the oldest: it gets an id past the
        # stream's own (they are distinct per worker).
        first = accesses.find(_newest_last(initial[worker]) if worker < len(initial) else ())
        unknown = first < 0
        first[unknown] = accesses.blocks + np.arange(int(unknown.sum()))
        firsts.append(first)
    stamp_of = np.full(accesses.blocks + max((len(first) for first in firsts), default=0), -1, dtype=np.int64)
    for worker, (capacity, first) in enumerate(zip(capacities, firsts)):
        _lru(accesses.ids, requests.offsets, worker, len(capacities), max(int(capacity), 0), first, stamp_of, hits)
    return _figure(Policy.ROUND_ROBIN, requests, hits, settings)


# --- what kvledger's routing achieved ---------------------------------------------------------


def achieved(requests: Requests, hit_blocks: Sequence[int] | np.ndarray, settings: ReuseSettings) -> Figure:
    """The recorded figure: `hit_blocks[i]` prefix blocks found (or transferred) for request i."""
    hits = np.minimum(np.asarray(hit_blocks, dtype=np.int64), requests.blocks)
    return _figure(Policy.ACHIEVED, requests, hits, settings)


def ceiling(requests: Requests, capacities: Sequence[int], achieved_hits: Sequence[int] | np.ndarray,
            settings: ReuseSettings, initial: Sequence[Iterable[int]] = ()) -> Ceiling:
    """The three figures on `requests`: the oracle over the pooled capacity, round-robin over `capacities`
    (blocks per worker, in round-robin order), and the recorded hits; `initial`: each worker's blocks at the
    start (oldest first), which the oracle pools."""
    if len(capacities) == 0 and len(requests):
        raise ValueError("a ceiling needs the fleet: no worker capacity given")
    initial = [list(blocks) for blocks in initial]
    accesses = _Accesses.of(requests.hashes)
    pooled = [block for blocks in initial for block in blocks]
    return Ceiling(
        oracle(requests, sum(capacities), settings, pooled, _accesses=accesses),
        round_robin(requests, capacities, settings, initial, _accesses=accesses) if capacities
        else _figure(Policy.ROUND_ROBIN, requests, np.zeros(0, dtype=np.int64), settings),
        achieved(requests, achieved_hits, settings),
        tuple(int(capacity) for capacity in capacities),
    )
