"""Shadow decisions: what reuse would choose, answered beside every live answer and recorded with it.

With `decide.shadow` on, each batch decide answers is also answered under the shadow reuse
settings (`decide.shadow_settings`, or the live ones with both enable flags on), against
the same index, for the request's own target, else its `fallback` (where its load
balancer places it), else as asked. The reply is the live answer alone; the record in
KV_DECISIONS carries the would-be answer in its `Kvledger-Shadow` header, and its relied-on
prefix covers the shadow's chosen source too, so store can judge it as it judges real
hints (docs/audit.md, "Shadow decisions").

A shadow answer needs the live one's target and every worker's prefix per tier, which the
live ranking has already walked: where the shadow's target is the live one's (no request
names a fallback, the credit weights are the live ones, no in-flight credit, the cpu
backend), `answer_with_shadow` ranks the batch once and derives the shadow's candidates
from the live ranking's overlaps with the shadow's cost settings (`kvledger.core.cost`, as the
ranking does), in the same compiled call. Otherwise the batch is ranked a second time.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import attrs
import numba
import numpy as np

from kvledger.core.decision_codec import MAX_RELIED_BLOCKS, shadow_header
from kvledger.core.reuse import ReuseRequest
from kvledger.core.settings import ReuseSettings, Settings, enabled_reuse, reuse_settings_from, settings_digest, SettingsError

from kvledger.decide.compiled import compiled as _compiled
from kvledger.decide.ranking.backend import RankingBackend
from kvledger.decide.ranking.cpu import CpuBackend, KernelSettings, _scan, rank_arguments
from kvledger.decide.ranking.kernels import (
    _candidate_costs, _put, _put_integer, _put_number, _put_slice, needs_repr, rank_requests, relied_prefix_texts, repr_texts_of, write_ranked_answers,
)
from kvledger.decide.ranking.packed import split_text_pairs
from kvledger.decide.ranking.ranked import (
    NO_TEXT, REASONS, AnswerTexts, BatchTargets, Clock, PerSettings, RequestArrays, WorkerTexts, _texts,
    answer_endings, answer_pieces, digest_of,
)
from kvledger.decide.serving.recorder import Texts
from kvledger.decide.startup import StartupError


def shadow_reuse(settings: Settings) -> ReuseSettings | None:
    """The shadow reuse settings `settings` ask for, or None when shadow decisions are off."""
    if not settings.decide.shadow:
        return None
    if settings.decide.shadow_settings is None:
        return enabled_reuse(settings.reuse)
    try:
        return reuse_settings_from(settings.decide.shadow_settings, settings.reuse)
    except SettingsError as error:
        raise StartupError(f"decide.shadow_settings: {error}") from None


def shadow_requests(requests: Sequence[ReuseRequest]) -> Sequence[ReuseRequest]:
    """The requests as the shadow ranks them: a request naming no target goes to its `fallback`, where
    its load balancer places it without kvledger's credit (reuse transfers a prefix to where a
    request is placed); without either, as asked (the most-credited worker is the target)."""
    if not any(request.target is None and request.fallback is not None for request in requests):
        return requests
    return [attrs.evolve(request, target=request.fallback) if request.target is None and request.fallback is not None
            else request for request in requests]


class ShadowDecisions:
    """Answers batches under the shadow settings; `headers` and `relied_prefixes` go on the records."""

    def __init__(self, reuse: ReuseSettings) -> None:
        self.reuse = reuse

    def answer(
        self, backend: RankingBackend, requests: Sequence[ReuseRequest], live: AnswerTexts, *,
        clock: Clock = time.perf_counter,
    ) -> ShadowTexts:
        """Per request, the `Kvledger-Shadow` header of its would-be answer, and the relied-on prefix
        covering both it and the live answer `live`: the batch ranked a second time."""
        texts = backend.answer_texts(shadow_requests(requests), self.reuse, clock=clock)
        # Both are prefixes of the request's sequence hashes: the longer holds the other.
        relied = [max(mine, theirs, key=len) for mine, theirs in zip(live.relied_prefixes, texts.relied_prefixes)]
        return ShadowTexts(Texts.of([shadow_header(answer).encode() for answer in texts.answers]), relied)

    def answer_with_live(
        self, backend: RankingBackend, requests: Sequence[ReuseRequest], live: ReuseSettings, *, inflight: bool,
        clock: Clock = time.perf_counter,
    ) -> tuple[AnswerTexts, ShadowTexts] | None:
        """The live answers and the shadow's from one ranking (`answer_with_shadow`), or None where the
        shadow's cannot be read off the live ranking (`shares_the_live_ranking`)."""
        if not shares_the_live_ranking(backend, requests, live, self.reuse, inflight):
            return None
        return answer_with_shadow(backend, requests, live, self.reuse, clock=clock)


