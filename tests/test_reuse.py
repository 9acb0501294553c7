"""The reference reuse model, rule by rule (docs/core.md, the reuse model)."""

from __future__ import annotations

import itertools

import attrs
import pytest

from kvledger.core.events import GapReason, Provenance, Reachability, Tier, WorkerId
from kvledger.core.fold import InventoryFold
from kvledger.core.reuse import Candidate, Overlap, Reason, ReuseRequest, decide, ranking_key
from kvledger.core.settings import ReuseSettings, settings_digest
from builders import BLOCK_SIZE, Stream, gap, local_hashes, removed, stored, tokens_for

NATIVE, RETAINED = Provenance.NATIVE, Provenance.RETAINED
TARGET = WorkerId("target")
SOURCE = WorkerId("source")
# 1000 µs per token makes a block of 4 tokens cost 4 ms to recompute, so thresholds are reachable.
ENABLED = ReuseSettings(
    enable_decode_to_prefill_reuse=True,
    enable_decode_to_prefill_gpu_reuse=True,
    transfer_source_prefill_token_us=1000.0,
    transfer_source_lookup_budget_ms=1e9,
)
REQUEST_BLOCKS = list(range(1, 13))


def blocks(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n))


class Inventory:
    """A fold fed through a stream, with terse helpers to place chains on workers."""

    def __init__(self) -> None:
        self.fold = InventoryFold()
        self.stream = Stream()

    def hold(self, worker: WorkerId, n: int, tier: Tier = Tier.DEVICE, provenance=NATIVE) -> Inventory:
        self.fold.apply(*self.stream.batch(worker, stored(blocks(n), tier=tier), provenance=provenance))
        return self

    def hold_blocks(self, worker: WorkerId, block_ids: list[int], parent: int | None, tier: Tier = Tier.DEVICE) -> Inventory:
        self.fold.apply(*self.stream.batch(worker, stored(block_ids, parent=parent, tier=tier)))
        return self

    def ask(self, settings: ReuseSettings = ENABLED, target: WorkerId | None = TARGET, n: int = len(REQUEST_BLOCKS), **kwargs):
        request = ReuseRequest("r1", local_hashes(blocks(n)), BLOCK_SIZE, target)
        return decide(self.fold, request, settings, **kwargs)


def test_reuse_is_off_by_default_but_credit_and_baseline_are_still_reported() -> None:
    inventory = Inventory().hold(TARGET, 3).hold(SOURCE, 12)
    decision = inventory.ask(ReuseSettings())
    assert decision.reason == Reason.DISABLED == "disabled"
    assert decision.chosen is None and decision.candidates == ()
    assert decision.credited_blocks == 3.0
    assert decision.baseline_blocks == 3
    assert decision.overlaps["source"].device == 12
    assert decision.settings_digest == settings_digest(ReuseSettings())
    assert decision.backend == "reference"
    assert decision.inventory_seq == 2


def test_credit_ignores_retained_blocks() -> None:
    decision = Inventory().hold(TARGET, 8, provenance=RETAINED).ask()
    assert decision.credited_blocks == 0.0
    assert decision.baseline_blocks == 8


def test_credit_weighs_each_block_by_its_best_native_tier_and_stops_at_the_first_missing_block() -> None:
    inventory = (
        Inventory()
        .hold_blocks(TARGET, [1, 2], None, Tier.DEVICE)
        .hold_blocks(TARGET, [1, 2, 3, 4], None, Tier.DISK)
        .hold_blocks(TARGET, [3], 2, Tier.HOST)
        .hold_blocks(TARGET, [6, 7], 5, Tier.DEVICE)  # beyond a hole at block 5: never credited
    )
    decision = inventory.ask()
    # device, device, host (beats disk), disk
    assert decision.credited_blocks == 1.0 + 1.0 + 0.75 + 0.25
    assert decision.overlaps["target"] == Overlap(device=2, host=0, disk=4, any=4, retained_device=2)


