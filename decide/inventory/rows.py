"""Who holds each row's sequence hash, in which classes: a short list, or a bitmask row beyond it.

A row of the index is one sequence hash. Most are held by a few workers, whatever the
fleet's size, so a row lists its holders: `INLINE` entries of 32 bits, each a worker's
slot and the classes it holds the hash in (`slot << 4 | planes`, plane bit p for class p
of `decide.inventory.index.CLASSES`; 0: no entry; the entries packed at the front). A row with more
holders than that spills into a bitmask row of a pool (four planes of `words` 64-bit words,
a bit per worker, as the index kept every row before), and its first entry then names it
(`dense << 4`, no plane bits). At 1 024 workers a bitmask row is 512 bytes, a listed row 32.

The kernels read and change a row however it is kept; `row_word` gives the ranking walk one
word of a row's planes as bitmasks, so the walk itself is the same for both (`load_planes`,
every word, is the device's copy). Compiled by numba and cached with the other kernels.
"""

from __future__ import annotations

import numpy as np

from kvledger.decide.compiled import compiled as _compiled, inlined as _inlined


INLINE = 8  # holders listed in a row before it spills into a bitmask row
PLANES = 4
# Results of changing one bit (EMPTIED: cleared, and the row is held by no one now).
UNCHANGED, CHANGED, NO_ROOM, EMPTIED = 0, 1, 2, 3

_PLANE_BITS = np.uint32(15)
_FOUR = np.uint32(4)
_ONE = np.uint64(1)
_ZERO_WORD = np.uint64(0)


def spilled_into(first_entry: int) -> int:
    """`spilled_row` from Python, given the row's first entry."""
    return first_entry >> 4 if first_entry and not first_entry & 15 else 0


@_inlined
def spilled_row(holders, row):
    """The pool row a row spilled into, 0 when it lists its holders."""
    first = holders[row, 0]
    if first != 0 and (first & _PLANE_BITS) == 0:
        return np.int64(first >> _FOUR)
    return np.int64(0)


@_inlined
def has_bit(holders, spilled, row, position, slot):
    """Whether worker `slot` holds row `row` in class `position`."""
    dense = spilled_row(holders, row)
    if dense:
        return (spilled[dense, position, slot >> 6] >> np.uint64(slot & 63)) & _ONE != 0
    for k in range(holders.shape[1]):
        entry = holders[row, k]
        if entry == 0:
            return False
        if np.int64(entry >> _FOUR) == slot:
            return (entry >> np.uint32(position)) & np.uint32(1) != 0
    return False


@_inlined
def change_bit(holders, spilled, row, position, slot, wanted):
    """Set (`wanted`) or clear one bit of an existing row: UNCHANGED, CHANGED, EMPTIED (the
    row's last bit cleared), or NO_ROOM (a listed row that is full; the caller spills it and
    asks again)."""
    dense = spilled_row(holders, row)
    if dense:
        word = slot >> 6
        flag = _ONE << np.uint64(slot & 63)
        held = spilled[dense, position, word] & flag != 0
        if held == wanted:
            return UNCHANGED
        if wanted:
            spilled[dense, position, word] |= flag
            return CHANGED
        spilled[dense, position, word] &= ~flag
        for plane in range(PLANES):
            for other in range(spilled.shape[2]):
                if spilled[dense, plane, other]:
                    return CHANGED
        return EMPTIED
    plane = np.uint32(1) << np.uint32(position)
    listed = holders.shape[1]
    for k in range(listed):
        entry = holders[row, k]
        if entry == 0:
            if not wanted:
                return UNCHANGED
            holders[row, k] = (np.uint32(slot) << _FOUR) | plane
            return CHANGED
        if np.int64(entry >> _FOUR) != slot:
            continue
        if ((entry & plane) != 0) == wanted:
            return UNCHANGED
        if wanted:
            holders[row, k] = entry | plane
            return CHANGED
        entry &= ~plane
        if entry & _PLANE_BITS:
            holders[row, k] = entry
            return CHANGED
        # The worker holds the hash in no class now: the last entry takes its place.
        last = k
        while last + 1 < listed and holders[row, last + 1] != 0:
            last += 1
        holders[row, k] = holders[row, last]
        holders[row, last] = 0
        return CHANGED if holders[row, 0] else EMPTIED
    return NO_ROOM if wanted else UNCHANGED


