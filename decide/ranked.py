"""What a ranking backend computes for a batch, and how it becomes `Decision` values.

Both backends fill the same `RankedBatch` of arrays (prefix lengths per worker and class,
targets, credit, baseline, reasons, ranked candidates); the Python objects of the answer
are built here once, so cpu and cuda can only differ in numbers, never in presentation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import numpy as np

from kvledger.events import Tier
from kvledger.reuse import Candidate, Decision, Overlap, Reason, ReuseRequest, enabled_source_tiers
from kvledger.settings import ReuseSettings, settings_digest

from decide.index import InventoryIndex

# Prefix classes reported per worker: the three native tiers alone, any native tier, and
# native ∪ retained device (the target's baseline).
PREFIX_DEVICE, PREFIX_HOST, PREFIX_DISK, PREFIX_ANY, PREFIX_RETAINED_DEVICE = range(5)
PREFIX_CLASSES = 5
SOURCE_TIERS = (Tier.DEVICE, Tier.HOST, Tier.DISK)  # tier code = its prefix class, and its rank

REASONS = (
    Reason.DISABLED, Reason.CHOSEN, Reason.NO_WORKERS, Reason.NO_CANDIDATES,
    Reason.BELOW_THRESHOLD, Reason.BUDGET_EXHAUSTED,
)
DISABLED, CHOSEN, NO_WORKERS, NO_CANDIDATES, BELOW_THRESHOLD, BUDGET_EXHAUSTED = range(len(REASONS))

NO_TARGET = -1  # no target given and no worker to pick, or a target the index has never seen

Clock = Callable[[], float]


@attrs.frozen
class RankedBatch:
    """Per-request results as arrays; candidates are flat, grouped by request, ranked within it."""

    lengths: np.ndarray  # int32 (requests, PREFIX_CLASSES, worker slots)
    target: np.ndarray  # int32 slot per request, NO_TARGET if none or unknown
    credited: np.ndarray  # float64
    baseline: np.ndarray  # int32
    reason: np.ndarray  # int8 index into REASONS
    candidate_request: np.ndarray  # int64, non-decreasing
    candidate_slot: np.ndarray
    candidate_tier: np.ndarray  # index into SOURCE_TIERS
    candidate_prefix: np.ndarray
    candidate_transfer_blocks: np.ndarray
    candidate_recompute_ms: np.ndarray
    candidate_transfer_ms: np.ndarray
    candidate_saving_ms: np.ndarray


def source_tier_codes(settings: ReuseSettings) -> tuple[int, ...]:
    return tuple(SOURCE_TIERS.index(tier) for tier in enabled_source_tiers(settings))


def flatten_requests(requests: Sequence[ReuseRequest]) -> tuple[np.ndarray, np.ndarray]:
    """All requests' sequence hashes end to end, and the offsets where each request starts."""
    sequences = [request.sequence_hashes for request in requests]
    lengths = np.fromiter((len(s) for s in sequences), dtype=np.int64, count=len(sequences))
    offsets = np.zeros(len(sequences) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.fromiter((h for s in sequences for h in s), dtype=np.uint64, count=int(offsets[-1]))
    return flat, offsets


def requested_targets(index: InventoryIndex, requests: Sequence[ReuseRequest]) -> tuple[np.ndarray, np.ndarray]:
    """Slots of the requests' targets (NO_TARGET when none or unknown) and which requests named one."""
    slots = np.full(len(requests), NO_TARGET, dtype=np.int32)
    named = np.zeros(len(requests), dtype=bool)
    for position, request in enumerate(requests):
        if request.target is not None:
            named[position] = True
            slot = index.slot(request.target)
            if slot is not None:
                slots[position] = slot
    return slots, named


class DigestCache:
    """`settings_digest` is a SHA-256 over JSON; one per settings value is enough."""

    def __init__(self) -> None:
        self._settings: ReuseSettings | None = None
        self._digest = ""

    def __call__(self, settings: ReuseSettings) -> str:
        if settings is not self._settings:
            self._settings, self._digest = settings, settings_digest(settings)
        return self._digest


_digests = DigestCache()


def to_decisions(
    index: InventoryIndex,
    requests: Sequence[ReuseRequest],
    ranked: RankedBatch,
    settings: ReuseSettings,
    backend: str,
) -> list[Decision]:
    """Build the answers, field for field as `kvledger.reuse.decide` would."""
    count = len(requests)
    workers = index.workers
    in_order = index.slots_in_order
    lengths = ranked.lengths[:, :, in_order] if count else ranked.lengths
    shown = (lengths[:, PREFIX_ANY, :] > 0) | (lengths[:, PREFIX_RETAINED_DEVICE, :] > 0)
    targets = ranked.target
    known = targets >= 0
    if known.any():
        shown[np.flatnonzero(known), index.order_rank[targets[known]]] = True
    shown_request, shown_position = np.nonzero(shown)
    shown_lengths = lengths[shown_request, :, shown_position].tolist()
    shown_slots = in_order[shown_position].tolist()
    shown_bounds = np.searchsorted(shown_request, np.arange(count + 1)).tolist()

    candidate_bounds = np.searchsorted(ranked.candidate_request, np.arange(count + 1)).tolist()
    candidates = [
        Candidate(workers[slot].publisher, workers[slot].dp_rank, SOURCE_TIERS[tier], prefix, transfer_blocks,
                  recompute, transfer, saving)
        for slot, tier, prefix, transfer_blocks, recompute, transfer, saving in zip(
            ranked.candidate_slot.tolist(), ranked.candidate_tier.tolist(), ranked.candidate_prefix.tolist(),
            ranked.candidate_transfer_blocks.tolist(), ranked.candidate_recompute_ms.tolist(),
            ranked.candidate_transfer_ms.tolist(), ranked.candidate_saving_ms.tolist(),
        )
    ]
    names = [worker.name for worker in workers]
    digest = _digests(settings)
    uncertain = index.uncertain_names()
    inventory_seq = index.inventory_seq
    zero = Overlap(0, 0, 0, 0, 0)
    decisions = []
    for position, (request, target, credited, baseline, reason) in enumerate(zip(
        requests, targets.tolist(), ranked.credited.tolist(), ranked.baseline.tolist(), ranked.reason.tolist(),
    )):
        overlaps = {
            names[slot]: Overlap(*values)
            for slot, values in zip(
                shown_slots[shown_bounds[position]:shown_bounds[position + 1]],
                shown_lengths[shown_bounds[position]:shown_bounds[position + 1]],
            )
        }
        if target >= 0:
            target_name = names[target]
        elif request.target is not None:
            target_name = request.target.name
            overlaps[target_name] = zero  # a target the inventory has never seen holds nothing
        else:
            target_name = None
        ranked_here = tuple(candidates[candidate_bounds[position]:candidate_bounds[position + 1]])
        decisions.append(Decision(
            request_id=request.request_id,
            inventory_seq=inventory_seq,
            target=target_name,
            credited_blocks=credited,
            baseline_blocks=baseline,
            overlaps=overlaps,
            candidates=ranked_here,
            chosen=ranked_here[0] if ranked_here else None,
            reason=REASONS[reason],
            uncertain_workers=uncertain,
            backend=backend,
            settings_digest=digest,
        ))
    return decisions
