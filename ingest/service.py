"""`kvledger ingest`: run the bridge until SIGTERM or Ctrl-C, then shut down cleanly."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from kvledger.core.settings import Settings
from kvledger.ingest.bridge import Bridge
from kvledger.ingest.endpoints import EndpointError, parse_endpoints, stream_sources
from kvledger.runtime.entry import run_stage
from kvledger.runtime.nats_options import describe_server
from kvledger.runtime.system import install_stop_signals

log = logging.getLogger("kvledger.ingest")


def sources_from(settings: Settings, publishers: Sequence[str]):
    """The engine streams to follow, from `ingest.endpoints` (flags or file) and `--publisher` names."""
    endpoints = parse_endpoints(settings.ingest.endpoints, publishers, settings.ingest.publisher)
    if not endpoints:
        raise EndpointError("no endpoints: give --endpoint tcp://HOST:PORT --publisher NAME (or ingest.endpoints)")
    return stream_sources(endpoints)


async def serve(settings: Settings, publishers: Sequence[str]) -> None:
    sources = sources_from(settings, publishers)
    stop = asyncio.Event()
    install_stop_signals(stop)
    bridge = Bridge(settings, sources)
    if not await _start_unless_stopped(bridge, stop):
        log.info("ingest: stopped while starting")
        return
    try:
        log.info(
            "ingest: %d engine streams -> %s (metrics and health on :%d)",
            len(sources), describe_server(settings.nats), bridge.http_port,
        )
        # Stop, or publishing failing for good, ends the wait at any time, readiness included.
        stopped = asyncio.ensure_future(stop.wait())
        failed = asyncio.ensure_future(bridge.wait_failed())
        ready = asyncio.ensure_future(bridge.wait_ready())
        try:
            done, _ = await asyncio.wait({stopped, failed, ready}, return_when=asyncio.FIRST_COMPLETED)
            if ready in done and not stopped.done():
                ready.result()
                log.info("ingest: ready")
                done, _ = await asyncio.wait({stopped, failed}, return_when=asyncio.FIRST_COMPLETED)
            if failed in done:
                failed.result()
        finally:
            for waiter in (stopped, failed, ready):
                waiter.cancel()
        log.info("ingest: stopping, flushing unacknowledged batches")
    finally:
        await bridge.close()


async def _start_unless_stopped(bridge: Bridge, stop: asyncio.Event) -> bool:
    """Start `bridge`; a stop that comes first (NATS slow or away) cancels the start instead of waiting it out.

    False when stopped: the bridge is closed then, whether or not its start had finished.
    """
    starting = asyncio.ensure_future(bridge.__aenter__())  # a start that fails or is cancelled closes itself
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if not stop.is_set():
        starting.result()  # re-raises a failed start (a refused login, a stream conflict)
        return True
    starting.cancel()
    await asyncio.wait({starting})
    if not starting.cancelled() and starting.exception() is None:
        await bridge.close()  # it had started (or the cancel was swallowed on the way): close it all the same
    return False


def run(settings: Settings, publishers: Sequence[str]) -> int:
    return run_stage("ingest", lambda: serve(settings, publishers), refusals=(EndpointError,), failures=(TimeoutError,))
