"""The `cpu` ranking backend: numpy, vectorised over a whole batch of requests.

Every stage works on all requests' blocks at once: one vectorised hash-table probe, one
segmented prefix-AND over the class bitmasks, one sparse unpacking of where each worker's
prefix ends. Per-worker Python loops never appear; the only Python loops run over block
positions (credit, which must add in block order to equal the reference's floats) and
over worker chunks (the lookup budget).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from kvledger.reuse import Decision, ReuseRequest
from kvledger.settings import ReuseSettings

from decide.index import NATIVE_DEVICE, NATIVE_DISK, NATIVE_HOST, RETAINED_DEVICE, InventoryIndex
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
    """Contiguous prefix length per (request, prefix class, worker slot), and the blocks' raw masks."""
    requests = len(offsets) - 1
    workers = index.worker_count
    lengths = np.zeros((requests, PREFIX_CLASSES, workers), dtype=np.int32)
    masks = index.masks[index.lookup(flat)]  # (blocks, stored classes, words)
    if not flat.size or not workers:
        return lengths, masks
    native_any = masks[:, NATIVE_DEVICE] | masks[:, NATIVE_HOST] | masks[:, NATIVE_DISK]
    held = np.concatenate(
        (masks[:, :NATIVE_DISK + 1], native_any[:, None], (masks[:, NATIVE_DEVICE] | masks[:, RETAINED_DEVICE])[:, None]),
        axis=1,
    ).reshape(flat.size, -1)  # (blocks, prefix classes × words)
    held = np.concatenate((held, np.zeros((1, held.shape[1]), dtype=np.uint64)))  # a last row nobody holds
    nothing = flat.size
    request_length = np.diff(offsets)
    # Requests are padded into a (requests × blocks) matrix per power-of-two length class, so
    # padding at most doubles the work and the prefix-AND is one accumulate along each row.
    length_class = np.ceil(np.log2(np.maximum(request_length, 1))).astype(np.int64)
    by_class = np.argsort(length_class, kind="stable")
    bounds = np.searchsorted(length_class[by_class], np.arange(int(length_class.max()) + 2))
    for low, high in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        if low == high:
            continue
        rows = by_class[low:high]
        width = int(request_length[rows].max())
        if not width:
            continue
        steps = np.arange(width)
        blocks = offsets[rows, None] + steps
        blocks[steps >= request_length[rows, None]] = nothing
        prefix_and = np.bitwise_and.accumulate(held[blocks], axis=1)  # (rows, width, classes × words)
        # A worker's prefix ends where its bit drops: the last block still holding it.
        drops = prefix_and.copy()
        drops[:, :-1] &= ~prefix_and[:, 1:]
        row, step, column = np.nonzero(drops)
        if not row.size:
            continue
        bits = np.unpackbits(drops[row, step, column].view(np.uint8).reshape(-1, 8), axis=1, bitorder="little")
        which, bit = np.nonzero(bits)
        prefix_class, word = np.divmod(column[which], index.words)
        lengths[rows[row[which]], prefix_class, word * 64 + bit] = step[which] + 1
    return lengths, masks


def credits_of(
    masks: np.ndarray, offsets: np.ndarray, pair_request: np.ndarray, pair_slot: np.ndarray,
    pair_length: np.ndarray, settings: ReuseSettings,
) -> np.ndarray:
    """Execution credit of each (request, worker) pair over its native prefix.

    Each pair's per-block weights form one row, summed by `np.add.accumulate` along the
    row: a strictly sequential sum in block order, so the floats equal the reference's
    `credit += ...` (np.sum would add pairwise and could differ in the last bit).
    """
    credit = np.zeros(pair_request.size, dtype=np.float64)
    if not pair_request.size:
        return credit
    weights = np.array([settings.device_credit_weight, settings.host_credit_weight, settings.disk_credit_weight])
    order = np.argsort(pair_length, kind="stable")
    # Rows are padded to the longest prefix in their group; grouping by length keeps that cheap.
    for group in np.array_split(order, max(1, int(pair_length.max()) * order.size // _CREDIT_CELLS)):
        if not group.size:
            continue
        longest = int(pair_length[group].max())
        steps = np.arange(longest)
        blocks = offsets[:-1][pair_request[group], None] + steps[None, :]
        inside = steps[None, :] < pair_length[group, None]
        blocks = np.where(inside, blocks, 0)
        word = (pair_slot[group] // 64)[:, None]
        bit = (pair_slot[group] % 64).astype(np.uint64)[:, None, None]
        tiers = masks[blocks, :3, word] if masks.shape[0] else np.zeros((group.size, longest, 3), np.uint64)
        holding = ((tiers >> bit) & np.uint64(1)).astype(bool)
        per_block = np.where(holding, weights, -np.inf).max(axis=2)
        per_block[~inside] = 0.0  # after the prefix: adding +0.0 leaves a sum unchanged
        credit[group] = np.add.accumulate(per_block, axis=1)[:, -1]
    return credit


_CREDIT_CELLS = 1 << 20


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
    lengths, masks = prefix_lengths(index, flat, offsets)
    target, named = requested_targets(index, requests)

    # Credit: for every worker of requests without a target (to pick one), else the target's.
    any_prefix = lengths[:, PREFIX_ANY, :]
    choose = ~named
    pick_request, pick_slot = np.nonzero(any_prefix * choose[:, None] > 0)
    given_request = np.flatnonzero(target >= 0)
    given_request = given_request[any_prefix[given_request, target[given_request]] > 0]
    pair_request = np.concatenate((pick_request, given_request))
    pair_slot = np.concatenate((pick_slot, target[given_request])).astype(np.int64)
    pair_credit = credits_of(masks, offsets, pair_request, pair_slot, any_prefix[pair_request, pair_slot], settings)

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
        for chunk_start in range(0, workers if scanned_rows.size else 0, BUDGET_CHUNK_WORKERS):
            if (clock() - started) * 1000.0 > budget_ms:
                exhausted = True
                break
            chunk = index.slots_in_order[chunk_start:chunk_start + BUDGET_CHUNK_WORKERS]
            not_target = chunk[None, :] != target[scanned_rows, None]
            for tier in tiers:
                prefix = lengths[scanned_rows[:, None], tier, chunk[None, :]]
                is_longer = (prefix > baseline[scanned_rows, None]) & not_target
                rows, columns = np.nonzero(is_longer)
                if not rows.size:
                    continue
                request_rows = scanned_rows[rows]
                longer[request_rows] = True
                found.append(_costed(
                    request_rows, chunk[columns], tier, prefix[rows, columns], baseline[request_rows],
                    requests, settings,
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
    requests: Sequence[ReuseRequest], settings: ReuseSettings,
) -> tuple[np.ndarray, ...]:
    """The reference's cost model on arrays; the operations run in the same order, so the floats agree."""
    block_size = np.fromiter((requests[row].block_size for row in request_rows.tolist()), dtype=np.int64,
                             count=request_rows.size)
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
