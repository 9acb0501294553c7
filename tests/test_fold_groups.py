"""The fold with KV-cache groups, ownerships, references, placeholders and tier clears.

Covers: block identity (tier, group, ownership, engine hash) and parents that survive a
sliding-window removal; reference counting of repeated stores; stores without tokens
(resolved from the worker's engine-hash map, else kept unresolved); the residency rule
`holds` applies (kvledger/core/residency.py); tier-scoped clears and the uncertainty they end;
snapshots of all of it; version-1 records read as group 0, no ownership, clear all.
"""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.core.events import (
    Cleared, GapReason, Provenance, Removed, Stored, Tier, WorkerId, decode_batch, encode_batch,
)
from kvledger.core.fold import (
    BlockReferencedFact, BlockRemovedFact, BlockStoredFact, InventoryClearedFact, InventoryFold, RemovalCause,
    UncertaintyFact,
)
from kvledger.core.hashing import chain_hash, sequence_hashes
from kvledger.core.residency import ResidencyRule, decides, rule_for
from kvledger.core.snapshot import decode_snapshot, encode_snapshot
from builders import BLOCK_SIZE, Stream, gap, local_hashes

NATIVE, RETAINED = Provenance.NATIVE, Provenance.RETAINED
DEVICE, HOST = Tier.DEVICE, Tier.HOST
W = WorkerId("vllm-a")
FULL, SW, MAMBA = "full_attention", "sliding_window", "mamba"


def put(ids, parent=None, *, tier=DEVICE, group=0, owner=None, kind=None, window=None) -> Stored:
    """Blocks with tokens: engine hash = block id, content keyed by the id (as builders.stored)."""
    return Stored(tier, tuple(ids), parent, BLOCK_SIZE, local_hashes(ids), None, None, group, owner, kind, window)


def placeholder(ids, *, tier=HOST, group=0, owner=None, kind=None) -> Stored:
    """A store without tokens (vLLM's offload placeholder: block size 0, no token ids)."""
    return Stored(tier, tuple(ids), None, 0, (), None, None, group, owner, kind)


def drop(ids, *, tier=DEVICE, group=0, owner=None) -> Removed:
    return Removed(tier, tuple(ids), group, owner)


def seq(*chain: int) -> int:
    """The sequence hash of the last block of the chain `chain` (a root first)."""
    return sequence_hashes(local_hashes(list(chain)))[-1]


def fold_with(*batches) -> tuple[InventoryFold, list]:
    fold = InventoryFold()
    return fold, fold.apply_all(batches)


def keyed(fold: InventoryFold, tier=DEVICE, provenance=NATIVE) -> dict:
    return {(r.group_idx, r.ownership, r.engine_hash): r for r in fold.records(W, provenance, tier)}


def holds(fold: InventoryFold, sequence_hash: int, tier=DEVICE, provenance=NATIVE) -> bool:
    return fold.holds(W, provenance, tier, sequence_hash)


# --- 1. block identity ----------------------------------------------------------------------


def test_a_removal_touches_only_its_own_group_and_ownership() -> None:
    s = Stream()
    fold, _ = fold_with(s.batch(W, put([1, 2]), put([1, 2], group=1, kind=SW), put([1, 2], owner="cpu")))
    facts = fold.apply(*s.batch(W, drop([1, 2], group=1)))
    assert [(type(f), f.record.key, f.cause) for f in facts] == [
        (BlockRemovedFact, (1, None, 1), RemovalCause.REMOVED), (BlockRemovedFact, (1, None, 2), RemovalCause.REMOVED),
    ]
    assert set(keyed(fold)) == {(0, None, 1), (0, None, 2), (0, "cpu", 1), (0, "cpu", 2)}
    [removal] = fold.apply(*s.batch(W, drop([1], owner="cpu")))
    assert removal.record.key == (0, "cpu", 1)
    assert set(keyed(fold)) == {(0, None, 1), (0, None, 2), (0, "cpu", 2)}
    assert fold.apply(*s.batch(W, drop([2], group=2), drop([2], owner="disk"))) == []
    assert fold.counters["unknown_remove"] == 2
    assert holds(fold, seq(1)) and holds(fold, seq(1, 2))


