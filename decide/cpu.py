"""The `cpu` ranking backend: numpy, vectorised over a whole batch of requests.

Every stage works on all requests' blocks at once: the batch's sequence hashes chained
together, prefix-ANDs over the class bitmasks walked in rounds (one table probe and one
accumulate per round), one sparse unpacking of where each worker's prefix ends.
Per-worker Python loops never appear; the only Python loops run over those rounds, over
power-of-two length classes (credit, which must add in block order to equal the
reference's floats) and over worker chunks (the lookup budget)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from kvledger.reuse import Decision, ReuseRequest
from kvledger.settings import ReuseSettings

from decide.index import CLASSES, MISSING_ROW, NATIVE_DEVICE, NATIVE_DISK, NATIVE_HOST, RETAINED_DEVICE, InventoryIndex
from decide.ranked import (
    BELOW_THRESHOLD,
    BUDGET_EXHAUSTED,
    CHOSEN,
    DISABLED,
    NO_CANDIDATES,
    NO_WORKERS,
    PREFIX_ANY,
    PREFIX_CLASSES,
    PREFIX_RETAINED_DEVICE,
    AnswerBatch,
    Clock,
    RankedBatch,
    flatten_requests,
    requested_targets,
    source_tier_codes,
)

# The budget is checked before each chunk of workers, as the reference checks it before
# each worker; a chunk is the unit a vectorised scan cannot interrupt.
BUDGET_CHUNK_WORKERS = 256


class CpuBackend:
    """Ranks batches of requests against an `InventoryIndex` with numpy."""

    name = "cpu"

    def __init__(self, index: InventoryIndex) -> None:
        self.index = index

    def warm_up(self, settings: ReuseSettings) -> None:
        """Run every code path once before the service reports ready."""
        self.answer_batch([ReuseRequest("warm-up", (1, 2, 3), 16)], settings).encoded()

    def close(self) -> None:
        pass

    def answer_batch(
        self, requests: Sequence[ReuseRequest], settings: ReuseSettings, *, clock: Clock = time.perf_counter,
    ) -> AnswerBatch:
        """The batch's answers as arrays; the service encodes them straight to JSON."""
        started = clock()
        ranked = rank_batch(self.index, requests, settings, clock=clock, started=started)
        return AnswerBatch.of(self.index, requests, ranked, settings, self.name)

    def decide_batch(
        self, requests: Sequence[ReuseRequest], settings: ReuseSettings, *, clock: Clock = time.perf_counter,
    ) -> list[Decision]:
        return self.answer_batch(requests, settings, clock=clock).decisions()

    def decide(self, request: ReuseRequest, settings: ReuseSettings, *, clock: Clock = time.perf_counter) -> Decision:
        return self.decide_batch([request], settings, clock=clock)[0]


