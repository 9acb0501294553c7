"""decide's compiled hot path: ranking and the answers' JSON (the sequence hashing and the table probe it
uses are the index's: `decide/inventory/chain.py`, `decide/inventory/table.py`).

Written for numba (`@njit(cache=True)`): compiled to machine code on first use and kept
on disk, so a service pays the compilation once per machine, not once per start. The
cpu backend runs all three kernels; the cuda backend runs `chain_hashes` before its
launch and `write_answers` after it, so only the table and the ranking are on the device.

Every kernel computes exactly what `kvledger.core.reuse.decide` computes, in the same order of
float operations, so the answers are equal to the reference's bit for bit; the parity
suite checks it.
"""

from __future__ import annotations

import json
import math

import numba
import numpy as np

from kvledger.core import cost

# Sets numba's kernel cache folder before any kernel below is decorated.
from kvledger.decide.compiled import compiled as _compiled, inlined as _inlined, kernel_cache_dir  # noqa: F401
from kvledger.decide.inventory.rows import row_word

# The cost model, compiled from its one definition.
_recompute_ms = _inlined(cost.recompute_ms)
_transfer_ms = _inlined(cost.transfer_ms)
_block_us = _inlined(cost.block_us)

from kvledger.decide.inventory.chain import chain_hash, wide_product
from kvledger.decide.inventory.table import probe

_ONE = np.uint64(1)
_BYTE = np.uint64(0xFF)
_ZERO = np.uint64(0)
_ALL_BITS = np.uint64(0xFFFFFFFFFFFFFFFF)


@_inlined
def _candidate_costs(transfer_blocks, block_size, from_device, prefill_token_us, block_us, gpu_block_us,
                     minimum_blocks, minimum_saving_ms):
    """A candidate's recompute, transfer and saving (ms) for moving `transfer_blocks` blocks from a device tier
    or not, and whether it is kept: at least `minimum_blocks` moved and `minimum_saving_ms` saved (a NaN saving
    never is). The one rule of decide's ranking, the replay's and the shadow's re-ask."""
    recompute_ms = _recompute_ms(np.int64(transfer_blocks), np.int64(block_size), prefill_token_us)
    transfer_ms = _transfer_ms(np.int64(transfer_blocks), _block_us(from_device, gpu_block_us, block_us))
    saving_ms = recompute_ms - transfer_ms
    return recompute_ms, transfer_ms, saving_ms, transfer_blocks >= minimum_blocks and saving_ms >= minimum_saving_ms


# --- bits -------------------------------------------------------------------------------

_DE_BRUIJN = np.uint64(0x03F79D71B4CB0A89)
_DE_BRUIJN_SHIFT = np.uint64(58)
_DE_BRUIJN_POSITIONS = np.array([
    0, 1, 48, 2, 57, 49, 28, 3, 61, 58, 50, 42, 38, 29, 17, 4, 62, 55, 59, 36, 53, 51, 43, 22, 45, 39, 33, 30, 24, 18,
    12, 5, 63, 47, 56, 27, 60, 41, 37, 16, 54, 35, 52, 21, 44, 32, 23, 11, 46, 26, 40, 15, 34, 20, 31, 10, 25, 14, 19,
    9, 13, 8, 7, 6,
], dtype=np.int64)


@_inlined
def _lowest_bit(word):
    """Position of the lowest set bit of a non-zero word."""
    isolated = word & (~word + _ONE)
    return _DE_BRUIJN_POSITIONS[np.int64((isolated * _DE_BRUIJN) >> _DE_BRUIJN_SHIFT)]


# --- ranking ----------------------------------------------------------------------------

_ROWS_AHEAD = 8  # blocks probed together while walking a request

# Stored classes of a row (decide.inventory.index.CLASSES) and prefix classes (decide.ranked).
_NATIVE_DEVICE, _NATIVE_HOST, _NATIVE_DISK, _RETAINED_DEVICE = 0, 1, 2, 3
_PREFIX_ANY, _PREFIX_RETAINED_DEVICE = 3, 4
# Reason codes, as decide.ranking.ranked.REASONS orders them.
_DISABLED, _CHOSEN, _NO_WORKERS, _NO_CANDIDATES, _BELOW_THRESHOLD, _BUDGET_EXHAUSTED = range(6)


@_inlined
def _with_room(values, needed):
    """`values`, or a copy grown to hold `needed` items: the call is made only when it must
    grow (a call passing an array pays its reference count, which costs more than the test)."""
    if needed <= values.shape[0]:
        return values
    return _grown(values, needed)


@_compiled
def _grown(values, needed):
    if needed <= values.shape[0]:
        return values
    grown = np.empty((max(needed, 2 * values.shape[0]),) + values.shape[1:], dtype=values.dtype)
    grown[: values.shape[0]] = values
    return grown


_FEW_TO_SORT = 16


@_inlined
def _sort_ranks(ranks, count):
    """Sort `ranks[:count]`: by insertion where there are few (a request shows a handful of
    workers, and a library sort's call costs more than that), else by numpy's sort."""
    if count > _FEW_TO_SORT:
        ranks[:count].sort()
        return
    for position in range(1, count):
        moving = ranks[position]
        place = position
        while place > 0 and ranks[place - 1] > moving:
            ranks[place] = ranks[place - 1]
            place -= 1
        ranks[place] = moving


@_inlined
def _ranks_before(first, second, saving, prefix, tier, rank):
    """`kvledger.core.reuse.ranking_key` order: saving (higher first), longer prefix, tier, worker order."""
    if saving[first] != saving[second]:
        return saving[first] > saving[second]
    if prefix[first] != prefix[second]:
        return prefix[first] > prefix[second]
    if tier[first] != tier[second]:
        return tier[first] < tier[second]
    return rank[first] < rank[second]


@_inlined  # one call site; a call would pay nine arrays' reference counts per request
def _sort_candidates(start, stop, slot, tier, prefix, transfer, recompute, transfer_ms, saving, rank):
    """Order candidates[start:stop] by ranking key (insertion sort: a request has few)."""
    for position in range(start + 1, stop):
        moving = position
        while moving > start and _ranks_before(moving, moving - 1, saving, prefix, tier, rank):
            for column in (slot, tier, prefix, transfer, rank):
                column[moving], column[moving - 1] = column[moving - 1], column[moving]
            for column in (recompute, transfer_ms, saving):
                column[moving], column[moving - 1] = column[moving - 1], column[moving]
            moving -= 1


