"""The replay client: asks an engine's ROUTER socket for every batch it still buffers from a seq on."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from ingest.wire import WireError, replay_request, split_replay_frames


class ReplayClient:
    """A DEALER per request, so a reply that arrives after a timeout can never be mistaken for the next one's."""

    def __init__(self, endpoint: str, context: zmq.asyncio.Context, *, timeout_s: float = 2.0) -> None:
        self.endpoint = endpoint
        self._context = context
        self._timeout = timeout_s
        self.malformed_replies = 0
        self.incomplete_replays = 0

    async def fetch(self, start_seq: int) -> list[tuple[int, bytes]]:
        """Every (seq, payload) the engine buffers from `start_seq` on, in order; partial on timeout."""
        replies, _ = await self.fetch_complete(start_seq)
        return replies

    async def fetch_complete(self, start_seq: int) -> tuple[list[tuple[int, bytes]], bool]:
        """`fetch`, and whether the end marker came: an empty answer then says the engine has nothing from there."""
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        replies: list[tuple[int, bytes]] = []
        try:
            sock.connect(self.endpoint)
            await sock.send_multipart(replay_request(start_seq))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self._timeout
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0 or not await sock.poll(remaining * 1000):
                    self.incomplete_replays += 1
                    return replies, False
                frames = await sock.recv_multipart()
                try:
                    reply = split_replay_frames(frames)
                except WireError:
                    self.malformed_replies += 1
                    continue
                if reply.seq is None:
                    return replies, True
                replies.append((reply.seq, reply.payload))
                # A long replay is progress, not a hang: each reply extends the deadline.
                deadline = loop.time() + self._timeout
        finally:
            sock.close(linger=0)
