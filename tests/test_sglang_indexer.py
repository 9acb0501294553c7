"""decide as SGLang's external KV indexer, asked over gRPC as SGLang's router asks it.

Simulated SGLang workers publish on ZMQ (engine hashes as SGLang computes them: SHA-256
chained per page, truncated to a signed 64-bit integer); ingest puts the batches on
NATS, decide follows them, and the router's questions go through stubs generated from
SGLang's own `kv_indexer.proto`, with the hashes the router computes from a request's
tokens. Every answer must equal what the workers hold (the test keeps the engines' truth).
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import grpc.aio
import pytest

from kvledger.decide.routers.protos import kv_indexer_pb2 as pb
from kvledger.decide.routers.protos import kv_indexer_pb2_grpc as pb_grpc
from kvledger.decide.serving.service import DecideService
from engines import engine_endpoints, wait_until
from kvledger.core.events import Provenance, WorkerId
from kvledger.ingest.bridge import Bridge
from kvledger.ingest.endpoints import StreamSource
from kvledger.ingest.wire import Engine
from kvledger.sim.engine import SimulatedEngine
from kvledger.sim.vllm import VllmBlockRemoved, VllmBlockStored
from pipeline import pipeline_settings

pytestmark = pytest.mark.service

PAGE = 4
MEDIUM = {pb.TIER_HBM: "GPU", pb.TIER_DRAM: "CPU_PINNED", pb.TIER_SSD: "DISK"}
# Workers, and the router-facing URL each is registered under; "sgl-c" has none (unroutable).
ADDRESSES = {"sgl-a": "http://10.0.0.1:30000", "sgl-b": "http://10.0.0.2:30000"}
WORKERS = ("sgl-a", "sgl-b", "sgl-c")
SERVICE = "/kv_indexer.v1.KVIndexer/"


def sglang_hashes(tokens: list[int], page: int = PAGE) -> list[int]:
    """SGLang's page hashes (the router's `compute_block_hashes`): SHA-256 over the previous page's
    full digest and the page's tokens (u32 little-endian), its first 8 bytes as a signed integer."""
    out, prior = [], b""
    for start in range(0, len(tokens), page):
        digest = hashlib.sha256(prior + b"".join(t.to_bytes(4, "little") for t in tokens[start:start + page])).digest()
        out.append(int.from_bytes(digest[:8], "big", signed=True))
        prior = digest
    return out


def test_sglang_hashes_match_the_routers_goldens() -> None:
    # The router's own cross-language goldens (hash.rs).
    assert sglang_hashes([1, 2, 3, 4], 4) == [-3488128144981237669]
    assert sglang_hashes([1, 2, 3, 4, 5], 4) == [-3488128144981237669, -3787494577174227566]
    assert sglang_hashes([10, 20, 30, 40, 50, 60, 70, 80], 2) == [
        978178666101069530, -895308556211281782, -8033692805846017938, 835415944263129316]


class Worker:
    """One simulated SGLang worker and what it holds (the engine's truth): tier -> engine hashes."""

    def __init__(self, name: str, engine: SimulatedEngine) -> None:
        self.name = name
        self.engine = engine
        self.held: dict[int, set[int]] = {tier: set() for tier in MEDIUM}

    def holds_anywhere(self, block: int) -> bool:
        return any(block in blocks for blocks in self.held.values())

    async def store(self, tier: int, tokens: list[int], start: int, end: int) -> None:
        hashes = sglang_hashes(tokens[: end * PAGE])
        blocks = tuple(hashes[start:end])
        event = VllmBlockStored(blocks, hashes[start - 1] if start else None, tuple(tokens[start * PAGE:end * PAGE]),
                                PAGE, medium=MEDIUM[tier])
        await self.engine.publish([event], ts=time.time())
        self.held[tier].update(blocks)

    async def remove(self, tier: int, blocks: list[int]) -> None:
        await self.engine.publish([VllmBlockRemoved(tuple(blocks), medium=MEDIUM[tier])], ts=time.time())
        self.held[tier].difference_update(blocks)

    async def step(self, rng: random.Random, paths: list[list[int]]) -> None:
        tier = rng.choice(list(MEDIUM))
        held = sorted(self.held[tier])
        if held and rng.random() < 0.3:
            await self.remove(tier, rng.sample(held, min(len(held), rng.randint(1, 3))))
            return
        path = rng.choice(paths)
        hashes = sglang_hashes(path)
        # SGLang stores a page under a parent it holds; a block already on the tier is not stored again.
        starts = [0] + [i for i in range(1, len(hashes)) if self.holds_anywhere(hashes[i - 1])]
        start = rng.choice(starts)
        end = start
        while end < len(hashes) and hashes[end] not in self.held[tier] and (end == start or rng.random() < 0.8):
            end += 1
        if end > start:
            await self.store(tier, path, start, end)


