"""What-if replay at decide's speed: recorded requests answered again by decide's own index and kernels.

`kvledger replay` (docs/audit.md, "What-if replay") asks what the recorded requests would have
been answered under other reuse settings, each at its own inventory seq, and whether those
answers would still have held at their horizon. Here that is done the way decide answers: the
recorded timeline becomes rows of decide's index (`decide.rows`: who holds each sequence hash,
in which class), and the requests are answered as `decide.ranking.kernels.rank_requests` ranks them, in
batches, one batch per inventory seq, every settings value over the same rows and from one walk of each
request (`walk_request`, `best_after_walk`).

Two timelines, as the reference (`store/whatif_reference.py`) reads them:

- `StayTimeline`, the stays SQL keeps: each (worker, class, sequence hash) held over seq
  intervals. Only what a request reads matters, so an interval is reduced to the inventory
  seqs it covers, and one compiled pass (`answer_on_stays`) applies each seq's changes to the
  rows and ranks that seq's requests: no Python per seq. A worker is in the index from the
  seq it was first seen. Judging is a second such pass, over the horizon seqs, on rows of the
  native stays alone: a bit read per relied-on block.
- `FoldTimeline`, KV_EVENTS folded by decide's `InventoryIndex` itself: batches applied up to
  each seq, the seq's requests ranked against the index, horizons judged on its rows.

The answers are reduced to what a replay report counts (`Answers`); the request being asked
again for its fallback when it named no target and nobody had credit is decided here as
`store.whatif_reference.answer_again` decides it. The lookup budget never runs out, as the reference's
clock stands still.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import attrs
import numpy as np

from kvledger.core.decision_codec import MAX_RELIED_BLOCKS
from kvledger.core.events import EventBatch, Provenance, Tier, WorkerId
from kvledger.core.settings import ReuseSettings

from kvledger.decide.compiled import compiled as _compiled, inlined as _inlined
from kvledger.decide.inventory.chain import chain_hashes
from kvledger.decide.inventory.index import CLASSES, InventoryIndex
from kvledger.decide.inventory.rows import INLINE, PLANES, change_bit, has_bit
from kvledger.decide.inventory.table import fill_distinct, lookup_rows, probe
from kvledger.decide.ranking.cpu import KernelSettings
from kvledger.decide.ranking.kernels import best_after_walk, walk_request

FOREVER = np.iinfo(np.int64).max
NO_SLOT = -1  # a worker the index does not hold
NONE = -2  # no worker at all (nothing chosen, no target)
# How an answer's target was given: chosen by credit (or none), the one the request named, its fallback.
CHOSEN_BY_CREDIT, NAMED, FALLBACK = 0, 1, 2
_PLANE_OF = {key: plane for plane, key in enumerate(CLASSES)}
_UNJUDGED = -1


@attrs.frozen
class Requests:
    """The recorded requests, in KV_DECISIONS order, as the kernels read them."""

    local: np.ndarray  # uint64, every request's local hashes end to end
    offsets: np.ndarray  # int64, requests + 1
    block_sizes: np.ndarray  # int64
    inventory_seqs: np.ndarray  # int64
    workers: Sequence[WorkerId]  # the workers `targets` and `fallbacks` name by their place here
    targets: np.ndarray  # int32: as asked (the fallback already put in when replayed as placed), -1: none
    fallbacks: np.ndarray  # int32, -1 where the answer is never asked again for a fallback

    def __len__(self) -> int:
        return self.offsets.size - 1


@attrs.frozen
class Answers:
    """Per settings (rows) and request (columns): what a replay report counts of each answer."""

    target: np.ndarray  # int32 slot, NO_SLOT: none, or a worker the index did not hold (see `target_how`)
    target_how: np.ndarray  # int8: CHOSEN_BY_CREDIT, NAMED, FALLBACK
    reason: np.ndarray  # int8, decide.ranking.ranked.REASONS
    baseline: np.ndarray  # int32
    target_prefix: np.ndarray  # int32, the target's prefix over any native tier
    source: np.ndarray  # int32 slot of the chosen candidate, NO_SLOT: nothing chosen
    tier: np.ndarray  # int8 tier code of the chosen candidate
    prefix: np.ndarray  # int32
    transfer: np.ndarray  # int32
    saving: np.ndarray  # float64


@attrs.frozen
class Judged:
    """Per outcome (rows: the recorded one, then each settings) and request: stale, lost (1, 0, or -1: None)."""

    stale: np.ndarray  # int8
    lost: np.ndarray  # int8


def _settings_arrays(settings: Sequence[ReuseSettings]) -> tuple[np.ndarray, ...]:
    values = [KernelSettings.of(value) for value in settings]
    return (np.array([v.weight_of for v in values], dtype=np.float64).reshape(len(values), 8),
            np.array([v.tier_enabled for v in values], dtype=np.bool_).reshape(len(values), 3),
            np.array([v.minimum_blocks for v in values], dtype=np.int64),
            np.array([v.minimum_saving_ms for v in values], dtype=np.float64),
            np.array([v.prefill_token_us for v in values], dtype=np.float64),
            np.array([v.block_us for v in values], dtype=np.float64),
            np.array([v.gpu_block_us for v in values], dtype=np.float64))


def _empty_answers(settings: int, count: int) -> Answers:
    return Answers(np.full((settings, count), NO_SLOT, np.int32), np.zeros((settings, count), np.int8),
                   np.zeros((settings, count), np.int8), np.zeros((settings, count), np.int32),
                   np.zeros((settings, count), np.int32), np.full((settings, count), NO_SLOT, np.int32),
                   np.zeros((settings, count), np.int8), np.zeros((settings, count), np.int32),
                   np.zeros((settings, count), np.int32), np.zeros((settings, count), np.float64))


# --- ranking one inventory seq's requests under every settings value -------------------


@_compiled
def answer_batch(first, stop, present, local, offsets, block_sizes, targets, named, fallbacks, has_fallback,
                 table_keys, table_rows, table_bits, holders, spilled, slots_in_order, order_rank,
                 weight_of, tier_enabled, minimum_blocks, minimum_saving_ms, prefill_token_us, block_us, gpu_block_us,
                 out_target, out_how, out_reason, out_baseline, out_target_prefix, out_source, out_tier, out_prefix,
                 out_transfer, out_saving):
    """Answer requests [first, stop) (all at one inventory seq) under each settings value, the index holding the
    workers of slots below `present`: each request walked once (`walk_request`, its credit under every value at
    once), then answered under each value from that walk (`best_after_walk`), as `rank_requests` ranks it; a
    request that named no target and got no credit is asked again for its fallback, as
    `store.whatif_reference.answer_again` does, from the same walk (the lengths a walk finds do not depend on
    the target)."""
    settings = weight_of.shape[0]
    workers = slots_in_order.size
    base = offsets[first]
    sequence = np.empty(offsets[stop] - base, dtype=np.uint64)  # the walk's chained hashes, unused here
    block_rows = np.empty(64, dtype=np.int64)
    lengths = np.zeros((5, max(workers, 1)), dtype=np.int32)
    credit = np.zeros((settings, max(workers, 1)), dtype=np.float64)
    shown_ranks = np.empty(max(workers, 1) + 1, dtype=np.int64)
    batch_local = local[base:offsets[stop]]
    for request in range(first, stop):
        start, blocks = offsets[request] - base, offsets[request + 1] - offsets[request]
        slot = targets[request]
        target = slot if 0 <= slot < present else NO_SLOT
        choose = named[request] == 0
        shown_count = 0
        if blocks > 0 and workers > 0:
            block_rows, shown_count = walk_request(
                batch_local, start, blocks, target, choose, table_keys, table_rows, table_bits, holders, spilled,
                order_rank, weight_of, sequence, block_rows, lengths, credit, shown_ranks)
        for setting in range(settings):
            answer = best_after_walk(
                target, choose, workers, shown_count, shown_ranks, slots_in_order, lengths, credit, setting,
                block_sizes[request], tier_enabled[setting], minimum_blocks[setting], minimum_saving_ms[setting],
                prefill_token_us[setting], block_us[setting], gpu_block_us[setting])
            how = named[request]
            # The fallback: asked again where nothing was named, nobody had credit and the target is not the
            # fallback.
            if not named[request] and has_fallback[request] and answer[1] == 0.0:
                slot = fallbacks[request]
                known = slot if 0 <= slot < present else NO_SLOT
                if known < 0 or answer[0] != known:
                    answer = best_after_walk(
                        known, False, workers, shown_count, shown_ranks, slots_in_order, lengths, credit, setting,
                        block_sizes[request], tier_enabled[setting], minimum_blocks[setting],
                        minimum_saving_ms[setting], prefill_token_us[setting], block_us[setting],
                        gpu_block_us[setting])
                    how = FALLBACK
            out_target[setting, request] = answer[0]
            out_how[setting, request] = how
            out_reason[setting, request] = answer[3]
            out_baseline[setting, request] = answer[2]
            out_target_prefix[setting, request] = answer[4]
            out_source[setting, request] = answer[5]
            out_tier[setting, request] = answer[6]
            out_prefix[setting, request] = answer[7]
            out_transfer[setting, request] = answer[8]
            out_saving[setting, request] = answer[9]
        # Scratch back to zero where the walk wrote it.
        for position in range(shown_count):
            slot = slots_in_order[shown_ranks[position]]
            for setting in range(settings):
                credit[setting, slot] = 0.0
            for prefix_class in range(5):
                lengths[prefix_class, slot] = 0


# --- the stays SQL keeps ----------------------------------------------------------------


@_compiled
def answer_on_stays(rank_from, rank_to, change_bounds, changes, minor_bits, request_bounds, present, orders,
                    order_ranks, local, offsets, block_sizes, targets, named, fallbacks, has_fallback, table_keys,
                    table_rows, table_bits, holders, spilled, weight_of, tier_enabled, minimum_blocks,
                    minimum_saving_ms, prefill_token_us, block_us, gpu_block_us, out_target, out_how, out_reason,
                    out_baseline, out_target_prefix, out_source, out_tier, out_prefix, out_transfer, out_saving):
    """One pass over the inventory seqs in order: apply the seq's changes to the rows, rank its requests; the
    points [rank_from, rank_to) only, on rows as they stood before rank_from (`_hold_at`)."""
    for point in range(rank_from, rank_to):
        _apply_changes(holders, spilled, changes, change_bounds[point], change_bounds[point + 1], minor_bits)
        first, stop = request_bounds[point], request_bounds[point + 1]
        if stop == first:
            continue
        workers = present[point]
        answer_batch(first, stop, workers, local, offsets, block_sizes, targets, named, fallbacks, has_fallback,
                     table_keys, table_rows, table_bits, holders, spilled, orders[workers, :workers],
                     order_ranks[workers], weight_of, tier_enabled, minimum_blocks, minimum_saving_ms,
                     prefill_token_us, block_us, gpu_block_us, out_target, out_how, out_reason, out_baseline,
                     out_target_prefix, out_source, out_tier, out_prefix, out_transfer, out_saving)


@_compiled
def judge_on_stays(judge_from, judge_to, change_bounds, changes, minor_bits, item_bounds, items, sequence, offsets,
                   source, tier, source_from, source_to, target, target_to, table_keys, table_rows, table_bits,
                   holders, spilled, stale, lost):
    """One pass over the horizon seqs in order: apply the seq's changes to the native rows, judge the outcomes of
    the requests whose horizon it is (`items[item_bounds[p]:item_bounds[p + 1]]`) on the rows as they stand: a
    bit read per block, where the intervals would cost a search each. The points [judge_from, judge_to) only, on
    rows as they stood before judge_from (`_hold_at`)."""
    for point in range(judge_from, judge_to):
        _apply_changes(holders, spilled, changes, change_bounds[point], change_bounds[point + 1], minor_bits)
        first, stop = item_bounds[point], item_bounds[point + 1]
        if stop > first:
            judge_outcomes(items[first:stop], sequence, offsets, source, tier, source_from, source_to, target,
                           target_to, table_keys, table_rows, table_bits, holders, spilled, stale, lost)


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _spans(bounds: np.ndarray, parts: int) -> list[slice]:
    """The points of `bounds` (items [bounds[p], bounds[p + 1]) at point p) in at most `parts` contiguous spans
    of about as many items, none empty."""
    points = bounds.size - 1
    if parts <= 1 or points < 2:
        return [slice(0, points)]
    count = int(bounds[-1])
    cuts = np.searchsorted(bounds, [count * span // parts for span in range(1, parts)], "left").tolist()
    edges = sorted({0, *(min(max(cut, 1), points) for cut in cuts), points})
    return [slice(start, stop) for start, stop in zip(edges, edges[1:]) if stop > start]


def _together(*calls: Callable[[], object]) -> list:
    """Each call's result, the calls made side by side in threads where there are several calls and cores: the
    kernels release the GIL, so they run on every core."""
    if len(calls) <= 1 or _cores() <= 1:
        return [call() for call in calls]
    with ThreadPoolExecutor(len(calls), thread_name_prefix="whatif") as pool:
        return [done.result() for done in [pool.submit(call) for call in calls]]


def _in_parallel(work: Callable, parts: list) -> None:
    """`work(part)` for every part, side by side (`_together`)."""
    _together(*(functools.partial(work, part) for part in parts))


@_compiled
def _segments_in_order(values, offsets, order):
    """The segments values[offsets[i]:offsets[i + 1]] end to end in `order`, and their offsets there."""
    out_offsets = np.zeros(order.size + 1, dtype=np.int64)
    for position in range(order.size):
        item = order[position]
        out_offsets[position + 1] = out_offsets[position] + offsets[item + 1] - offsets[item]
    out = np.empty(out_offsets[order.size], dtype=values.dtype)
    for position in range(order.size):
        item = order[position]
        out[out_offsets[position]:out_offsets[position + 1]] = values[offsets[item]:offsets[item + 1]]
    return out, out_offsets


def _table_of(sequence: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, int]:
    """A table (keys, rows, bits) of the distinct hashes of `sequence`, rows 1, 2, … in order of first sight
    (row 0 reads as "nobody"), at most half full; and the count of rows."""
    table_bits = max(10, int(max(sequence.size // 2, 1)).bit_length())
    while True:
        table_keys = np.zeros(1 << table_bits, dtype=np.uint64)
        table_rows = np.full(1 << table_bits, -1, dtype=np.int32)
        distinct = fill_distinct(sequence, table_keys, table_rows, table_bits)
        if distinct >= 0:
            return table_keys, table_rows, table_bits, distinct
        table_bits += 1


def _rows(distinct: int, held_rows: np.ndarray, workers: int) -> tuple[np.ndarray, ...]:
    """Empty rows (`distinct` of them after row 0) for what `held_rows` (a row per interval) will hold: a row with
    more intervals than a row lists holders is spilled into a bitmask row up front, so that a change never finds
    a row full (more intervals than holders spill a row early, which reads the same)."""
    holders = np.zeros((distinct + 1, INLINE), dtype=np.uint32)
    crowded = np.flatnonzero(np.bincount(held_rows, minlength=distinct + 1) > INLINE)
    spilled = np.zeros((crowded.size + 1, PLANES, (workers + 63) // 64), dtype=np.uint64)
    holders[crowded, 0] = (np.arange(1, crowded.size + 1, dtype=np.uint32) << np.uint32(4))
    return holders, spilled


def _changes(keys: np.ndarray, start: np.ndarray, end: np.ndarray, points: np.ndarray) -> tuple[np.ndarray, ...]:
    """Disjoint intervals [start, end) of keys (row and minor in bits), sorted by (key, start) (`merge_intervals`),
    as changes at the sorted `points` they cover: set at the first covered point, cleared after the last; (bounds
    per point, changes), at each point its sets before its clears, each in key order. A change is its key and a
    bit, set or cleared (`_apply_changes` reads it): one array scattered by point, where a column per part would
    cost a cache miss each per change."""
    return _by_point(keys, points_at_or_after(points, start), points_at_or_after(points, end), points.size)


@_compiled
def _hold_at(holders, spilled, keys, starts, ends, seq, minor_bits):
    """The bits of the intervals that cover `seq` set on empty rows: the rows as the changes of every point up to
    `seq` leave them (a pass in key order, where the changes would be as many random writes)."""
    for item in range(keys.size):
        if starts[item] <= seq < ends[item]:
            _change_key(holders, spilled, keys[item], minor_bits, True)


@_compiled
def _apply_changes(holders, spilled, changes, first, stop, minor_bits):
    """`changes[first:stop]` (`_changes`) applied to the rows."""
    for at in range(first, stop):
        _change_key(holders, spilled, changes[at] >> 1, minor_bits, (changes[at] & 1) == 1)


@_inlined
def _change_key(holders, spilled, key, minor_bits, wanted):
    """Set or clear the bit a key (row and minor side by side in bits) stands for."""
    minor = key & ((1 << minor_bits) - 1)
    change_bit(holders, spilled, key >> minor_bits, minor % PLANES, minor // PLANES, wanted)


def points_at_or_after(points: np.ndarray, seqs: np.ndarray) -> np.ndarray:
    """For each seq, the index of the first of the sorted, distinct `points` at or after it (`points.size` past
    the last): `np.searchsorted(points, seqs, "left")`, read off a table over the points' span where it is
    not much wider than the seqs are many (a binary search per seq costs more)."""
    if not points.size or not seqs.size:
        return np.searchsorted(points, seqs, "left")
    low, high = int(points[0]), int(points[-1])
    if high - low > max(4 * seqs.size, 1 << 16):
        return np.searchsorted(points, seqs, "left")
    return _points_by_table(points, seqs, low, high)


@_compiled
def _points_by_table(points, seqs, low, high):
    table = np.empty(high - low + 1, dtype=np.int64)
    point = 0
    for seq in range(low, high + 1):
        if points[point] < seq:
            point += 1
        table[seq - low] = point
    found = np.empty(seqs.size, dtype=np.int64)
    for item in range(seqs.size):
        seq = seqs[item]
        found[item] = 0 if seq <= low else points.size if seq > high else table[seq - low]
    return found


@_compiled
def _by_point(keys, first_point, end_point, point_count):
    """The sets (at first_point) and clears (at end_point, unless past the last point) of the intervals, merged
    again where they touch or vanish in points (apart in seqs, they may), grouped by point in one counting pass:
    per point its sets, then its clears, each in the intervals' order; (bounds per point, changes). The
    merge runs twice, counting, then placing: cheaper than keeping the merged intervals."""
    sets = np.zeros(point_count + 1, dtype=np.int64)
    clears = np.zeros(point_count + 1, dtype=np.int64)
    bounds = np.zeros(point_count + 1, dtype=np.int64)
    set_at = np.zeros(point_count + 1, dtype=np.int64)
    clear_at = np.zeros(point_count + 1, dtype=np.int64)
    out = np.empty(0, dtype=np.int64)
    for placing in range(2):
        if placing:
            for point in range(point_count):
                bounds[point + 1] = bounds[point] + sets[point] + clears[point]
                set_at[point] = bounds[point]
                clear_at[point] = bounds[point] + sets[point]
            out = np.empty(bounds[point_count], dtype=np.int64)
        holding = False  # an interval being merged: its key and points [first, end)
        held_key, held_first, held_end = 0, 0, 0
        for item in range(keys.size + 1):
            if item < keys.size:
                first, end = first_point[item], end_point[item]
                if first >= end:
                    continue
                if holding and keys[item] == held_key and first <= held_end:
                    if end > held_end:
                        held_end = end
                    continue
            if holding:
                if placing:
                    out[set_at[held_first]] = (held_key << 1) | 1
                    set_at[held_first] += 1
                    if held_end < point_count:
                        out[clear_at[held_end]] = held_key << 1
                        clear_at[held_end] += 1
                else:
                    sets[held_first] += 1
                    if held_end < point_count:
                        clears[held_end] += 1
            if item < keys.size:
                holding, held_key, held_first, held_end = True, keys[item], first_point[item], end_point[item]
    return bounds, out


@_compiled
def _held(table_keys, table_rows, table_bits, holders, spilled, slot, code, sequence_hash):
    """Whether worker `slot` natively held the hash on tier `code`, read off the rows as they stand."""
    if slot < 0:
        return False
    row = probe(table_keys, table_rows, table_bits, sequence_hash)
    return row != 0 and has_bit(holders, spilled, row, code, slot)


@_compiled
def judge_outcomes(items, sequence, offsets, source, tier, source_from, source_to, target, target_to, table_keys,
                   table_rows, table_bits, holders, spilled, stale, lost):
    """`store.quality.judge` for every outcome (rows of `source` …) of requests `items`, on the rows as they stand
    at their horizon: the hint is stale when the source no longer held every transferred block on its tier, the
    credit lost when the target no longer held every credited block on some native tier (at most
    MAX_RELIED_BLOCKS blocks, as store keeps them). A slot is NONE for no worker, NO_SLOT for one that holds
    nothing."""
    for outcome in range(source.shape[0]):
        for item in range(items.size):
            request = items[item]
            start = offsets[request]
            slot = source[outcome, request]
            first, last = source_from[outcome, request], min(source_to[outcome, request], MAX_RELIED_BLOCKS)
            if slot != NONE and first < last:
                verdict = 0
                for block in range(first, last):
                    if not _held(table_keys, table_rows, table_bits, holders, spilled, slot, tier[outcome, request],
                                 sequence[start + block]):
                        verdict = 1
                        break
                stale[outcome, request] = verdict
            slot = target[outcome, request]
            last = min(target_to[outcome, request], MAX_RELIED_BLOCKS)
            if slot != NONE and last > 0:
                verdict = 0
                for block in range(last):
                    held = False
                    for code in range(3):
                        if _held(table_keys, table_rows, table_bits, holders, spilled, slot, code,
                                 sequence[start + block]):
                            held = True
                            break
                    if not held:
                        verdict = 1
                        break
                lost[outcome, request] = verdict


def merge_intervals(rows: np.ndarray, minors: np.ndarray, minor_count: int, starts: np.ndarray,
                    ends: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per key (row * minor_count + minor), the union of its intervals [start, end) as disjoint, non-touching
    ones, sorted by (key, start): held at a seq when some interval covers it, however many stays overlap there.
    Returns their keys, starts and ends."""
    rows, minors = rows.astype(np.int64, copy=False), minors.astype(np.int64, copy=False)
    starts, ends = starts.astype(np.int64, copy=False), ends.astype(np.int64, copy=False)
    if not rows.size:
        return rows, starts, ends
    keys = rows * minor_count + minors
    # Stays come in their placement's seq order (SQL's key): two stable counting sorts, by minor then by row,
    # leave each key's items in start order, where a sort of the keys costs n log n. Checked, and sorted else.
    order, in_start_order = _counting_order(rows, minors, minor_count, int(rows.max()) + 1, starts)
    if not in_start_order:
        low, high = int(starts.min()), int(starts.max())
        if int(keys.min()) >= 0 and (int(keys.max()) + 1) * (high - low + 1) < 2**63:
            order = np.argsort(keys * (high - low + 1) + (starts - low))  # one int64 sort, not lexsort's two
        else:
            order = np.lexsort((starts, keys))
    return _merged(order, keys, starts, ends)