def test_children_of_a_block_whose_sliding_window_copy_was_removed_resolve_their_parent() -> None:
    s = Stream()
    fold, _ = fold_with(
        s.batch(W, put([1, 2], kind=FULL), put([1, 2], group=1, kind=SW, window=8)),
        s.batch(W, drop([1, 2], group=1)),  # the window slid past 1 and 2
        s.batch(W, put([3], parent=2, kind=FULL), put([3], parent=2, group=1, kind=SW, window=8)),
    )
    assert fold.counters["unknown_parent"] == 0
    expected = chain_hash(seq(1, 2), local_hashes([3])[0])
    assert expected == sequence_hashes(local_hashes([1, 2, 3]))[2]
    records = keyed(fold)
    assert records[(0, None, 3)].sequence_hash == records[(1, None, 3)].sequence_hash == expected
    assert records[(1, None, 3)].parent_hash == 2 and records[(1, None, 3)].sliding_window == 8
    assert holds(fold, expected)


def test_a_parent_held_only_by_another_group_still_resolves() -> None:
    s = Stream()
    fold, _ = fold_with(s.batch(W, put([1, 2], group=1, kind=SW)), s.batch(W, put([3], parent=2, kind=FULL)))
    assert fold.counters["unknown_parent"] == 0
    assert keyed(fold)[(0, None, 3)].sequence_hash == seq(1, 2, 3)


# --- 2. reference counting ------------------------------------------------------------------


def test_a_repeated_store_adds_a_reference_and_each_removal_drops_one() -> None:
    s = Stream()
    fold, _ = fold_with(s.batch(W, put([1])))
    [first] = fold.records(W, NATIVE, DEVICE)
    assert first.refs == 1
    assert fold.apply(*s.batch(W, put([1]))) == [BlockReferencedFact(msgspec.structs.replace(first, refs=2), 2)]
    assert fold.counters["duplicate_store"] == 1 and fold.worker_state(W).counters["duplicate_store"] == 1
    assert fold.records(W, NATIVE, DEVICE)[0].refs == 2
    [referenced] = fold.apply(*s.batch(W, drop([1])))
    assert type(referenced) is BlockReferencedFact and referenced.record.refs == 1 and referenced.stream_seq == 3
    assert holds(fold, seq(1))
    [removed] = fold.apply(*s.batch(W, drop([1])))
    assert removed == BlockRemovedFact(first, RemovalCause.REMOVED, 4)  # stream_seq of its first store, refs 1
    assert not holds(fold, seq(1)) and fold.records(W, NATIVE, DEVICE) == []
    assert fold.apply(*s.batch(W, drop([1]))) == [] and fold.counters["unknown_remove"] == 1


def test_the_same_hash_in_another_group_ownership_or_tier_is_another_block_not_a_reference() -> None:
    s = Stream()
    fold, facts = fold_with(s.batch(W, put([1]), put([1], group=1), put([1], owner="cpu"), put([1], tier=HOST)))
    assert [type(f) for f in facts] == [BlockStoredFact] * 4
    assert fold.counters["duplicate_store"] == 0
    assert all(r.refs == 1 for tier in (DEVICE, HOST) for r in fold.records(W, NATIVE, tier))


def test_references_survive_interleaved_removals_in_other_groups() -> None:
    s = Stream()
    fold, _ = fold_with(s.batch(W, put([1]), put([1]), put([1], group=1)))
    assert keyed(fold)[(0, None, 1)].refs == 2 and keyed(fold)[(1, None, 1)].refs == 1
    facts = fold.apply(*s.batch(W, drop([1], group=1), drop([1])))
    assert [type(f) for f in facts] == [BlockRemovedFact, BlockReferencedFact]
    assert list(keyed(fold)) == [(0, None, 1)] and keyed(fold)[(0, None, 1)].refs == 1