@_inlined
def _prefixes_held(lengths, prefix_class, word, reaching, held, walked):
    """The workers of `reaching` (one word) whose prefix in this class goes on through a block
    held by `held`; each other one's prefix ends at `walked` blocks."""
    going_on = reaching & held
    ended = reaching & ~going_on
    while ended:
        bit = _lowest_bit(ended)
        ended ^= _ONE << np.uint64(bit)
        lengths[prefix_class, word * 64 + bit] = walked
    return going_on


@_compiled
def rank_requests(
    local, offsets, given_target, named, block_sizes,
    table_keys, table_rows, table_bits, holders, spilled, slots_in_order, order_rank,
    scan, weight_of, tier_enabled, minimum_blocks, minimum_saving_ms, prefill_token_us, block_us, gpu_block_us,
):
    """Rank every request against the index; see `decide.ranking.ranked.RankedBatch` for what comes back.

    `local` holds every request's local hashes end to end, chained into sequence hashes as
    the walk goes. Per request and per word of 64 workers, the blocks are walked from the
    first: each class's prefix-AND of worker bits loses a worker where its prefix ends, and
    the walk stops once no worker of the word holds a prefix in any class (each block is
    probed once, by the first word's walk that reaches it). Credit adds each native block's
    best tier weight in block order, as the reference does. `weight_of[tiers held]` is that
    best weight for a 3-bit set of native tiers (device 1, host 2, disk 4). Each walked row's
    word is read as four masks (`decide.inventory.rows.row_word`), however the index keeps the row.
    """
    count = offsets.size - 1
    workers = slots_in_order.size
    words = spilled.shape[2]
    target_out = np.full(count, -1, dtype=np.int32)
    credited = np.zeros(count, dtype=np.float64)
    baseline_out = np.zeros(count, dtype=np.int32)
    reason = np.full(count, _NO_CANDIDATES, dtype=np.int8)
    overlap_bounds = np.zeros(count + 1, dtype=np.int64)
    overlap_slot = np.empty(max(count, 16), dtype=np.int32)
    overlap_lengths = np.empty((max(count, 16), 5), dtype=np.int32)
    candidate_bounds = np.zeros(count + 1, dtype=np.int64)
    capacity = max(count, 16)
    c_slot = np.empty(capacity, dtype=np.int32)
    c_tier = np.empty(capacity, dtype=np.int32)
    c_prefix = np.empty(capacity, dtype=np.int32)
    c_transfer = np.empty(capacity, dtype=np.int32)
    c_rank = np.empty(capacity, dtype=np.int32)
    c_recompute = np.empty(capacity, dtype=np.float64)
    c_transfer_ms = np.empty(capacity, dtype=np.float64)
    c_saving = np.empty(capacity, dtype=np.float64)
    any_tier = tier_enabled[0] or tier_enabled[1] or tier_enabled[2]

    # The sequence hashes as far as each walk chained them (at least the walked blocks):
    # the relied-on prefixes are read from here, not chained again.
    sequence = np.empty(local.size, dtype=np.uint64)
    block_rows = np.empty(64, dtype=np.int64)  # the rows of a request's blocks, as far as probed
    lengths = np.zeros((5, max(workers, 1)), dtype=np.int32)  # per request, reset where written
    credit = np.zeros(max(workers, 1), dtype=np.float64)
    shown_ranks = np.empty(max(workers, 1) + 1, dtype=np.int64)
    shown_count = 0
    overlaps, candidates = 0, 0

    for request in range(count):
        start, stop = offsets[request], offsets[request + 1]
        blocks = stop - start
        target = np.int64(given_target[request])
        choose = named[request] == 0
        shown_count = 0
        walked = 0
        if blocks > 0 and workers > 0:
            block_rows = _with_room(block_rows, blocks)
            sequence_hash = local[start]
            sequence[start] = sequence_hash
            block_rows[0] = probe(table_keys, table_rows, table_bits, sequence_hash)
            rows_known = 1
            # Each word of workers is walked on its own, its masks in registers: a worker's
            # prefixes and credit depend on its own bits alone, and the rows one word's walk
            # probed serve the next.
            for word in range(words):
                if choose:
                    credited_bits = _ALL_BITS
                elif target >= 0 and target // 64 == word:
                    credited_bits = _ONE << np.uint64(target % 64)
                else:
                    credited_bits = _ZERO
                device, host, disk, retained = row_word(holders, spilled, block_rows[0], word)
                native_device, native_host, native_disk = device, host, disk
                native_any = device | host | disk
                retained_device = device | retained
                # The workers holding any prefix at all are the ones an answer shows.
                shown = native_any | retained_device
                while shown:
                    bit = _lowest_bit(shown)
                    shown ^= _ONE << np.uint64(bit)
                    shown_ranks[shown_count] = order_rank[word * 64 + bit]
                    shown_count += 1
                walked = 1
                while True:
                    # Credit of block `walked - 1` for every worker whose native prefix reaches it.
                    holding = native_any & credited_bits
                    while holding:
                        bit = _lowest_bit(holding)
                        flag = _ONE << np.uint64(bit)
                        holding ^= flag
                        tiers = 0
                        if device & flag:
                            tiers |= 1
                        if host & flag:
                            tiers |= 2
                        if disk & flag:
                            tiers |= 4
                        credit[word * 64 + bit] += weight_of[tiers]
                    if (native_any | retained_device) == _ZERO or walked == blocks:
                        break
                    if walked >= rows_known:
                        # The next blocks' rows at once: their probes do not wait on each other,
                        # so their cache misses overlap instead of coming one after another.
                        rows_until = min(walked + _ROWS_AHEAD, blocks)
                        for ahead in range(rows_known, rows_until):
                            sequence_hash = chain_hash(sequence_hash, local[start + ahead])
                            sequence[start + ahead] = sequence_hash
                            block_rows[ahead] = probe(table_keys, table_rows, table_bits, sequence_hash)
                        rows_known = rows_until
                    device, host, disk, retained = row_word(holders, spilled, block_rows[walked], word)
                    native_device = _prefixes_held(lengths, 0, word, native_device, device, walked)
                    native_host = _prefixes_held(lengths, 1, word, native_host, host, walked)
                    native_disk = _prefixes_held(lengths, 2, word, native_disk, disk, walked)
                    native_any = _prefixes_held(lengths, 3, word, native_any, device | host | disk, walked)
                    retained_device = _prefixes_held(lengths, 4, word, retained_device, device | retained, walked)
                    walked += 1
                # What reaches the last block walked ends there.
                _prefixes_held(lengths, 0, word, native_device, _ZERO, walked)
                _prefixes_held(lengths, 1, word, native_host, _ZERO, walked)
                _prefixes_held(lengths, 2, word, native_disk, _ZERO, walked)
                _prefixes_held(lengths, 3, word, native_any, _ZERO, walked)
                _prefixes_held(lengths, 4, word, retained_device, _ZERO, walked)
            _sort_ranks(shown_ranks, shown_count)

        # The target: the one given, or the first worker (in worker order) of highest credit.
        if choose and workers > 0:
            best, best_rank = -np.inf, workers
            native = 0
            for position in range(shown_count):
                slot = slots_in_order[shown_ranks[position]]
                if lengths[_PREFIX_ANY, slot] > 0:
                    native += 1
                    if credit[slot] > best:
                        best, best_rank = credit[slot], shown_ranks[position]
            if native < workers and best <= 0.0:
                # A worker holding nothing has credit 0.0: the first of them in worker order.
                first_empty = 0
                for position in range(shown_count):
                    if shown_ranks[position] == first_empty and lengths[_PREFIX_ANY, slots_in_order[first_empty]] > 0:
                        first_empty += 1
                if best < 0.0 or first_empty < best_rank:
                    best, best_rank = 0.0, first_empty
            target = np.int64(slots_in_order[best_rank])
        if target >= 0:
            credited[request] = credit[target]
            baseline = lengths[_PREFIX_RETAINED_DEVICE, target]
        else:
            baseline = 0
        target_out[request] = target
        baseline_out[request] = baseline

        # Overlaps in worker order: every worker holding a prefix, and the target.
        target_rank = order_rank[target] if target >= 0 else -1
        if target >= 0:
            listed = False
            for position in range(shown_count):
                if shown_ranks[position] == target_rank:
                    listed = True
            if not listed:
                position = shown_count
                while position > 0 and shown_ranks[position - 1] > target_rank:
                    shown_ranks[position] = shown_ranks[position - 1]
                    position -= 1
                shown_ranks[position] = target_rank
                shown_count += 1
        overlap_slot = _with_room(overlap_slot, overlaps + shown_count)
        overlap_lengths = _with_room(overlap_lengths, overlaps + shown_count)
        for position in range(shown_count):
            slot = slots_in_order[shown_ranks[position]]
            overlap_slot[overlaps] = slot
            for prefix_class in range(5):
                overlap_lengths[overlaps, prefix_class] = lengths[prefix_class, slot]
            overlaps += 1
        overlap_bounds[request + 1] = overlaps

        # Candidates: every other worker whose prefix on an enabled tier beats the baseline.
        if not any_tier:
            reason[request] = _DISABLED
        elif not choose or target >= 0:
            if not scan:
                reason[request] = _BUDGET_EXHAUSTED
            else:
                first = candidates
                longer = False
                for position in range(shown_count):
                    slot = slots_in_order[shown_ranks[position]]
                    if slot == target:
                        continue
                    for tier in range(3):
                        prefix = lengths[tier, slot]
                        if not tier_enabled[tier] or prefix <= baseline:
                            continue
                        longer = True
                        transfer_blocks = prefix - baseline
                        recompute_ms, transfer_ms, saving_ms, kept = _candidate_costs(
                            transfer_blocks, block_sizes[request], tier == 0, prefill_token_us, block_us, gpu_block_us,
                            minimum_blocks, minimum_saving_ms)
                        if not kept:
                            continue
                        if candidates == c_slot.size:
                            c_slot, c_tier = _grown(c_slot, candidates + 1), _grown(c_tier, candidates + 1)
                            c_prefix, c_transfer = _grown(c_prefix, candidates + 1), _grown(c_transfer, candidates + 1)
                            c_rank = _grown(c_rank, candidates + 1)
                            c_recompute = _grown(c_recompute, candidates + 1)
                            c_transfer_ms = _grown(c_transfer_ms, candidates + 1)
                            c_saving = _grown(c_saving, candidates + 1)
                        c_slot[candidates], c_tier[candidates], c_prefix[candidates] = slot, tier, prefix
                        c_transfer[candidates], c_rank[candidates] = transfer_blocks, shown_ranks[position]
                        c_recompute[candidates], c_transfer_ms[candidates] = recompute_ms, transfer_ms
                        c_saving[candidates] = saving_ms
                        candidates += 1
                _sort_candidates(first, candidates, c_slot, c_tier, c_prefix, c_transfer, c_recompute, c_transfer_ms,
                                 c_saving, c_rank)
                if candidates > first:
                    reason[request] = _CHOSEN
                elif longer:
                    reason[request] = _BELOW_THRESHOLD
        else:
            reason[request] = _NO_WORKERS
        candidate_bounds[request + 1] = candidates

        # Scratch back to zero where this request wrote it.
        for position in range(shown_count):
            slot = slots_in_order[shown_ranks[position]]
            credit[slot] = 0.0
            for prefix_class in range(5):
                lengths[prefix_class, slot] = 0
    # Views, not copies: a copy each was a tenth of a single request's time, and the scratch
    # they leave unused is at most as large again as what they hold.
    c_recompute, c_transfer_ms, c_saving = c_recompute[:candidates], c_transfer_ms[:candidates], c_saving[:candidates]
    return (
        target_out, credited, baseline_out, reason,
        overlap_bounds, overlap_slot[:overlaps], overlap_lengths[:overlaps],
        candidate_bounds, c_slot[:candidates], c_tier[:candidates], c_prefix[:candidates],
        c_transfer[:candidates], c_recompute, c_transfer_ms, c_saving,
        repr_positions(credited, c_recompute, c_transfer_ms, c_saving), sequence,
    )


