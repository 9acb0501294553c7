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

import contextlib
import gc
from collections.abc import Iterator

YOUNG_COLLECTION_THRESHOLD = 50_000


def defer_young_collections(threshold: int = YOUNG_COLLECTION_THRESHOLD) -> tuple[int, ...]:
    """Raise the young-generation threshold to `threshold` (never lower it); returns the previous thresholds.

    Interpreter-wide: under `kvledger up` the other stages in the process share it.
    """
    previous = gc.get_threshold()
    young, *older = previous
    if young and young < threshold:  # 0 means collection was disabled on purpose: leave it
        gc.set_threshold(threshold, *older)
    return previous


@contextlib.contextmanager
def young_collections_deferred(threshold: int = YOUNG_COLLECTION_THRESHOLD) -> Iterator[None]:
    """`defer_young_collections` for as long as the block runs (the store service's lifetime)."""
    previous = defer_young_collections(threshold)
    raised = gc.get_threshold()
    try:
        yield
    finally:
        if gc.get_threshold() == raised:  # someone else changed it meanwhile: theirs stands
            gc.set_threshold(*previous)
