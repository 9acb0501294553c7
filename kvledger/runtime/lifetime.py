"""`async with` for long-lived things that have an async `start()` and `close()`, and stopping child processes."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections.abc import Iterable
from typing import Self

RECANCEL_S = 0.1  # how long a cancelled task may run on before it is cancelled again


class AsyncLifetime:
    """Opens with `start()`, closes with `close()`; a start that fails is closed before the error goes up."""

    async def start(self) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


async def cancel_and_wait(tasks: Iterable[asyncio.Task]) -> None:
    """Cancel `tasks` and return once every one has ended, cancelling again any that runs on.

    One cancel is not always enough: Python 3.11's asyncio.wait_for, inside every nats-py
    request and connect, returns a result that arrived in the same loop turn and drops the
    cancellation, so the task carries on as if never cancelled. For tasks whose cleanup does
    not itself wait long: a repeated cancel cuts a slow one short. The tasks' own errors are
    not raised here (closing must not hide the caller's); the caller's cancellation is.
    """
    tasks = list(tasks)
    pending = {task for task in tasks if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_S)
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()  # retrieved: no "exception was never retrieved" at garbage collection


def stop_process(process: subprocess.Popen, *, timeout_s: float, stop_signal: int = signal.SIGTERM) -> None:
    """Ask a child process to stop with `stop_signal`; SIGKILL it if it has not exited within `timeout_s`."""
    if process.poll() is not None:
        return
    process.send_signal(stop_signal)
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
