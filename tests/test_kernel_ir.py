"""Once its kernels are loaded, decide keeps each one's IR as bitcode, not parsed (`release_linking_ir`), and
has LLVM's pages reclaimed (`page_out_compiler`): the kernels still run, and a kernel compiled afterwards that
calls a released one still links it."""

from __future__ import annotations

import subprocess
import sys

PROGRAM = """
import numba, numpy as np
from kvledger.decide.compiled import page_out_compiler, release_linking_ir
from kvledger.decide.inventory.chain import chain_hashes

local = np.arange(1, 8, dtype=np.uint64)
offsets = np.array([0, 3, 7], dtype=np.int64)
expected = chain_hashes(local, offsets)  # loaded (or compiled) and run: its library holds its IR
released = release_linking_ir()
assert released >= 1, released
assert release_linking_ir() == 0  # nothing left to release
assert page_out_compiler() > 0  # LLVM's read-only mappings (Linux 5.4 and later)
assert (chain_hashes(local, offsets) == expected).all()

@numba.njit
def twice(local, offsets):  # links chain_hashes' library: its IR parsed again from the bitcode kept
    return chain_hashes(local, offsets) ^ chain_hashes(local, offsets)

assert (twice(local, offsets) == 0).all()
print(released)
"""


def test_kernels_run_and_link_after_their_ir_and_the_compiler_are_let_go() -> None:
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert int(done.stdout) >= 1
