"""How decide's kernels are compiled: numba, cached on disk in a folder that is writable.

Every kernel module decorates with `compiled` or `inlined` from here, so the cache folder
is set before any of them is decorated, whichever is imported first.
"""

from __future__ import annotations

import ctypes
import gc
import os
import tempfile
from pathlib import Path

import llvmlite.binding as llvm
import numba
from numba.core.codegen import CPUCodeLibrary, JITCodeLibrary


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


# --- the IR numba keeps beside each kernel loaded from the cache ----------------------------------------
#
# numba keeps, beside each kernel it loads from the cache, the kernel's whole LLVM IR as a parsed module:
# needed only to link that kernel into another compiled later, never to run it. Parsed, it takes about
# four times its bitcode (decide's kernels: about 24 MB resident against 6.6 MB of bitcode). `release_linking_ir`
# keeps the bitcode instead, and a later compile that links one of them parses it again.

_module_for_linking = CPUCodeLibrary._get_module_for_linking


def _module_for_linking_again(library: CPUCodeLibrary):
    bitcode = library.__dict__.pop("_linking_bitcode", None)
    if bitcode is not None and library._shared_module is None:
        library._shared_module = llvm.parse_bitcode(bitcode)
    return _module_for_linking(library)


CPUCodeLibrary._get_module_for_linking = _module_for_linking_again


def release_linking_ir() -> int:
    """Replace the parsed IR kept beside every kernel loaded so far by its bitcode; the libraries released.
    Called once a service has loaded its kernels (and before it forks readers, which then share less)."""
    released = 0
    for library in gc.get_objects():
        if type(library) is not JITCodeLibrary:  # (weak proxies to the libraries pass isinstance)
            continue
        module = library._shared_module
        # A kernel compiled in this process may share its final module, which the JIT engine owns.
        if module is None or module is library._final_module:
            continue
        library._linking_bitcode = module.as_bitcode()
        library._shared_module = None
        module.close()
        released += 1
    _trim_heap()
    return released


def _trim_heap() -> None:
    """Hand the heap's free pages back to the system (glibc keeps what LLVM freed otherwise)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


# --- the compiler's own pages, once every kernel is loaded ------------------------------------------------
#
# Loading kernels runs LLVM (llvmlite's library, about 150 MB of code and tables): about 70 MB of it stays
# resident though nothing runs it again while decide answers, since the kernels are called without it.
# `page_out_compiler` asks the kernel to reclaim those pages now (MADV_PAGEOUT, Linux 5.4+). They are clean
# copies of the file, so this changes nothing but residency: a later compile reads them back from disk.

_MADV_PAGEOUT = 21
_COMPILER_LIBRARY = "libllvmlite"


def page_out_compiler() -> int:
    """Bytes of the compiler's read-only mappings whose pages were asked back (0 where the system cannot)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
        with open("/proc/self/maps") as maps:
            lines = maps.read().splitlines()
    except (OSError, AttributeError):  # not Linux, or no madvise
        return 0
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    asked = 0
    for line in lines:
        fields = line.split()
        if len(fields) < 6 or _COMPILER_LIBRARY not in fields[5] or "w" in fields[1]:
            continue
        start, end = (int(bound, 16) for bound in fields[0].split("-"))
        if madvise(start, end - start, _MADV_PAGEOUT) == 0:  # EINVAL before Linux 5.4: left as it is
            asked += end - start
    return asked
