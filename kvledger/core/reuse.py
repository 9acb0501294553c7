"""The reuse decision model (docs/core.md, the reuse model): a plain, slow, obviously correct reference.

It is the oracle the fast backends in decide/ are tested against, so it walks blocks one
by one and spells every rule out rather than vectorising anything.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import attrs

from kvledger.core import precedence
from kvledger.core import cost
from kvledger.core.events import Provenance, Tier, WorkerId
from kvledger.core.hashing import BlockKeys, local_block_hashes, sequence_hashes
from kvledger.core.settings import ReuseSettings, settings_digest

# Tiers that hold blocks locally on a worker, best first; external stores are not a worker's own.
LOCAL_TIERS = (Tier.DEVICE, Tier.HOST, Tier.DISK)
_TIER_RANK = {tier: rank for rank, tier in enumerate(LOCAL_TIERS)}


class InventoryView(Protocol):
    """What the model reads: the fold implements it, and so do the decide backends' indexes."""

    inventory_seq: int

    def workers(self) -> list[WorkerId]: ...

    def holds(self, worker: WorkerId, provenance: Provenance, tier: Tier, sequence_hash: int) -> bool: ...

    def uncertain_workers(self) -> list[WorkerId]: ...

    def unreachable_workers(self) -> list[WorkerId]:
        """Workers whose engine ingest cannot reach: `holds` holds nothing native for them, and answers list
        them with the uncertain ones."""
        ...


@attrs.frozen
class ReuseRequest:
    """A request about to be prefilled, reduced to its blocks' local hashes."""

    request_id: str
    local_hashes: tuple[int, ...]
    block_size: int
    target: WorkerId | None = None
    lora_name: str | None = None
    # Where the caller places the request when nobody has credit (decide/serving/inflight.py); the
    # model itself never reads it.
    fallback: WorkerId | None = None

    @classmethod
    def from_tokens(
        cls,
        request_id: str,
        token_ids: Sequence[int],
        block_size: int,
        target: WorkerId | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        block_keys: Sequence[BlockKeys] = (),
        lookahead: int = 0,
    ) -> ReuseRequest:
        local = local_block_hashes(
            token_ids, block_size, lora_name=lora_name, cache_salt=cache_salt, block_keys=block_keys, lookahead=lookahead,
        )
        return cls(request_id, tuple(local), block_size, target, lora_name)

    @property
    def sequence_hashes(self) -> list[int]:
        return sequence_hashes(self.local_hashes)


@attrs.frozen
class Overlap:
    """Contiguous prefix lengths (in blocks) one worker holds of the request."""

    device: int
    host: int
    disk: int
    any: int
    retained_device: int

    def on(self, tier: Tier) -> int:
        return {Tier.DEVICE: self.device, Tier.HOST: self.host, Tier.DISK: self.disk}[tier]


@attrs.frozen
class Candidate:
    source: str
    dp_rank: int
    tier: Tier
    prefix_blocks: int
    transfer_blocks: int
    recompute_ms: float
    transfer_ms: float
    saving_ms: float

    @property
    def worker(self) -> WorkerId:
        return WorkerId(self.source, self.dp_rank)


class Reason:
    DISABLED = "disabled"
    CHOSEN = "chosen"
    NO_WORKERS = "no_workers"
    NO_CANDIDATES = "no_candidates"
    BELOW_THRESHOLD = "below_threshold"
    BUDGET_EXHAUSTED = "budget_exhausted"


@attrs.frozen
class Decision:
    """A reuse answer with every field of docs/decide.md's answer."""

    request_id: str
    inventory_seq: int
    target: str | None
    credited_blocks: float
    baseline_blocks: int
    overlaps: Mapping[str, Overlap]
    candidates: tuple[Candidate, ...]
    chosen: Candidate | None
    reason: str
    uncertain_workers: tuple[str, ...]
    backend: str
    settings_digest: str


def overlap_of(view: InventoryView, worker: WorkerId, sequence: Sequence[int]) -> Overlap:
    """Walk the request's blocks from the first and count, per class, how far the worker holds them."""

    def prefix(holds_block: Callable[[int], bool]) -> int:
        length = 0
        for sequence_hash in sequence:
            if not holds_block(sequence_hash):
                break
            length += 1
        return length

    # kvledger/core/precedence.py, rule 4: sources and credit count what the engine announced.
    def native_on(tier: Tier) -> Callable[[int], bool]:
        return lambda h: view.holds(worker, precedence.CREDITED, tier, h)

    return Overlap(
        device=prefix(native_on(Tier.DEVICE)),
        host=prefix(native_on(Tier.HOST)),
        disk=prefix(native_on(Tier.DISK)),
        any=prefix(lambda h: any(view.holds(worker, precedence.CREDITED, tier, h) for tier in LOCAL_TIERS)),
        # kvledger/core/precedence.py, rule 5: retained device blocks still spare the target a transfer.
        retained_device=prefix(
            lambda h: any(view.holds(worker, provenance, tier, h) for provenance, tier in precedence.BASELINE_CLASSES)
        ),
    )


