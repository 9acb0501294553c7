"""Large arrays whose memory goes back to the system when they are dropped, and is only taken as it is written.

Two reasons for a mapping of their own. A table replaced by a larger one: from the C heap,
the old one's memory stayed in the process (the allocator raises its mapping threshold
after the first large free), so resident memory kept the high-water mark of every growth;
a mapping goes back when it is dropped. And a ring filled slowly: the system commits a
mapping's pages as they are first written, so an array sized for its limit costs only what
it holds.
"""

from __future__ import annotations

import mmap
import struct

# Below this an array comes from the C heap as usual (numpy's own allocator).
_MAPPED_FROM = 1 << 20


def mapped_words(count: int, typecode: str) -> memoryview:
    """`count` zeroed items of a `struct` typecode ("q", "Q", ...) in a mapping of their own, as Python ints."""
    return memoryview(mmap.mmap(-1, max(count, 1) * struct.calcsize(typecode))).cast(typecode)


def mapped_zeros(shape: int | tuple[int, ...], dtype: type, *, mapped_from: int = _MAPPED_FROM):
    """A zeroed numpy array in a mapping of its own when it is `mapped_from` bytes or more."""
    import numpy as np  # here, not above: ingest uses `mapped_words` and does not load numpy

    count = int(np.prod(shape))
    nbytes = count * np.dtype(dtype).itemsize
    if nbytes < mapped_from or nbytes == 0:
        return np.zeros(shape, dtype=dtype)
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=count).reshape(shape)
