"""The ceiling of a window of recorded decisions, read from SQL (docs/audit.md, "Ceiling: what an oracle
would have reached"): the requests, the fleet's capacity and its holdings at the window's start, handed to
the pure computation in `kvledger/core/ceiling.py`.

- Requests: every decision of the window with its recorded request (`decision_requests`), in KV_DECISIONS
  order, as sequence hashes chained from the recorded local hashes; decisions recorded without their
  request are counted `unreplayable`, requests recorded on their first blocks only `truncated`.
- Achieved: per decision, the prefix its target held natively on any local tier when decide answered
  (`target_prefix_blocks`), or the prefix reuse chose to transfer there when longer
  (`chosen_prefix_blocks`): what the demo counts as a hit.
- Capacity: per worker, the most distinct blocks it held natively at once on the counted tiers (all local
  ones by default: the hits counted are on any of them) at any ledger seq from the window's first
  decision's inventory seq to its last one; round-robin runs over the workers with some, in worker order.
- Start: each worker's native holdings as of the first decision's inventory seq (oldest first), which both
  the oracle (pooled) and round-robin begin with, so a window that starts on a warm fleet is fair to both.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence

import attrs
import numpy as np
import sqlalchemy as sa

from kvledger.core import ceiling as model
from kvledger.core.events import Provenance, Tier, WorkerId
from kvledger.core.hashing import sequence_hashes
from kvledger.core.reuse import LOCAL_TIERS
from kvledger.core.settings import ReuseSettings
from kvledger.store.audit import Query
from kvledger.store.whatif_reference import NEVER, ReplayRefused, sql_refusal, stays_of, warm_stay_kernels

CEILING_REQUESTS = Query(
    "ceiling_requests",
    "The decisions of a window with the requests they answered and the prefix each found, in KV_DECISIONS order",
    """SELECT d.stream_seq, d.decided_ts, d.inventory_seq, d.target_prefix_blocks, d.chosen_prefix_blocks,
       r.block_size, r.blocks, r.local_hashes
FROM decisions d
JOIN decision_requests r ON r.stream_seq = d.stream_seq
WHERE d.decided_ts >= :from_ts AND d.decided_ts < :to_ts
ORDER BY d.stream_seq;""",
    ("from_ts", "to_ts"),
)

CEILING_UNREPLAYABLE = Query(
    "ceiling_unreplayable",
    "Decisions of a window recorded without their request",
    """SELECT COUNT(*) AS decisions
FROM decisions d
WHERE d.decided_ts >= :from_ts AND d.decided_ts < :to_ts
  AND NOT EXISTS (SELECT 1 FROM decision_requests r WHERE r.stream_seq = d.stream_seq);""",
    ("from_ts", "to_ts"),
)

# Native stays on local tiers open at some seq of [:first_seq, :last_seq]: the fleet's occupancy.
CEILING_STAYS = Query(
    "ceiling_stays",
    "Native stays on local tiers open at some seq of a window: each worker's occupancy over it",
    """SELECT publisher, dp_rank, tier, sequence_hash, stored_seq, slot, removed_seq
FROM block_residency
WHERE provenance = 'native' AND tier IN ('device', 'host', 'disk') AND NOT unresolved
  AND stored_seq <= :last_seq AND (removed_seq IS NULL OR removed_seq > :first_seq);""",
    ("first_seq", "last_seq"),
)

CEILING_GENERATIONS = Query(
    "ceiling_generations",
    "Where KV_EVENTS lost acknowledged messages: from which stream seq its seqs map to ledger seqs, since when",
    """SELECT first_stream_seq, ledger_offset, detected_ts
FROM stream_generations
WHERE stream = 'KV_EVENTS'
ORDER BY generation;""",
    (),
)

QUERIES = (CEILING_REQUESTS, CEILING_UNREPLAYABLE, CEILING_STAYS, CEILING_GENERATIONS)


@attrs.frozen
class CeilingReport:
    """A window's ceiling: the three figures (`kvledger.core.ceiling.Ceiling`) and what they were read from."""

    window: tuple[float, float]
    figures: model.Ceiling
    workers: tuple[str, ...]  # in round-robin order, beside figures.capacities
    unreplayable: int  # decisions of the window without their request: in no figure
    truncated: int  # requests recorded on their first blocks only (their tail is counted a miss)
    seqs: tuple[int, int] | None  # the ledger seqs the capacity was read over; None without requests
    start_blocks: int  # distinct blocks the fleet held at the window's start

    @property
    def capacities(self) -> dict[str, int]:
        return dict(zip(self.workers, self.figures.capacities))

    def rows(self) -> list[dict]:
        """One row per policy (oracle, round_robin, achieved), each with the window's counts."""
        extra = {"unreplayable": self.unreplayable, "truncated": self.truncated,
                 "capacity_blocks": self.figures.capacity_blocks, "workers": len(self.workers)}
        return [{**row, **extra} for row in self.figures.rows()]