def test_credit_weights_come_from_settings() -> None:
    settings = attrs.evolve(ENABLED, device_credit_weight=2.0, host_credit_weight=0.5, disk_credit_weight=0.125)
    inventory = Inventory().hold(TARGET, 2).hold_blocks(TARGET, [3], 2, Tier.HOST).hold_blocks(TARGET, [4], 3, Tier.DISK)
    assert inventory.ask(settings).credited_blocks == 2.0 + 2.0 + 0.5 + 0.125


def test_baseline_includes_retained_gpu_blocks_but_not_retained_host_blocks() -> None:
    inventory = (
        Inventory()
        .hold(TARGET, 2)
        .hold(TARGET, 5, provenance=RETAINED)
        .hold(TARGET, 12, Tier.HOST, provenance=RETAINED)
        .hold(SOURCE, 12)
    )
    decision = inventory.ask()
    assert decision.baseline_blocks == 5
    assert decision.credited_blocks == 2.0
    assert decision.chosen.transfer_blocks == 12 - 5


def test_a_retained_gpu_block_keeps_serving_as_baseline_after_native_eviction() -> None:
    inventory = Inventory().hold(TARGET, 6).hold(TARGET, 6, provenance=RETAINED)
    inventory.fold.apply(*inventory.stream.batch(TARGET, removed(blocks(6))))
    decision = inventory.ask()
    assert decision.baseline_blocks == 6
    assert decision.credited_blocks == 0.0


def test_candidate_cost_model_numbers() -> None:
    decision = Inventory().hold(TARGET, 2).hold(SOURCE, 10).hold(SOURCE, 10, Tier.HOST).ask()
    device, host = decision.candidates
    assert device == Candidate("source", 0, Tier.DEVICE, 10, 8, 8 * 4 * 1000.0 / 1000.0, 8 * 40.0 / 1000.0, 32.0 - 0.32)
    assert host == Candidate("source", 0, Tier.HOST, 10, 8, 32.0, 8 * 400.0 / 1000.0, 32.0 - 3.2)
    assert decision.chosen == device
    assert decision.reason == Reason.CHOSEN


def test_the_target_is_never_its_own_candidate() -> None:
    decision = Inventory().hold(TARGET, 12).ask(target=TARGET)
    assert decision.candidates == ()
    assert decision.reason == Reason.NO_CANDIDATES


@pytest.mark.parametrize(
    ("gpu_flag", "host_flag", "expected_tiers"),
    [
        (False, False, []),
        (True, False, [Tier.DEVICE]),
        (False, True, [Tier.HOST, Tier.DISK]),
        (True, True, [Tier.DEVICE, Tier.HOST, Tier.DISK]),
    ],
)
def test_each_enable_flag_gates_its_tiers(gpu_flag: bool, host_flag: bool, expected_tiers: list[Tier]) -> None:
    settings = attrs.evolve(ENABLED, enable_decode_to_prefill_gpu_reuse=gpu_flag, enable_decode_to_prefill_reuse=host_flag)
    inventory = Inventory().hold(SOURCE, 10, Tier.DEVICE).hold(SOURCE, 10, Tier.HOST).hold(SOURCE, 10, Tier.DISK)
    decision = inventory.ask(settings)
    assert sorted(c.tier.value for c in decision.candidates) == sorted(t.value for t in expected_tiers)
    assert decision.reason == (Reason.CHOSEN if expected_tiers else Reason.DISABLED)


def test_minimum_transfer_prefix_blocks_is_inclusive() -> None:
    settings = attrs.evolve(ENABLED, minimum_transfer_prefix_blocks=4, minimum_estimated_ttft_saving_ms=0.0)
    inventory = Inventory().hold(TARGET, 2).hold(SOURCE, 6)
    assert inventory.ask(settings).chosen.transfer_blocks == 4
    decision = inventory.ask(attrs.evolve(settings, minimum_transfer_prefix_blocks=5))
    assert decision.chosen is None and decision.reason == Reason.BELOW_THRESHOLD


