"""The contract every ranking backend keeps (`cpu`, `cuda`), and which one `decide.backend` picks."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from kvledger.core.reuse import Decision, ReuseRequest
from kvledger.core.settings import ReuseSettings

from kvledger.decide.inventory.view import IndexReader
from kvledger.decide.ranking.cpu import CpuBackend
from kvledger.decide.ranking.ranked import AnswerBatch, AnswerTexts, Clock
from kvledger.decide.startup import StartupError


@runtime_checkable
class RankingBackend(Protocol):
    """Ranks batches of requests against the `InventoryIndex` it was made with.

    Not safe against concurrent index updates: the service calls it from the event loop
    that applies KV_EVENTS, between two events.
    """

    name: str
    index: IndexReader

    def answer_batch(
        self, requests: Sequence[ReuseRequest], settings: ReuseSettings, *, clock: Clock = time.perf_counter,
    ) -> AnswerBatch:
        """The batch's answers as arrays, encoded to JSON by `AnswerBatch.encoded()`."""
        ...

    def answer_texts(
        self, requests: Sequence[ReuseRequest], settings: ReuseSettings, *, clock: Clock = time.perf_counter,
    ) -> AnswerTexts:
        """What the service sends and records: `AnswerTexts.of(answer_batch(…))`, or the same texts sooner."""
        ...

    def decide_batch(
        self, requests: Sequence[ReuseRequest], settings: ReuseSettings, *, clock: Clock = time.perf_counter,
    ) -> list[Decision]:
        ...

    def decide(self, request: ReuseRequest, settings: ReuseSettings, *, clock: Clock = time.perf_counter) -> Decision:
        ...

    def warm_up(self, settings: ReuseSettings) -> None:
        """Run every code path once, so the first client request pays no compile or upload."""
        ...

    def use_index(self, index: IndexReader) -> None:
        """Rank against `index` from now on: decide rebuilt its index after KV_EVENTS lost messages."""
        ...

    def close(self) -> None:
        ...


def choose_backend(wanted: str, index: IndexReader) -> tuple[RankingBackend, str]:
    """The ranking backend for `decide.backend`, and a line saying what was chosen and why."""
    if wanted == "cpu":
        return CpuBackend(index), "backend cpu (as configured)"
    from kvledger.decide.ranking.cuda import CudaBackend, CudaUnavailable, device_unavailable_reason

    reason = device_unavailable_reason()
    if reason is None:
        try:
            backend = CudaBackend(index)
            return backend, f"backend cuda on {backend.device.name} ({backend.arch})" + (
                " (auto: a CUDA device answered)" if wanted == "auto" else " (as configured)"
            )
        except CudaUnavailable as error:  # CudaBackend turns every startup failure into this
            reason = str(error)
    if wanted == "cuda":
        raise StartupError(f"decide.backend = cuda, but {reason}; use backend = auto or cpu")
    return CpuBackend(index), f"backend cpu (auto: {reason})"