def credit_of(view: InventoryView, worker: WorkerId, sequence: Sequence[int], settings: ReuseSettings) -> float:
    """Execution credit: native blocks only, each weighted by the best tier holding it, summed in order."""
    weights = {
        Tier.DEVICE: settings.device_credit_weight,
        Tier.HOST: settings.host_credit_weight,
        Tier.DISK: settings.disk_credit_weight,
    }
    credit = 0.0
    for sequence_hash in sequence:
        holding = [tier for tier in LOCAL_TIERS if view.holds(worker, precedence.CREDITED, tier, sequence_hash)]
        if not holding:
            break
        credit += max(weights[tier] for tier in holding)
    return credit


def candidate_for(source: WorkerId, tier: Tier, prefix_blocks: int, baseline: int, block_size: int, settings: ReuseSettings) -> Candidate:
    """Cost model for moving `prefix_blocks − baseline` blocks from `source`'s `tier` instead of recomputing them."""
    transfer_blocks = prefix_blocks - baseline
    recompute = cost.recompute_ms(transfer_blocks, block_size, settings.transfer_source_prefill_token_us)
    per_block = cost.block_us(
        tier is Tier.DEVICE, settings.transfer_source_gpu_estimated_block_us, settings.transfer_source_estimated_block_us
    )
    transfer = cost.transfer_ms(transfer_blocks, per_block)
    return Candidate(
        source.publisher, source.dp_rank, tier, prefix_blocks, transfer_blocks, recompute, transfer, recompute - transfer,
    )


def ranking_key(candidate: Candidate) -> tuple:
    """Saving (higher first), longer prefix, device before host before disk, then worker order."""
    return (-candidate.saving_ms, -candidate.prefix_blocks, _TIER_RANK[candidate.tier], candidate.source, candidate.dp_rank)


def enabled_source_tiers(settings: ReuseSettings) -> tuple[Tier, ...]:
    tiers: list[Tier] = []
    if settings.enable_decode_to_prefill_gpu_reuse:
        tiers.append(Tier.DEVICE)
    if settings.enable_decode_to_prefill_reuse:
        tiers.extend((Tier.HOST, Tier.DISK))
    return tuple(tiers)


def decide(
    view: InventoryView,
    request: ReuseRequest,
    settings: ReuseSettings,
    *,
    clock: Callable[[], float] = time.perf_counter,
    backend: str = "reference",
) -> Decision:
    """Answer one reuse request against an inventory, rule by rule."""
    started = clock()
    sequence = request.sequence_hashes
    workers = view.workers()
    overlaps = {worker: overlap_of(view, worker, sequence) for worker in workers}

    target = request.target
    if target is None and workers:
        credits = {worker: credit_of(view, worker, sequence, settings) for worker in workers}
        best = max(credits.values())
        target = next(worker for worker in workers if credits[worker] == best)
    credited = credit_of(view, target, sequence, settings) if target is not None else 0.0
    target_overlap = overlaps.get(target) if target is not None else None
    baseline = target_overlap.retained_device if target_overlap is not None else 0

    eligible: list[Candidate] = []
    reason = Reason.NO_CANDIDATES
    source_tiers = enabled_source_tiers(settings)
    if not source_tiers:
        reason = Reason.DISABLED
    elif target is None:
        reason = Reason.NO_WORKERS
    else:
        longer_than_baseline = False
        for worker in workers:
            if (clock() - started) * 1000.0 > settings.transfer_source_lookup_budget_ms:
                reason = Reason.BUDGET_EXHAUSTED
                break
            if worker == target:
                continue
            for tier in source_tiers:
                prefix_blocks = overlaps[worker].on(tier)
                if prefix_blocks <= baseline:
                    continue
                longer_than_baseline = True
                candidate = candidate_for(worker, tier, prefix_blocks, baseline, request.block_size, settings)
                if (
                    candidate.transfer_blocks >= settings.minimum_transfer_prefix_blocks
                    and candidate.saving_ms >= settings.minimum_estimated_ttft_saving_ms
                ):
                    eligible.append(candidate)
        if reason != Reason.BUDGET_EXHAUSTED:
            if eligible:
                reason = Reason.CHOSEN
            elif longer_than_baseline:
                reason = Reason.BELOW_THRESHOLD
    eligible.sort(key=ranking_key)

    shown = {
        worker.name: overlap
        for worker, overlap in overlaps.items()
        if worker == target or overlap.any or overlap.retained_device
    }
    if target is not None and target not in overlaps:
        shown[target.name] = Overlap(0, 0, 0, 0, 0)
    return Decision(
        request_id=request.request_id,
        inventory_seq=view.inventory_seq,
        target=target.name if target is not None else None,
        credited_blocks=credited,
        baseline_blocks=baseline,
        overlaps=shown,
        candidates=tuple(eligible),
        chosen=eligible[0] if eligible else None,
        reason=reason,
        uncertain_workers=unvouched_names(view),
        backend=backend,
        settings_digest=settings_digest(settings),
    )


def unvouched_names(view: InventoryView) -> tuple[str, ...]:
    """An answer's `uncertain_workers`: the uncertain and the unreachable workers' names, in worker order (what
    an answer cannot vouch for; decide's index lists the same from its fold)."""
    unreachable = view.unreachable_workers()
    if not unreachable:
        return tuple(worker.name for worker in view.uncertain_workers())
    flagged = {*view.uncertain_workers(), *unreachable}
    return tuple(worker.name for worker in sorted(flagged, key=lambda worker: (worker.publisher, worker.dp_rank)))