# --- a replay sweep: one walk per request, answered under each settings value ----------


@_inlined  # a call would pay its arrays' reference counts per request
def walk_request(local, start, blocks, target, choose, table_keys, table_rows, table_bits, holders, spilled,
                 order_rank, weights, sequence, block_rows, lengths, credit, shown_ranks):
    """One request's walk as `rank_requests` walks it, its credit under several settings values at once (a replay
    sweep's): for each worker showing a prefix, its five prefix lengths in `lengths` and, where it may be
    credited (every worker where `choose`, else the target), its credit under each row of `weights` in that row
    of `credit`; the shown workers' ranks, sorted, in `shown_ranks`. Returns `block_rows` (grown where it had to
    be) and the number of workers shown; the chained hashes of the walked blocks are written to `sequence`.
    `rank_requests` keeps its own copy of this walk, crediting one value: a loop over the values there cost
    decide's batched ranking 8 %. The replay's reports are checked against the reference model to the last float
    (tests/test_replay_speed.py), so the two walks cannot drift apart unnoticed."""
    words = spilled.shape[2]
    shown_count = 0
    block_rows = _with_room(block_rows, blocks)
    sequence_hash = local[start]
    sequence[start] = sequence_hash
    block_rows[0] = probe(table_keys, table_rows, table_bits, sequence_hash)
    rows_known = 1
    # Each word of workers is walked on its own, its masks in registers: a worker's
    # prefixes and credit depend on its own bits alone, and the rows one word's walk
    # probed serve the next.
    for word in range(words):
        if choose:
            credited_bits = _ALL_BITS
        elif target >= 0 and target // 64 == word:
            credited_bits = _ONE << np.uint64(target % 64)
        else:
            credited_bits = _ZERO
        device, host, disk, retained = row_word(holders, spilled, block_rows[0], word)
        native_device, native_host, native_disk = device, host, disk
        native_any = device | host | disk
        retained_device = device | retained
        # The workers holding any prefix at all are the ones an answer shows.
        shown = native_any | retained_device
        while shown:
            bit = _lowest_bit(shown)
            shown ^= _ONE << np.uint64(bit)
            shown_ranks[shown_count] = order_rank[word * 64 + bit]
            shown_count += 1
        walked = 1
        while True:
            # Credit of block `walked - 1` for every worker whose native prefix reaches it.
            holding = native_any & credited_bits
            while holding:
                bit = _lowest_bit(holding)
                flag = _ONE << np.uint64(bit)
                holding ^= flag
                tiers = 0
                if device & flag:
                    tiers |= 1
                if host & flag:
                    tiers |= 2
                if disk & flag:
                    tiers |= 4
                for setting in range(weights.shape[0]):
                    credit[setting, word * 64 + bit] += weights[setting, tiers]
            if (native_any | retained_device) == _ZERO or walked == blocks:
                break
            if walked >= rows_known:
                # The next blocks' rows at once: their probes do not wait on each other,
                # so their cache misses overlap instead of coming one after another.
                rows_until = min(walked + _ROWS_AHEAD, blocks)
                for ahead in range(rows_known, rows_until):
                    sequence_hash = chain_hash(sequence_hash, local[start + ahead])
                    sequence[start + ahead] = sequence_hash
                    block_rows[ahead] = probe(table_keys, table_rows, table_bits, sequence_hash)
                rows_known = rows_until
            device, host, disk, retained = row_word(holders, spilled, block_rows[walked], word)
            native_device = _prefixes_held(lengths, 0, word, native_device, device, walked)
            native_host = _prefixes_held(lengths, 1, word, native_host, host, walked)
            native_disk = _prefixes_held(lengths, 2, word, native_disk, disk, walked)
            native_any = _prefixes_held(lengths, 3, word, native_any, device | host | disk, walked)
            retained_device = _prefixes_held(lengths, 4, word, retained_device, device | retained, walked)
            walked += 1
        # What reaches the last block walked ends there.
        _prefixes_held(lengths, 0, word, native_device, _ZERO, walked)
        _prefixes_held(lengths, 1, word, native_host, _ZERO, walked)
        _prefixes_held(lengths, 2, word, native_disk, _ZERO, walked)
        _prefixes_held(lengths, 3, word, native_any, _ZERO, walked)
        _prefixes_held(lengths, 4, word, retained_device, _ZERO, walked)
    _sort_ranks(shown_ranks, shown_count)
    return block_rows, shown_count


