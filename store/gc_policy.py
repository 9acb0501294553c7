"""How often Python's cyclic garbage collector runs in store's processes.

The fold keeps every held block alive as objects, and each projected transaction's rows
live for a batch or two. At CPython's default (a young collection every 700 net
allocations) those rows survive into the old generation, which then fills fast enough
to trigger full collections that walk the whole fold: about a third of the projector's
CPU at 1 000 000 blocks. Collecting the young generation less often lets the rows die
by reference counting first; block data holds no reference cycles, so the larger young
generation costs little memory.
"""

from __future__ import annotations

import gc

YOUNG_COLLECTION_THRESHOLD = 50_000


def defer_young_collections(threshold: int = YOUNG_COLLECTION_THRESHOLD) -> None:
    """Raise the young-generation threshold to `threshold`; never lower one already higher.

    Interpreter-wide: under `kvledger up` the other stages in the process share it.
    """
    young, *older = gc.get_threshold()
    if young and young < threshold:  # 0 means collection was disabled on purpose: leave it
        gc.set_threshold(threshold, *older)