def expected_prefix(workers: list[Worker], hashes: list[int]) -> pb.MatchExternalKvPrefixResponse:
    found = []
    for worker in workers:
        count = 0
        while count < len(hashes) and worker.holds_anywhere(hashes[count]):
            count += 1
        if count and worker.name in ADDRESSES:
            found.append((worker.name, count))
    if not any(worker.holds_anywhere(hashes[0]) for worker in workers):
        return pb.MatchExternalKvPrefixResponse(blocks_read=1)
    found.sort(key=lambda item: -item[1])
    response = pb.MatchExternalKvPrefixResponse(best_prefix_blocks=found[0][1] if found else 0, blocks_read=len(hashes))
    for name, count in found:
        response.matches.add(worker_address=ADDRESSES[name], matched_prefix_blocks=count, worker_id=name)
    return response


def held_by_tier(workers: list[Worker], hashes: list[int]) -> dict[str, dict[int, list[str]]]:
    """worker -> tier -> the requested hashes it holds there, in request order."""
    return {worker.name: {tier: [str(h) for h in hashes if h in blocks] for tier, blocks in worker.held.items()
                          if any(h in blocks for h in hashes)}
            for worker in workers if any(worker.holds_anywhere(h) for h in hashes)}


def answered_by_tier(response: pb.MatchExternalKvResponse) -> dict[str, dict[int, list[str]]]:
    return {match.worker_id: {tiers.tier: list(tiers.hashes) for tiers in match.hashes_by_tier}
            for match in response.matches}


def prefix_rows(response: pb.MatchExternalKvPrefixResponse) -> tuple:
    """The answer with workers of equal prefix in either order (sgl-kv-indexer's own order among them is a hash map's)."""
    return (response.best_prefix_blocks, response.blocks_read,
            sorted((-m.matched_prefix_blocks, m.worker_id, m.worker_address) for m in response.matches),
            [m.matched_prefix_blocks for m in response.matches])


@contextlib.asynccontextmanager
async def sglang_fleet(nats_url: str, tmp_path: Path) -> AsyncIterator[tuple[DecideService, list[Worker], pb_grpc.KVIndexerStub]]:
    routers = tmp_path / "routers.toml"
    routers.write_text("[sglang.workers]\n" + "".join(f'"{name}" = "{url}"\n' for name, url in ADDRESSES.items()))
    settings = pipeline_settings(nats_url, "sqlite://", **{
        "decide.backend": "cpu", "decide.grpc_listen": "127.0.0.1:0", "decide.grpc_routers": str(routers),
        "decide.grpc_max_message_bytes": 256 * 1024})
    workers, sources = [], []
    async with contextlib.AsyncExitStack() as stack:
        for name in WORKERS:
            pub, replay = engine_endpoints()
            engine = await stack.enter_async_context(SimulatedEngine(pub, replay))
            workers.append(Worker(name, engine))
            sources.append(StreamSource(WorkerId(name), engine.pub_endpoint, engine.replay_endpoint,
                                        Provenance.NATIVE, Engine.SGLANG))
        bridge = await stack.enter_async_context(Bridge(settings, sources))
        service = await stack.enter_async_context(DecideService(settings))
        await bridge.wait_ready(timeout=30)
        await service.wait_ready(timeout=60)
        channel = await stack.enter_async_context(grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc.port}"))
        yield service, workers, pb_grpc.KVIndexerStub(channel)