# --- the shadow from the live ranking, in one compiled call --------------------------------------

# Per settings value, as cpu's own caches: one for the shadow's, so the live ones' are not displaced.
_shadow_kernel_settings = PerSettings(lambda settings: attrs.astuple(KernelSettings.of(settings), recurse=False))
_shadow_digest = PerSettings(settings_digest)


def _weights(settings: ReuseSettings) -> tuple[float, float, float]:
    return settings.device_credit_weight, settings.host_credit_weight, settings.disk_credit_weight


def shares_the_live_ranking(backend: RankingBackend, requests: Sequence[ReuseRequest], live: ReuseSettings,
                            shadow: ReuseSettings, inflight: bool) -> bool:
    """Whether the shadow's answers can be read off the live ranking: same target, same walk."""
    return (type(backend) is CpuBackend and not inflight and len(requests) > 1 and _weights(live) == _weights(shadow)
            and not any(request.fallback is not None for request in requests))


def compile_shadow_kernels(live: ReuseSettings, shadow: ReuseSettings) -> None:
    """Compile (or load from the kernel cache) `answer_with_shadow`'s kernels, so the first batch does not wait."""
    from kvledger.decide.ranking.cpu import WARM_UP_REQUEST
    from kvledger.decide.inventory.index import InventoryIndex

    answer_with_shadow(CpuBackend(InventoryIndex()), [WARM_UP_REQUEST, WARM_UP_REQUEST], live, shadow)


@attrs.frozen
class ShadowTexts:
    """The shadow's part of the records: each `Kvledger-Shadow` header, and each record's relied-on
    prefix (the longer of the live answer's and the shadow's)."""

    headers: Texts
    relied_prefixes: list[bytes]


def answer_with_shadow(
    backend: CpuBackend, requests: Sequence[ReuseRequest], live: ReuseSettings, shadow: ReuseSettings, *,
    clock: Clock = time.perf_counter,
) -> tuple[AnswerTexts, ShadowTexts]:
    """The live answers (as `backend.answer_texts`) and the shadow's, ranked once (`shares_the_live_ranking`).

    The relied-on prefixes, in both, are the records': each the longer of the live answer's and the shadow's."""
    started = clock()
    index = backend.index
    count = len(requests)
    batch = RequestArrays.of(requests)
    arguments = rank_arguments(index, requests, batch, live, clock, started)
    target = arguments[2]
    worker_texts = WorkerTexts.of(index)
    pieces = answer_pieces(requests, batch.ids, batch.id_bounds, target, index.inventory_seq, worker_texts)
    (answers, answer_bounds, relied, relied_bounds, reason_counts, targets, baselines, s_reason, s_slot, s_tier,
     s_prefix, s_transfer, s_floats) = _live_and_shadow(
        *arguments, *pieces, *answer_endings(index.uncertain_names(), backend.name, digest_of(live)),
        MAX_RELIED_BLOCKS, _scan(index, shadow, clock, started, count), *_shadow_kernel_settings(shadow)[1:],
    )
    answer_list, relied_list = split_text_pairs(answers, answer_bounds, relied, relied_bounds, count)
    live_texts = AnswerTexts(answer_list, relied_list,
                             {REASONS[code]: number for code, number in enumerate(reason_counts.tolist()) if number},
                             batch, BatchTargets(target, arguments[3], worker_texts.name_texts))
    floats = s_floats.reshape(-1)
    flagged = np.flatnonzero(needs_repr(floats))
    items = np.full(floats.size, -1, dtype=np.int64)
    repr_texts, repr_bounds = NO_TEXT, np.zeros(1, dtype=np.int64)
    if flagged.size:
        repr_texts, repr_bounds, flagged_items = repr_texts_of(floats[flagged])
        items[flagged] = flagged_items
    # Named targets the index has never seen are written by name (`answer_pieces`'s last two).
    buffer, bounds = _shadow_headers(
        _shadow_opening(_shadow_digest(shadow)), _REASON_TEXTS[0], _REASON_TEXTS[1], *worker_texts.name_texts,
        pieces[-2], pieces[-1], *worker_texts.sources, targets, baselines, s_reason, s_slot, s_tier, s_prefix,
        s_transfer, floats, items, repr_texts, repr_bounds,
    )
    return live_texts, ShadowTexts(Texts(buffer, bounds), relied_list)


@functools.lru_cache(maxsize=4)
def _shadow_opening(digest: str) -> np.ndarray:
    return np.frombuffer(b'{"settings_digest":"' + digest.encode() + b'","reason":"', dtype=np.uint8).copy()


