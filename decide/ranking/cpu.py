"""The `cpu` ranking backend: the compiled kernels of `decide.kernels` over the index's arrays.

One kernel call ranks a whole batch (hash chaining, table probes, the prefix walk, credit,
target, baseline, candidates and their order), a second writes every answer's JSON; for
the service (`answer_texts`) one call does both and writes the relied-on prefixes too.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import attrs
import numpy as np

from kvledger.core.decision_codec import MAX_RELIED_BLOCKS
from kvledger.core.reuse import Decision, ReuseRequest
from kvledger.core.settings import ReuseSettings

from kvledger.decide.inventory import rows
from kvledger.decide.inventory.chain import chain_hashes
from kvledger.decide.inventory.index import InventoryIndex, warm_up as index_warm_up
from kvledger.decide.inventory.view import IndexReader
from kvledger.decide.ranking.kernels import answer_request, answer_requests, rank_requests
from kvledger.decide.ranking.packed import split_text_pairs
from kvledger.decide.ranking.ranked import (
    NO_TEXT, REASONS, AnswerBatch, AnswerTexts, BatchTargets, Clock, PerSettings, RankedBatch, RequestArrays,
    WorkerTexts, answer_endings, answer_pieces, digest_of, inventory_target_text, json_string_text,
    requested_targets, source_tier_codes, target_slot,
)

INT64_MAX = 2**63 - 1
WARM_UP_REQUEST = ReuseRequest("warm-up", (1, 2, 3), 16)


class CpuBackend:
    """Ranks batches of requests against an `InventoryIndex` with compiled CPU kernels."""

    name = "cpu"

    def __init__(self, index: IndexReader) -> None:
        self.index = index

    def warm_up(self, settings: ReuseSettings) -> None:
        """Answer once the way the service does, so the first client pays no compile or load
        (`compile_kernels` has compiled the rest, in a worker thread)."""
        self.answer_texts([WARM_UP_REQUEST], settings)

    def use_index(self, index: IndexReader) -> None:
        self.index = index

    def close(self) -> None:
        pass

    def answer_batch(
        self, requests: Sequence[ReuseRequest], settings: ReuseSettings, *, clock: Clock = time.perf_counter,
    ) -> AnswerBatch:
        """The batch's answers as arrays; the service encodes them straight to JSON."""
        started = clock()
        ranked = rank_batch(self.index, requests, settings, clock=clock, started=started)
        return AnswerBatch.of(self.index, requests, ranked, settings, self.name)

    def answer_texts(
        self, requests: Sequence[ReuseRequest], settings: ReuseSettings, *, clock: Clock = time.perf_counter,
    ) -> AnswerTexts:
        """What the service sends and records, ranked and written by one compiled call
        (`decide.ranking.kernels.answer_requests`): the same texts as `AnswerTexts.of(self.answer_batch(…))`."""
        started = clock()
        count = len(requests)
        if not count:
            return AnswerTexts([], [], {})
        if count == 1:
            return self._answer_text(requests[0], settings, clock, started)
        index = self.index
        batch = RequestArrays.of(requests)
        arguments = rank_arguments(index, requests, batch, settings, clock, started)
        target = arguments[2]
        worker_texts = WorkerTexts.of(index)
        answers, answer_bounds, relied, relied_bounds, reason_counts = answer_requests(
            *arguments,
            *answer_pieces(requests, batch.ids, batch.id_bounds, target, index.inventory_seq, worker_texts),
            *answer_endings(index.uncertain_names(), self.name, digest_of(settings)), MAX_RELIED_BLOCKS,
        )
        return AnswerTexts(
            *split_text_pairs(answers, answer_bounds, relied, relied_bounds, count),
            {REASONS[code]: number for code, number in enumerate(reason_counts.tolist()) if number}, batch,
            BatchTargets(target, arguments[3], worker_texts.name_texts),
        )

    def _answer_text(self, request: ReuseRequest, settings: ReuseSettings, clock: Clock, started: float) -> AnswerTexts:
        """`answer_texts` for a single request, the service's usual case: `answer_request` takes
        its values as scalars, sparing the dozen small arrays a batch of one would make."""
        index = self.index
        local = np.array(request.local_hashes, dtype=np.uint64)
        target = request.target
        slot = target_slot(index, target)
        unknown = NO_TEXT if target is None or slot >= 0 else json_string_text(target.name)
        worker_texts = WorkerTexts.of(index)
        texts, relied_from, reason = answer_request(
            local, slot, target is not None, request.block_size,
            index.table_keys, index.table_rows, index.table_bits, index.holders, index.spilled, index.slots_in_order,
            index.order_rank, _scan(index, settings, clock, started, 1), *_kernel_settings(settings),
            np.frombuffer(request.request_id.encode(), dtype=np.uint8), inventory_target_text(index.inventory_seq),
            *worker_texts.name_texts, *worker_texts.sources, unknown,
            *answer_endings(index.uncertain_names(), self.name, digest_of(settings)), MAX_RELIED_BLOCKS,
        )
        data = texts.tobytes()
        return AnswerTexts([data[:relied_from]], [data[relied_from:]], {REASONS[reason]: 1})

    def decide_batch(
        self, requests: Sequence[ReuseRequest], settings: ReuseSettings, *, clock: Clock = time.perf_counter,
    ) -> list[Decision]:
        return self.answer_batch(requests, settings, clock=clock).decisions()

    def decide(self, request: ReuseRequest, settings: ReuseSettings, *, clock: Clock = time.perf_counter) -> Decision:
        return self.decide_batch([request], settings, clock=clock)[0]


