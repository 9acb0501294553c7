"""A child process that ends with its parent: the kernel's parent-death signal (Linux), and a process's name.

Kept apart from `lifetime` so that a lean child (store's writer) imports nothing else to use it.
"""

from __future__ import annotations

import ctypes
import os

# Looked up at import, never in a forked child: loading a library there can deadlock on a lock another thread
# of the parent held when it forked.
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # no prctl: not Linux
    _prctl = None
_PR_SET_PDEATHSIG, _PR_SET_NAME = 1, 15


def end_with_parent(signum: int, parent: int) -> bool:
    """Ask the kernel for `signum` to this process when the thread of `parent` that started it ends, even by
    kill -9 (Linux's parent-death signal); False when `parent` had already ended (the caller leaves: nothing
    would signal it). Safe between fork and exec. Where there is no such signal, True: nothing is asked."""
    if _prctl is None:
        return True
    _prctl(_PR_SET_PDEATHSIG, signum)
    return os.getppid() == parent


def name_process(name: bytes) -> None:
    """This process's name as `ps -o comm` and /proc/PID/comm show it (15 bytes at most; Linux only)."""
    if _prctl is not None:
        _prctl(_PR_SET_NAME, ctypes.c_char_p(name))