@_compiled
def _stays_read(row_of_stay, stay_slot, stay_plane, stay_start, stay_end, planes):
    """The stays of hashes some request reads (row > 0): their rows, minors (slot * planes + plane), starts and
    ends, in one pass (the stays are many: a copy per column costs a pass each)."""
    count = 0
    for stay in range(row_of_stay.size):
        if row_of_stay[stay] > 0:
            count += 1
    rows, minors = np.empty(count, dtype=np.int64), np.empty(count, dtype=np.int64)
    starts, ends = np.empty(count, dtype=np.int64), np.empty(count, dtype=np.int64)
    item = 0
    for stay in range(row_of_stay.size):
        if row_of_stay[stay] > 0:
            rows[item], minors[item] = row_of_stay[stay], stay_slot[stay] * planes + stay_plane[stay]
            starts[item], ends[item] = stay_start[stay], stay_end[stay]
            item += 1
    return rows, minors, starts, ends


@_compiled
def _native_only(keys, starts, ends, minor_bits, planes):
    """The intervals on a native plane (below 3: the tier codes), every column in one pass."""
    minor_mask = (1 << minor_bits) - 1
    count = 0
    for item in range(keys.size):
        if (keys[item] & minor_mask) % planes < 3:
            count += 1
    out_keys, out_starts, out_ends = (np.empty(count, dtype=np.int64), np.empty(count, dtype=np.int64),
                                      np.empty(count, dtype=np.int64))
    kept = 0
    for item in range(keys.size):
        if (keys[item] & minor_mask) % planes < 3:
            out_keys[kept], out_starts[kept], out_ends[kept] = keys[item], starts[item], ends[item]
            kept += 1
    return out_keys, out_starts, out_ends