@_inlined
def best_after_walk(target, choose, workers, shown_count, shown_ranks, slots_in_order, lengths, credit, setting,
                    block_size, tier_enabled, minimum_blocks, minimum_saving_ms, prefill_token_us, block_us,
                    gpu_block_us):
    """What `rank_requests` answers a walked request (`walk_request`) under one settings value (`credit`'s row
    `setting`), its best candidate alone: (target, credited, baseline, reason, the target's prefix on any tier,
    then the best candidate's slot (-1: none), tier, prefix, transfer blocks and saving). The same rules in the
    same order of float operations; the best is the first of `_sort_candidates`' order."""
    if choose and workers > 0:
        best, best_rank = -np.inf, workers
        native = 0
        for position in range(shown_count):
            slot = slots_in_order[shown_ranks[position]]
            if lengths[_PREFIX_ANY, slot] > 0:
                native += 1
                if credit[setting, slot] > best:
                    best, best_rank = credit[setting, slot], shown_ranks[position]
        if native < workers and best <= 0.0:
            first_empty = 0
            for position in range(shown_count):
                if shown_ranks[position] == first_empty and lengths[_PREFIX_ANY, slots_in_order[first_empty]] > 0:
                    first_empty += 1
            if best < 0.0 or first_empty < best_rank:
                best, best_rank = 0.0, first_empty
        target = np.int64(slots_in_order[best_rank])
    credited, baseline, target_prefix = 0.0, 0, 0
    if target >= 0:
        credited = credit[setting, target]
        baseline = lengths[_PREFIX_RETAINED_DEVICE, target]
        target_prefix = lengths[_PREFIX_ANY, target]
    reason = _NO_CANDIDATES
    best_slot, best_tier, best_prefix, best_transfer, best_saving, best_rank = -1, 0, 0, 0, 0.0, 0
    if not (tier_enabled[0] or tier_enabled[1] or tier_enabled[2]):
        reason = _DISABLED
    elif not choose or target >= 0:
        longer = False
        for position in range(shown_count):
            slot = slots_in_order[shown_ranks[position]]
            if slot == target:
                continue
            for tier in range(3):
                prefix = lengths[tier, slot]
                if not tier_enabled[tier] or prefix <= baseline:
                    continue
                longer = True
                transfer_blocks = prefix - baseline
                _, _, saving_ms, kept = _candidate_costs(transfer_blocks, block_size, tier == 0, prefill_token_us,
                                                         block_us, gpu_block_us, minimum_blocks, minimum_saving_ms)
                if not kept:
                    continue
                rank = shown_ranks[position]
                # `_ranks_before`: saving (higher first), longer prefix, tier, worker order.
                if best_slot < 0 or saving_ms > best_saving or (saving_ms == best_saving and (
                        prefix > best_prefix or (prefix == best_prefix and (
                            tier < best_tier or (tier == best_tier and rank < best_rank))))):
                    best_slot, best_tier, best_prefix = slot, tier, prefix
                    best_transfer, best_saving, best_rank = transfer_blocks, saving_ms, rank
        if best_slot >= 0:
            reason = _CHOSEN
        elif longer:
            reason = _BELOW_THRESHOLD
    else:
        reason = _NO_WORKERS
    return (target, credited, baseline, reason, target_prefix, best_slot, best_tier, best_prefix, best_transfer,
            best_saving)


@_compiled
def repr_positions(credited, recompute, transfer, saving):
    """Positions, in the four columns end to end, of the floats `_put_float` cannot write."""
    flagged = 0
    positions = np.empty(16, dtype=np.int64)
    offset = 0
    for column in (credited, recompute, transfer, saving):
        for item in range(column.size):
            if _needs_repr(column[item]):
                positions = _with_room(positions, flagged + 1)
                positions[flagged] = offset + item
                flagged += 1
        offset += column.size
    return positions[:flagged]