# --- 3. stores without tokens ---------------------------------------------------------------


def test_a_placeholder_takes_its_hashes_from_the_block_held_on_another_tier() -> None:
    s = Stream()
    fold, _ = fold_with(s.batch(W, put([1, 2, 3])))
    facts = fold.apply(*s.batch(W, placeholder([2, 3], owner="cpu")))
    device, host = keyed(fold), keyed(fold, HOST)
    assert [f.record for f in facts] == [host[(0, "cpu", 2)], host[(0, "cpu", 3)]]
    for engine_hash in (2, 3):
        on_host, on_device = host[(0, "cpu", engine_hash)], device[(0, None, engine_hash)]
        assert (on_host.sequence_hash, on_host.parent_hash, on_host.local_hash) == (
            on_device.sequence_hash, on_device.parent_hash, on_device.local_hash)
        assert not on_host.unresolved and on_host.indexable
    assert host[(0, "cpu", 3)].sequence_hash == seq(1, 2, 3) and host[(0, "cpu", 3)].parent_hash == 2
    assert holds(fold, seq(1, 2, 3), HOST) and not holds(fold, seq(1), HOST)
    # a child stored under a placeholder chains from it once the device copy is gone
    fold.apply(*s.batch(W, drop([1, 2, 3]), put([4], parent=3, tier=HOST, owner="cpu")))
    assert keyed(fold, HOST)[(0, "cpu", 4)].sequence_hash == seq(1, 2, 3, 4)
    assert fold.counters["unknown_parent"] == 0 and fold.counters["unresolved_store"] == 0


def test_a_placeholder_resolves_from_another_group_on_the_same_tier() -> None:
    s = Stream()
    fold, _ = fold_with(s.batch(W, put([1, 2])), s.batch(W, placeholder([2], tier=DEVICE, group=1, kind=SW)))
    record = keyed(fold)[(1, None, 2)]
    assert record.sequence_hash == seq(1, 2) and record.spec_kind == SW and not record.unresolved


def test_a_native_placeholder_falls_back_to_retained_topology_and_a_retained_one_to_native() -> None:
    s = Stream()
    fold, _ = fold_with(
        s.batch(W, put([1, 2]), provenance=RETAINED),
        s.batch(W, put([7])),
        s.batch(W, placeholder([2])),
        s.batch(W, placeholder([7]), provenance=RETAINED),
    )
    assert keyed(fold, HOST)[(0, None, 2)].sequence_hash == seq(1, 2)
    retained = keyed(fold, HOST, RETAINED)[(0, None, 7)]
    assert retained.sequence_hash == seq(7) and not retained.conflict
    assert holds(fold, seq(1, 2), HOST) and holds(fold, seq(7), HOST, RETAINED)
    assert fold.counters["unresolved_store"] == 0


def test_an_unknown_placeholder_is_kept_unresolved_unindexed_and_counted() -> None:
    s = Stream()
    fold, facts = fold_with(s.batch(W, put([1])), s.batch(W, placeholder([1, 77], group=0)))
    host = keyed(fold, HOST)
    unknown = host[(0, None, 77)]
    assert facts[-1] == BlockStoredFact(unknown)
    assert unknown.unresolved and not unknown.indexable
    assert (unknown.sequence_hash, unknown.local_hash, unknown.parent_hash) == (0, 0, None)
    assert fold.counters["unresolved_store"] == 1 and fold.worker_state(W).counters["unresolved_store"] == 1
    assert not holds(fold, 0, HOST) and holds(fold, seq(1), HOST)
    # it is not in the engine-hash map: a child under it starts a new chain, another placeholder stays unresolved
    fold.apply(*s.batch(W, put([78], parent=77, tier=Tier.DISK), placeholder([77], tier=Tier.DISK)))
    assert fold.counters["unknown_parent"] == 1 and fold.counters["unresolved_store"] == 2
    # a placeholder stored again is a reference; removals drop it like any block
    fold.apply(*s.batch(W, placeholder([77])))
    assert keyed(fold, HOST)[(0, None, 77)].refs == 2 and fold.counters["duplicate_store"] == 1
    fold.apply(*s.batch(W, drop([77], tier=HOST), drop([77], tier=HOST)))
    assert (0, None, 77) not in keyed(fold, HOST)


