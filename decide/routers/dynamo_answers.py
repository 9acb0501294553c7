"""Dynamo's indexer answers, compiled: the walk of decide's index, a `/query` body's token ids read
from its JSON text, and the answer written as JSON text.

A router's query is small and the index's walk quick: in Python, the body's token ids as a
list of ints, their copy to u32 and the answer built as text cost several times the walk
(docs/routers.md, "What was tried"). Here a `/query` costs two compiled calls: its token ids
read (`json_token_ids`), then its blocks hashed, walked and its answer written
(`token_scores`); a `/query_by_hash`, or a query whose blocks the compiled hashing does not
cover, one (`block_scores`) after its hashes are had.
"""

from __future__ import annotations

import numpy as np

from kvledger.decide.compiled import compiled as _compiled, inlined as _inlined
from kvledger.decide.inventory.chain import chain_hash
from kvledger.decide.inventory.rows import spilled_row
from kvledger.decide.inventory.table import probe
from kvledger.decide.inventory.token_hashes import token_block_hashes
from kvledger.decide.ranking.kernels import _put, _put_integer, _text

_ONE, _TWO, _FOUR, _SEVEN = np.uint64(1), np.uint64(2), np.uint32(4), np.uint32(7)
_U32_MAX = np.uint64(0xFFFFFFFF)
_TEN = np.uint64(10)


# --- the walk --------------------------------------------------------------------------------------


@_inlined
def _extend(held, slot, block, planes):
    """Worker `slot` holds block `block` in `planes` (bit 0 device, 1 host, 2 disk): lengthen its prefixes."""
    if held[2, slot] != block or planes & 7 == 0:
        return False
    held[2, slot] = block + 1
    if held[1, slot] == block and planes & 3 != 0:
        held[1, slot] = block + 1
    if held[0, slot] == block and planes & 1 != 0:
        held[0, slot] = block + 1
    return True


@_compiled
def prefix_blocks(table_keys, table_rows, table_bits, holders, spilled, local, worker_count):
    """Per worker slot, how many leading blocks of the request it holds natively: [0] on device,
    [1] on device or host, [2] on any of the three.

    One compiled call per query: the request's sequence hashes chained from its local hashes,
    each probed in the index's table, its row's holders read as they are kept (listed or a
    bitmask row); the walk stops at the first block no worker still in its prefix holds.

    Safe on arrays another process is changing (an index reader's, decide/serving/readers.py):
    a row, pool row or slot past the arrays it was given ends the walk or is passed over
    instead of read out of bounds; the reader then discards the answer and asks again.
    """
    held = np.zeros((3, worker_count), dtype=np.int64)
    if worker_count > spilled.shape[2] * 64:
        return held
    sequence = np.uint64(0)
    for block in range(local.size):
        sequence = local[block] if block == 0 else chain_hash(sequence, local[block])
        row = probe(table_keys, table_rows, table_bits, sequence)
        if row <= 0 or row >= holders.shape[0]:
            break
        advanced = False
        dense = spilled_row(holders, row)
        if dense >= spilled.shape[0]:
            break
        if dense:
            for slot in range(worker_count):
                word, bit = slot >> 6, np.uint64(slot & 63)
                planes = (((spilled[dense, 0, word] >> bit) & _ONE) | (((spilled[dense, 1, word] >> bit) & _ONE) << _ONE)
                          | (((spilled[dense, 2, word] >> bit) & _ONE) << _TWO))
                advanced |= _extend(held, slot, block, planes)
        else:
            for k in range(holders.shape[1]):
                entry = holders[row, k]
                if entry == 0:
                    break
                if np.int64(entry >> _FOUR) < worker_count:
                    advanced |= _extend(held, np.int64(entry >> _FOUR), block, entry & _SEVEN)
        if not advanced:
            break
    return held


@_compiled
def registered_prefixes(table_keys, table_rows, table_bits, holders, spilled, local, worker_count, slots):
    """`prefix_blocks` for the ranks at `slots` that hold a prefix: rows of (position in `slots`, device, device
    or host, any tier), so a fleet's other workers cost the answer nothing."""
    held = prefix_blocks(table_keys, table_rows, table_bits, holders, spilled, local, worker_count)
    count = 0
    for position in range(slots.size):
        if held[2, slots[position]]:
            count += 1
    found = np.empty((count, 4), dtype=np.int64)
    count = 0
    for position in range(slots.size):
        slot = slots[position]
        if held[2, slot]:
            found[count, 0] = position
            found[count, 1] = held[0, slot]
            found[count, 2] = held[1, slot]
            found[count, 3] = held[2, slot]
            count += 1
    return found


# --- a query's token ids ---------------------------------------------------------------------------