# --- the answers' JSON ------------------------------------------------------------------


def _text(value: str) -> np.ndarray:
    return np.frombuffer(value.encode(), dtype=np.uint8).copy()


_REQUEST_ID = _text('{"request_id":')
_CREDITED = _text(',"credited_blocks":')
_BASELINE = _text(',"baseline_blocks":')
_OVERLAPS = _text(',"overlaps":{')
# Separate arrays, not tuples of them: numba keeps a global array as a constant, but a
# tuple of arrays would be unpickled on every use.
_DEVICE_LABEL, _HOST_LABEL, _DISK_LABEL = _text(':{"device":'), _text(',"host":'), _text(',"disk":')
_ANY_LABEL, _RETAINED_DEVICE_LABEL = _text(',"any":'), _text(',"retained_device":')
_ZERO_OVERLAP = _text(':{"device":0,"host":0,"disk":0,"any":0,"retained_device":0}')
_CANDIDATES = _text('},"candidates":[')
_CHOSEN_LABEL = _text('],"chosen":')
_NULL = _text("null")
_DEVICE_TIER = _text(',"tier":"device","prefix_blocks":')
_HOST_TIER = _text(',"tier":"host","prefix_blocks":')
_DISK_TIER = _text(',"tier":"disk","prefix_blocks":')
_TRANSFER_BLOCKS = _text(',"transfer_blocks":')
_RECOMPUTE = _text(',"recompute_ms":')
_TRANSFER_MS = _text(',"transfer_ms":')
_SAVING = _text(',"saving_ms":')
_HEX_DIGITS = _text("0123456789abcdef")
# A byte's two hex digits read as one 16-bit word in the machine's order, so that storing
# the word writes them in order.
_HEX_PAIRS = np.frombuffer("".join(f"{byte:02x}" for byte in range(256)).encode(), dtype=np.uint16).copy()
_SHORT_ESCAPES = np.zeros(32, dtype=np.uint8)
for _code, _letter in ((8, "b"), (9, "t"), (10, "n"), (12, "f"), (13, "r")):
    _SHORT_ESCAPES[_code] = ord(_letter)
_LONGEST_LABELS = 160  # the fixed text of one overlap or candidate, numbers aside


@_inlined
def copy_bytes(out, position, source, start, length):
    """`source[start:start + length]` into `out` at `position`; the position after it."""
    # Unsigned indices: no negative-index wrap-around per byte, so the loop vectorises.
    to, at = np.uint64(position), np.uint64(start)
    for offset in range(np.uint64(length)):
        out[to + offset] = source[at + offset]
    return position + length


@_inlined
def _put(out, position, text):
    return copy_bytes(out, position, text, 0, text.size)


@_inlined
def _put_slice(out, position, buffer, bounds, item):
    return copy_bytes(out, position, buffer, bounds[item], bounds[item + 1] - bounds[item])


_TEN = np.uint64(10)


@_inlined
def _put_integer(out, position, value):
    """`str(value)` of an integer."""
    if value < 0:
        out[position] = 45  # "-"
        position += 1
        value = -value
    if value < 10:  # most lengths and counts
        out[position] = 48 + value
        return position + 1
    # Unsigned, so division by ten compiles to a multiply.
    rest = np.uint64(value)
    digits = 1
    bound = _TEN
    while rest >= bound and digits < 20:
        digits += 1
        if bound > np.uint64(0xFFFFFFFFFFFFFFFF) // _TEN:
            break
        bound *= _TEN
    for place in range(digits - 1, -1, -1):
        out[position + place] = 48 + rest % _TEN
        rest //= _TEN
    return position + digits


@_inlined
def _put_escape(out, position, code):
    out[position] = 92  # backslash
    out[position + 1] = 117  # "u"
    for place in range(4):
        out[position + 2 + place] = _HEX_DIGITS[(code >> (12 - 4 * place)) & 15]
    return position + 6


@_inlined
def _put_json_string(out, position, text):
    """`json.dumps` of a UTF-8 text: quotes, backslash escapes, everything outside ASCII as \\uXXXX."""
    out[position] = 34
    position += 1
    at = 0
    while at < text.size:
        byte = np.int64(text[at])
        if byte == 34 or byte == 92:
            out[position] = 92
            out[position + 1] = byte
            position += 2
            at += 1
        elif byte < 32:
            if _SHORT_ESCAPES[byte]:
                out[position] = 92
                out[position + 1] = _SHORT_ESCAPES[byte]
                position += 2
            else:
                position = _put_escape(out, position, byte)
            at += 1
        elif byte < 127:
            out[position] = byte
            position += 1
            at += 1
        elif byte == 127:
            position = _put_escape(out, position, byte)
            at += 1
        else:
            if byte >= 0xF0:
                code, extra = byte & 0x07, 3
            elif byte >= 0xE0:
                code, extra = byte & 0x0F, 2
            else:
                code, extra = byte & 0x1F, 1
            for follower in range(1, extra + 1):
                code = (code << 6) | (np.int64(text[at + follower]) & 0x3F)
            at += extra + 1
            if code >= 0x10000:
                code -= 0x10000
                position = _put_escape(out, position, 0xD800 | (code >> 10))
                position = _put_escape(out, position, 0xDC00 | (code & 0x3FF))
            else:
                position = _put_escape(out, position, code)
    out[position] = 34
    return position + 1


_POWERS_OF_TEN = np.array([10.0 ** power for power in range(16)])
_EXACT_INTEGERS = 9007199254740992.0  # 2**53: every integer below is a double
_POWERS_OF_FIVE = np.array([5**power for power in range(27)], dtype=np.uint64)
_SEVENTEEN_DIGITS_FROM, _SEVENTEEN_DIGITS_UNTIL = np.int64(10**16), np.int64(10**17)
_MANTISSA_SCALE = 9007199254740992.0  # 2**53, as a double
_FIFTY_THREE = 53
_ONE_CANDIDATE_BELOW = np.int64(2**50)