@_compiled
def _counting_order(rows, minors, minor_count, row_count, starts):
    """The items by (row, minor), stably (LSD: by minor, then by row), and whether the starts of each
    (row, minor) then rise."""
    order = _stably_by(rows, row_count, _stably_by(minors, minor_count, np.arange(rows.size)))
    for position in range(1, order.size):
        item, before = order[position], order[position - 1]
        if rows[item] == rows[before] and minors[item] == minors[before] and starts[item] < starts[before]:
            return order, False
    return order, True


@_compiled
def _stably_by(values, value_count, items):
    """`items` in the order of their values (each below value_count), stably: one counting sort."""
    bounds = np.zeros(value_count + 1, dtype=np.int64)
    for position in range(items.size):
        bounds[values[items[position]] + 1] += 1
    for value in range(value_count):
        bounds[value + 1] += bounds[value]
    ordered = np.empty(items.size, dtype=np.int64)
    for position in range(items.size):
        value = values[items[position]]
        ordered[bounds[value]] = items[position]
        bounds[value] += 1
    return ordered


@_compiled
def _merged(order, keys, starts, ends):
    out_keys = np.empty(keys.size, dtype=np.int64)
    out_starts = np.empty(keys.size, dtype=np.int64)
    out_ends = np.empty(keys.size, dtype=np.int64)
    count = -1
    for position in range(order.size):
        item = order[position]
        key, start, end = keys[item], starts[item], ends[item]
        if start >= end:
            continue
        if count >= 0 and out_keys[count] == key and start <= out_ends[count]:
            if end > out_ends[count]:
                out_ends[count] = end
            continue
        count += 1
        out_keys[count], out_starts[count], out_ends[count] = key, start, end
    return out_keys[:count + 1].copy(), out_starts[:count + 1].copy(), out_ends[:count + 1].copy()


