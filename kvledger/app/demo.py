"""The demo's closed loop: route each request through the decision service, serve it, keep score.

A shadow fleet of the same caches, routed round-robin without kvledger, serves the same
requests as the baseline. The fleet, the decision call and the display are handed in by
kvledger/app/cli.py; this module only keeps the loop and the score, and `decide_asker` makes
the decision call from a `DecideClient`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol

import attrs

from kvledger.client import Answer, DecideClient, DecideError, DecideRequest
from kvledger.core import cost
from kvledger.core.events import WorkerId
from kvledger.core.settings import ReuseSettings
from kvledger.sim.workload import DEMO_BLOCK_SIZE, CacheChange, EngineCache, Request, request_tokens

log = logging.getLogger("kvledger.demo")

# What the loop hears back: decide's answer, or None when there is none (the request is
# then placed as it would be without kvledger). Raw JSON answers are read as an Answer
# too, since kvledger/app/cli.py still hands in an `ask` of its own that returns them.
# The request, the target it is placed on (None: decide picks), and where it goes when no
# worker has credit (its `fallback`).
Ask = Callable[[Request, str | None, str | None], Awaitable[Answer | None]]


class Worker(Protocol):
    worker: WorkerId
    cache: EngineCache

    async def serve(self, request: Request) -> CacheChange: ...


@attrs.define
class DemoScore:
    requests: int = 0
    blocks: int = 0
    hit_blocks: int = 0
    baseline_hit_blocks: int = 0
    decisions: int = 0
    routed_by_credit: int = 0
    routed_by_inflight: int = 0  # routed where in-flight credit, not native credit alone, pointed
    reuse_chosen: int = 0
    reuse_saving_ms: float = 0.0
    uncertain_answers: int = 0
    elapsed_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    @property
    def baseline_hit_rate(self) -> float:
        return self.baseline_hit_blocks / self.blocks if self.blocks else 0.0

    def routing_saving_ms(self, block_size: int, reuse: ReuseSettings) -> float:
        """Prefill avoided by prefix hits that round-robin routing would have missed."""
        extra_blocks = self.hit_blocks - self.baseline_hit_blocks
        return cost.recompute_ms(extra_blocks, block_size, reuse.transfer_source_prefill_token_us)


def decide_asker(client: DecideClient, block_size: int = DEMO_BLOCK_SIZE) -> Ask:
    """The loop's decision call: a request's tokens to decide through `client`, under the request's own id."""

    async def ask(request: Request, target: str | None, fallback: str | None = None) -> Answer | None:
        try:
            return await client.decide(DecideRequest(
                request_id=request.request_id, token_ids=request_tokens(request, block_size), block_size=block_size,
                target=target, fallback=fallback,
            ))
        except DecideError as error:  # the demo goes on; this request is placed without advice
            log.warning("demo: no decision for %s: %s", request.request_id, error)
            return None

    return ask


async def run_closed_loop(
    workers: list[Worker],
    requests: Iterable[Request],
    ask: Ask,
    *,
    duration_s: float,
    reuse: bool = False,
    on_progress: Callable[[DemoScore], None] = lambda score: None,
) -> DemoScore:
    """Serve requests until they run out or `duration_s` passes.

    Without reuse the decision picks the worker (the one with most credit). With reuse, a
    load balancer places requests round-robin and the decision says which other worker's
    prefix to transfer there, which is what decode-to-prefill reuse is for.
    """
    score = DemoScore()
    by_name = {worker.worker.name: worker for worker in workers}
    shadow = [EngineCache(w.cache.gpu_blocks, w.cache.cpu_blocks, w.cache.block_size) for w in workers]
    started = time.monotonic()
    for number, request in enumerate(requests):
        if time.monotonic() - started > duration_s:
            break
        placed = workers[number % len(workers)]
        # With no credit anywhere, every worker is equally good: spread the load, and say so, so
        # decide knows where the request went (in-flight credit, decide.inflight_ttl_ms).
        answer = await ask(request, placed.worker.name if reuse else None, None if reuse else placed.worker.name)
        score.decisions += 1
        target = placed
        if not reuse and answer is not None and (answer.credited_blocks or answer.inflight is not None):
            credited = by_name.get(answer.target or "")
            if credited is not None:
                target = credited
                score.routed_by_credit += 1
                score.routed_by_inflight += answer.inflight is not None
        transferred = 0
        if answer is not None and answer.chosen is not None:
            score.reuse_chosen += 1
            score.reuse_saving_ms += answer.chosen.saving_ms
            transferred = answer.chosen.prefix_blocks
        if answer is not None and answer.uncertain_workers:
            score.uncertain_answers += 1
        change = await target.serve(request)
        score.requests += 1
        score.blocks += len(request.block_ids)
        # A transferred prefix is reused just as a local hit is.
        score.hit_blocks += max(change.hit_blocks, transferred)
        score.baseline_hit_blocks += shadow[number % len(shadow)].serve(request.block_ids).hit_blocks
        score.elapsed_s = time.monotonic() - started
        on_progress(score)
    return score
