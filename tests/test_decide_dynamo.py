"""Dynamo's indexer as an outside oracle: decide's per-worker device overlap equals
`dynamo._core.RadixTree.find_matches(...).scores` fed the same stored/removed events."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvledger.core.events import EventBatch, Provenance, Removed, Stored, Tier, WorkerId
from kvledger.core.reuse import ReuseRequest
from kvledger.core.settings import ReuseSettings
from builders import BLOCK_SIZE, local_hashes

from kvledger.decide.inventory.index import InventoryIndex
from kvledger.decide.ranking.cpu import CpuBackend
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


# --- decide's answers to Dynamo's indexer API, without a server ---------------------------------------

from kvledger.runtime.http import Request  # noqa: E402

from kvledger.decide.routers.dynamo_indexer import DynamoIndexerApi  # noqa: E402


def _call(api: DynamoIndexerApi, method: str, path: str, body: object = None, query: str = "") -> tuple[int, object]:
    route = api.routes(max_request_bytes=1 << 20, max_query_bytes=1 << 20)[(method, path)]
    response = route.handler(Request(method, path, {"content-type": "application/json"},
                                     json.dumps(body).encode() if body is not None else b"", query))
    return response.status, json.loads(response.body)


def test_workers_are_active_right_after_register_as_dynamo_says() -> None:
    # Dynamo 1.6.1's indexer lists a listener "active" as soon as it is registered, before any event.
    api = DynamoIndexerApi(InventoryIndex)
    body = {"instance_id": 7, "endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5558",
            "model_name": "m", "block_size": 16, "additionalsalt": "tenant"}
    assert _call(api, "POST", "/register", body) == (201, {"status": "ok"})
    assert _call(api, "POST", "/register", {**body, "dp_rank": 1, "additional_salt": "tenant"})[0] == 201
    [worker] = _call(api, "GET", "/workers")[1]
    assert worker["status"] == "active"
    assert {rank: item["status"] for rank, item in worker["listeners"].items()} == {"0": "active", "1": "active"}


def test_query_reads_rows_listed_and_spilled_into_bitmask_rows_alike() -> None:
    """Forty workers hold one chain (its rows spill past the listed holders), each to its own depth and tier."""
    index = InventoryIndex()
    api = DynamoIndexerApi(lambda: index)
    path = PATHS[0]
    local = local_hashes(list(path))
    expected = {}
    tiers = (Tier.DEVICE, Tier.HOST, Tier.DISK)
    for number in range(40):
        depth, tier = number % len(path) + 1, tiers[number % 3]
        blocks = tuple(engine_hash(path, i) for i in range(depth))
        event = Stored(tier, blocks, None, BLOCK_SIZE, tuple(local[:depth]))
        index.apply(EventBatch(WorkerId(f"p{number}"), 0, 0, 1.0, 2.0, Provenance.NATIVE, (event,)), number + 1)
        assert _call(api, "POST", "/register", {"instance_id": number, "endpoint": "tcp://h:1", "model_name": "m",
                                                "block_size": BLOCK_SIZE, "publisher": f"p{number}"})[0] == 201
        tokens = depth * BLOCK_SIZE
        gpu = tokens if tier is Tier.DEVICE else 0
        cpu = tokens if tier is not Tier.DISK else 0
        expected[str(number)] = {"longest_matched": tokens, "gpu": gpu, "dp": {"0": gpu}, "cpu": cpu, "disk": tokens}
    status, answer = _call(api, "POST", "/query_by_hash", {"block_hashes": [h - (1 << 64) if h >= 1 << 63 else h
                                                                            for h in local], "model_name": "m"})
    assert status == 200 and answer["instances"] == expected
    assert answer["scores"] == {name: {"0": match["gpu"]} for name, match in expected.items() if match["gpu"]}