_REASON_TEXTS = _texts([reason.encode() for reason in REASONS])
_TARGET = np.frombuffer(b'","target":', dtype=np.uint8).copy()
_BASELINE = np.frombuffer(b',"baseline_blocks":', dtype=np.uint8).copy()
_CHOSEN = np.frombuffer(b',"chosen":', dtype=np.uint8).copy()
_NULL = np.frombuffer(b"null", dtype=np.uint8).copy()
_TIERS = (np.frombuffer(b',"tier":"device","prefix_blocks":', dtype=np.uint8).copy(),
          np.frombuffer(b',"tier":"host","prefix_blocks":', dtype=np.uint8).copy(),
          np.frombuffer(b',"tier":"disk","prefix_blocks":', dtype=np.uint8).copy())
_DEVICE_TIER, _HOST_TIER, _DISK_TIER = _TIERS
_TRANSFER_BLOCKS = np.frombuffer(b',"transfer_blocks":', dtype=np.uint8).copy()
_RECOMPUTE = np.frombuffer(b',"recompute_ms":', dtype=np.uint8).copy()
_TRANSFER_MS = np.frombuffer(b',"transfer_ms":', dtype=np.uint8).copy()
_SAVING = np.frombuffer(b',"saving_ms":', dtype=np.uint8).copy()
_DISABLED, _CHOSEN_CODE, _NO_WORKERS, _NO_CANDIDATES, _BELOW_THRESHOLD, _BUDGET_EXHAUSTED = range(6)


@numba.njit(cache=True)  # not nogil: write_ranked_answers's object-mode block needs the interpreter
def _live_and_shadow(
    local, offsets, given_target, named, block_sizes,
    table_keys, table_rows, table_bits, holders, spilled, slots_in_order, order_rank,
    scan, weight_of, tier_enabled, minimum_blocks, minimum_saving_ms, prefill_token_us, block_us, gpu_block_us,
    ids, id_bounds, inventory_target, names, name_bounds, sources, source_bounds, unknown, unknown_bounds,
    endings, ending_bounds, max_relied_blocks,
    s_scan, s_tier_enabled, s_minimum_blocks, s_minimum_saving_ms, s_prefill_token_us, s_block_us, s_gpu_block_us,
):
    """`decide.ranking.kernels.answer_requests`, and per request the shadow's reason and chosen candidate,
    read off the same ranking's overlaps (the candidates `rank_requests` would rank under the
    shadow's settings, the best of them by the same key); the relied-on prefixes cover both."""
    (target, credited, baseline, reason, overlap_bounds, overlap_slot, overlap_lengths, candidate_bounds,
     c_slot, c_tier, c_prefix, c_transfer, c_recompute, c_transfer_ms, c_saving, flagged, sequence) = rank_requests(
        local, offsets, given_target, named, block_sizes,
        table_keys, table_rows, table_bits, holders, spilled, slots_in_order, order_rank,
        scan, weight_of, tier_enabled, minimum_blocks, minimum_saving_ms, prefill_token_us, block_us, gpu_block_us,
    )
    count = reason.size
    reason_counts = np.zeros(6, dtype=np.int64)
    for request in range(count):
        reason_counts[reason[request]] += 1
    answers, answer_bounds = write_ranked_answers(
        ids, id_bounds, inventory_target, names, name_bounds, sources, source_bounds, unknown, unknown_bounds,
        target, credited, baseline, reason, overlap_bounds, overlap_slot, overlap_lengths,
        candidate_bounds, c_slot, c_tier, c_prefix, c_transfer, c_recompute, c_transfer_ms, c_saving, flagged,
        endings, ending_bounds,
    )
    s_reason = np.empty(count, dtype=np.int8)
    s_slot = np.full(count, -1, dtype=np.int32)
    s_tier = np.zeros(count, dtype=np.int32)
    s_prefix = np.zeros(count, dtype=np.int32)
    s_transfer = np.zeros(count, dtype=np.int32)
    s_floats = np.zeros((count, 3), dtype=np.float64)  # recompute, transfer, saving
    relied_prefix = np.zeros(count, dtype=np.int32)  # per request, the longer chosen prefix of the two
    any_tier = s_tier_enabled[0] or s_tier_enabled[1] or s_tier_enabled[2]
    for request in range(count):
        if candidate_bounds[request + 1] > candidate_bounds[request]:
            relied_prefix[request] = c_prefix[candidate_bounds[request]]
        choose = named[request] == 0
        here = target[request]
        floor = baseline[request]
        if not any_tier:
            s_reason[request] = _DISABLED
        elif not choose or here >= 0:
            if not s_scan:
                s_reason[request] = _BUDGET_EXHAUSTED
            else:
                longer = False
                best = -1
                best_saving, best_prefix, best_tier = 0.0, 0, 0
                # Overlaps are in worker order, and every worker holding a prefix is among them.
                for item in range(overlap_bounds[request], overlap_bounds[request + 1]):
                    slot = overlap_slot[item]
                    if slot == here:
                        continue
                    for tier in range(3):
                        prefix = overlap_lengths[item, tier]
                        if not s_tier_enabled[tier] or prefix <= floor:
                            continue
                        longer = True
                        transfer_blocks = prefix - floor
                        recompute_ms, transfer_ms, saving_ms, kept = _candidate_costs(
                            transfer_blocks, block_sizes[request], tier == 0, s_prefill_token_us, s_block_us,
                            s_gpu_block_us, s_minimum_blocks, s_minimum_saving_ms)
                        if not kept:
                            continue
                        # `kvledger.core.reuse.ranking_key`: saving, longer prefix, tier, worker order (earlier kept).
                        if (best < 0 or saving_ms > best_saving
                                or (saving_ms == best_saving and (prefix > best_prefix
                                                                  or (prefix == best_prefix and tier < best_tier)))):
                            best, best_saving, best_prefix, best_tier = item, saving_ms, prefix, tier
                            s_slot[request], s_tier[request], s_prefix[request] = slot, tier, prefix
                            s_transfer[request] = transfer_blocks
                            s_floats[request, 0], s_floats[request, 1] = recompute_ms, transfer_ms
                            s_floats[request, 2] = saving_ms
                if best >= 0:
                    s_reason[request] = _CHOSEN_CODE
                    relied_prefix[request] = max(relied_prefix[request], s_prefix[request])
                elif longer:
                    s_reason[request] = _BELOW_THRESHOLD
                else:
                    s_reason[request] = _NO_CANDIDATES
        else:
            s_reason[request] = _NO_WORKERS
    # The relied-on prefixes: each request's one "candidate" is the longer chosen prefix.
    relied, relied_bounds = relied_prefix_texts(
        sequence, offsets, target, overlap_bounds, overlap_slot, overlap_lengths,
        np.arange(count + 1).astype(np.int64), relied_prefix, max_relied_blocks,
    )
    return (answers, answer_bounds, relied, relied_bounds, reason_counts, target, baseline, s_reason, s_slot, s_tier,
            s_prefix, s_transfer, s_floats)


