"""Dynamo's indexer as an outside oracle: decide's per-worker device overlap equals
`dynamo._core.RadixTree.find_matches(...).scores` fed the same stored/removed events."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvledger.events import EventBatch, Provenance, Removed, Stored, Tier, WorkerId
from kvledger.reuse import ReuseRequest
from kvledger.settings import ReuseSettings
from builders import BLOCK_SIZE, local_hashes

from decide.cpu import CpuBackend
from decide.index import InventoryIndex
from decide_inventories import PATHS, engine_hash

dynamo_core = pytest.importorskip("dynamo._core", reason="ai-dynamo-runtime is not installed")

WORKER_COUNT = 4


def _worker(number: int) -> WorkerId:
    return WorkerId(f"w{number}")


def _dynamo_event(event_id: int, event: Stored | Removed) -> bytes:
    if isinstance(event, Stored):
        data = {"stored": {"parent_hash": event.parent_hash, "blocks": [
            {"block_hash": block, "tokens_hash": local} for block, local in zip(event.block_hashes, event.local_hashes)]}}
    else:
        data = {"removed": {"block_hashes": list(event.block_hashes)}}
    return json.dumps({"event_id": event_id, "data": data}).encode()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_device_overlaps_equal_dynamo_radix_tree_scores(data: st.DataObject) -> None:
    tree = dynamo_core.RadixTree()
    index = InventoryIndex()
    held: list[set[int]] = [set() for _ in range(WORKER_COUNT)]
    seqs = [0] * WORKER_COUNT
    parent_of: dict[int, int | None] = {}
    for stream_seq in range(1, data.draw(st.integers(1, 30)) + 1):
        number = data.draw(st.integers(0, WORKER_COUNT - 1))
        mine = held[number]
        parents = {parent_of[block] for block in mine}
        leaves = sorted(mine - parents)
        if leaves and data.draw(st.integers(0, 3)) == 0:
            # Evictions take chain tails, as an LRU cache does. (A removal from the middle is
            # where the two differ: Dynamo drops the worker's descendants of the block with
            # it, kvledger's fold keeps them and the contiguous prefix stops at the hole.)
            gone = data.draw(st.lists(st.sampled_from(leaves), min_size=1, max_size=3, unique=True))
            event = Removed(Tier.DEVICE, tuple(gone))
            mine.difference_update(gone)
        else:
            path = data.draw(st.sampled_from(PATHS))
            # Dynamo refuses a store under a parent it does not hold, so parents are always held.
            starts = [0] + [i for i in range(1, len(path)) if engine_hash(path, i - 1) in mine]
            start = data.draw(st.sampled_from(starts))
            end = data.draw(st.integers(start + 1, len(path)))
            blocks = tuple(engine_hash(path, i) for i in range(start, end))
            if mine.intersection(blocks):
                # A second store of a held block is one more reference in kvledger (vLLM stores
                # and removes each copy of a block), a no-op in Dynamo's tree: not compared here.
                continue
            parent_of.update({engine_hash(path, i): engine_hash(path, i - 1) if i else None for i in range(start, end)})
            event = Stored(Tier.DEVICE, blocks, engine_hash(path, start - 1) if start else None, BLOCK_SIZE,
                           local_hashes(list(path[start:end])))
            mine.update(blocks)
        tree.apply_event(number, _dynamo_event(stream_seq, event))
        index.apply(EventBatch(_worker(number), 0, seqs[number], 1.0, 2.0, Provenance.NATIVE, (event,)), stream_seq)
        seqs[number] += 1

    backend = CpuBackend(index)
    for path in PATHS:
        for length in range(1, len(path) + 1):
            local = local_hashes(list(path[:length]))
            scores = tree.find_matches(local).scores
            answer = backend.decide(ReuseRequest("q", local, BLOCK_SIZE), ReuseSettings())
            device = {name: overlap.device for name, overlap in answer.overlaps.items() if overlap.device}
            assert device == {_worker(worker).name: score for (worker, _dp), score in scores.items() if score}
