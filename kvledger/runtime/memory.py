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
import os
import struct
import weakref

import attrs

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


# --- arrays other processes of this host can map --------------------------------------------------


class SharedArrays:
    """Allocates zeroed numpy arrays in anonymous shared memory (memfd) that other processes of the same user
    map read-only, by `SharedArrays.handle(array)` → `map_shared(handle)`.

    Each array is one memfd named `kvledger-<pid>-<serial>`, kept open while the array lives (its descriptor
    is how another process finds it: `/proc/<pid>/fd/<fd>`). The serial is never reused, so a process that
    reopens a descriptor number taken over by a newer file sees another name and refuses it; a file unlike
    the handle's size is refused too. Linux only (memfd and /proc).
    """

    def __init__(self) -> None:
        self._serial = 0
        self._pid = os.getpid()
        self._handles: dict[int, SharedHandle] = {}  # by id() of the array's mmap

    def zeros(self, shape: int | tuple[int, ...], dtype: type):
        import numpy as np

        count = int(np.prod(shape))
        nbytes = max(count * np.dtype(dtype).itemsize, 1)
        self._serial += 1
        name = f"kvledger-{self._pid}-{self._serial}"
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            mapping = mmap.mmap(fd, nbytes)
        except BaseException:
            os.close(fd)
            raise
        shape_tuple = tuple(int(size) for size in np.atleast_1d(np.array(shape)))
        handle = SharedHandle(self._pid, fd, name, shape_tuple, np.dtype(dtype).str)
        key = id(mapping)
        self._handles[key] = handle
        weakref.finalize(mapping, self._forget, key, fd)
        return np.frombuffer(mapping, dtype=dtype, count=count).reshape(shape)

    def _forget(self, key: int, fd: int) -> None:
        self._handles.pop(key, None)
        os.close(fd)

    def handle(self, array) -> SharedHandle:
        """The handle of an array `zeros` made (or a view of one)."""
        base = array
        while base is not None and not isinstance(base, mmap.mmap):
            base = base.obj if isinstance(base, memoryview) else getattr(base, "base", None)
        handle = self._handles.get(id(base)) if base is not None else None
        if handle is None:
            raise ValueError("not an array of this allocator")
        return handle


@attrs.frozen
class SharedHandle:
    """Where another process finds a shared array: the owner's pid and descriptor, the memfd's name, its shape."""

    pid: int
    fd: int
    name: str
    shape: tuple[int, ...]
    dtype: str  # numpy's dtype.str, e.g. "<u8"


class SharedArrayGone(Exception):
    """The array a handle names is no longer there (dropped by its owner, or the owner gone)."""


def map_shared(handle: SharedHandle):
    """The array a handle names, mapped read-only; raises SharedArrayGone when it is no longer there."""
    import numpy as np

    path = f"/proc/{handle.pid}/fd/{handle.fd}"
    try:
        if os.readlink(path) != f"/memfd:{handle.name} (deleted)":
            raise SharedArrayGone(f"{path} is no longer {handle.name}")
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as error:
        raise SharedArrayGone(f"{handle.name}: {error}") from None
    try:
        count = int(np.prod(handle.shape))
        nbytes = max(count * np.dtype(handle.dtype).itemsize, 1)
        if os.fstat(fd).st_size != nbytes:
            raise SharedArrayGone(f"{handle.name} is not {nbytes} bytes")
        mapping = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    return np.frombuffer(mapping, dtype=handle.dtype, count=count).reshape(handle.shape)
