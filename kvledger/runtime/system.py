"""Running several services in one process: `kvledger up` and `kvledger demo`.

The stages are handed in as plain async callables by kvledger/app/cli.py (the one place that
imports them), so this module knows lifetimes, not stages.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

from kvledger.core.settings import LoadedSettings

log = logging.getLogger("kvledger.up")

# A service runs until `stop` is set, then returns after shutting down cleanly.
Service = Callable[[asyncio.Event], Awaitable[None]]

DEFAULT_DATA_DIR = ".kvledger"


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