@_compiled
def _shadow_headers(opening, reasons, reason_bounds, names, name_bounds, unknown, unknown_bounds, sources,
                    source_bounds, target, baseline, reason, c_slot, c_tier, c_prefix, c_transfer, floats, items,
                    repr_texts, repr_bounds):
    """Each `ShadowAnswer` as JSON (`kvledger.core.decision_codec.shadow_header`'s fields, in its order)."""
    count = target.size
    longest_name = 0
    for slot in range(name_bounds.size - 1):
        longest_name = max(longest_name, name_bounds[slot + 1] - name_bounds[slot],
                           source_bounds[slot + 1] - source_bounds[slot])
    longest_repr = 0
    for item in range(repr_bounds.size - 1):
        longest_repr = max(longest_repr, repr_bounds[item + 1] - repr_bounds[item])
    size = 0
    for request in range(count):
        size += (opening.size + 360 + 2 * longest_name + unknown_bounds[request + 1] - unknown_bounds[request]
                 + 3 * max(longest_repr, 24))
    out = np.empty(size, dtype=np.uint8)
    bounds = np.zeros(count + 1, dtype=np.int64)
    position = 0
    for request in range(count):
        position = _put(out, position, opening)
        position = _put_slice(out, position, reasons, reason_bounds, reason[request])
        position = _put(out, position, _TARGET)
        if target[request] >= 0:
            position = _put_slice(out, position, names, name_bounds, target[request])
        elif unknown_bounds[request + 1] > unknown_bounds[request]:
            position = _put_slice(out, position, unknown, unknown_bounds, request)
        else:
            position = _put(out, position, _NULL)
        position = _put(out, position, _BASELINE)
        position = _put_integer(out, position, baseline[request])
        position = _put(out, position, _CHOSEN)
        if reason[request] == _CHOSEN_CODE:
            position = _put_slice(out, position, sources, source_bounds, c_slot[request])
            tier = c_tier[request]
            position = _put(out, position, _DEVICE_TIER if tier == 0 else _HOST_TIER if tier == 1 else _DISK_TIER)
            position = _put_integer(out, position, c_prefix[request])
            position = _put(out, position, _TRANSFER_BLOCKS)
            position = _put_integer(out, position, c_transfer[request])
            position = _put(out, position, _RECOMPUTE)
            position = _put_number(out, position, floats, items, 3 * request, repr_texts, repr_bounds)
            position = _put(out, position, _TRANSFER_MS)
            position = _put_number(out, position, floats, items, 3 * request + 1, repr_texts, repr_bounds)
            position = _put(out, position, _SAVING)
            position = _put_number(out, position, floats, items, 3 * request + 2, repr_texts, repr_bounds)
            out[position] = 125
            position += 1
        else:
            position = _put(out, position, _NULL)
        out[position] = 125
        position += 1
        bounds[request + 1] = position
    return out[:position], bounds