async def caught_up(stub: pb_grpc.KVIndexerStub, workers: list[Worker], number: int) -> None:
    """A marker page stored on every worker's device tier, waited for until decide holds them all."""
    for worker in workers:
        await worker.store(pb.TIER_HBM, [4_000_000_000 + number, WORKERS.index(worker.name), 0, 0], 0, 1)
    markers = [str(sglang_hashes([4_000_000_000 + number, position, 0, 0])[0]) for position in range(len(workers))]

    async def all_seen() -> bool:
        answer = await stub.MatchExternalKv(pb.MatchExternalKvRequest(hashes=markers))
        return len(answer.matches) == len(workers)

    await wait_until(all_seen, 30, f"decide holding marker {number} of every worker")


def paths_of(rng: random.Random) -> list[list[int]]:
    trunk = [rng.randrange(1, 50_000) for _ in range(PAGE * 6)]
    paths = [trunk]
    for _ in range(5):  # branches share a prefix of the trunk, then diverge
        cut = rng.randrange(1, 6) * PAGE
        paths.append(trunk[:cut] + [rng.randrange(1, 50_000) for _ in range(PAGE * rng.randrange(1, 5))])
    return paths


async def test_answers_equal_the_workers_truth(nats_server, tmp_path: Path) -> None:
    rng = random.Random(44)
    async with sglang_fleet(nats_server.url, tmp_path) as (service, workers, stub):
        paths = paths_of(rng)
        compared = 0
        for phase in range(4):
            for _ in range(30):
                await rng.choice(workers).step(rng, paths)
            await caught_up(stub, workers, phase)
            for path in paths:
                for pages in range(1, len(path) // PAGE + 1):
                    hashes = sglang_hashes(path[: pages * PAGE])
                    # As the router asks: decimal strings, the first page first, no ceiling.
                    asked = [str(h) for h in hashes]
                    answer = await stub.MatchExternalKvPrefix(pb.MatchExternalKvPrefixRequest(hashes=asked))
                    assert prefix_rows(answer) == prefix_rows(expected_prefix(workers, hashes))
                    placements = await stub.MatchExternalKv(pb.MatchExternalKvRequest(hashes=asked))
                    assert answered_by_tier(placements) == held_by_tier(workers, hashes)
                    for match in placements.matches:
                        assert match.address == ADDRESSES.get(match.worker_id, "")
                    compared += 1
        assert compared > 100

        # Not every answer was empty, and DRAM and SSD extended some prefixes past HBM's.
        hashes = sglang_hashes(paths[0])
        held = await stub.MatchExternalKv(pb.MatchExternalKvRequest(hashes=[str(h) for h in hashes]))
        assert {tiers.tier for match in held.matches for tiers in match.hashes_by_tier} == set(MEDIUM)

        # max_blocks bounds the scan; an unsigned spelling of a hash is the same block.
        answer = await stub.MatchExternalKvPrefix(pb.MatchExternalKvPrefixRequest(
            hashes=[str(h % (1 << 64)) for h in hashes], max_blocks=2))
        assert answer.blocks_read == 2 and answer.best_prefix_blocks <= 2
        assert prefix_rows(answer) == prefix_rows(expected_prefix(workers, hashes[:2]))

        # Hit counts: only what count_as_hit matched counts, a hash asked twice once. The block:
        # the last marker page of sgl-a, held by it alone.
        marker = sglang_hashes([4_000_000_000 + 3, 0, 0, 0])[0]
        first = str(marker)
        unknown = str(sglang_hashes([7, 7, 7, 7])[0])
        before = await stub.GetExternalKvHitCounts(pb.GetExternalKvHitCountsRequest(hashes=[first, unknown]))
        assert list(before.entries) == []
        await stub.MatchExternalKv(pb.MatchExternalKvRequest(hashes=[first, first, unknown], count_as_hit=True))
        await stub.MatchExternalKv(pb.MatchExternalKvRequest(hashes=[first], count_as_hit=True))
        await stub.MatchExternalKv(pb.MatchExternalKvRequest(hashes=[first]))
        counts = await stub.GetExternalKvHitCounts(pb.GetExternalKvHitCountsRequest(hashes=[first, unknown, first]))
        assert [(entry.hash, entry.hit_count_total) for entry in counts.entries] == [(first, 2)]
        # Once no worker holds the block, its count is gone (sgl-kv-indexer forgets it with its last placement).
        await workers[0].remove(pb.TIER_HBM, [marker])
        await caught_up(stub, workers, 99)
        gone = await stub.GetExternalKvHitCounts(pb.GetExternalKvHitCountsRequest(hashes=[first]))
        assert list(gone.entries) == []
        assert service.grpc.requests.labels("kv_indexer.v1.KVIndexer", "MatchExternalKvPrefix").value >= compared


async def test_bad_input_gets_sglangs_status_codes_and_is_counted(nats_server, tmp_path: Path) -> None:
    async with sglang_fleet(nats_server.url, tmp_path) as (service, workers, stub):
        refusals = service.grpc.refusals
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc.port}")
        async with channel:
            raw = channel.unary_unary(SERVICE + "MatchExternalKvPrefix")  # bytes in, bytes out

            async def status_of(call) -> tuple[grpc.StatusCode, str]:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call
                return caught.value.code(), caught.value.details()

            code, details = await status_of(raw(b"\x0a\x05ab"))  # a string field cut short
            assert code is grpc.StatusCode.INTERNAL and details.startswith("failed to decode Protobuf message")
            code, details = await status_of(raw(b"\x0a\x02\xff\xfe"))  # a string that is not UTF-8
            assert code is grpc.StatusCode.INTERNAL
            too_big = pb.MatchExternalKvPrefixRequest(hashes=["1" * 1000] * 300).SerializeToString()
            code, details = await status_of(raw(too_big))
            assert (code, details) == (grpc.StatusCode.OUT_OF_RANGE, "Error, decoded message length too large: "
                                       f"found {len(too_big)} bytes, the limit is: {256 * 1024} bytes")
            assert refusals.labels("kv_indexer.v1.KVIndexer", "MatchExternalKvPrefix", "INTERNAL", "malformed").value == 2
            assert refusals.labels("kv_indexer.v1.KVIndexer", "MatchExternalKvPrefix", "OUT_OF_RANGE",
                                   "message_too_large").value == 1

        async def refused(call) -> tuple[grpc.StatusCode, str]:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call
            return caught.value.code(), caught.value.details()

        assert await refused(stub.MatchExternalKv(pb.MatchExternalKvRequest())) == (
            grpc.StatusCode.INVALID_ARGUMENT, "hashes must not be empty")
        assert await refused(stub.MatchExternalKvPrefix(pb.MatchExternalKvPrefixRequest(hashes=["1", ""]))) == (
            grpc.StatusCode.INVALID_ARGUMENT, "hashes must not contain empty values")
        assert await refused(stub.GetExternalKvHitCounts(pb.GetExternalKvHitCountsRequest(hashes=["1"] * 16_385))) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED, "request contains 16385 hashes; maximum is 16384")
        code, details = await refused(stub.ApplyExternalKvBatch(pb.ApplyExternalKvBatchRequest(
            worker_id="sgl-a", seq=1, actions=[pb.ExternalKvAction(type=pb.ACTION_REPORT, tier=pb.TIER_HBM, hashes=["1"])])))
        assert code is grpc.StatusCode.UNIMPLEMENTED and "kvledger ingest" in details
        for method, code, reason in (("MatchExternalKv", "INVALID_ARGUMENT", "empty_hashes"),
                                     ("MatchExternalKvPrefix", "INVALID_ARGUMENT", "empty_hash_value"),
                                     ("GetExternalKvHitCounts", "RESOURCE_EXHAUSTED", "too_many_hashes"),
                                     ("ApplyExternalKvBatch", "UNIMPLEMENTED", "apply_refused")):
            assert refusals.labels("kv_indexer.v1.KVIndexer", method, code, reason).value == 1
        assert "kvledger_decide_grpc_refusals_total" in service.metrics.text().decode()

        # Hashes that are no 64-bit integer are opaque strings nobody holds, not errors; decide still answers.
        answer = await stub.MatchExternalKvPrefix(pb.MatchExternalKvPrefixRequest(hashes=["abc", "99999999999999999999999"]))
        assert answer == pb.MatchExternalKvPrefixResponse(blocks_read=1)
        await caught_up(stub, workers, 1)


