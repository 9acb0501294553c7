"""A service in a child process of its own (kvledger.runtime.system.in_own_process): how it starts, ends and fails."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from kvledger.runtime import system


def _exit_with(code: int) -> None:
    sys.exit(code)


def _until_sigterm(marker: str) -> None:
    """Writes its pid, then waits for SIGTERM, on which it writes "stopped" and ends cleanly."""
    stopped = False

    def on_term(signum, frame) -> None:
        nonlocal stopped
        stopped = True

    signal.signal(signal.SIGTERM, on_term)
    Path(marker).write_text(str(os.getpid()))
    while not stopped:
        time.sleep(0.01)
    Path(marker).write_text("stopped")


def _deaf_to_sigterm(marker: str) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    Path(marker).write_text(str(os.getpid()))
    time.sleep(600)


async def _started(marker: Path) -> int:
    deadline = time.monotonic() + 60
    while not marker.exists() or not marker.read_text():
        assert time.monotonic() < deadline, "the child did not start"
        await asyncio.sleep(0.02)
    return int(marker.read_text())


def _comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def test_a_child_that_ends_on_its_own_fails_the_service_with_its_exit_code() -> None:
    service = system.in_own_process("early", _exit_with, 3)
    with pytest.raises(ChildProcessError, match=r"early \(pid \d+\) ended with exit code 3"):
        asyncio.run(service(asyncio.Event()))


def test_stop_ends_the_child_by_sigterm_and_the_service_returns(tmp_path) -> None:
    marker = tmp_path / "pid"

    async def main() -> None:
        stop = asyncio.Event()
        running = asyncio.create_task(system.in_own_process("waiter", _until_sigterm, str(marker))(stop))
        pid = await _started(marker)
        assert _comm(pid) == "kvledger-waiter"
        stop.set()
        await asyncio.wait_for(running, 30)

    asyncio.run(main())
    assert marker.read_text() == "stopped"  # it ended by its own handler, cleanly


def test_a_child_deaf_to_sigterm_is_killed_after_the_stop_timeout(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(system, "CHILD_STOP_TIMEOUT_S", 0.5)
    marker = tmp_path / "pid"

    async def main() -> int:
        stop = asyncio.Event()
        running = asyncio.create_task(system.in_own_process("deaf", _deaf_to_sigterm, str(marker))(stop))
        pid = await _started(marker)
        stop.set()
        started = time.monotonic()
        await asyncio.wait_for(running, 30)
        assert time.monotonic() - started < 10
        return pid

    pid = asyncio.run(main())
    assert not Path(f"/proc/{pid}").exists()  # killed and reaped


def test_run_services_stops_everything_when_a_child_service_fails() -> None:
    stopped_cleanly = []

    async def neighbour(stop: asyncio.Event) -> None:
        await stop.wait()
        stopped_cleanly.append(True)

    services = {"early": system.in_own_process("early", _exit_with, 1), "neighbour": neighbour}
    with pytest.raises(ExceptionGroup) as raised:
        asyncio.run(system.run_services(services, asyncio.Event()))
    assert raised.group_contains(ChildProcessError)
    assert stopped_cleanly == [True]
