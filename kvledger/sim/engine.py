"""A vLLM-compatible KV-event publisher over real ZMQ, for tests, benchmarks and the demo.

It speaks what vLLM sends: a PUB socket with `[topic, seq, payload]` frames (seq an 8-byte
big-endian counter from 0) and a ROUTER replay socket answering `[b"", start_seq]` with
every buffered batch from there, then an end marker (seq -1). Data-parallel rank r binds
the base ports + r and counts its own sequence.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence

import zmq
import zmq.asyncio

from kvledger.ingest.endpoints import with_port_offset
from kvledger.ingest.wire import END_OF_REPLAY_SEQ
from kvledger.sim.vllm import VllmEvent, encode_vllm_batch, publisher_frames

DEFAULT_BUFFER_STEPS = 10_000


class SimulatedEngine:
    """One engine rank: publishes batches, keeps the last `buffer_steps` for replay, can restart."""

    def __init__(
        self,
        pub_endpoint: str,
        replay_endpoint: str | None = None,
        *,
        dp_rank: int = 0,
        topic: bytes = b"kv-events",
        buffer_steps: int = DEFAULT_BUFFER_STEPS,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.pub_endpoint = with_port_offset(pub_endpoint, dp_rank)
        self.replay_endpoint = with_port_offset(replay_endpoint, dp_rank) if replay_endpoint else None
        self.dp_rank = dp_rank
        self.topic = topic
        self.next_seq = 0
        self.batches_published = 0  # over every restart, sent or not
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._context = context or zmq.asyncio.Context.instance()
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task | None = None
        self.replays_served = 0

    async def __aenter__(self) -> SimulatedEngine:
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

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            try:
                await self._replay_task
            except asyncio.CancelledError:
                pass
            self._replay_task = None
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None

    def encode(self, events: Sequence[VllmEvent], ts: float | None = None) -> bytes:
        return encode_vllm_batch(time.time() if ts is None else ts, events, self.dp_rank)

    async def publish(self, events: Sequence[VllmEvent], *, ts: float | None = None, send: bool = True) -> int:
        """Publish one batch; returns its seq. `send=False` buffers it without sending (a lost message)."""
        return await self.publish_payload(self.encode(events, ts), send=send)

    async def publish_payload(self, payload: bytes, *, send: bool = True) -> int:
        """Publish raw payload bytes under the next seq (tests use it for malformed batches)."""
        seq = self.next_seq
        self.next_seq += 1
        self.batches_published += 1
        self._buffer.append((seq, payload))
        if send:
            await self._pub.send_multipart(publisher_frames(self.topic, seq, payload))
        return seq

    async def send_frames(self, frames: Sequence[bytes]) -> None:
        """Send arbitrary frames on the PUB socket (malformed framing in tests)."""
        await self._pub.send_multipart(list(frames))

    def restart(self) -> None:
        """What an engine restart looks like from outside: the counter and the buffer start over."""
        self.next_seq = 0
        self._buffer.clear()

    def shrink_replay_buffer(self, steps: int) -> None:
        """Keep only the last `steps` batches for replay from now on (an engine with a short memory)."""
        self._buffer = deque(self._buffer, maxlen=steps)

    @property
    def buffered_seqs(self) -> list[int]:
        return [seq for seq, _ in self._buffer]

    async def _serve_replay(self) -> None:
        assert self._router is not None
        while True:
            frames = await self._router.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            self.replays_served += 1
            for seq, payload in list(self._buffer):
                if seq >= start:
                    # The newer framing: the DEALER sees [b"", topic, seq, payload].
                    await self._router.send_multipart([identity, b"", self.topic, seq.to_bytes(8, "big"), payload])
            end = END_OF_REPLAY_SEQ.to_bytes(8, "big", signed=True)
            await self._router.send_multipart([identity, b"", self.topic, end, b""])