@_compiled
def json_token_ids(text):
    """(True, the token ids as u32) when `text`, the bytes of a valid JSON value (msgspec checked it),
    is an array of plain integers each below 2**32; (False, nothing) for anything else, which the
    full schema then refuses with its own message (or reads).

    Valid JSON made only of digits, commas and whitespace between its outer brackets is a flat
    array of non-negative integers without leading zeros, so no other check is needed.
    """
    size = text.size
    tokens = np.empty((size + 1) // 2, dtype=np.uint32)
    if size < 2 or text[0] != 91 or text[size - 1] != 93:  # "[" … "]"
        return False, tokens[:0]
    count, at, end = 0, 1, size - 1
    while at < end:
        byte = text[at]
        if byte == 44 or byte == 32 or byte == 9 or byte == 10 or byte == 13:  # "," or JSON whitespace
            at += 1
            continue
        first = at
        value = np.uint64(0)
        while at < end and 48 <= text[at] <= 57:  # digits
            value = value * _TEN + np.uint64(text[at] - 48)
            at += 1
        if at == first or at - first > 10 or value > _U32_MAX:  # not a digit, or past u32
            return False, tokens[:0]
        tokens[count] = value
        count += 1
    return True, tokens[:count]


# --- the answer ------------------------------------------------------------------------------------


_SCORES = _text('{"scores":{')
_INSTANCES = _text('},"frequencies":[],"instances":{')
_CLOSE_ALL = _text("}}")
_LONGEST = _text('":{"longest_matched":')
_GPU = _text(',"gpu":')
_DP = _text(',"dp":{')
_CPU = _text('},"cpu":')
_DISK = _text(',"disk":')
_OPEN_RANKS = _text('":{')
_LONGEST_ROW = 96  # an instance's text in the answer, numbers and ranks aside
_LONGEST_RANK = 48  # a rank's entry: two numbers of up to 20 digits, quotes, colon, comma


@_inlined
def _put_rank(out, position, first, rank, tokens):
    """`"rank":tokens` after a comma unless `first`."""
    if not first:
        out[position] = 44
        position += 1
    out[position] = 34
    position = _put_integer(out, position + 1, rank)
    out[position] = 34
    out[position + 1] = 58
    return _put_integer(out, position + 2, tokens)


@_inlined
def _put_instance(out, position, first, instance):
    """`"instance` after a comma unless `first`."""
    if not first:
        out[position] = 44
        position += 1
    out[position] = 34
    return _put_integer(out, position + 1, instance)


@_compiled
def scores_json(found, instance_ids, ranks, block_size):
    """Dynamo's answer for `registered_prefixes`' rows, as JSON text: its instances' prefixes in tokens.

    `{"scores": {instance: {rank: device prefix}} (ranks with one only), "frequencies": [],
    "instances": {instance: {longest_matched, gpu, dp: {rank: device prefix}, cpu, disk}}}`,
    `cpu` and `disk` counting the tiers before them too (Mooncake RFC #1403). A plan lists an
    instance's ranks together, so its rows are consecutive.
    """
    rows = found.shape[0]
    out = np.empty(_SCORES.size + _INSTANCES.size + 2 + rows * (_LONGEST_ROW + 3 * _LONGEST_RANK), dtype=np.uint8)
    at = _put(out, 0, _SCORES)
    first_instance = True
    row = 0
    while row < rows:  # "scores": the instances holding a device prefix, by their ranks that do
        instance, end = instance_ids[found[row, 0]], row
        while end < rows and instance_ids[found[end, 0]] == instance:
            end += 1
        first_rank = True
        for item in range(row, end):
            if found[item, 1]:
                if first_rank:
                    at = _put_instance(out, at, first_instance, instance)
                    at = _put(out, at, _OPEN_RANKS)
                    first_instance = False
                at = _put_rank(out, at, first_rank, ranks[found[item, 0]], found[item, 1] * block_size)
                first_rank = False
        if not first_rank:
            out[at] = 125  # "}"
            at += 1
        row = end
    at = _put(out, at, _INSTANCES)
    row = 0
    while row < rows:  # "instances": every instance holding a prefix on any tier
        instance, end = instance_ids[found[row, 0]], row
        gpu, cpu, disk = 0, 0, 0
        while end < rows and instance_ids[found[end, 0]] == instance:
            gpu, cpu, disk = max(gpu, found[end, 1]), max(cpu, found[end, 2]), max(disk, found[end, 3])
            end += 1
        gpu, cpu, disk = gpu * block_size, cpu * block_size, disk * block_size
        at = _put_instance(out, at, row == 0, instance)
        at = _put(out, at, _LONGEST)
        at = _put_integer(out, at, max(gpu, cpu, disk))
        at = _put(out, at, _GPU)
        at = _put_integer(out, at, gpu)
        at = _put(out, at, _DP)
        for item in range(row, end):
            at = _put_rank(out, at, item == row, ranks[found[item, 0]], found[item, 1] * block_size)
        at = _put(out, at, _CPU)
        at = _put_integer(out, at, cpu)
        at = _put(out, at, _DISK)
        at = _put_integer(out, at, disk)
        out[at] = 125  # "}"
        at += 1
        row = end
    at = _put(out, at, _CLOSE_ALL)
    return out[:at]


@_compiled
def block_scores(local, block_size, table_keys, table_rows, table_bits, holders, spilled, worker_count, slots,
                 instance_ids, ranks):
    """The answer's JSON text for a request's local block hashes: walked, then written."""
    found = registered_prefixes(table_keys, table_rows, table_bits, holders, spilled, local, worker_count, slots)
    return scores_json(found, instance_ids, ranks, block_size)


@_compiled
def token_scores(tokens, seed, block_size, table_keys, table_rows, table_bits, holders, spilled, worker_count, slots,
                 instance_ids, ranks):
    """The answer's JSON text for a request's token ids: its full blocks hashed (`token_block_hashes`), walked,
    then written."""
    return block_scores(token_block_hashes(tokens, block_size, seed), block_size, table_keys, table_rows, table_bits,
                        holders, spilled, worker_count, slots, instance_ids, ranks)