def test_a_placeholder_ahead_of_the_store_it_copies_is_resolved_when_that_store_comes() -> None:
    s = Stream()
    # A sliding-window group's null-block store (no usable tokens) ahead of the full-attention
    # group's store of the same blocks in one batch, then a CPU placeholder a batch before its GPU store.
    fold, facts = fold_with(s.batch(W, placeholder([1, 2], tier=DEVICE, group=1, kind=SW), put([1, 2], kind=FULL)),
                            s.batch(W, placeholder([3], tier=HOST)))
    window = keyed(fold)
    assert not window[(1, None, 2)].unresolved and window[(1, None, 2)].sequence_hash == seq(1, 2)
    unresolved_1 = msgspec.structs.replace(window[(1, None, 1)], sequence_hash=0, parent_hash=None, local_hash=0, unresolved=True)
    # the unresolved stay ends with cause `resolved`, its resolved copy is stored at that seq
    assert facts[3:5] == [BlockRemovedFact(unresolved_1, RemovalCause.RESOLVED, 1), BlockStoredFact(window[(1, None, 1)])]
    assert keyed(fold, HOST)[(0, None, 3)].unresolved
    fold.apply(*s.batch(W, put([1, 2, 3], kind=FULL)))
    host = keyed(fold, HOST)[(0, None, 3)]
    assert not host.unresolved and host.sequence_hash == seq(1, 2, 3) and host.parent_hash == 2
    assert holds(fold, seq(1, 2, 3), HOST) and not fold.worker_state(W).by_provenance[NATIVE].waiting
    restored = decode_snapshot(encode_snapshot(fold))
    assert list(restored.iter_records()) == list(fold.iter_records())


# --- 4. the residency rule ------------------------------------------------------------------


def test_every_full_attention_group_must_hold_a_block() -> None:
    s = Stream()
    fold, _ = fold_with(s.batch(W, put([1, 2], kind=FULL), put([1], group=1, kind=FULL)))
    assert holds(fold, seq(1)) and not holds(fold, seq(1, 2))
    fold.apply(*s.batch(W, put([2], parent=1, group=1, kind=FULL)))
    assert holds(fold, seq(1, 2))
    fold.apply(*s.batch(W, drop([1], group=0)))
    assert not holds(fold, seq(1)) and holds(fold, seq(1, 2))


def test_a_sliding_window_removal_does_not_unhold_a_block_and_does_not_hold_one_alone() -> None:
    s = Stream()
    fold, _ = fold_with(s.batch(W, put([1, 2], kind=FULL), put([1, 2], group=1, kind=SW, window=4)))
    fold.apply(*s.batch(W, drop([1], group=1)))
    assert holds(fold, seq(1)) and holds(fold, seq(1, 2))
    fold.apply(*s.batch(W, drop([2], group=0)))
    assert not holds(fold, seq(1, 2))  # the sliding-window group's copy does not decide


def test_ownerships_are_alternative_copies_of_a_deciding_group() -> None:
    s = Stream()
    fold, _ = fold_with(s.batch(W, put([1], tier=HOST, owner="cpu", kind=FULL), put([1], tier=HOST, group=1, kind=FULL)))
    assert holds(fold, seq(1), HOST)
    fold.apply(*s.batch(W, put([1], tier=HOST, owner="lmcache", kind=FULL)))
    fold.apply(*s.batch(W, drop([1], tier=HOST, owner="cpu")))
    assert holds(fold, seq(1), HOST)
    fold.apply(*s.batch(W, drop([1], tier=HOST, owner="lmcache")))
    assert not holds(fold, seq(1), HOST)