@attrs.frozen
class KernelSettings:
    """The reuse settings as `rank_requests` takes them, after the request arrays."""

    weight_of: np.ndarray  # credit of a block by which native tiers hold it (bit 0 device, 1 host, 2 disk)
    tier_enabled: np.ndarray  # per source tier code
    minimum_blocks: int
    minimum_saving_ms: float
    prefill_token_us: float
    block_us: float
    gpu_block_us: float

    @classmethod
    def of(cls, settings: ReuseSettings) -> KernelSettings:
        weights = (settings.device_credit_weight, settings.host_credit_weight, settings.disk_credit_weight)
        tiers = source_tier_codes(settings)
        return cls(
            np.array([max((weights[tier] for tier in range(3) if held >> tier & 1), default=0.0)
                      for held in range(8)], dtype=np.float64),
            np.array([tier in tiers for tier in range(3)]),
            min(settings.minimum_transfer_prefix_blocks, INT64_MAX), float(settings.minimum_estimated_ttft_saving_ms),
            float(settings.transfer_source_prefill_token_us), float(settings.transfer_source_estimated_block_us),
            float(settings.transfer_source_gpu_estimated_block_us),
        )


# The settings as the kernel's last arguments, made once per settings value.
_kernel_settings = PerSettings(lambda settings: attrs.astuple(KernelSettings.of(settings), recurse=False))


def compile_kernels(settings: ReuseSettings) -> None:
    """Compile (or load from the kernel cache) every kernel, as both backends call them: the
    cpu service's one call, the two-step way the cuda backend's answers are written, and the
    index's for plain workers."""
    compile_single_request_kernels(settings)
    compile_batch_kernels(settings)


def compile_single_request_kernels(settings: ReuseSettings) -> None:
    """`compile_kernels`' first half: a request answered alone, and the index's kernels."""
    CpuBackend(InventoryIndex()).answer_texts([WARM_UP_REQUEST], settings)
    chain_hashes(np.zeros(1, dtype=np.uint64), np.array([0, 1], dtype=np.int64))
    index_warm_up()  # the index's kernels, and its compact store's for plain workers
    rows.warm_up()  # and for its rows' holders


def compile_batch_kernels(settings: ReuseSettings) -> None:
    """`compile_kernels`' second half: batches (they take another way in), and the cuda backend's two steps."""
    backend = CpuBackend(InventoryIndex())
    backend.answer_texts([WARM_UP_REQUEST, WARM_UP_REQUEST], settings)
    AnswerTexts.of(backend.answer_batch([WARM_UP_REQUEST], settings))


def rank_batch(
    index: IndexReader, requests: Sequence[ReuseRequest], settings: ReuseSettings, *,
    clock: Clock = time.perf_counter, started: float | None = None,
) -> RankedBatch:
    """The numbers of every answer in the batch (see `decide.ranking.ranked.RankedBatch`)."""
    if started is None:
        started = clock()
    arguments = rank_arguments(index, requests, RequestArrays.of(requests), settings, clock, started)
    return RankedBatch(*rank_requests(*arguments), arguments[1])


def rank_arguments(
    index: IndexReader, requests: Sequence[ReuseRequest], batch: RequestArrays, settings: ReuseSettings,
    clock: Clock, started: float,
) -> tuple:
    """`rank_requests`'s arguments: the batch (local hashes and offsets, target slots, which
    requests named a target, block sizes), the index's arrays, whether to scan, the settings.

    A compiled scan cannot be interrupted, so the lookup budget is checked once, before it
    (as the cuda backend does); a batch shares one clock and gets the per-request budget
    times its size.
    """
    target, named = requested_targets(index, requests)
    return (batch.local, batch.offsets, target, named.view(np.uint8), batch.block_sizes,
            index.table_keys, index.table_rows, index.table_bits, index.holders, index.spilled, index.slots_in_order,
            index.order_rank,
            _scan(index, settings, clock, started, len(requests)), *_kernel_settings(settings))


def _scan(index: IndexReader, settings: ReuseSettings, clock: Clock, started: float, count: int) -> bool:
    """Whether the batch's lookup budget (per request, times its size) still allows the scan."""
    # With no worker there is nothing to scan, and the reference never reads its clock.
    budget_ms = settings.transfer_source_lookup_budget_ms * max(count, 1)
    return index.worker_count == 0 or (clock() - started) * 1000.0 <= budget_ms