def prefix_lengths(index: InventoryIndex, flat: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Contiguous prefix length per (request, prefix class, worker slot), and each block's index row.

    Blocks are walked in rounds of doubling width (8, 16, 32, … blocks): a request leaves
    the walk once no worker holds its prefix in any class, since no later block can matter,
    so most requests are never looked up to their end. Blocks never looked up keep the empty
    row; they lie beyond every prefix, where nothing reads them.
    """
    requests = len(offsets) - 1
    workers, words = index.worker_count, index.words
    planes = PREFIX_CLASSES * words
    lengths = np.zeros((requests, PREFIX_CLASSES, workers), dtype=np.int32)
    block_rows = np.full(flat.size, MISSING_ROW, dtype=np.int32)
    if not flat.size or not workers:
        return lengths, block_rows
    table = index.masks.reshape(index.masks.shape[0], -1)
    request_length = np.diff(offsets)
    walking = np.flatnonzero(request_length > 0)
    carried = np.zeros((walking.size, planes), dtype=np.uint64)  # the prefix-AND before this round
    begin, width = 0, _FIRST_ROUND_BLOCKS
    while walking.size:
        steps = np.arange(begin, begin + width)
        blocks = offsets[walking, None] + steps
        inside = np.flatnonzero(steps < request_length[walking, None])  # cells that are real blocks
        looked_up = np.take(blocks, inside)
        rows = np.full(blocks.shape, MISSING_ROW, dtype=np.int32)  # the all-zero row, past a request's end
        np.put(rows, inside, index.lookup(np.take(flat, looked_up)))
        np.put(block_rows, looked_up, np.take(rows, inside))
        # np.take along axis 0 copies whole rows, several times faster than fancy indexing.
        held = _prefix_classes(np.take(table, rows, axis=0), words)  # (walking, width, planes)
        if begin:
            held[:, 0] &= carried
        prefix_and = np.bitwise_and.accumulate(held, axis=1)
        # A worker's prefix ends at the last block still holding its bit. The prefix-AND only
        # loses bits, so "in this block, not the next" is a plain XOR with the next column.
        by_row = prefix_and.reshape(walking.size, -1)
        drops = np.empty_like(by_row)
        np.bitwise_xor(by_row[:, :-planes], by_row[:, planes:], out=drops[:, :-planes])
        last = prefix_and[:, -1]
        going_on = (request_length[walking] > begin + width) & last.any(axis=1)
        # A request that goes on carries its last column into the next round, undecided.
        drops[:, -planes:] = np.where(going_on[:, None], 0, last)
        if begin:
            ended = carried & ~prefix_and[:, 0]  # prefixes that ended just before this round
            first = nonzero_cells(ended)
            _set_lengths(lengths, walking, first // planes, np.full(first.size, begin), first % planes,
                         np.take(ended, first), words)
        cell = nonzero_cells(drops)
        row, within = np.divmod(cell, width * planes)
        step, column = np.divmod(within, planes)
        _set_lengths(lengths, walking, row, begin + step + 1, column, np.take(drops, cell), words)
        walking, carried = walking[going_on], last[going_on]
        begin, width = begin + width, width * 2
    return lengths, block_rows


_FIRST_ROUND_BLOCKS = 8


def nonzero_cells(values: np.ndarray) -> np.ndarray:
    """Flat indices of the non-zero cells: np.nonzero is several times faster on flat booleans."""
    return np.flatnonzero(values if values.dtype == bool else values != 0)


def _prefix_classes(stored: np.ndarray, words: int) -> np.ndarray:
    """The five prefix classes' planes from the four stored ones, along the last axis."""
    held = np.empty(stored.shape[:-1] + (PREFIX_CLASSES * words,), dtype=np.uint64)
    held[..., : 3 * words] = stored[..., : 3 * words]
    native_device = stored[..., NATIVE_DEVICE * words:(NATIVE_DEVICE + 1) * words]
    native_any = held[..., PREFIX_ANY * words:(PREFIX_ANY + 1) * words]
    np.bitwise_or(native_device, stored[..., NATIVE_HOST * words:(NATIVE_HOST + 1) * words], out=native_any)
    native_any |= stored[..., NATIVE_DISK * words:(NATIVE_DISK + 1) * words]
    np.bitwise_or(native_device, stored[..., RETAINED_DEVICE * words:(RETAINED_DEVICE + 1) * words],
                  out=held[..., PREFIX_RETAINED_DEVICE * words:])
    return held


def _set_lengths(lengths: np.ndarray, requests: np.ndarray, row: np.ndarray, length: np.ndarray,
                 column: np.ndarray, bits: np.ndarray, words: int) -> None:
    """For each set bit of `bits[i]` (a word of class-plane `column[i]`), that worker's prefix is `length[i]`."""
    if not bits.size:
        return
    bit = np.flatnonzero(np.unpackbits(np.ascontiguousarray(bits).view(np.uint8), bitorder="little").view(bool))
    entry = bit >> 6
    prefix_class, word = np.divmod(column[entry], words)
    lengths[requests[row[entry]], prefix_class, word * 64 + (bit & 63)] = length[entry]


def credits_of(
    index: InventoryIndex, block_rows: np.ndarray, offsets: np.ndarray, pair_request: np.ndarray,
    pair_slot: np.ndarray, pair_length: np.ndarray, settings: ReuseSettings,
) -> np.ndarray:
    """Execution credit of each (request, worker) pair over its native prefix.

    Each pair's per-block weights form one row, summed by `np.add.accumulate` along the
    row: a strictly sequential sum in block order, so the floats equal the reference's
    `credit += ...` (np.sum would add pairwise and could differ in the last bit).
    """
    credit = np.zeros(pair_request.size, dtype=np.float64)
    if not pair_request.size:
        return credit
    # Weight of a block by which of the three native tiers hold it (bit 0 device, 1 host,
    # 2 disk): the best of them; a block outside the prefix holds none and adds +0.0.
    weights = (settings.device_credit_weight, settings.host_credit_weight, settings.disk_credit_weight)
    weight_of = np.array([max((weights[tier] for tier in range(3) if held >> tier & 1), default=0.0)
                          for held in range(8)])
    words = index.words
    row_width = len(CLASSES) * words
    table = index.masks.reshape(-1)
    # Padding reads the all-zero row.
    block_rows = np.append(block_rows, MISSING_ROW).astype(np.int64)
    for pairs, _, blocks in padded_rows(offsets[:-1][pair_request], pair_length, nothing=block_rows.size - 1):
        word = (pair_slot[pairs] // 64)[:, None]
        bit = (pair_slot[pairs] % 64).astype(np.uint64)[:, None]
        row_start = np.take(block_rows, blocks) * row_width + word
        held = np.zeros(blocks.shape, dtype=np.uint64)
        for tier in range(3):
            plane = np.take(table, row_start + tier * words)
            held |= ((plane >> bit) & np.uint64(1)) << np.uint64(tier)
        credit[pairs] = np.add.accumulate(weight_of[held], axis=1)[:, -1]
    return credit


def padded_rows(starts: np.ndarray, lengths: np.ndarray, *, nothing: int):
    """Rows of consecutive block indices, `starts[i]` onwards for `lengths[i]` blocks, padded with `nothing`.

    Yields (members, width, blocks) per power-of-two class of lengths, so padding at most
    doubles the work while each class is one rectangular numpy operation.
    """
    length_class = np.ceil(np.log2(np.maximum(lengths, 1))).astype(np.int64)
    by_class = np.argsort(length_class, kind="stable")
    bounds = np.searchsorted(length_class[by_class], np.arange(int(length_class.max(initial=0)) + 2))
    for low, high in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        members = by_class[low:high]
        width = int(lengths[members].max(initial=0))
        if not width:
            continue
        steps = np.arange(width)
        blocks = starts[members, None] + steps
        blocks[steps >= lengths[members, None]] = nothing
        yield members, width, blocks


def rank_batch(
    index: InventoryIndex, requests: Sequence[ReuseRequest], settings: ReuseSettings, *,
    clock: Clock = time.perf_counter, started: float | None = None,
) -> RankedBatch:
    """The numbers of every answer in the batch (see `decide.ranked.RankedBatch`)."""
    if started is None:
        started = clock()
    count = len(requests)
    workers = index.worker_count
    flat, offsets = flatten_requests(requests)
    lengths, block_rows = prefix_lengths(index, flat, offsets)
    target, named = requested_targets(index, requests)

    # Credit: for every worker of requests without a target (to pick one), else the target's.
    any_prefix = lengths[:, PREFIX_ANY, :]
    choose = ~named
    pick_request, pick_slot = np.divmod(nonzero_cells((any_prefix > 0) & choose[:, None]), workers)
    given_request = np.flatnonzero(target >= 0)
    given_request = given_request[any_prefix[given_request, target[given_request]] > 0]
    pair_request = np.concatenate((pick_request, given_request))
    pair_slot = np.concatenate((pick_slot, target[given_request])).astype(np.int64)
    pair_credit = credits_of(index, block_rows, offsets, pair_request, pair_slot, any_prefix[pair_request, pair_slot],
                             settings)

    credited = np.zeros(count, dtype=np.float64)
    if workers:
        chosen_requests = np.flatnonzero(choose)
        table = np.zeros((count, workers), dtype=np.float64)
        table[pick_request, pick_slot] = pair_credit[: pick_request.size]
        in_order = table[chosen_requests][:, index.slots_in_order]
        best = np.argmax(in_order, axis=1)  # first maximum: ties go to worker order
        target[chosen_requests] = index.slots_in_order[best]
        credited[chosen_requests] = in_order[np.arange(chosen_requests.size), best]
    credited[given_request] = pair_credit[pick_request.size:]

    has_target = target >= 0
    baseline = np.zeros(count, dtype=np.int32)
    baseline[has_target] = lengths[has_target, PREFIX_RETAINED_DEVICE, target[has_target]]

    reason = np.full(count, NO_CANDIDATES, dtype=np.int8)
    tiers = source_tier_codes(settings)
    scanning = named | has_target
    empty = np.zeros(0, dtype=np.int64)
    found: list[tuple[np.ndarray, ...]] = []
    if not tiers:
        reason[:] = DISABLED
    else:
        reason[~scanning] = NO_WORKERS
        longer = np.zeros(count, dtype=bool)
        exhausted = False
        # A batch shares one clock; its budget is the per-request budget times its size.
        budget_ms = settings.transfer_source_lookup_budget_ms * max(count, 1)
        scanned_rows = np.flatnonzero(scanning)
        scanned_baseline = baseline[scanned_rows, None]
        block_sizes = np.fromiter((request.block_size for request in requests), dtype=np.int64, count=count)
        for chunk_start in range(0, workers if scanned_rows.size else 0, BUDGET_CHUNK_WORKERS):
            if (clock() - started) * 1000.0 > budget_ms:
                exhausted = True
                break
            chunk = index.slots_in_order[chunk_start:chunk_start + BUDGET_CHUNK_WORKERS]
            not_target = chunk[None, :] != target[scanned_rows, None]
            for tier in tiers:
                prefix = np.take(np.take(lengths[:, tier], scanned_rows, axis=0), chunk, axis=1)
                is_longer = (prefix > scanned_baseline) & not_target
                rows, columns = np.divmod(nonzero_cells(is_longer), chunk.size)
                if not rows.size:
                    continue
                request_rows = scanned_rows[rows]
                longer[request_rows] = True
                found.append(_costed(
                    request_rows, chunk[columns], tier, prefix[rows, columns], baseline[request_rows],
                    block_sizes[request_rows], settings,
                ))
        candidates = _ranked(found, index) if found else (empty,) * 8
        has_candidates = np.zeros(count, dtype=bool)
        has_candidates[candidates[0]] = True
        reason[scanning & has_candidates] = CHOSEN
        reason[scanning & ~has_candidates & longer] = BELOW_THRESHOLD
        if exhausted:
            reason[scanning] = BUDGET_EXHAUSTED
    if not tiers or not found:
        candidates = (empty,) * 4 + (np.zeros(0, dtype=np.int64),) + (np.zeros(0),) * 3
    return RankedBatch(lengths, target, credited, baseline, reason, *candidates)


def _costed(
    request_rows: np.ndarray, slots: np.ndarray, tier: int, prefix: np.ndarray, baseline: np.ndarray,
    block_size: np.ndarray, settings: ReuseSettings,
) -> tuple[np.ndarray, ...]:
    """The reference's cost model on arrays; the operations run in the same order, so the floats agree."""
    transfer_blocks = (prefix - baseline).astype(np.int64)
    recompute_ms = (transfer_blocks * block_size).astype(np.float64) * settings.transfer_source_prefill_token_us / 1000.0
    block_us = settings.transfer_source_gpu_estimated_block_us if tier == 0 else settings.transfer_source_estimated_block_us
    transfer_ms = transfer_blocks.astype(np.float64) * block_us / 1000.0
    saving_ms = recompute_ms - transfer_ms
    eligible = (transfer_blocks >= settings.minimum_transfer_prefix_blocks) & (
        saving_ms >= settings.minimum_estimated_ttft_saving_ms
    )
    return (
        request_rows[eligible], slots[eligible].astype(np.int64), np.full(int(eligible.sum()), tier, dtype=np.int64),
        prefix[eligible].astype(np.int64), transfer_blocks[eligible], recompute_ms[eligible],
        transfer_ms[eligible], saving_ms[eligible],
    )


def _ranked(found: list[tuple[np.ndarray, ...]], index: InventoryIndex) -> tuple[np.ndarray, ...]:
    """Concatenate the candidates and order them by request, then `kvledger.reuse.ranking_key`."""
    columns = [np.concatenate(parts) for parts in zip(*found)]
    request, slot, tier, prefix, _, _, _, saving = columns
    # lexsort's last key is the primary one.
    order = np.lexsort((index.order_rank[slot], tier, -prefix, -saving, request))
    return tuple(column[order] for column in columns)
