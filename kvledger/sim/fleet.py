"""A fleet of simulated vLLM engines serving a workload, announcing their caches over real ZMQ.

Each worker is a `SimulatedEngine` (PUB + replay) with an `EngineCache` (GPU spilling to
CPU). Serving a request publishes exactly what vLLM would: the blocks it stored on the
GPU, what it offloaded to the CPU tier, what it evicted — one batch per request.
"""

from __future__ import annotations

import contextlib
import socket

from kvledger.core.events import WorkerId
from kvledger.runtime.lifetime import AsyncLifetime
from kvledger.sim.engine import SimulatedEngine
from kvledger.sim.vllm import VllmBlockRemoved, VllmBlockStored
from kvledger.sim.workload import CacheChange, EngineCache, Request, block_tokens


def free_tcp_port() -> int:
    with contextlib.closing(socket.socket()) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class SimulatedWorker:
    def __init__(self, worker: WorkerId, engine: SimulatedEngine, cache: EngineCache) -> None:
        self.worker = worker
        self.engine = engine
        self.cache = cache
        self.requests_served = 0

    @property
    def endpoint_spec(self) -> str:
        return f"{self.engine.pub_endpoint},replay={self.engine.replay_endpoint}"

    async def serve(self, request: Request) -> CacheChange:
        """Prefill `request` here and publish the cache changes as one engine batch."""
        change = self.cache.serve(request.block_ids)
        size = self.cache.block_size
        events: list = _stored_runs(change.stored_gpu, size, "GPU")
        if change.evicted_gpu:
            events.append(VllmBlockRemoved(change.evicted_gpu, "GPU"))
        events.extend(_stored_runs(change.offloaded_cpu, size, "CPU"))
        if change.evicted_cpu:
            events.append(VllmBlockRemoved(change.evicted_cpu, "CPU"))
        if events:
            await self.engine.publish(events)
        self.requests_served += 1
        return change


def _stored_runs(blocks: tuple[tuple[int, int | None, int], ...], size: int, medium: str) -> list[VllmBlockStored]:
    """One BlockStored per chain run, as vLLM announces them: each block's parent is the one before."""
    runs: list[list[tuple[int, int | None, int]]] = []
    for block in blocks:
        if runs and block[1] == runs[-1][-1][2]:
            runs[-1].append(block)
        else:
            runs.append([block])
    return [
        VllmBlockStored(
            tuple(block for _, _, block in run), run[0][1],
            tuple(token for block_id, _, _ in run for token in block_tokens(block_id, size)), size, medium,
        )
        for run in runs
    ]


class SimulatedFleet(AsyncLifetime):
    """`async with SimulatedFleet(4) as fleet:` — workers `sim-0` … `sim-3` on free loopback ports."""

    def __init__(self, workers: int, *, gpu_blocks: int = 512, cpu_blocks: int = 2048, prefix: str = "sim") -> None:
        self._specs = [(WorkerId(f"{prefix}-{number}"), gpu_blocks, cpu_blocks) for number in range(workers)]
        self.workers: list[SimulatedWorker] = []

    async def start(self) -> None:
        for worker, gpu_blocks, cpu_blocks in self._specs:
            engine = SimulatedEngine(f"tcp://127.0.0.1:{free_tcp_port()}", f"tcp://127.0.0.1:{free_tcp_port()}")
            await engine.__aenter__()
            self.workers.append(SimulatedWorker(worker, engine, EngineCache(gpu_blocks, cpu_blocks)))

    async def close(self) -> None:
        for worker in self.workers:
            await worker.engine.close()

    def worker(self, worker: WorkerId) -> SimulatedWorker:
        return next(w for w in self.workers if w.worker == worker)