@_compiled  # not inlined: called for one float in a few, it would grow every place a float is written
def _exactly_scaled(value, decimals):
    """`value × 10**decimals` rounded to the nearest integer (ties to even), computed exactly,
    for 0 < value and 1 <= decimals <= 26; -1 when the result would not fit a signed 64-bit integer.

    value = m·2**e with a 53-bit integer m, so value·10**d = (m·5**d)·2**(e + d): a 128-bit
    product of two 64-bit words, then a shift that rounds.
    """
    fraction, exponent = math.frexp(value)
    mantissa = np.uint64(fraction * _MANTISSA_SCALE)  # exact: fraction has 53 significant bits
    shift = exponent - _FIFTY_THREE + decimals
    high, low = wide_product(mantissa, _POWERS_OF_FIVE[decimals])
    if shift >= 0:
        # Shifts of 64 or more are undefined: the result must stay below 2**63 anyway.
        if high != 0 or shift >= 63 or low >> np.uint64(63 - shift) != 0:
            return np.int64(-1)
        return np.int64(low << np.uint64(shift))
    right = -shift
    if right >= 64 or high >> np.uint64(right) != 0:
        return np.int64(-1)
    quotient = (low >> np.uint64(right)) | (high << np.uint64(64 - right))
    remainder = low & ((_ONE << np.uint64(right)) - _ONE)
    half = _ONE << np.uint64(right - 1)
    if remainder > half or (remainder == half and quotient & _ONE):
        quotient += _ONE
    if quotient >> np.uint64(63):
        return np.int64(-1)
    return np.int64(quotient)


@_inlined
def _shortest_fixed(value):
    """(digits, decimals) with `digits / 10**decimals` the shortest text that reads back as `value` (> 0),
    or (-1, -1) where `repr` is needed: exponent notation, or two texts equally short.

    `float(digits) / 10**decimals` is the correctly rounded value of that decimal text (both
    operands are exact doubles), so the test is exactly "reads back as `value`". Where no
    text of up to 16 significant digits reads back, 17 always do, and `repr` writes the 17
    digits nearest the value: `_exactly_scaled` computes them. (Where 16 digits could not
    be tested, their integer being above 2**53, Python writes the text.)
    """
    if value >= 1e16 or value < 1e-4:
        return -1, -1
    for decimals in range(16):
        scale = _POWERS_OF_TEN[decimals]
        product = value * scale
        if product >= _EXACT_INTEGERS:
            if product >= 1e16 and decimals > 0:
                # Every shorter text failed: the 17 digits, if this scaling really gives 17.
                digits = _exactly_scaled(value, decimals)
                if _SEVENTEEN_DIGITS_FROM <= digits < _SEVENTEEN_DIGITS_UNTIL:
                    return digits, decimals
            return -1, -1
        nearest = np.int64(np.rint(product))
        if nearest < _ONE_CANDIDATE_BELOW:
            # Below 2**50 the product is within 1/8 of exact and two texts are more than an
            # ulp apart: only the nearest integer can read back, and never two.
            if np.float64(nearest) / scale == value:
                return nearest, decimals
            continue
        found, hits = -1, 0
        for digits in (nearest - 1, nearest, nearest + 1):
            if digits >= 0 and np.float64(digits) / scale == value:
                found, hits = digits, hits + 1
        if hits == 1:
            return found, decimals
        if hits > 1:
            return -1, -1
    return -1, -1


def repr_texts_of(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Floats `_put_float` cannot write, as `json.dumps` writes them: each distinct value's text
    once, end to end with its bounds, and each value's item among those texts."""
    text_of: dict[int, int] = {}
    texts: list[bytes] = []
    items = np.empty(values.size, dtype=np.int64)
    for position, (bits, value) in enumerate(zip(values.view(np.uint64).tolist(), values.tolist())):
        item = text_of.get(bits)
        if item is None:
            item = text_of[bits] = len(texts)
            # json.dumps writes a finite float as repr does.
            texts.append(repr(value).encode() if math.isfinite(value) else json.dumps(value).encode())
        items[position] = item
    bounds = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, texts), dtype=np.int64, count=len(texts)), out=bounds[1:])
    return np.frombuffer(b"".join(texts), dtype=np.uint8).copy(), bounds, items


@_inlined
def _needs_repr(value):
    """Whether `_put_float` cannot write this float as `repr` would (Python writes it)."""
    if not np.isfinite(value):
        return True
    return value != 0.0 and _shortest_fixed(abs(value))[0] < 0


@_compiled
def needs_repr(values):
    """`_needs_repr` of each float."""
    result = np.zeros(values.size, dtype=np.bool_)
    for item in range(values.size):
        result[item] = _needs_repr(values[item])
    return result


@_inlined
def _put_float(out, position, value):
    """`repr(value)` of a float `needs_repr` passed."""
    if value < 0.0 or (value == 0.0 and np.signbit(value)):
        out[position] = 45
        position += 1
        value = -value
    if value == 0.0:
        digits, decimals = 0, 0
    else:
        digits, decimals = _shortest_fixed(value)
    text_start = position
    position = _put_integer(out, position, digits)
    if decimals == 0:
        out[position] = 46  # "."
        out[position + 1] = 48
        return position + 2
    written = position - text_start
    if written <= decimals:  # 0.00ddd: leading zeros first
        shift = decimals - written + 2
        for place in range(written - 1, -1, -1):
            out[text_start + shift + place] = out[text_start + place]
        out[text_start] = 48
        out[text_start + 1] = 46
        for place in range(2, shift):
            out[text_start + place] = 48
        return text_start + decimals + 2
    for place in range(position - 1, position - decimals - 1, -1):
        out[place + 1] = out[place]
    out[position - decimals] = 46
    return position + 1


@_inlined
def _put_number(out, position, values, texts, item, repr_texts, repr_bounds):
    """A float: as Python wrote it where it had to (`texts[item] >= 0`), else by `_put_float`."""
    if texts[item] >= 0:
        return _put_slice(out, position, repr_texts, repr_bounds, texts[item])
    return _put_float(out, position, values[item])


@_compiled
def _longest(bounds):
    longest = 0
    for item in range(bounds.size - 1):
        longest = max(longest, bounds[item + 1] - bounds[item])
    return longest


@_inlined  # at one place only: the chosen candidate is copied from the list, not written again
def _put_candidate(out, position, item, sources, source_bounds, c_slot, c_tier, c_prefix, c_transfer,
                   recompute, recompute_text, transfer, transfer_text, saving, saving_text, repr_texts, repr_bounds):
    position = _put_slice(out, position, sources, source_bounds, c_slot[item])
    tier = c_tier[item]
    position = _put(out, position, _DEVICE_TIER if tier == 0 else _HOST_TIER if tier == 1 else _DISK_TIER)
    position = _put_integer(out, position, c_prefix[item])
    position = _put(out, position, _TRANSFER_BLOCKS)
    position = _put_integer(out, position, c_transfer[item])
    position = _put(out, position, _RECOMPUTE)
    position = _put_number(out, position, recompute, recompute_text, item, repr_texts, repr_bounds)
    position = _put(out, position, _TRANSFER_MS)
    position = _put_number(out, position, transfer, transfer_text, item, repr_texts, repr_bounds)
    position = _put(out, position, _SAVING)
    position = _put_number(out, position, saving, saving_text, item, repr_texts, repr_bounds)
    out[position] = 125  # "}"
    return position + 1