def test_a_worker_without_a_deciding_group_holds_what_any_group_holds() -> None:
    s = Stream()
    fold, _ = fold_with(s.batch(W, put([1], kind=MAMBA), put([2], group=1, kind=SW)))
    assert holds(fold, seq(1)) and holds(fold, seq(2)) and not holds(fold, seq(3))


def test_undeclared_and_unknown_kinds_decide() -> None:
    s = Stream()
    fold, _ = fold_with(s.batch(W, put([1, 2], kind=FULL), put([1], group=1), put([1, 2], group=2, kind="future_attention")))
    assert holds(fold, seq(1)) and not holds(fold, seq(1, 2))  # group 1, undeclared, lacks 2


def test_a_groups_kind_learned_from_a_later_store_changes_the_rule() -> None:
    s = Stream()
    fold, _ = fold_with(s.batch(W, put([1, 2], kind=FULL), put([1], group=1)))
    assert not holds(fold, seq(1, 2))
    fold.apply(*s.batch(W, put([9], group=1, kind=SW)))
    assert holds(fold, seq(1, 2))


def test_the_rule_reads_only_the_groups_seen_on_each_tier() -> None:
    s = Stream()
    fold, _ = fold_with(s.batch(W, put([1], kind=FULL), put([5], group=1, kind=FULL), put([1], tier=HOST, kind=FULL)))
    assert not holds(fold, seq(1)) and holds(fold, seq(1), HOST)


def test_residency_kinds_and_rules() -> None:
    assert all(not decides(kind) for kind in (
        "sliding_window", "sliding_window_mla", "chunked_local_attention", "mamba", "encoder_only_attention",
        "cross_attention", "Sliding_Window"))
    assert all(decides(kind) for kind in ("full_attention", "mla_attention", "sink_full_attention", "novel", None))
    assert rule_for([2, 0, 1], {0: FULL, 1: SW}) == ResidencyRule((0, 2), True)
    assert rule_for([1, 0], {0: MAMBA, 1: SW}) == ResidencyRule((0, 1), False)


# --- 5. tier-scoped clears ------------------------------------------------------------------


def test_a_tier_clear_empties_only_that_tier() -> None:
    s = Stream()
    fold, _ = fold_with(s.batch(W, put([1, 2]), put([1, 2], group=1), put([1], tier=HOST), placeholder([66], tier=HOST)))
    facts = fold.apply(*s.batch(W, Cleared(DEVICE)))
    assert facts == [InventoryClearedFact(W, NATIVE, RemovalCause.CLEARED, 2, 4, DEVICE)]
    assert fold.records(W, NATIVE, DEVICE) == [] and not holds(fold, seq(1))
    assert sorted(keyed(fold, HOST)) == [(0, None, 1), (0, None, 66)] and holds(fold, seq(1), HOST)
    fold.apply(*s.batch(W, put([2], parent=1)))  # the parent is still known from the host copy
    assert fold.counters["unknown_parent"] == 0 and holds(fold, seq(1, 2))
    facts = fold.apply(*s.batch(W, Cleared(None)))
    assert facts == [InventoryClearedFact(W, NATIVE, RemovalCause.CLEARED, 4, 3, None)]
    assert all(fold.records(W, NATIVE, tier) == [] for tier in Tier)


def test_a_tier_clear_ends_uncertainty_only_when_no_tier_holds_a_block() -> None:
    s = Stream()
    fold, _ = fold_with(s.batch(W, put([1]), put([1], tier=HOST)), s.batch(W, gap(GapReason.MISSED)))
    assert fold.is_uncertain(W)
    assert fold.apply(*s.batch(W, Cleared(DEVICE))) == [InventoryClearedFact(W, NATIVE, RemovalCause.CLEARED, 3, 1, DEVICE)]
    assert fold.is_uncertain(W)
    assert fold.apply(*s.batch(W, Cleared(HOST))) == [
        InventoryClearedFact(W, NATIVE, RemovalCause.CLEARED, 4, 1, HOST), UncertaintyFact(W, NATIVE, False, "cleared", 4),
    ]
    assert not fold.is_uncertain(W)


