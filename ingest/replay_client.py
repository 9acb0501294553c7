"""The replay client: asks an engine's ROUTER socket for every batch it still buffers from a seq on."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from kvledger.ingest.wire import WireError, replay_request, split_replay_frames

# A probe asks for the batches from a seq no engine reaches: a live engine answers with the
# end marker alone, so its answer costs it nothing however much it buffers.
PROBE_SEQ = 1 << 62
MALFORMED_KEPT = 16  # unreadable replies kept for dead-lettering between two drains


class ReplayClient:
    """A DEALER per request, so a reply that arrives after a timeout can never be mistaken for the next one's."""

    def __init__(self, endpoint: str, context: zmq.asyncio.Context, *, timeout_s: float = 2.0) -> None:
        self.endpoint = endpoint
        self._context = context
        self._timeout = timeout_s
        self.malformed_replies = 0
        self.incomplete_replays = 0
        self.probes = 0
        self.unanswered_probes = 0
        # (why, frames) of replies with unreadable framing, for the stream to dead-letter (`take_malformed`)
        self._malformed: list[tuple[str, list[bytes]]] = []

    async def fetch(self, start_seq: int) -> list[tuple[int, bytes]]:
        """Every (seq, payload) the engine buffers from `start_seq` on, in order; partial on timeout."""
        replies, _ = await self.fetch_complete(start_seq)
        return replies

    async def fetch_complete(self, start_seq: int, timeout_s: float | None = None) -> tuple[list[tuple[int, bytes]], bool]:
        """`fetch`, and whether the end marker came: an empty answer then says the engine has nothing from there."""
        replies: list[tuple[int, bytes]] = []
        complete = await self._request(start_seq, self._timeout if timeout_s is None else timeout_s, replies)
        if not complete:
            self.incomplete_replays += 1
        return replies, complete

    async def probe(self, timeout_s: float) -> bool:
        """Whether the engine's replay socket answers anything within `timeout_s`: a sign of life,
        even where the SUB connection is down (an unreadable answer counts: something answered)."""
        self.probes += 1
        answered = await self._request(PROBE_SEQ, timeout_s, [], first_reply_only=True)
        if not answered:
            self.unanswered_probes += 1
        return answered

    def take_malformed(self) -> list[tuple[str, list[bytes]]]:
        """The unreadable replies since the last call (at most MALFORMED_KEPT of them), to dead-letter."""
        taken, self._malformed = self._malformed, []
        return taken

    async def _request(
        self, start_seq: int, timeout_s: float, replies: list[tuple[int, bytes]], *, first_reply_only: bool = False,
    ) -> bool:
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        try:
            sock.connect(self.endpoint)
            await sock.send_multipart(replay_request(start_seq))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0 or not await sock.poll(remaining * 1000):
                    return False
                frames = await sock.recv_multipart()
                if first_reply_only:
                    return True
                try:
                    reply = split_replay_frames(frames)
                except WireError as error:
                    # Never a crash, never silently dropped: counted, and kept for a dead letter. The
                    # batch it stood for is missing from the replay, which the sequence rules make a Gap.
                    self.malformed_replies += 1
                    if len(self._malformed) < MALFORMED_KEPT:
                        self._malformed.append((f"replay reply from {self.endpoint}: {error}", frames))
                    continue
                if reply.seq is None:
                    return True
                replies.append((reply.seq, reply.payload))
                # A long replay is progress, not a hang: each reply extends the deadline.
                deadline = loop.time() + timeout_s
        finally:
            sock.close(linger=0)
