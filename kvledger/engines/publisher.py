"""One engine rank's side of vLLM's KV-event protocol, over real ZMQ.

What vLLM's publisher does, and what ingest reads: a PUB socket sending `[topic, seq, payload]`
(seq an 8-byte big-endian counter from 0), the last `buffer_steps` batches kept, and a ROUTER
replay socket answering `[b"", start_seq]` with every buffered batch from there, then an end
marker (seq -1). The simulated engines and the TensorRT-LLM forwarder both publish through it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Sequence

import zmq
import zmq.asyncio

from kvledger.ingest.wire import END_OF_REPLAY_SEQ

DEFAULT_BUFFER_STEPS = 10_000


class EventPublisher:
    """PUB, sequence counter, replay buffer and ROUTER replay server of one rank (`start`, then `publish`)."""

    def __init__(self, context: zmq.asyncio.Context, pub_endpoint: str, replay_endpoint: str | None, *,
                 topic: bytes = b"kv-events", buffer_steps: int = DEFAULT_BUFFER_STEPS) -> None:
        self.pub_endpoint, self.replay_endpoint = pub_endpoint, replay_endpoint
        self.topic = topic
        self.next_seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.replays_served = 0
        self._context = context
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task | None = None

    def start(self) -> EventPublisher:
        """Bind the sockets (the endpoints become the bound addresses, ports resolved) and serve replays."""
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.bind(self.pub_endpoint)
        self.pub_endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        if self.replay_endpoint:
            self._router = self._context.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            # A ROUTER silently drops what exceeds its send HWM (1000): a long replay to a busy
            # reader would lose batches in the middle and turn into a replay_incomplete Gap.
            self._router.setsockopt(zmq.SNDHWM, 0)
            self._router.bind(self.replay_endpoint)
            self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._replay_task = asyncio.create_task(self._serve_replay(), name=f"replay-{self.replay_endpoint}")
        return self

    async def publish(self, payload: bytes, *, send: bool = True, lost_before: int = 0) -> int:
        """Publish `payload` under the next seq and keep it for replay; returns the seq. `send=False` keeps it
        without sending (a lost message); `lost_before` seqs are skipped first, never sent nor kept (a hole
        no replay can fill)."""
        self.next_seq += lost_before
        seq = self.next_seq
        self.next_seq += 1
        self.buffer.append((seq, payload))
        if send:
            await self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    async def send_frames(self, frames: Sequence[bytes]) -> None:
        """Send arbitrary frames on the PUB socket (malformed framing, in tests)."""
        await self._pub.send_multipart(list(frames))

    def restart(self) -> None:
        """What an engine restart looks like from outside: the counter and the buffer start over."""
        self.next_seq = 0
        self.buffer.clear()

    def keep_last(self, steps: int) -> None:
        """Keep only the last `steps` batches for replay from now on."""
        self.buffer = deque(self.buffer, maxlen=steps)

    async def _serve_replay(self) -> None:
        while True:
            frames = await self._router.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            self.replays_served += 1
            for seq, payload in list(self.buffer):
                if seq >= start:
                    # The newer framing: the DEALER sees [b"", topic, seq, payload].
                    await self._router.send_multipart([identity, b"", self.topic, seq.to_bytes(8, "big"), payload])
            end = END_OF_REPLAY_SEQ.to_bytes(8, "big", signed=True)
            await self._router.send_multipart([identity, b"", self.topic, end, b""])

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
            self._replay_task = None
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None