def test_a_tier_clear_of_the_retained_stream_leaves_the_engines_tier() -> None:
    s = Stream()
    fold, facts = fold_with(s.batch(W, put([1])), s.batch(W, put([1]), provenance=RETAINED),
                            s.batch(W, Cleared(DEVICE), provenance=RETAINED))
    assert facts[-1] == InventoryClearedFact(W, RETAINED, RemovalCause.CLEARED, 3, 1, DEVICE)
    assert holds(fold, seq(1)) and not holds(fold, seq(1), provenance=RETAINED)


# --- 6. snapshots ---------------------------------------------------------------------------


def state_of(fold: InventoryFold) -> tuple:
    return (
        fold.inventory_seq, sorted(fold.counters.items()), list(fold.iter_records()),
        [(w, fold.is_uncertain(w), sorted(fold.worker_state(w).counters.items()),
          [fold.worker_state(w).position(p).groups for p in Provenance]) for w in fold.workers()],
    )


def test_a_snapshot_keeps_groups_ownership_kinds_windows_refs_and_unresolved_records() -> None:
    s = Stream()
    fold, _ = fold_with(s.batch(W, put([1, 2], kind=FULL), put([1, 2], group=3, owner="cpu", kind=SW, window=128),
                                put([2], group=3, owner="cpu", kind=SW, window=128), placeholder([77], owner="cpu")))
    restored = decode_snapshot(encode_snapshot(fold))
    assert state_of(restored) == state_of(fold)
    records = keyed(restored)
    assert records[(3, "cpu", 2)].refs == 2 and records[(3, "cpu", 2)].sliding_window == 128
    assert records[(3, "cpu", 2)].spec_kind == SW and keyed(restored, HOST)[(0, "cpu", 77)].unresolved
    assert holds(restored, seq(1, 2))


# Stores are chain prefixes from their root, so an engine hash always has one chain position
# (a re-parented block has its own test below); placeholders and removals draw from any id.
CHAINS = ((1, 2, 3, 4), (5, 6, 7), (8, 9))
GROUP_KINDS = {0: (FULL, None), 1: (SW,), 2: ("mla_attention",)}
TIERS, OWNERS, WORKERS = (DEVICE, HOST), (None, "cpu"), (W, WorkerId("vllm-a", 1))
IDS = st.lists(st.sampled_from([*range(1, 10), 90, 91]), min_size=1, max_size=3)


@st.composite
def group_event(draw, make):
    group = draw(st.sampled_from(sorted(GROUP_KINDS)))
    kind = draw(st.sampled_from(GROUP_KINDS[group]))
    return make(draw, tier=draw(st.sampled_from(TIERS)), group=group, owner=draw(st.sampled_from(OWNERS)), kind=kind)


EVENTS = st.one_of(
    group_event(lambda draw, **k: (put(draw(st.sampled_from(CHAINS))[: draw(st.integers(1, 4))], **k),)),
    group_event(lambda draw, **k: (placeholder(draw(IDS), **k),)),
    group_event(lambda draw, kind, **k: (drop(draw(IDS), **k),)),
    st.sampled_from(TIERS).map(lambda tier: (Cleared(tier),)),
    st.just((Cleared(None),)),
    st.just((gap(GapReason.MISSED),)),
)
STEP = st.tuples(st.sampled_from(WORKERS), st.sampled_from(list(Provenance)), st.lists(EVENTS, min_size=1, max_size=3))
UNIVERSE = [0, *(seq(*chain[:k]) for chain in CHAINS for k in range(1, len(chain) + 1))]