@_compiled
def change_bits(holders, spilled, rows, positions, slots, wanted, status):
    """`change_bit` for each (row, position, slot); `status[i]` says what became of item i.
    Rows not made yet (MISSING_ROW, 0) are left."""
    for item in range(rows.size):
        row = rows[item]
        if row == 0:
            status[item] = UNCHANGED
            continue
        status[item] = change_bit(holders, spilled, row, positions[item], slots[item], wanted)


@_compiled
def change_worker_bits(holders, spilled, rows, position, slot, wanted, status):
    """`change_bits` for one worker's bit of one class in each of `rows` (an event's blocks);
    returns how many rows had NO_ROOM, so the common case costs its caller no scan."""
    full = 0
    for item in range(rows.size):
        row = rows[item]
        if row == 0:
            status[item] = UNCHANGED
            continue
        status[item] = change_bit(holders, spilled, row, position, slot, wanted)
        if status[item] == NO_ROOM:
            full += 1
    return full


@_compiled
def spill(holders, spilled, row, dense):
    """Move a listed row's holders into pool row `dense` (all zero), which it names from now on."""
    for k in range(holders.shape[1]):
        entry = holders[row, k]
        if entry == 0:
            break
        slot = np.int64(entry >> _FOUR)
        for position in range(PLANES):
            if (entry >> np.uint32(position)) & np.uint32(1):
                spilled[dense, position, slot >> 6] |= _ONE << np.uint64(slot & 63)
        holders[row, k] = 0
    holders[row, 0] = np.uint32(dense) << _FOUR


@_inlined
def row_word(holders, spilled, row, word):
    """Word `word` of row `row`'s planes as four scalars (native device, host, disk; retained
    device), however the row is kept: what the ranking walk reads, one word at a time."""
    dense = spilled_row(holders, row)
    if dense:
        return spilled[dense, 0, word], spilled[dense, 1, word], spilled[dense, 2, word], spilled[dense, 3, word]
    device, host, disk, retained = _ZERO_WORD, _ZERO_WORD, _ZERO_WORD, _ZERO_WORD
    for k in range(holders.shape[1]):
        entry = holders[row, k]
        if entry == 0:
            break
        slot = np.int64(entry >> _FOUR)
        if slot >> 6 != word:
            continue
        flag = _ONE << np.uint64(slot & 63)
        if entry & np.uint32(1):
            device |= flag
        if entry & np.uint32(2):
            host |= flag
        if entry & np.uint32(4):
            disk |= flag
        if entry & np.uint32(8):
            retained |= flag
    return device, host, disk, retained


@_inlined
def load_planes(holders, spilled, row, planes):
    """Row `row` as bitmask planes into `planes` (PLANES × words), whichever way it is kept."""
    for word in range(planes.shape[1]):
        planes[0, word], planes[1, word], planes[2, word], planes[3, word] = row_word(holders, spilled, row, word)


@_compiled
def rows_with_bit(holders, spilled, rows_used, position, slot):
    """The rows (of the first `rows_used`) where worker `slot` holds its hash in class `position`."""
    found = np.empty(rows_used, dtype=np.int64)
    count = 0
    for row in range(1, rows_used):
        if holders[row, 0] != 0 and has_bit(holders, spilled, row, position, slot):
            found[count] = row
            count += 1
    return found[:count].copy()


@_compiled
def dense_planes(holders, spilled, rows, words):
    """Rows as bitmask planes (rows × PLANES × words): what the device mirror holds."""
    out = np.zeros((rows.size, PLANES, words), dtype=np.uint64)
    for item in range(rows.size):
        load_planes(holders, spilled, rows[item], out[item])
    return out


def warm_up() -> None:
    """Compile (or load) every kernel here, on arrays of the types the index passes."""
    holders = np.zeros((4, INLINE), dtype=np.uint32)
    spilled = np.zeros((2, PLANES, 1), dtype=np.uint64)
    rows = np.array([1], dtype=np.int32)
    status = np.empty(1, dtype=np.int8)
    one = np.zeros(1, dtype=np.int64)
    change_bits(holders, spilled, rows, one, one, True, status)
    change_worker_bits(holders, spilled, rows, 0, 0, False, status)
    spill(holders, spilled, 1, 1)
    rows_with_bit(holders, spilled, 4, 0, 0)
    dense_planes(holders, spilled, rows, 1)
