"""How decide's kernels are compiled: numba, cached on disk in a folder that is writable.

Every kernel module decorates with `compiled` or `inlined` from here, so the cache folder
is set before any of them is decorated, whichever is imported first.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numba


def kernel_cache_dir() -> str:
    """Where compiled kernels are kept: numba's NUMBA_CACHE_DIR when set, else a folder of
    the user's cache, else one in the temporary directory (site-packages is often not writable)."""
    if numba.config.CACHE_DIR:
        return numba.config.CACHE_DIR
    user = f"-{os.getuid()}" if hasattr(os, "getuid") else ""
    for candidate in (Path.home() / ".cache" / "kvledger" / "kernels",
                      Path(tempfile.gettempdir()) / f"kvledger-kernels{user}"):
        try:
            candidate.mkdir(parents=True, exist_ok=True)
            if os.access(candidate, os.W_OK):
                return str(candidate)
        except (OSError, RuntimeError):  # RuntimeError: no home directory to be found
            continue
    return ""  # numba then tries beside the source and in its own user-wide folder


# Read by numba when each kernel below is decorated.
numba.config.CACHE_DIR = kernel_cache_dir()
compiled = numba.njit(cache=True, nogil=True)
# Small helpers are inlined where they are used: a call that passes arrays pays their
# reference counts (atomic), which cost more than what the helpers do.
inlined = numba.njit(cache=True, nogil=True, inline="always")