@settings(deadline=None, max_examples=150)
@given(st.lists(STEP, min_size=1, max_size=25), st.data())
def test_snapshot_then_rest_equals_folding_everything_with_groups(steps: list, data: st.DataObject) -> None:
    stream = Stream()
    batches = [stream.batch(w, *(e for events in step for e in events), provenance=p) for w, p, step in steps]
    cut = data.draw(st.integers(0, len(batches)))
    whole, head = InventoryFold(), InventoryFold()
    whole.apply_all(batches)
    head.apply_all(batches[:cut])
    restored = decode_snapshot(encode_snapshot(head))
    assert state_of(restored) == state_of(head)
    restored.apply_all(batches[cut:])
    assert state_of(restored) == state_of(whole)
    for worker in WORKERS:
        for provenance in Provenance:
            for tier in Tier:
                assert [restored.holds(worker, provenance, tier, h) for h in UNIVERSE] == [
                    whole.holds(worker, provenance, tier, h) for h in UNIVERSE]


def _diverges(*batches) -> tuple[InventoryFold, InventoryFold]:
    """The fold of `batches`, and the same fold after a snapshot round trip."""
    fold, _ = fold_with(*batches)
    return fold, decode_snapshot(encode_snapshot(fold))


def test_a_deciding_group_that_emptied_a_tier_decides_the_same_after_a_snapshot() -> None:
    s = Stream()
    fold, restored = _diverges(s.batch(W, put([1]), put([1], group=1)), s.batch(W, drop([1], group=1)), s.batch(W, put([2])))
    assert holds(restored, seq(2)) == holds(fold, seq(2))  # live: False (group 1 seen), restored: True


def test_a_groups_learned_kind_survives_a_snapshot() -> None:
    s = Stream()
    fold, restored = _diverges(s.batch(W, put([1], kind=FULL), put([1], group=1)), s.batch(W, put([1], group=1, kind=SW)),
                               s.batch(W, put([2], kind=FULL)))
    assert holds(restored, seq(2)) == holds(fold, seq(2))  # live: True (group 1 sliding window), restored: False


def test_a_child_chains_from_the_surviving_copy_of_a_reparented_block() -> None:
    s = Stream()
    fold, restored = _diverges(s.batch(W, put([3])), s.batch(W, put([5]), put([5], parent=3, group=1)),
                               s.batch(W, drop([5], group=1)))
    child = s.batch(W, put([6], parent=5))
    fold.apply(*child)
    restored.apply(*child)
    assert keyed(fold)[(0, None, 6)].sequence_hash == keyed(restored)[(0, None, 6)].sequence_hash == seq(5, 6)


# --- 7. version-1 records -------------------------------------------------------------------


def test_a_version_1_record_reads_as_group_0_no_ownership_and_a_clear_of_every_tier() -> None:
    record = msgspec.msgpack.encode({
        "v": 1, "publisher": "w", "dp_rank": 0, "epoch": 0, "seq": 1, "engine_ts": 1.0, "ingest_ts": 2.0,
        "provenance": "native",
        "events": [["S", "host", [1, 2], None, 16, [11, 12], None, None, 0], ["R", "host", [1]], ["C"]],
    })
    batch = decode_batch(record)
    assert batch.events == (
        Stored(HOST, (1, 2), None, 16, (11, 12), None, None, 0, None, None, None), Removed(HOST, (1,), 0, None), Cleared(None),
    )
    fold, facts = fold_with((batch, 1))
    assert facts[-1] == InventoryClearedFact(WorkerId("w"), NATIVE, RemovalCause.CLEARED, 1, 1, None)


def test_a_version_2_record_carries_group_ownership_kind_window_and_a_clears_tier() -> None:
    events = (put([1], tier=HOST, group=2, owner="cpu", kind=SW, window=64), placeholder([1]), drop([1], group=2, owner="cpu"),
              Cleared(HOST))
    batch, _ = Stream().batch(W, *events)
    assert decode_batch(encode_batch(batch)) == batch
