"""The SUB side of one engine rank, ready only once the ZMQ handshake with the publisher is done.

ZMQ's slow joiner: a SUB that has not finished connecting drops whatever the publisher
sends meanwhile, silently. The socket monitor tells when the handshake succeeded; only
then does the subscriber call itself ready, and callers await that instead of sleeping.
"""

from __future__ import annotations

import asyncio
import logging
import time

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvledger.runtime.lifetime import cancel_and_wait

log = logging.getLogger("kvledger.ingest.subscriber")


class EngineSubscriber:
    """A SUB socket to one publisher endpoint, with reconnect, heartbeats and observable readiness."""

    def __init__(self, endpoint: str, context: zmq.asyncio.Context, *, heartbeat_ms: int = 1000) -> None:
        self.endpoint = endpoint
        self._context = context
        self._heartbeat_ms = heartbeat_ms
        self.connected = asyncio.Event()  # handshake done, not since disconnected
        self.dropped = asyncio.Event()  # disconnected, not since reconnected
        self.handshakes = 0
        # When the connection last dropped (loop time and wall clock; None while connected or
        # before the first handshake): where an engine's silence is counted from (ingest/liveness.py).
        self.disconnected_at: float | None = None
        self.disconnected_wall: float | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._monitor_task: asyncio.Task | None = None

    async def __aenter__(self) -> EngineSubscriber:
        sock = self._context.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        # ZMTP heartbeats notice a publisher that vanished without closing its connection, or
        # froze (SIGSTOP): its ZMQ I/O thread stops answering them too.
        sock.setsockopt(zmq.HEARTBEAT_IVL, self._heartbeat_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, self._heartbeat_ms * 3)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self._monitor_task = asyncio.create_task(self._watch(), name=f"monitor-{self.endpoint}")
        sock.connect(self.endpoint)
        self._sock = sock
        self._direct = zmq.Socket.shadow(sock.underlying)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        try:
            if self._monitor_task is not None:
                # Not `except CancelledError: pass` around an await: that would swallow our caller's cancel too.
                await cancel_and_wait([self._monitor_task])
        finally:
            # Closed whatever happens above, so no socket outlives us to block the context's term.
            if self._sock is not None:
                self._sock.disable_monitor()  # while the monitor's PAIR is still open to take the stop event
                self._sock.close(linger=0)
            if self._monitor is not None:
                self._monitor.close(linger=0)

    async def recv(self, timeout_s: float) -> list[bytes] | None:
        """The next message's frames, or None when nothing arrived within `timeout_s`."""
        if not await self._sock.poll(timeout_s * 1000):
            return None
        return await self._sock.recv_multipart()

    async def recv_burst(self, timeout_s: float, limit: int = 512) -> list[list[bytes]]:
        """Wait up to `timeout_s` for a message, then take every one already queued (up to `limit`).

        Handling a burst before yielding lets the publisher put many batches on the wire in
        one write instead of one system call per batch.
        """
        burst: list[list[bytes]] = []
        # Non-blocking reads go through a plain (synchronous) view of the same socket: no
        # future per message. Only an empty queue pays for polling.
        direct = self._direct
        try:
            burst.append(_frames_nowait(direct))
        except zmq.Again:
            first = await self.recv(timeout_s)
            if first is None:
                return []
            burst.append(first)
        while len(burst) < limit:
            try:
                burst.append(_frames_nowait(direct))
            except zmq.Again:
                break
        return burst

    async def _watch(self) -> None:
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.handshakes += 1
                self.disconnected_at = self.disconnected_wall = None
                self.dropped.clear()
                self.connected.set()
                log.info("subscribed to %s (handshake %d)", self.endpoint, self.handshakes)
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                if self.disconnected_at is None:
                    self.disconnected_at, self.disconnected_wall = asyncio.get_running_loop().time(), time.time()
                self.connected.clear()
                self.dropped.set()


def _frames_nowait(sock: zmq.Socket) -> list[bytes]:
    """One queued message's frames, or zmq.Again; `Frame.more` spares a getsockopt per frame."""
    frame = sock.recv(zmq.NOBLOCK, copy=False)
    frames = [frame.bytes]
    while frame.more:  # a message arrives whole, so its later frames never have to be waited for
        frame = sock.recv(zmq.NOBLOCK, copy=False)
        frames.append(frame.bytes)
    return frames