@attrs.frozen
class Outcomes:
    """What is judged of each answer, per outcome (rows: the recorded one first, then each settings) and request:
    the source (slot, NONE, NO_SLOT), its tier code and the blocks relied on it [from, to), the target and the
    blocks [0, to) relied on it."""

    source: np.ndarray
    tier: np.ndarray
    source_from: np.ndarray
    source_to: np.ndarray
    target: np.ndarray
    target_to: np.ndarray

    @classmethod
    def of(cls, recorded: Outcomes, answers: Answers) -> Outcomes:
        """The recorded outcomes (one row) with the replayed answers' below them."""
        chosen = answers.source >= 0
        return cls(
            np.vstack([recorded.source, np.where(chosen, answers.source, NONE)]).astype(np.int64),
            np.vstack([recorded.tier, answers.tier]).astype(np.int64),
            np.vstack([recorded.source_from, answers.baseline]).astype(np.int64),
            np.vstack([recorded.source_to, np.where(chosen, answers.prefix, 0)]).astype(np.int64),
            np.vstack([recorded.target, np.where(answers.target >= 0, answers.target, NONE)]).astype(np.int64),
            np.vstack([recorded.target_to, answers.target_prefix]).astype(np.int64),
        )


def recorded_outcomes(slot_of, workers: Sequence[WorkerId], sources: np.ndarray, tiers: np.ndarray,
                      baselines: np.ndarray, prefixes: np.ndarray, targets: np.ndarray,
                      target_prefixes: np.ndarray) -> Outcomes:
    """The recorded decisions' outcomes to judge: sources and targets as places in `workers` (-1: none), their
    slots by `slot_of` (None: not held); tiers as codes in DEVICE, HOST, DISK order (-1 where no source)."""
    slot_of_place = _slots_by_place(slot_of, workers, NONE).astype(np.int64)

    def row(values) -> np.ndarray:
        return np.asarray(values, dtype=np.int64).reshape(1, -1)

    return Outcomes(row(slot_of_place[sources]), row(np.maximum(tiers, 0)), row(baselines), row(prefixes),
                    row(slot_of_place[targets]), row(target_prefixes))


