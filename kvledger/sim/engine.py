"""A vLLM-compatible KV-event publisher over real ZMQ, for tests, benchmarks and the demo.

It speaks what vLLM sends (`kvledger.engines.publisher`: a PUB socket of `[topic, seq, payload]`,
a ROUTER replay socket, the last `buffer_steps` batches kept) with vLLM's event format
(`kvledger.sim.vllm`). Data-parallel rank r binds the base ports + r and counts its own sequence.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import zmq.asyncio

from kvledger.engines.publisher import DEFAULT_BUFFER_STEPS, EventPublisher
from kvledger.ingest.endpoints import with_port_offset
from kvledger.sim.vllm import VllmEvent, encode_vllm_batch


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
        self.dp_rank = dp_rank
        self.topic = topic
        self.batches_published = 0  # over every restart, sent or not
        self._publisher = EventPublisher(
            context or zmq.asyncio.Context.instance(), with_port_offset(pub_endpoint, dp_rank),
            with_port_offset(replay_endpoint, dp_rank) if replay_endpoint else None, topic=topic,
            buffer_steps=buffer_steps,
        )

    @property
    def pub_endpoint(self) -> str:
        return self._publisher.pub_endpoint

    @property
    def replay_endpoint(self) -> str | None:
        return self._publisher.replay_endpoint

    @property
    def next_seq(self) -> int:
        return self._publisher.next_seq

    @property
    def replays_served(self) -> int:
        return self._publisher.replays_served

    async def __aenter__(self) -> SimulatedEngine:
        self._publisher.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._publisher.close()

    def encode(self, events: Sequence[VllmEvent], ts: float | None = None) -> bytes:
        return encode_vllm_batch(time.time() if ts is None else ts, events, self.dp_rank)

    async def publish(self, events: Sequence[VllmEvent], *, ts: float | None = None, send: bool = True) -> int:
        """Publish one batch; returns its seq. `send=False` buffers it without sending (a lost message)."""
        return await self.publish_payload(self.encode(events, ts), send=send)

    async def publish_payload(self, payload: bytes, *, send: bool = True) -> int:
        """Publish raw payload bytes under the next seq (tests use it for malformed batches)."""
        self.batches_published += 1
        return await self._publisher.publish(payload, send=send)

    async def send_frames(self, frames: Sequence[bytes]) -> None:
        """Send arbitrary frames on the PUB socket (malformed framing in tests)."""
        await self._publisher.send_frames(frames)

    def restart(self) -> None:
        """What an engine restart looks like from outside: the counter and the buffer start over."""
        self._publisher.restart()

    def shrink_replay_buffer(self, steps: int) -> None:
        """Keep only the last `steps` batches for replay from now on (an engine with a short memory)."""
        self._publisher.keep_last(steps)

    @property
    def buffered_seqs(self) -> list[int]:
        return [seq for seq, _ in self._publisher.buffer]