async def test_a_taken_port_stops_the_front_with_a_startup_error() -> None:
    import socket

    from kvledger.decide.routers.grpc_front import GrpcFront
    from kvledger.decide.metrics import DecideMetrics
    from kvledger.decide.inventory.index import InventoryIndex
    from kvledger.decide.startup import StartupError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        front = GrpcFront(InventoryIndex, DecideMetrics(), f"127.0.0.1:{taken.getsockname()[1]}")
        with pytest.raises(StartupError, match="decide.grpc_listen"):
            await front.start()
        await front.close()


def test_placements_are_by_engine_hash_per_worker_plain_promoted_or_joined_midway() -> None:
    """Every kind of worker the index holds is asked by its own engine hashes, as sgl-kv-indexer keys placements."""
    from kvledger.decide.inventory.index import InventoryIndex
    from kvledger.decide.routers.sglang_indexer import SglangIndexer
    from kvledger.core.events import EventBatch, Stored, Tier
    from kvledger.core.hashing import local_block_hashes

    tokens = list(range(1, 4 * PAGE + 1))
    engines = [h % (1 << 64) for h in sglang_hashes(tokens)]
    local = local_block_hashes(tokens, PAGE)
    index = InventoryIndex()
    batches = {
        # plain: the whole chain on the device, its last page also on disk
        "plain": [Stored(Tier.DEVICE, tuple(engines), None, PAGE, tuple(local)),
                  Stored(Tier.DISK, (engines[3],), engines[2], PAGE, (local[3],))],
        # joined midway: pages 2-3 under a parent kvledger never saw, so another chain of sequence hashes
        "midway": [Stored(Tier.HOST, tuple(engines[2:]), engines[1], PAGE, tuple(local[2:]))],
        # promoted: a second engine hash for one block moves the worker into the fold
        "promoted": [Stored(Tier.DEVICE, (12345,), None, PAGE, (local[0],)),
                     Stored(Tier.DEVICE, tuple(engines[:2]), None, PAGE, tuple(local[:2]))],
    }
    stream_seq = 0
    for name, events in batches.items():
        for seq, event in enumerate(events):
            stream_seq += 1
            index.apply(EventBatch(WorkerId(name), 0, seq, 1.0, 1.0, Provenance.NATIVE, (event,)), stream_seq)
    assert [worker.publisher for worker in index.promoted_workers] == ["promoted"]

    indexer = SglangIndexer({"plain": "http://p", "midway": "http://m", "promoted": "http://q"})
    asked = [str(h - (1 << 64) if h >= 1 << 63 else h) for h in engines]
    answer = indexer.match(index, pb.MatchExternalKvRequest(hashes=asked))
    assert answered_by_tier(answer) == {
        "plain": {pb.TIER_HBM: asked, pb.TIER_SSD: asked[3:]},
        "promoted": {pb.TIER_HBM: asked[:2]},
        "midway": {pb.TIER_DRAM: asked[2:]},
    }
    prefix = indexer.match_prefix(index, pb.MatchExternalKvPrefixRequest(hashes=asked))
    assert [(m.worker_id, m.matched_prefix_blocks) for m in prefix.matches] == [("plain", 4), ("promoted", 2)]
    assert (prefix.best_prefix_blocks, prefix.blocks_read) == (4, 4)
    # A request starting at page 2 is a prefix the midway worker holds (sgl-kv-indexer does not check the chain).
    later = indexer.match_prefix(index, pb.MatchExternalKvPrefixRequest(hashes=asked[2:]))
    assert [(m.worker_id, m.matched_prefix_blocks) for m in later.matches] == [("plain", 2), ("midway", 2)]