def _request_slots(slot_of, requests: Requests) -> tuple[np.ndarray, ...]:
    """Targets' and fallbacks' slots (NO_SLOT: not held), whether each request named a target, has a fallback."""
    slot_of_place = _slots_by_place(slot_of, requests.workers, NO_SLOT)
    return (slot_of_place[requests.targets], requests.targets >= 0, slot_of_place[requests.fallbacks],
            requests.fallbacks >= 0)


@attrs.frozen(eq=False)
class RequestTable:
    """What answering reads of the requests before any stay: their chained sequence hashes, and a table of the
    distinct ones (`_table_of`: keys, rows, bits, and the count of rows). Made apart (`of`), so that a replay
    can make it while its stays are still being read."""

    sequence: np.ndarray
    keys: np.ndarray
    rows: np.ndarray
    bits: int
    distinct: int

    @classmethod
    def of(cls, local: np.ndarray, offsets: np.ndarray) -> RequestTable:
        sequence = chain_hashes(local, offsets)
        return cls(sequence, *_table_of(sequence))


class StayTimeline:
    """The stays SQL keeps, as decide's rows at each inventory seq (see the module's docstring).

    `workers`: every worker with the seq it was first seen; `stay_*`: one item per stay, its worker (an index
    into `workers`), class (a plane of `decide.inventory.index.CLASSES`), sequence hash, and the seqs [start, end) it was
    held over. Slots follow first-seen order, so the workers at a seq are the slots below a count.
    """

    def __init__(self, workers: Sequence[tuple[WorkerId, int]], stay_worker: np.ndarray, stay_plane: np.ndarray,
                 stay_hash: np.ndarray, stay_start: np.ndarray, stay_end: np.ndarray) -> None:
        by_first = sorted(range(len(workers)), key=lambda item: (workers[item][1], workers[item][0]))
        self.workers = [workers[item][0] for item in by_first]
        self.firsts = np.array([workers[item][1] for item in by_first], dtype=np.int64)
        slot_of_item = np.empty(len(workers), dtype=np.int64)
        slot_of_item[by_first] = np.arange(len(workers))
        self._slot = {worker: slot for slot, worker in enumerate(self.workers)}
        self.stay_slot = slot_of_item[stay_worker] if len(workers) else stay_worker.astype(np.int64)
        # Not copied where they are already so: a ledger's stays are many.
        self.stay_plane = stay_plane.astype(np.int64, copy=False)
        self.stay_hash = stay_hash.astype(np.uint64, copy=False)
        self.stay_start = stay_start.astype(np.int64, copy=False)
        self.stay_end = stay_end.astype(np.int64, copy=False)

    @classmethod
    def of_stays(cls, workers: Sequence[tuple[WorkerId, int]], placements: Sequence[tuple[str, int, str, str]],
                 placement: np.ndarray, sequence_hash: np.ndarray, stored_seq: np.ndarray, removed_seq: np.ndarray,
                 conflict_since: np.ndarray) -> StayTimeline:
        """From `block_residency`'s stays as arrays (`store.whatif_reference.Stays`): per placement (publisher,
        dp_rank, provenance, tier), and per stay its placement (an index), sequence hash (signed, as SQL keeps
        it), stored seq, removed seq and conflict_since (int64 max where none), without a Python object per stay.
        A retained stay stops being indexed at conflict_since (kvledger/core/precedence.py, rule 1); retained host
        and disk stays are never read (neither credit nor baseline counts them), so they are left out."""
        workers = list(workers)
        item_of = {(worker.publisher, worker.dp_rank): item for item, (worker, _first) in enumerate(workers)}
        plane_of = {(p.value, t.value): plane for (p, t), plane in _PLANE_OF.items()}
        worker_of_placement = np.zeros(max(len(placements), 1), dtype=np.int64)
        plane_of_placement = np.full(max(len(placements), 1), -1, dtype=np.int64)
        for item, (publisher, dp_rank, provenance, tier) in enumerate(placements):
            key = (publisher, dp_rank)
            if key not in item_of:  # a stay of a worker never listed: never present
                item_of[key] = len(workers)
                workers.append((WorkerId(*key), FOREVER))
            worker_of_placement[item] = item_of[key]
            plane_of_placement[item] = plane_of.get((provenance, tier), -1)
        placement = np.asarray(placement, dtype=np.int64)
        stay_plane = plane_of_placement[placement]
        end = np.asarray(removed_seq, dtype=np.int64)
        retained = stay_plane == _PLANE_OF[(Provenance.RETAINED, Tier.DEVICE)]
        if retained.any():
            end = np.where(retained, np.minimum(end, conflict_since), end)
        kept = stay_plane >= 0
        if not kept.all():
            placement, stay_plane, end = placement[kept], stay_plane[kept], end[kept]
            sequence_hash, stored_seq = sequence_hash[kept], stored_seq[kept]
        return cls(workers, worker_of_placement[placement], stay_plane,
                   np.asarray(sequence_hash, dtype=np.int64).view(np.uint64), stored_seq, end)

    def slot(self, worker: WorkerId) -> int | None:
        return self._slot.get(worker)

    def answer(self, requests: Requests, settings: Sequence[ReuseSettings], horizons: np.ndarray,
               recorded: Outcomes, table: RequestTable | None = None) -> tuple[Answers, Judged]:
        """Every request ranked at its inventory seq under each settings, and every outcome judged at its
        request's horizon seq (`horizons` < 0: none). `table`: the requests' `RequestTable`, if made before."""
        count, worker_count = len(requests), len(self.workers)
        # Only rows a request reads matter: a row per distinct hash the requests read, the stays of other hashes
        # left out (a hash table of the requests' hashes, probed by each stay: no sort of either).
        if table is None:
            table = RequestTable.of(requests.local, requests.offsets)
        sequence, table_keys, table_rows, table_bits, distinct = attrs.astuple(table, recurse=False)
        row_of_stay = lookup_rows(table_keys, table_rows, table_bits, self.stay_hash)
        rows, minor, start, end = _stays_read(row_of_stay, self.stay_slot, self.stay_plane, self.stay_start,
                                              self.stay_end, PLANES)
        workers = max(worker_count, 1)
        # Each (row, slot, plane)'s stays as disjoint intervals, sorted once for both passes. The minors (slot *
        # PLANES + plane) counted in a power of two, so that a key is its row and minor side by side in bits.
        minor_bits = (workers * PLANES - 1).bit_length()
        if distinct >= 1 << (62 - minor_bits):
            raise ValueError(f"a replay of {worker_count} workers reads at most {1 << (62 - minor_bits)} hashes")
        keys, start, end = merge_intervals(rows, minor, 1 << minor_bits, start, end)
        held_rows = keys >> minor_bits

        # Ranking: each interval as the inventory seqs it covers, applied at the first and undone after the last.
        # Judging: a second pass, over the horizon seqs, on rows of the native stays alone (the tier codes are
        # their planes), each request's outcomes judged once its horizon seq is reached. Both passes' changes are
        # made side by side: they only read the intervals.
        points = np.unique(requests.inventory_seqs)
        items = np.flatnonzero(horizons >= 0)
        items = items[np.argsort(horizons[items], kind="stable")]
        horizon_points = np.unique(horizons[items])

        def judging_changes() -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
            native = _native_only(keys, start, end, minor_bits, PLANES)
            return native, _changes(*native, horizon_points)

        (change_bounds, changes), (native, judge_changes) = \
            _together(lambda: _changes(keys, start, end, points), judging_changes)
        holders, spilled = _rows(distinct, held_rows, workers)

        # The requests in inventory seq order (stable: KV_DECISIONS order within a seq), answered, put back.
        order = np.argsort(requests.inventory_seqs, kind="stable")
        local, offsets = _segments_in_order(requests.local, requests.offsets, order)
        target, named, fallback, has_fallback = (array[order] for array in _request_slots(self.slot, requests))
        request_bounds = np.searchsorted(requests.inventory_seqs[order], points, "left").astype(np.int64)
        request_bounds = np.append(request_bounds, count)
        present = np.searchsorted(self.firsts, points, "right").astype(np.int64)
        orders, order_ranks = self._orders()
        answers = _empty_answers(len(settings), count)
        outputs = attrs.astuple(answers, recurse=False)
        kernel_settings = _settings_arrays(settings)
        block_sizes = requests.block_sizes[order]

        def rank(span: slice) -> None:
            # Every settings value for the requests of the points in `span`, on rows of its own (the pass changes
            # them); its outputs are its columns of the answers. Spans of points, not groups of settings: each
            # change is then applied once, not once per group.
            own_holders, own_spilled = (holders, spilled) if span.start == 0 else _rows(distinct, held_rows, workers)
            if span.start:
                _hold_at(own_holders, own_spilled, keys, start, end, points[span.start - 1], minor_bits)
            answer_on_stays(span.start, span.stop, change_bounds, changes, minor_bits, request_bounds, present, orders,
                            order_ranks, local, offsets, block_sizes, target, named, fallback, has_fallback,
                            table_keys, table_rows, table_bits, own_holders, own_spilled,
                            *kernel_settings, *outputs)

        _in_parallel(rank, _spans(request_bounds, _cores()))
        back = np.empty(count, dtype=np.int64)
        back[order] = np.arange(count)
        answers = Answers(*(array[:, back] for array in attrs.astuple(answers, recurse=False)))

        # Judging (its changes made above).
        change_bounds, changes = judge_changes
        item_bounds = np.append(np.searchsorted(horizons[items], horizon_points, "left"), items.size).astype(np.int64)
        outcomes = attrs.astuple(Outcomes.of(recorded, answers), recurse=False)
        judged = Judged(np.full(outcomes[0].shape, _UNJUDGED, np.int8), np.full(outcomes[0].shape, _UNJUDGED, np.int8))

        def judge(span: slice) -> None:
            # Every outcome of the requests whose horizons are the points in `span`, on rows of its own.
            holders, spilled = _rows(distinct, native[0] >> minor_bits, workers)
            if span.start:
                _hold_at(holders, spilled, *native, horizon_points[span.start - 1], minor_bits)
            judge_on_stays(span.start, span.stop, change_bounds, changes, minor_bits, item_bounds, items, sequence,
                           requests.offsets, *outcomes, table_keys, table_rows, table_bits, holders, spilled,
                           judged.stale, judged.lost)

        _in_parallel(judge, _spans(item_bounds, _cores()))
        return answers, judged

    def _orders(self) -> tuple[np.ndarray, np.ndarray]:
        """Per count k of workers present (the slots below k): their slots in worker order, and each slot's rank."""
        count = len(self.workers)
        orders = np.zeros((count + 1, max(count, 1)), dtype=np.int32)
        ranks = np.zeros((count + 1, max(count, 1)), dtype=np.int32)
        in_order = np.array(sorted(range(count), key=self.workers.__getitem__), dtype=np.int32)  # one sort
        for present in range(1, count + 1):
            ordered = in_order[in_order < present]  # the slots below `present`, in worker order
            orders[present, :present] = ordered
            ranks[present, ordered] = np.arange(present, dtype=np.int32)
        return orders, ranks