_LONGEST_FLOAT = 24  # "-0.000123456789012345" and the like: what _put_float writes at most


@_compiled
def write_answers(
    ids, id_bounds, inventory_target, names, name_bounds, sources, source_bounds, unknown, unknown_bounds,
    target, credited, credited_text, baseline, reason, overlap_bounds, overlap_slot, overlap_lengths,
    candidate_bounds, c_slot, c_tier, c_prefix, c_transfer,
    recompute, recompute_text, transfer, transfer_text, saving, saving_text, repr_texts, repr_bounds,
    endings, ending_bounds,
):
    """Every answer's JSON, end to end in one buffer, and where each answer starts.

    Byte for byte `json.dumps(decision_to_json(decision), separators=(",", ":"))`. Texts
    come as one buffer with bounds per item: the request ids (UTF-8, escaped here), the
    workers' names and candidate openings by slot (already JSON), a named target the index
    has never seen (by request, empty when none), the floats Python had to write
    (`needs_repr`; a float's `*_text` is its item there, or -1), and the answer's ending
    per reason code. `inventory_target` is `,"inventory_seq":N,"target":`.
    """
    count = id_bounds.size - 1
    answer_bounds = np.zeros(count + 1, dtype=np.int64)
    longest_name = _longest(name_bounds)
    longest_source = _longest(source_bounds)
    longest_float = max(_longest(repr_bounds), _LONGEST_FLOAT)
    longest_ending = _longest(ending_bounds)
    out = np.empty(max(count * 512, 1024), dtype=np.uint8)
    position = 0
    for request in range(count):
        shown = overlap_bounds[request + 1] - overlap_bounds[request]
        ranked = candidate_bounds[request + 1] - candidate_bounds[request]
        unknown_length = unknown_bounds[request + 1] - unknown_bounds[request]
        bound = (position + 12 * (id_bounds[request + 1] - id_bounds[request]) + inventory_target.size + longest_float
                 + longest_ending + 2 * unknown_length + 2 * longest_name + 256
                 + (shown + 1) * (longest_name + _LONGEST_LABELS)
                 + (ranked + 1) * (longest_source + 3 * longest_float + _LONGEST_LABELS))
        if bound > out.size:
            out = _grown(out, 2 * bound)
        position = _put(out, position, _REQUEST_ID)
        position = _put_json_string(out, position, ids[id_bounds[request]:id_bounds[request + 1]])
        position = _put(out, position, inventory_target)
        if target[request] >= 0:
            position = _put_slice(out, position, names, name_bounds, target[request])
        elif unknown_length:
            position = _put_slice(out, position, unknown, unknown_bounds, request)
        else:
            position = _put(out, position, _NULL)
        position = _put(out, position, _CREDITED)
        position = _put_number(out, position, credited, credited_text, request, repr_texts, repr_bounds)
        position = _put(out, position, _BASELINE)
        position = _put_integer(out, position, baseline[request])
        position = _put(out, position, _OVERLAPS)
        for item in range(overlap_bounds[request], overlap_bounds[request + 1]):
            if item > overlap_bounds[request]:
                out[position] = 44  # ","
                position += 1
            position = _put_slice(out, position, names, name_bounds, overlap_slot[item])
            position = _put(out, position, _DEVICE_LABEL)
            position = _put_integer(out, position, overlap_lengths[item, 0])
            position = _put(out, position, _HOST_LABEL)
            position = _put_integer(out, position, overlap_lengths[item, 1])
            position = _put(out, position, _DISK_LABEL)
            position = _put_integer(out, position, overlap_lengths[item, 2])
            position = _put(out, position, _ANY_LABEL)
            position = _put_integer(out, position, overlap_lengths[item, 3])
            position = _put(out, position, _RETAINED_DEVICE_LABEL)
            position = _put_integer(out, position, overlap_lengths[item, 4])
            out[position] = 125
            position += 1
        if unknown_length:
            # A target the inventory has never seen holds nothing, listed after the others.
            if shown:
                out[position] = 44
                position += 1
            position = _put_slice(out, position, unknown, unknown_bounds, request)
            position = _put(out, position, _ZERO_OVERLAP)
        position = _put(out, position, _CANDIDATES)
        chosen_from = chosen_until = position  # the first candidate's text, which "chosen" repeats
        for item in range(candidate_bounds[request], candidate_bounds[request + 1]):
            if item > candidate_bounds[request]:
                out[position] = 44
                position += 1
            position = _put_candidate(out, position, item, sources, source_bounds, c_slot, c_tier, c_prefix,
                                      c_transfer, recompute, recompute_text, transfer, transfer_text, saving,
                                      saving_text, repr_texts, repr_bounds)
            if item == candidate_bounds[request]:
                chosen_until = position
        position = _put(out, position, _CHOSEN_LABEL)
        if ranked:
            position = copy_bytes(out, position, out, chosen_from, chosen_until - chosen_from)
        else:
            position = _put(out, position, _NULL)
        position = _put_slice(out, position, endings, ending_bounds, reason[request])
        answer_bounds[request + 1] = position
    return out[:position], answer_bounds


@_compiled
def relied_prefix_texts(sequence, offsets, target, overlap_bounds, overlap_slot, overlap_lengths,
                        candidate_bounds, c_prefix, max_blocks):
    """Per answer, the sequence hashes it relies on as the hex of little-endian u64s, end to
    end in one buffer, and where each answer's text starts.

    An answer relies on the chosen source's prefix (its first candidate's) or the target's
    credited prefix (native on any local tier), whichever is longer, at most `max_blocks`.
    """
    count = offsets.size - 1
    lengths = np.zeros(count, dtype=np.int64)
    for request in range(count):
        length = 0
        if candidate_bounds[request + 1] > candidate_bounds[request]:
            length = c_prefix[candidate_bounds[request]]
        for item in range(overlap_bounds[request], overlap_bounds[request + 1]):
            if overlap_slot[item] == target[request] and overlap_lengths[item, _PREFIX_ANY] > length:
                length = overlap_lengths[item, _PREFIX_ANY]
        lengths[request] = min(length, max_blocks)
    bounds = np.zeros(count + 1, dtype=np.int64)
    for request in range(count):
        bounds[request + 1] = bounds[request] + lengths[request] * 16
    out = np.empty(bounds[count], dtype=np.uint8)
    # Two hex digits per byte, stored at once: every text starts at an even position.
    pairs = out.view(np.uint16)
    for request in range(count):
        pair = bounds[request] // 2
        for block in range(offsets[request], offsets[request] + lengths[request]):
            value = sequence[block]
            for byte in range(8):
                pairs[pair + byte] = _HEX_PAIRS[(value >> np.uint64(8 * byte)) & _BYTE]
            pair += 8
    return out, bounds