def _run(connection: sa.Connection, query: Query, **params: object) -> sa.CursorResult:
    return connection.execute(sa.text(query.sql.rstrip(";")), params)


def _ledger_seqs(connection: sa.Connection, inventory_seqs: np.ndarray, decided: np.ndarray) -> np.ndarray:
    """Decisions' inventory seqs (KV_EVENTS seqs) as ledger seqs, through the stream's generations as known
    when each decision was made (store/whatif_reference.py maps them alike)."""
    offsets = np.zeros(len(inventory_seqs), dtype=np.int64)
    for first_stream_seq, ledger_offset, detected_ts in _run(connection, CEILING_GENERATIONS):
        known = (decided >= detected_ts) & (inventory_seqs >= first_stream_seq)
        offsets[known] = ledger_offset  # by generation: the newest known one at or below the seq wins
    return inventory_seqs + offsets


@attrs.frozen(eq=False)
class _Stays:
    worker: np.ndarray  # int64: position in `workers`
    hashes: np.ndarray  # uint64
    stored: np.ndarray  # int64
    slot: np.ndarray  # int64
    removed: np.ndarray  # int64, _OPEN when still held
    workers: list[WorkerId]


_OPEN = NEVER  # as `stays_of` marks a stay still held


def _stays(connection: sa.Connection, first: int, last: int, tiers: Sequence[Tier]) -> _Stays:
    """The native stays on the counted tiers open at some seq of [first, last] (`CEILING_STAYS`' rows), read in
    bulk as the replay reads them (`store.whatif_reference.stays_of`): no Python object per stay."""
    counted = {tier.value for tier in tiers}
    stays = stays_of(connection, first, last)
    wanted = np.array([provenance == Provenance.NATIVE.value and tier in counted
                       for _publisher, _dp_rank, provenance, tier in stays.placements] or [False], dtype=np.bool_)
    pairs = sorted({(publisher, dp_rank) for (publisher, dp_rank, _provenance, _tier), kept
                    in zip(stays.placements, wanted) if kept})  # as WorkerId orders: by (publisher, dp_rank)
    position = {pair: number for number, pair in enumerate(pairs)}
    worker_of = np.array([position.get((publisher, dp_rank), -1) for publisher, dp_rank, _provenance, _tier
                          in stays.placements] or [-1], dtype=np.int64)
    kept = wanted[stays.placement]
    return _Stays(worker_of[stays.placement[kept]], stays.sequence_hash[kept].view(np.uint64),
                  stays.stored_seq[kept], stays.slot[kept], stays.removed_seq[kept],
                  [WorkerId(publisher, dp_rank) for publisher, dp_rank in pairs])


def most_held(stays: _Stays, first: int, last: int) -> np.ndarray:
    """Per worker, the most distinct blocks held at once at a seq of [first, last]: a block on two tiers (or
    in two stays at once) counts once. Held at S is `stored <= S < removed`."""
    start = np.maximum(stays.stored, first)
    end = np.minimum(stays.removed, last + 1)
    open_ = start < end
    worker, hashes = stays.worker[open_], stays.hashes[open_]
    count = int(open_.sum())
    # A block's coverage per worker, swept in seq order (ends before starts at one seq): where it goes from
    # 0 to 1 the block comes, where it falls back to 0 it goes.
    w = np.concatenate([worker, worker])
    h = np.concatenate([hashes, hashes])
    seq = np.concatenate([start[open_], end[open_]])
    delta = np.concatenate([np.ones(count, dtype=np.int64), -np.ones(count, dtype=np.int64)])
    order = np.lexsort((delta, seq, h, w))
    coverage = np.cumsum(delta[order])  # each (worker, block) sums to 0, so the running sum is its own
    change = ((delta[order] == 1) & (coverage == 1)) | ((delta[order] == -1) & (coverage == 0))
    w, seq, delta = w[order][change], seq[order][change], delta[order][change]
    order = np.lexsort((delta, seq, w))
    held = np.cumsum(delta[order])  # each worker's changes sum to 0 too
    most = np.zeros(len(stays.workers), dtype=np.int64)
    np.maximum.at(most, w[order], held)
    return most