class FoldTimeline:
    """KV_EVENTS folded by decide's own `InventoryIndex`, answered and judged as it stands at each seq."""

    def __init__(self, batches: Sequence[tuple[int, EventBatch]]) -> None:
        self.batches = batches
        self.index = InventoryIndex()

    @property
    def workers(self) -> list[WorkerId]:
        """By slot, as the answers name them."""
        return self.index.workers

    def answer(self, requests: Requests, settings: Sequence[ReuseSettings], horizons: np.ndarray,
               recorded: tuple) -> tuple[Answers, Judged]:
        """As `StayTimeline.answer`; a request is judged at its horizon seq, or at its inventory seq when the
        horizon comes before it (a fold cannot go back). `recorded`: `recorded_outcomes`' arguments after
        `slot_of`, each array read at the requests judged at a seq."""
        count = len(requests)
        index = self.index = InventoryIndex()
        sequence = chain_hashes(requests.local, requests.offsets)
        kernel_settings = _settings_arrays(settings)
        answers = _empty_answers(len(settings), count)
        outputs = attrs.astuple(answers, recurse=False)
        stale = np.full((len(settings) + 1, count), _UNJUDGED, np.int8)
        lost = np.full((len(settings) + 1, count), _UNJUDGED, np.int8)
        target = np.full(count, NO_SLOT, np.int32)
        fallback = np.full(count, NO_SLOT, np.int32)
        named, has_fallback = requests.targets >= 0, requests.fallbacks >= 0
        workers, *recorded_columns = recorded
        # At each seq, answers before judgements (a decision may be judged at its own seq).
        at_seq: dict[int, tuple[list[int], list[int]]] = {}
        for request, seq in enumerate(requests.inventory_seqs.tolist()):
            at_seq.setdefault(seq, ([], []))[0].append(request)
        for request, (seq, horizon) in enumerate(zip(requests.inventory_seqs.tolist(), horizons.tolist())):
            if horizon >= 0:
                at_seq.setdefault(max(horizon, seq), ([], []))[1].append(request)
        applied = 0
        for seq in sorted(at_seq):
            while applied < len(self.batches) and self.batches[applied][0] <= seq:
                index.apply(self.batches[applied][1], self.batches[applied][0])
                applied += 1
            asked, judged_here = at_seq[seq]
            if asked:
                first, stop = asked[0], asked[-1] + 1
                contiguous = stop - first == len(asked)
                slot_of_place = _slots_by_place(index.slot, requests.workers, NO_SLOT)
                target[asked] = slot_of_place[requests.targets[asked]]
                fallback[asked] = slot_of_place[requests.fallbacks[asked]]
                if contiguous:
                    self._answer(index, first, stop, requests, target, named, fallback, has_fallback,
                                 kernel_settings, outputs)
                else:
                    for request in asked:
                        self._answer(index, request, request + 1, requests, target, named, fallback, has_fallback,
                                     kernel_settings, outputs)
            if judged_here:
                items = np.array(judged_here, dtype=np.int64)
                recorded_here = recorded_outcomes(index.slot, workers, *(values[items] for values in recorded_columns))
                part = Answers(*(array[:, items] for array in outputs))
                outcomes = Outcomes.of(recorded_here, part)
                part_stale = np.full(outcomes.source.shape, _UNJUDGED, np.int8)
                part_lost = np.full(outcomes.source.shape, _UNJUDGED, np.int8)
                local_offsets = requests.offsets[items]
                judge_outcomes(np.arange(items.size), sequence, local_offsets, *attrs.astuple(outcomes, recurse=False),
                               index.table_keys, index.table_rows, index.table_bits, index.holders, index.spilled,
                               part_stale, part_lost)
                stale[:, items] = part_stale
                lost[:, items] = part_lost
        return Answers(*outputs), Judged(stale, lost)

    @staticmethod
    def _answer(index, first, stop, requests, target, named, fallback, has_fallback, kernel_settings, outputs):
        answer_batch(first, stop, index.worker_count, requests.local, requests.offsets, requests.block_sizes,
                     target, named, fallback, has_fallback, index.table_keys, index.table_rows, index.table_bits,
                     index.holders, index.spilled, index.slots_in_order, index.order_rank, *kernel_settings,
                     *outputs)


def _slots_by_place(slot_of, workers: Sequence[WorkerId], none: int) -> np.ndarray:
    """Each worker's slot by `slot_of` (NO_SLOT where it holds nothing), by its place in `workers`, and `none`
    last: indexed by a place, -1 (no worker) reads `none`."""
    return np.array([_slot_or(slot_of(worker)) for worker in workers] + [none], dtype=np.int32)


def _slot_or(slot: int | None) -> int:
    return NO_SLOT if slot is None else slot
