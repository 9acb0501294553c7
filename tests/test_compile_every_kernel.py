"""`compile_every_kernel(side_by_side=True)` (the service image's build): half the kernels compiled in a second
process, written to the kernel cache and loaded from it; where no second process can start, this one compiles
both halves and says so. Run in a child process each, with the kernel cache the suite uses (warm after the
first run, so each takes seconds)."""

from __future__ import annotations

import subprocess
import sys

SIDE_BY_SIDE = """
from kvledger.core.settings import ReuseSettings
from kvledger.decide.serving.service import compile_every_kernel
compile_every_kernel(ReuseSettings(), side_by_side=True)
print("compiled")
"""

# The spawned process cannot start: the context's Process refuses, as a sandbox without processes would.
NO_SECOND_PROCESS = """
import logging, multiprocessing
from multiprocessing.context import SpawnContext, SpawnProcess
from kvledger.core.settings import ReuseSettings
from kvledger.decide.serving import service

class Refused(SpawnProcess):
    def start(self):
        raise OSError("no processes here")

class NoProcesses(SpawnContext):
    Process = Refused

logging.basicConfig(level=logging.WARNING, format="%(message)s")
service.multiprocessing.get_context = lambda method=None: NoProcesses()
service.compile_every_kernel(ReuseSettings(), side_by_side=True)
print("compiled")
"""


def _run(program: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=600)


def test_the_side_by_side_compile_spawns_its_second_process_and_ends_well() -> None:
    result = _run(SIDE_BY_SIDE)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "compiled"


def test_without_a_second_process_one_compiles_both_halves_and_says_so() -> None:
    result = _run(NO_SECOND_PROCESS)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "compiled"
    assert "kernels compiled in one process (no second one: no processes here)" in result.stderr