def test_minimum_estimated_saving_is_inclusive() -> None:
    # 4 blocks from a GPU: recompute 16 ms, transfer 0.16 ms, saving 15.84 ms
    inventory = Inventory().hold(SOURCE, 4)
    at = attrs.evolve(ENABLED, enable_decode_to_prefill_reuse=False, minimum_estimated_ttft_saving_ms=16.0 - 0.16)
    assert inventory.ask(at).chosen.saving_ms == 16.0 - 0.16
    above = attrs.evolve(at, minimum_estimated_ttft_saving_ms=15.85)
    decision = inventory.ask(above)
    assert decision.chosen is None and decision.reason == Reason.BELOW_THRESHOLD


def test_host_transfers_slower_than_recompute_are_never_chosen() -> None:
    # recompute 12 blocks x 4 tokens x 50 µs = 2.4 ms < transfer 12 x 400 µs = 4.8 ms
    settings = attrs.evolve(ENABLED, transfer_source_prefill_token_us=50.0, minimum_estimated_ttft_saving_ms=0.0)
    decision = Inventory().hold(SOURCE, 12, Tier.HOST).ask(settings)
    assert decision.chosen is None
    assert decision.reason == Reason.BELOW_THRESHOLD


def test_only_prefixes_longer_than_the_baseline_are_candidates() -> None:
    inventory = Inventory().hold(TARGET, 6).hold(SOURCE, 6).hold(WorkerId("short"), 3)
    decision = inventory.ask()
    assert decision.candidates == ()
    assert decision.reason == Reason.NO_CANDIDATES


def test_ranking_saving_then_prefix_then_tier_then_worker_order() -> None:
    def c(source: str, rank: int, tier: Tier, prefix: int, saving: float) -> Candidate:
        return Candidate(source, rank, tier, prefix, prefix, 0.0, 0.0, saving)

    expected = [
        c("z", 0, Tier.DISK, 1, 9.0),  # highest saving wins whatever else
        c("z", 0, Tier.DISK, 8, 5.0),  # then the longer prefix
        c("z", 0, Tier.DEVICE, 4, 5.0),  # then device
        c("z", 0, Tier.HOST, 4, 5.0),  # before host
        c("a", 0, Tier.DISK, 4, 5.0),  # before disk; then publisher name
        c("b", 1, Tier.DISK, 4, 5.0),  # then dp_rank
        c("b", 2, Tier.DISK, 4, 5.0),
    ]
    for permutation in itertools.islice(itertools.permutations(expected), 200):
        assert sorted(permutation, key=ranking_key) == expected


def test_equal_candidates_are_ordered_by_tier_then_worker_in_decide() -> None:
    same_cost = attrs.evolve(ENABLED, transfer_source_gpu_estimated_block_us=400.0)
    inventory = Inventory()
    for worker in [WorkerId("b", 1), WorkerId("a", 2), WorkerId("b"), WorkerId("a", 10)]:
        inventory.hold(worker, 8).hold(worker, 8, Tier.HOST)
    decision = inventory.ask(same_cost)
    order = [(c.source, c.dp_rank, c.tier) for c in decision.candidates]
    assert order == [
        ("a", 2, Tier.DEVICE), ("a", 10, Tier.DEVICE), ("b", 0, Tier.DEVICE), ("b", 1, Tier.DEVICE),
        ("a", 2, Tier.HOST), ("a", 10, Tier.HOST), ("b", 0, Tier.HOST), ("b", 1, Tier.HOST),
    ]
    assert decision.chosen == decision.candidates[0]


def test_without_a_target_the_worker_with_most_credit_is_chosen_ties_by_worker_order() -> None:
    inventory = Inventory().hold(WorkerId("c"), 5).hold(WorkerId("b", 1), 5).hold(WorkerId("b", 2), 5).hold(WorkerId("a"), 5, Tier.HOST)
    decision = inventory.ask(target=None)
    assert decision.target == "b/1"
    assert decision.credited_blocks == 5.0
    assert Inventory().ask(target=None).target is None
    assert Inventory().ask(target=None).reason == Reason.NO_WORKERS


