"""Running several services together: `kvledger up` and `kvledger demo`.

The stages are handed in as plain async callables by kvledger/app/cli.py (the one place that
imports them), so this module knows lifetimes, not stages. A service may run in a child process
of its own (`in_own_process`): its own interpreter, so its Python does not queue for this
process's GIL behind the others'.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

from kvledger.core.settings import LoadedSettings
from kvledger.runtime.parent_death import end_with_parent, name_process

log = logging.getLogger("kvledger.up")

# A service runs until `stop` is set, then returns after shutting down cleanly.
Service = Callable[[asyncio.Event], Awaitable[None]]

DEFAULT_DATA_DIR = ".kvledger"

# How long a child service has to end after SIGTERM before it is killed.
CHILD_STOP_TIMEOUT_S = 30.0


def local_overrides(loaded: LoadedSettings, data_dir: str | Path) -> dict[str, object]:
    """Where `up` keeps its state when no external service was named: SQLite under `data_dir`."""
    overrides: dict[str, object] = {}
    if loaded.sources["db.url"] == "default":
        overrides["db.url"] = f"sqlite:///{Path(data_dir) / 'ledger.db'}"
    return overrides


def wants_embedded_nats(loaded: LoadedSettings) -> bool:
    """`up` starts its own nats-server unless a NATS URL was given (flag, file or environment)."""
    return loaded.sources["nats.url"] == "default"


def install_stop_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)


async def run_services(services: Mapping[str, Service], stop: asyncio.Event) -> None:
    """Run every service until `stop`; if one fails, stop the others and raise its error."""

    async def guarded(name: str, service: Service) -> None:
        try:
            await service(stop)
        except BaseException:
            log.error("%s failed; stopping everything", name)
            stop.set()
            raise
        if not stop.is_set():
            log.error("%s ended on its own; stopping everything", name)
            stop.set()

    async with asyncio.TaskGroup() as group:
        for name, service in services.items():
            group.create_task(guarded(name, service), name=name)


def in_own_process(name: str, target: Callable[..., None], *args: object) -> Service:
    """A service that runs `target(*args)` (a module-level function: it is pickled by name) in a spawned child
    process named `kvledger-<name>` (as `ps -o comm` shows it). The child gets SIGTERM when `stop` is set, and
    from the kernel when this process dies (even by kill -9), and is expected to end cleanly on it; one that
    outlives CHILD_STOP_TIMEOUT_S is killed. A child that ends before `stop` is set fails the service with its
    exit code."""

    async def service(stop: asyncio.Event) -> None:
        process = multiprocessing.get_context("spawn").Process(
            target=_child, args=(os.getpid(), f"kvledger-{name}", target, args), name=f"kvledger-{name}", daemon=True,
        )
        process.start()
        loop = asyncio.get_running_loop()
        ended = asyncio.Event()
        loop.add_reader(process.sentinel, ended.set)
        try:
            stopping = asyncio.ensure_future(stop.wait())
            waiting = asyncio.ensure_future(ended.wait())
            try:
                await asyncio.wait({stopping, waiting}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stopping.cancel()
                waiting.cancel()
                if process.is_alive():
                    process.terminate()
                    try:
                        await asyncio.wait_for(ended.wait(), CHILD_STOP_TIMEOUT_S)
                    except TimeoutError:
                        log.error("%s did not end %g s after SIGTERM; killing it", name, CHILD_STOP_TIMEOUT_S)
                        process.kill()
        finally:
            loop.remove_reader(process.sentinel)
            await asyncio.to_thread(process.join)
        if not stop.is_set():
            raise ChildProcessError(f"{name} (pid {process.pid}) ended with exit code {process.exitcode}")

    return service


def _child(parent: int, name: str, target: Callable[..., None], args: tuple) -> None:
    name_process(name.encode()[:15])
    if not end_with_parent(signal.SIGTERM, parent):  # the parent ended before the signal was asked for
        return
    target(*args)