def held_at(stays: _Stays, seq: int) -> list[list[int]]:
    """Per worker, the distinct blocks held at `seq`, oldest first (by stored seq and slot)."""
    held = (stays.stored <= seq) & (seq < stays.removed)
    order = np.lexsort((stays.slot[held], stays.stored[held]))
    worker, hashes = stays.worker[held][order], stays.hashes[held][order]
    blocks: list[dict[int, None]] = [{} for _ in stays.workers]
    for number, block in zip(worker.tolist(), hashes.tolist()):
        blocks[number].pop(block, None)  # on two tiers: as recent as its latest stay
        blocks[number][block] = None
    return [list(held) for held in blocks]


def warm_kernels() -> None:
    """The kernels a ceiling from SQL runs (the stays' read, the oracle's and round-robin's caches), compiled or
    loaded from numba's kernel cache on two requests of two blocks: a process that reads a ceiling later (the
    demo's summary, once its traffic ends) then finds them ready. A machine's first demo otherwise compiled
    them after its traffic, about five seconds of its summary."""
    warm_stay_kernels()
    model.ceiling(model.Requests.of([[1, 2], [1, 3]], 16), [1, 1], [0, 0], ReuseSettings(), [[1], []])


def ceiling(
    connection: sa.Connection, settings: ReuseSettings, *, from_ts: float = -math.inf, to_ts: float = math.inf,
    capacities: Mapping[str, int] | None = None, tiers: Sequence[Tier] = LOCAL_TIERS,
) -> CeilingReport:
    """The oracle, round-robin and achieved figures of the decisions made in [from_ts, to_ts), from SQL;
    raises ReplayRefused when SQL no longer holds the window. `capacities` (worker name → blocks) replaces
    the capacity read from the stays (say, the engines' configured cache sizes); `tiers`, the tiers whose
    blocks count (all local ones: decide's credit and the demo's hits count each of them)."""
    window = {"from_ts": max(from_ts, -1e18), "to_ts": min(to_ts, 1e18)}
    unreplayable = _run(connection, CEILING_UNREPLAYABLE, **window).scalar_one()
    stamps, inventory, block_sizes, asked, found, sequences = [], [], [], [], [], []
    for _, decided_ts, inventory_seq, target_prefix, chosen_prefix, block_size, blocks, local in \
            _run(connection, CEILING_REQUESTS, **window):
        data = bytes(local)
        hashes = sequence_hashes(struct.unpack(f"<{len(data) // 8}Q", data))
        sequences.append(np.array(hashes, dtype=np.uint64))
        stamps.append(decided_ts)
        inventory.append(inventory_seq)
        block_sizes.append(block_size)
        asked.append(blocks)
        found.append(max(target_prefix or 0, chosen_prefix or 0))
    lengths = np.array([len(sequence) for sequence in sequences], dtype=np.int64)
    offsets = np.zeros(len(sequences) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    requests = model.Requests(
        np.concatenate(sequences) if sequences else np.zeros(0, dtype=np.uint64), offsets,
        np.array(block_sizes, dtype=np.int64), np.maximum(np.array(asked, dtype=np.int64), lengths))
    truncated = int((requests.blocks > lengths).sum())
    seqs = None
    workers: list[WorkerId] = []
    most = np.zeros(0, dtype=np.int64)
    start: list[list[int]] = []
    if len(requests):
        ledger = _ledger_seqs(connection, np.array(inventory, dtype=np.int64), np.array(stamps, dtype=np.float64))
        seqs = (int(ledger.min()), int(ledger.max()))
        refusal = sql_refusal(connection, seqs[0], from_ts)
        if refusal is not None:
            raise ReplayRefused(refusal)
        stays = _stays(connection, *seqs, tiers)
        workers, most, start = stays.workers, most_held(stays, *seqs), held_at(stays, seqs[0])
    if capacities is not None:
        given = sorted(WorkerId.parse(name) for name in capacities)
        known = {worker: blocks for worker, blocks in zip(workers, start)}
        start = [known.get(worker, []) for worker in given]
        workers, most = given, np.array([capacities[worker.name] for worker in given], dtype=np.int64)
    else:  # round-robin over the workers that held something
        some = most > 0
        workers = [worker for worker, kept in zip(workers, some) if kept]
        start = [blocks for blocks, kept in zip(start, some) if kept]
        most = most[some]
    if len(requests) and not workers:
        raise ReplayRefused("no worker held a native block on the counted tiers during the window: "
                            "no fleet capacity to bound")
    figures = model.ceiling(requests, most.tolist(), np.array(found, dtype=np.int64), settings, start)
    return CeilingReport((from_ts, to_ts), figures, tuple(worker.name for worker in workers), unreplayable,
                         truncated, seqs, len({block for blocks in start for block in blocks}))