# --- ranked and written in one call -----------------------------------------------------


@numba.njit(cache=True)  # not nogil: its object-mode block needs the interpreter
def write_ranked_answers(
    ids, id_bounds, inventory_target, names, name_bounds, sources, source_bounds, unknown, unknown_bounds,
    target, credited, baseline, reason, overlap_bounds, overlap_slot, overlap_lengths,
    candidate_bounds, c_slot, c_tier, c_prefix, c_transfer, c_recompute, c_transfer_ms, c_saving, flagged,
    endings, ending_bounds,
):
    """`write_answers` for a ranking's arrays, the floats `_put_float` cannot write (`flagged`:
    their positions in the four float columns end to end, `_repr_positions`) written by Python
    (`repr_texts_of`), called from here. Both ways of writing answers come through here."""
    # Per float of the four columns end to end, its item among the Python-written texts (-1: none).
    items = np.full(credited.size + 3 * c_recompute.size, -1, dtype=np.int64)
    if flagged.size:
        values = np.concatenate((credited, c_recompute, c_transfer_ms, c_saving))[flagged]
        with numba.objmode(repr_texts="uint8[:]", repr_bounds="int64[:]", flagged_items="int64[:]"):
            repr_texts, repr_bounds, flagged_items = repr_texts_of(values)
        items[flagged] = flagged_items
    else:
        repr_texts, repr_bounds = np.empty(0, dtype=np.uint8), np.zeros(1, dtype=np.int64)
    recompute_from = credited.size
    transfer_from = recompute_from + c_recompute.size
    saving_from = transfer_from + c_recompute.size
    return write_answers(
        ids, id_bounds, inventory_target, names, name_bounds, sources, source_bounds, unknown, unknown_bounds,
        target, credited, items[:recompute_from], baseline, reason,
        overlap_bounds, overlap_slot, overlap_lengths, candidate_bounds, c_slot, c_tier, c_prefix, c_transfer,
        c_recompute, items[recompute_from:transfer_from], c_transfer_ms, items[transfer_from:saving_from],
        c_saving, items[saving_from:], repr_texts, repr_bounds, endings, ending_bounds,
    )


@numba.njit(cache=True)  # not nogil, as write_ranked_answers
def answer_requests(
    local, offsets, given_target, named, block_sizes,
    table_keys, table_rows, table_bits, holders, spilled, slots_in_order, order_rank,
    scan, weight_of, tier_enabled, minimum_blocks, minimum_saving_ms, prefill_token_us, block_us, gpu_block_us,
    ids, id_bounds, inventory_target, names, name_bounds, sources, source_bounds, unknown, unknown_bounds,
    endings, ending_bounds, max_relied_blocks,
):
    """`rank_requests`, then `write_ranked_answers` and `relied_prefix_texts` on its output, in
    one call: what the service sends and records, without the ranking's seventeen arrays going
    to Python and back (boxing them cost more than ranking a single request).

    Returns the answers end to end with their bounds, the relied-on prefixes with theirs,
    and how many answers have each reason code.
    """
    (target, credited, baseline, reason, overlap_bounds, overlap_slot, overlap_lengths, candidate_bounds,
     c_slot, c_tier, c_prefix, c_transfer, c_recompute, c_transfer_ms, c_saving, flagged, sequence) = rank_requests(
        local, offsets, given_target, named, block_sizes,
        table_keys, table_rows, table_bits, holders, spilled, slots_in_order, order_rank,
        scan, weight_of, tier_enabled, minimum_blocks, minimum_saving_ms, prefill_token_us, block_us, gpu_block_us,
    )
    reason_counts = np.zeros(6, dtype=np.int64)
    for request in range(reason.size):
        reason_counts[reason[request]] += 1
    answers, answer_bounds = write_ranked_answers(
        ids, id_bounds, inventory_target, names, name_bounds, sources, source_bounds, unknown, unknown_bounds,
        target, credited, baseline, reason, overlap_bounds, overlap_slot, overlap_lengths,
        candidate_bounds, c_slot, c_tier, c_prefix, c_transfer, c_recompute, c_transfer_ms, c_saving, flagged,
        endings, ending_bounds,
    )
    relied, relied_bounds = relied_prefix_texts(
        sequence, offsets, target, overlap_bounds, overlap_slot, overlap_lengths, candidate_bounds, c_prefix,
        max_relied_blocks,
    )
    return answers, answer_bounds, relied, relied_bounds, reason_counts


@numba.njit(cache=True)  # not nogil, as answer_requests
def answer_request(
    local, given_target, named, block_size,
    table_keys, table_rows, table_bits, holders, spilled, slots_in_order, order_rank,
    scan, weight_of, tier_enabled, minimum_blocks, minimum_saving_ms, prefill_token_us, block_us, gpu_block_us,
    request_id, inventory_target, names, name_bounds, sources, source_bounds, unknown_target,
    endings, ending_bounds, max_relied_blocks,
):
    """`answer_requests` for one request, its per-request values given as scalars: the arrays
    a batch passes are made here, where making one costs a tenth of what it does in numpy
    from Python, and one buffer comes back instead of five arrays (boxing each for Python
    cost more than ranking a short request).

    Returns the answer and its relied-on prefix end to end, where the prefix starts, and the
    answer's reason code.
    """
    offsets = np.zeros(2, dtype=np.int64)
    offsets[1] = local.size
    id_bounds = np.zeros(2, dtype=np.int64)
    id_bounds[1] = request_id.size
    unknown_bounds = np.zeros(2, dtype=np.int64)
    unknown_bounds[1] = unknown_target.size
    answers, _, relied, _, reason_counts = answer_requests(
        local, offsets, np.full(1, given_target, dtype=np.int32), np.full(1, named, dtype=np.uint8),
        np.full(1, block_size, dtype=np.int64),
        table_keys, table_rows, table_bits, holders, spilled, slots_in_order, order_rank,
        scan, weight_of, tier_enabled, minimum_blocks, minimum_saving_ms, prefill_token_us, block_us, gpu_block_us,
        request_id, id_bounds, inventory_target, names, name_bounds, sources, source_bounds, unknown_target,
        unknown_bounds, endings, ending_bounds, max_relied_blocks,
    )
    texts = np.empty(answers.size + relied.size, dtype=np.uint8)
    texts[:answers.size] = answers
    texts[answers.size:] = relied
    return texts, answers.size, np.argmax(reason_counts)