def test_uncertain_workers_are_reported() -> None:
    inventory = Inventory().hold(SOURCE, 12).hold(WorkerId("x", 3), 1)
    inventory.fold.apply(*inventory.stream.batch(WorkerId("x", 3), gap(GapReason.MISSED)))
    inventory.fold.apply(*inventory.stream.batch(SOURCE, gap(GapReason.REPLAY_INCOMPLETE)))
    assert inventory.ask().uncertain_workers == ("source", "x/3")


def test_a_lookup_budget_stops_the_scan() -> None:
    inventory = Inventory().hold(WorkerId("a"), 12).hold(WorkerId("b"), 12).hold(WorkerId("c"), 12)
    ticks = iter([0.0, 0.0, 0.0005, 0.0030, 1.0])  # start, then one reading before each worker
    settings = attrs.evolve(ENABLED, transfer_source_lookup_budget_ms=2.0)
    decision = inventory.ask(settings, clock=lambda: next(ticks))
    assert decision.reason == Reason.BUDGET_EXHAUSTED
    assert [c.source for c in decision.candidates] == ["a", "b"]  # c was never scanned: 3 ms > 2 ms
    assert decision.chosen.source == "a"


def test_overlaps_report_each_tier_alone_any_and_retained_device() -> None:
    inventory = (
        Inventory()
        .hold(SOURCE, 3, Tier.DEVICE)
        .hold_blocks(SOURCE, [4, 5], 3, Tier.HOST)
        .hold(SOURCE, 7, provenance=RETAINED)
        .hold(WorkerId("nobody-useful"), 0)
    )
    decision = inventory.ask()
    assert decision.overlaps["source"] == Overlap(device=3, host=0, disk=0, any=5, retained_device=7)
    assert "nobody-useful" not in decision.overlaps
    assert decision.overlaps["target"] == Overlap(0, 0, 0, 0, 0)


def test_requests_from_tokens_hash_like_the_engine_side() -> None:
    request = ReuseRequest.from_tokens("r", tokens_for(blocks(3)) + [9, 9], BLOCK_SIZE, TARGET)
    assert request.local_hashes == local_hashes(blocks(3))
    decision = decide(Inventory().hold(TARGET, 3).fold, request, ENABLED)
    assert decision.credited_blocks == 3.0


def test_a_shorter_request_is_limited_by_its_own_length() -> None:
    decision = Inventory().hold(SOURCE, 12).ask(n=5)
    assert decision.chosen.prefix_blocks == 5


def test_an_unreachable_worker_is_neither_credited_nor_a_source_and_is_listed_until_it_is_back() -> None:
    inventory = Inventory().hold(SOURCE, 12).hold(TARGET, 3)
    before = inventory.ask()
    assert before.chosen is not None and before.chosen.source == "source" and before.uncertain_workers == ()
    inventory.fold.apply(*inventory.stream.batch(SOURCE, Reachability(False, "pub disconnected", 1.0)))
    gone = inventory.ask(target=None)
    assert gone.target == "target" and gone.credited_blocks == 3.0  # the source's 12 blocks no longer count
    assert "source" not in gone.overlaps and gone.uncertain_workers == ("source",)
    assert inventory.ask().chosen is None
    # its records wait in the fold: back, it is credited and offered again
    assert inventory.fold.holds_recorded(SOURCE, NATIVE, Tier.DEVICE, inventory.fold.records(SOURCE, NATIVE, Tier.DEVICE)[0].sequence_hash)
    inventory.fold.apply(*inventory.stream.batch(SOURCE, Reachability(True, "replay answered", 2.0)))
    assert attrs.evolve(inventory.ask(), inventory_seq=before.inventory_seq) == before
