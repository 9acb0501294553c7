"""decide as a drop-in for Dynamo's standalone KV indexer, checked against the indexer itself.

Dynamo's own indexer (`python -m dynamo.indexer` from the `ai-dynamo-runtime` wheel) and
kvledger (ingest → NATS → decide) follow the same engines' ZMQ sockets, are registered with
the same `/register` bodies and asked the same `/query`, `/query_by_hash` and `/workers`
questions; every answer is compared. Where Dynamo is wrong about a feature kvledger handles,
`GOLDEN_DIFFERENCES` says which, and kvledger's answer is checked against its reference fold
(which `tests/test_golden_engines.py` checks against the engines' own account).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
import xxhash

from kvledger.decide.serving.service import DecideService
from engines import engine_endpoints, wait_until
from kvledger.core.decision_codec import request_from_json
from kvledger.core.events import Provenance, Tier, WorkerId
from kvledger.core.fold import InventoryFold
from kvledger.core.hashing import local_block_hashes, sequence_hashes
from kvledger.ingest.bridge import Bridge
from kvledger.ingest.endpoints import StreamSource
from kvledger.ingest.wire import Engine
from kvledger.sim.engine import SimulatedEngine
from kvledger.sim.vllm import VllmBlockRemoved, VllmBlockStored, encode_vllm_batch
from pipeline import pipeline_settings
from services import free_ports
from test_golden_engines import FIXTURES, fixture_worker, folded, load, request_body

pytest.importorskip("dynamo.llm", reason="ai-dynamo-runtime is not installed")
pytestmark = pytest.mark.service

TOKEN = "dropin-token"
U64 = 1 << 64
MARKER_TOKEN = 4_000_000_000  # token ids no request uses: the barrier blocks'


# --- both indexers side by side ---------------------------------------------------------------


class SideBySide:
    """Dynamo's indexer process and decide's HTTP front, asked the same things."""

    def __init__(self, session: aiohttp.ClientSession, dynamo_port: int, decide_port: int) -> None:
        self.session = session
        self.dynamo = f"http://127.0.0.1:{dynamo_port}"
        self.kvledger = f"http://127.0.0.1:{decide_port}"

    async def one(self, base: str, method: str, path: str, body: object = None) -> tuple[int, object]:
        headers = {"Authorization": f"Bearer {TOKEN}"} if base == self.kvledger else {}
        async with self.session.request(method, base + path, json=body, headers=headers) as reply:
            text = await reply.text()
            if reply.content_type == "application/json":
                return reply.status, json.loads(text)
            return reply.status, text

    async def both(self, method: str, path: str, body: object = None) -> tuple[tuple[int, object], tuple[int, object]]:
        return await asyncio.gather(self.one(self.dynamo, method, path, body), self.one(self.kvledger, method, path, body))

    async def same(self, method: str, path: str, body: object = None) -> tuple[int, object]:
        dynamo, kvledger = await self.both(method, path, body)
        assert kvledger == dynamo, (method, path, body)
        return kvledger

    async def workers(self, query: str = "") -> None:
        """`GET /workers` answered alike (Dynamo lists them in hash order).

        Dynamo's listener is "pending" for the moment between `/register` and its socket being set
        up (its task runs after the answer), then "active"; kvledger's is active at once, so the
        comparison waits out that moment on Dynamo's side.
        """
        async def settled() -> bool:
            status, listed = await self.one(self.dynamo, "GET", "/workers" + query)
            return status != 200 or all(worker["status"] != "pending" for worker in listed)

        await wait_until(settled, 10, "Dynamo's listeners set up", interval=0.01)
        dynamo, kvledger = await self.both("GET", "/workers" + query)
        key = lambda worker: worker["instance_id"]  # noqa: E731
        assert (kvledger[0], sorted(kvledger[1], key=key)) == (dynamo[0], sorted(dynamo[1], key=key))

    async def wait_for_marker(self, model: str, tokens: list[int], instance: int, rank: int, block_size: int) -> None:
        """Both hold the marker block: everything the engine published before it has been applied."""
        body = {"token_ids": tokens, "model_name": model}

        async def seen() -> bool:
            answers = await self.both("POST", "/query", body)
            return all(status == 200 and answer["instances"].get(str(instance), {}).get("dp", {}).get(str(rank)) == block_size
                       for status, answer in answers)

        await wait_until(seen, 30, f"instance {instance} rank {rank}'s marker in both indexers")


@contextlib.contextmanager
def dynamo_indexer(peers: str | None = None) -> Iterator[int]:
    """`python -m dynamo.indexer` on a free port, single-threaded (recovering from `peers` first); its port."""
    [port] = free_ports(1)
    process = subprocess.Popen([sys.executable, "-m", "dynamo.indexer", "--port", str(port), "--threads", "1",
                                *(("--peers", peers) if peers else ())],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        yield port
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.asynccontextmanager
async def side_by_side(nats_url: str, sources: list[StreamSource], token: str | None = TOKEN) -> AsyncIterator[SideBySide]:
    tokens = {"decide.http_token": token} if token else {}
    settings = pipeline_settings(nats_url, "sqlite://", **tokens, **{"decide.backend": "cpu"})
    with dynamo_indexer() as dynamo_port:
        async with Bridge(settings, sources) as bridge, DecideService(settings) as service, aiohttp.ClientSession() as session:
            await bridge.wait_ready(timeout=30)
            await service.wait_ready(timeout=60)
            pair = SideBySide(session, dynamo_port, service.http_port)

            async def dynamo_up() -> bool:
                with contextlib.suppress(aiohttp.ClientError):
                    return (await pair.one(pair.dynamo, "GET", "/health"))[0] == 200
                return False

            await wait_until(dynamo_up, 30, "Dynamo's indexer answering /health")
            yield pair


def marker_tokens(number: int, block_size: int) -> list[int]:
    return [MARKER_TOKEN + number] * block_size


async def publish_marker(engine: SimulatedEngine, number: int, block_size: int, rank: int = 0) -> None:
    marker = VllmBlockStored((0x7E57_0000_0000 + number,), None, tuple(marker_tokens(number, block_size)), block_size)
    await engine.publish_payload(encode_vllm_batch(time.time(), [marker], rank))


async def joined(pair: SideBySide, engine: SimulatedEngine, model: str, instance: int, rank: int, block_size: int,
                 number: int) -> None:
    """Past ZMQ's slow joiner: a marker published until Dynamo's subscription has it (ingest replays what it missed)."""
    tokens = marker_tokens(number, block_size)

    async def dynamo_has_it() -> bool:
        await publish_marker(engine, number, block_size, rank)
        status, answer = await pair.one(pair.dynamo, "POST", "/query", {"token_ids": tokens, "model_name": model})
        return status == 200 and str(instance) in answer["instances"]

    await wait_until(dynamo_has_it, 30, f"Dynamo subscribed to instance {instance} rank {rank}", interval=0.1)
    await pair.wait_for_marker(model, tokens, instance, rank, block_size)


# --- simulated vLLM engines: a random workload, every answer equal -------------------------------

BLOCK = 16
SIM_MODEL = "sim-model"
SIM_RANKS = {1: (0,), 2: (0, 1), 3: (0,)}  # instance id -> its data-parallel ranks


def engine_hash(tokens: list[int], blocks: int) -> int:
    """The engine's hash of a path's block `blocks - 1`, as a prefix hash (same content, same hash)."""
    return xxhash.xxh3_64_intdigest(repr(tokens[: blocks * BLOCK]).encode())


class SimWorker:
    """One rank's engine and what it holds per tier (engine hash -> parent), chains as vLLM's pools keep them."""

    def __init__(self, engine: SimulatedEngine) -> None:
        self.engine = engine
        self.held: dict[Tier, dict[int, int | None]] = {Tier.DEVICE: {}, Tier.HOST: {}, Tier.DISK: {}}

    async def step(self, rng: random.Random, paths: list[list[int]]) -> None:
        tier = rng.choice((Tier.DEVICE, Tier.DEVICE, Tier.HOST, Tier.DISK))
        medium = {Tier.DEVICE: "GPU", Tier.HOST: "CPU", Tier.DISK: "DISK"}[tier]
        held = self.held[tier]
        leaves = sorted(set(held) - set(held.values()))
        if leaves and rng.random() < 0.3:
            # Evictions take chain tails (an LRU pool's order); a removal mid-chain is where the
            # two indexers part (docs/decide.md).
            gone = rng.sample(leaves, min(len(leaves), rng.randint(1, 3)))
            for block in gone:
                del held[block]
            await self.engine.publish([VllmBlockRemoved(tuple(gone), medium)])
            return
        # A store extends a chain the tier already holds: the parent is always there.
        tokens = rng.choice(paths)
        start = 0
        while start < len(tokens) // BLOCK and engine_hash(tokens, start + 1) in held:
            start += 1
        end = min(len(tokens) // BLOCK, start + rng.randint(1, 4))
        if start >= end:
            return
        hashes = tuple(engine_hash(tokens, i + 1) for i in range(start, end))
        parent = engine_hash(tokens, start) if start else None
        for block in hashes:
            held[block] = parent
            parent = block
        parent = engine_hash(tokens, start) if start else None
        await self.engine.publish([VllmBlockStored(hashes, parent, tuple(tokens[start * BLOCK: end * BLOCK]), BLOCK, medium)])


def sim_paths(rng: random.Random) -> list[list[int]]:
    """Token paths sharing prefixes: a few roots, branches off them at block boundaries."""
    paths: list[list[int]] = []
    for _ in range(14):
        if paths and rng.random() < 0.7:
            base = rng.choice(paths)
            keep = rng.randint(1, len(base) // BLOCK) * BLOCK
            path = base[:keep]
        else:
            path = []
        path = path + [rng.randrange(50_000) for _ in range(rng.randint(1, 6) * BLOCK)]
        paths.append(path[: 12 * BLOCK])
    return paths


def sim_queries(rng: random.Random, paths: list[list[int]]) -> list[dict]:
    queries = []
    for tokens in paths:
        for blocks in range(1, len(tokens) // BLOCK + 1):
            # A partial last block is not hashed; a tail nobody stored ends every prefix.
            tail = [rng.randrange(50_000) for _ in range(rng.choice((0, 7, BLOCK)))]
            queries.append({"token_ids": tokens[: blocks * BLOCK] + tail, "model_name": SIM_MODEL})
    queries.append({"token_ids": paths[0], "model_name": SIM_MODEL, "lora_name": "adapter-1"})
    queries.append({"token_ids": paths[0], "model_name": SIM_MODEL, "cache_salt": "tenant-a"})
    return queries


async def sim_engines() -> tuple[dict[tuple[int, int], SimulatedEngine], list[StreamSource]]:
    """A simulated vLLM engine per (instance, rank) of SIM_RANKS, started, and ingest's source for each."""
    engines: dict[tuple[int, int], SimulatedEngine] = {}
    sources = []
    for instance, ranks in SIM_RANKS.items():
        pub, replay = engine_endpoints(len(ranks))
        for rank in ranks:
            engines[instance, rank] = await SimulatedEngine(pub, replay, dp_rank=rank).__aenter__()
            sources.append(StreamSource(WorkerId(str(instance), rank), engines[instance, rank].pub_endpoint,
                                        engines[instance, rank].replay_endpoint, Provenance.NATIVE))
    return engines, sources


async def test_simulated_vllm_engines_answer_exactly_as_dynamos_indexer(nats_server) -> None:
    rng = random.Random(33)
    engines, sources = await sim_engines()
    try:
        async with side_by_side(nats_server.url, sources) as pair:
            assert await pair.same("GET", "/workers") == (200, [])
            for (instance, rank), engine in engines.items():
                # The same body to both; kvledger binds id 2 to publisher "2" (ingest's --publisher 2).
                body = {"instance_id": instance, "endpoint": engine.pub_endpoint, "model_name": SIM_MODEL,
                        "block_size": BLOCK, "dp_rank": rank}
                assert await pair.same("POST", "/register", body) == (201, {"status": "ok"})
            await pair.workers()  # right after /register, before any event: every listener "active" on both
            markers = 0
            for (instance, rank), engine in engines.items():
                markers += 1
                await joined(pair, engine, SIM_MODEL, instance, rank, BLOCK, markers)
            await pair.workers()
            await pair.workers(f"?model_name={SIM_MODEL}&routing_group=default")
            await pair.workers("?model_name=another")

            paths = sim_paths(rng)
            workers = {key: SimWorker(engine) for key, engine in engines.items()}
            compared = 0
            for phase in range(4):
                for _ in range(40):
                    await workers[rng.choice(list(workers))].step(rng, paths)
                for (instance, rank), engine in engines.items():
                    markers += 1
                    await publish_marker(engine, markers, BLOCK, rank)
                    await pair.wait_for_marker(SIM_MODEL, marker_tokens(markers, BLOCK), instance, rank, BLOCK)
                for query in sim_queries(rng, paths):
                    status, answer = await pair.same("POST", "/query", query)
                    assert status == 200
                    local = local_block_hashes(query["token_ids"], BLOCK, lora_name=query.get("lora_name"),
                                               cache_salt=query.get("cache_salt"))
                    by_hash = {"block_hashes": [h - U64 if h >= 1 << 63 else h for h in local], "model_name": SIM_MODEL}
                    assert await pair.same("POST", "/query_by_hash", by_hash) == (200, answer)
                    compared += 2
            assert compared > 300
            # Not every answer is empty, and host and disk extend some prefixes past the device's.
            answers = [(await pair.one(pair.kvledger, "POST", "/query", q))[1] for q in sim_queries(rng, paths)]
            summaries = [match for answer in answers for match in answer["instances"].values()]
            assert any(match["cpu"] > match["gpu"] for match in summaries)
            assert any(len(match["dp"]) == 2 for match in summaries)

            await tiers_interleaved(pair, engines[3, 0])
            await check_errors_alike(pair, engines[1, 0].pub_endpoint)
            await check_salts_and_replay_alike(pair, engines[1, 0])
            # Unregistering: a rank, then an instance (without a routing group Dynamo drops every rank).
            assert await pair.same("POST", "/unregister", {"instance_id": 2, "model_name": SIM_MODEL,
                                                           "routing_group": "default", "dp_rank": 1}) == (200, {"status": "ok"})
            await pair.workers()
            await pair.same("POST", "/query", sim_queries(rng, paths)[3])
            assert await pair.same("POST", "/unregister", {"instance_id": 1, "model_name": SIM_MODEL, "dp_rank": 5}) == (
                200, {"status": "ok"})
            await pair.workers()
            for instance in (2, 3):
                await pair.same("POST", "/unregister", {"instance_id": instance, "model_name": SIM_MODEL})
            assert await pair.same("GET", "/workers") == (200, [])
            assert await pair.same("POST", "/query", {"token_ids": paths[0], "model_name": SIM_MODEL}) == (
                404, {"error": f"no indexer for model={SIM_MODEL} routing_group=default"})
    finally:
        for engine in engines.values():
            await engine.close()


def dumped_blocks(dump: dict) -> dict[str, set[tuple]]:
    """A dump's blocks per partition as (instance, rank, tier, engine hash, content hash, parent engine hash): Dynamo
    writes a chain as one event, decide a block per event, which replay alike."""
    found: dict[str, set[tuple]] = {}
    for partition, body in dump.items():
        blocks = found.setdefault(partition, set())
        for item in body["events"]:
            event = item["event"]
            stored = event["data"]["stored"]
            parent = stored["parent_hash"]
            for block in stored["blocks"]:
                blocks.add((item["worker_id"], event["dp_rank"], item["storage_tier"], block["block_hash"],
                            block["tokens_hash"], parent))
                parent = block["block_hash"]
    return found


async def test_a_dynamo_indexer_recovers_from_decides_dump_and_then_answers_as_decide(nats_server) -> None:
    """`GET /dump` in Dynamo's format: the blocks Dynamo's own dump lists, and a Dynamo indexer started with
    `--peers http://<decide>` (the wheel's recovery) answers every query as decide does."""
    rng = random.Random(34)
    engines, sources = await sim_engines()
    try:
        # Dynamo's recovery asks without a token: decide's API is open here (docs/routers.md says so).
        async with side_by_side(nats_server.url, sources, token=None) as pair:
            for (instance, rank), engine in engines.items():
                body = {"instance_id": instance, "endpoint": engine.pub_endpoint, "model_name": SIM_MODEL,
                        "block_size": BLOCK, "dp_rank": rank}
                assert await pair.same("POST", "/register", body) == (201, {"status": "ok"})
            markers = 0
            for (instance, rank), engine in engines.items():
                markers += 1
                await joined(pair, engine, SIM_MODEL, instance, rank, BLOCK, markers)
            paths = sim_paths(rng)
            workers = {key: SimWorker(engine) for key, engine in engines.items()}
            for _ in range(120):
                await workers[rng.choice(list(workers))].step(rng, paths)
            for (instance, rank), engine in engines.items():
                markers += 1
                await publish_marker(engine, markers, BLOCK, rank)
                await pair.wait_for_marker(SIM_MODEL, marker_tokens(markers, BLOCK), instance, rank, BLOCK)
            (_, dynamo_dump), (status, decide_dump) = await pair.both("GET", "/dump")
            assert status == 200 and list(decide_dump) == [f"{SIM_MODEL}:default"]
            assert decide_dump[f"{SIM_MODEL}:default"]["block_size"] == BLOCK
            blocks = dumped_blocks(decide_dump)
            assert len(blocks[f"{SIM_MODEL}:default"]) > 100
            assert blocks == dumped_blocks(dynamo_dump)
            with dynamo_indexer(peers=pair.kvledger) as recovered_port:
                recovered = f"http://127.0.0.1:{recovered_port}"

                async def recovered_up() -> bool:
                    with contextlib.suppress(aiohttp.ClientError):
                        return (await pair.one(recovered, "GET", "/health"))[0] == 200
                    return False

                await wait_until(recovered_up, 30, "the recovered Dynamo indexer answering /health")
                compared = 0
                for query in [*sim_queries(rng, paths),
                              *({"token_ids": marker_tokens(number, BLOCK), "model_name": SIM_MODEL}
                                for number in range(1, markers + 1))]:
                    expected = await pair.one(pair.kvledger, "POST", "/query", query)
                    assert await pair.one(recovered, "POST", "/query", query) == expected, query
                    compared += bool(expected[1]["instances"])
                assert compared > 50
    finally:
        for engine in engines.values():
            await engine.close()


async def tiers_interleaved(pair: SideBySide, engine: SimulatedEngine) -> None:
    """The one difference on plain vLLM events: a prefix whose blocks alternate tiers (device, host, disk, host).

    Dynamo walks the tiers in series (device, then host from where device stopped, then disk
    from where host stopped), so it stops at the second host block; kvledger's `disk` is the
    prefix held on any local tier, all four blocks, and its `cpu` the prefix on device or host.
    """
    tokens = [60_000 + number for number in range(4 * BLOCK)]
    hashes = [engine_hash(tokens, blocks) for blocks in range(1, 5)]
    for number, medium in enumerate(("GPU", "CPU", "DISK", "CPU")):
        parent = hashes[number - 1] if number else None
        block = tuple(tokens[number * BLOCK: (number + 1) * BLOCK])
        await engine.publish([VllmBlockStored((hashes[number],), parent, block, BLOCK, medium)])
    await publish_marker(engine, 999, BLOCK)
    await pair.wait_for_marker(SIM_MODEL, marker_tokens(999, BLOCK), 3, 0, BLOCK)
    dynamo, kvledger = await pair.both("POST", "/query", {"token_ids": tokens, "model_name": SIM_MODEL})
    assert dynamo[1]["instances"]["3"] == {"longest_matched": 48, "gpu": 16, "dp": {"0": 16}, "cpu": 32, "disk": 48}
    assert kvledger[1]["instances"]["3"] == {"longest_matched": 64, "gpu": 16, "dp": {"0": 16}, "cpu": 32, "disk": 64}


async def check_errors_alike(pair: SideBySide, endpoint: str) -> None:
    """Refusals: the same status; a JSON error body equal, a plain-text one from the same extractor step."""
    register = {"instance_id": 1, "endpoint": endpoint, "model_name": SIM_MODEL, "block_size": BLOCK}
    same_json = [
        ("POST", "/register", register),  # 409: rank 0 already registered
        ("POST", "/register", {**register, "instance_id": 40, "block_size": 32}),  # 409: block size mismatch
        ("POST", "/register", {**register, "instance_id": 41, "model_name": "other"}),
        ("POST", "/register", {**register, "instance_id": 1, "model_name": "other"}),  # 409: another partition
        ("POST", "/register", {**register, "instance_id": 42, "endpoint": "bogus"}),  # 400
        ("POST", "/register", {**register, "instance_id": 42, "endpoint": "udp://h:1"}),
        ("POST", "/register", {**register, "instance_id": 42, "endpoint": "tcp://h"}),
        ("POST", "/register", {**register, "instance_id": 42, "replay_endpoint": "nope"}),
        ("POST", "/unregister", {"instance_id": 99, "model_name": SIM_MODEL}),  # 404
        ("POST", "/unregister", {"instance_id": 41, "model_name": SIM_MODEL, "routing_group": "default"}),
        ("POST", "/unregister", {"instance_id": 1, "model_name": SIM_MODEL, "routing_group": "default", "dp_rank": 5}),
        ("POST", "/unregister", {"instance_id": 41, "model_name": "other"}),
        ("POST", "/query", {"token_ids": [1, 2], "model_name": "nope"}),  # 404
        ("POST", "/query", {"token_ids": [1, 2], "model_name": SIM_MODEL, "routing_group": "g"}),
        ("POST", "/query", {"token_ids": [], "model_name": SIM_MODEL}),  # 200, nothing
        ("POST", "/query_by_hash", {"block_hashes": [1], "model_name": SIM_MODEL, "cache_salt": "s"}),  # 400
        ("POST", "/query_by_hash", {"block_hashes": [1], "model_name": "nope"}),
    ]
    for method, path, body in same_json:
        await pair.same(method, path, body)
    # Type errors (422), malformed JSON (400), no JSON content type (415): axum's plain-text refusals.
    for path, body in [("/query", {"token_ids": [-1], "model_name": "m"}), ("/query", {"token_ids": [1 << 32], "model_name": "m"}),
                       ("/query", {"token_ids": [1]}), ("/query_by_hash", {"block_hashes": [1 << 63], "model_name": "m"}),
                       ("/register", {"instance_id": -1}), ("/unregister", {"model_name": "m"})]:
        dynamo, kvledger = await pair.both("POST", path, body)
        assert kvledger[0] == dynamo[0] == 422
        assert kvledger[1].startswith("Failed to deserialize the JSON body into the target type: ")
    for payload, headers, status, prefix in [
        (b"not json", {"Content-Type": "application/json"}, 400, "Failed to parse the request body as JSON: "),
        (b"{}", {}, 415, "Expected request with `Content-Type: application/json`"),
    ]:
        for base in (pair.dynamo, pair.kvledger):
            auth = {"Authorization": f"Bearer {TOKEN}"} if base == pair.kvledger else {}
            async with pair.session.post(base + "/query", data=payload, headers={**headers, **auth}) as reply:
                assert reply.status == status and (await reply.text()).startswith(prefix), base
    # decide's front: no token, no answer (Dynamo's indexer has no authentication at all).
    async with pair.session.post(pair.kvledger + "/query", json={"token_ids": [1], "model_name": SIM_MODEL}) as reply:
        assert reply.status == 401


async def check_salts_and_replay_alike(pair: SideBySide, engine: SimulatedEngine) -> None:
    """A replay endpoint and Mooncake's per-tenant salt (either spelling) are taken on /register; a salt on
    /query is not a field of Dynamo's query and changes nothing (its `cache_salt` is what salts a query)."""
    ok = (201, {"status": "ok"})
    salted = {"instance_id": 50, "endpoint": engine.pub_endpoint, "replay_endpoint": engine.replay_endpoint,
              "model_name": "salted", "block_size": BLOCK, "additional_salt": "tenant-a"}
    assert await pair.same("POST", "/register", salted) == ok
    respelled = {key: value for key, value in salted.items() if key != "additional_salt"}
    assert await pair.same("POST", "/register", {**respelled, "instance_id": 51, "additionalsalt": "tenant-b"}) == ok
    await pair.workers("?model_name=salted")
    tokens = marker_tokens(1, BLOCK)
    plain = await pair.same("POST", "/query", {"token_ids": tokens, "model_name": SIM_MODEL})
    assert plain[1]["instances"]
    assert await pair.same("POST", "/query", {"token_ids": tokens, "model_name": SIM_MODEL, "additional_salt": "x"}) == plain
    for instance in (50, 51):
        assert await pair.same("POST", "/unregister", {"instance_id": instance, "model_name": "salted"}) == (200, {"status": "ok"})


# --- the engines' own frames: every golden feature --------------------------------------------

# (fixture, request, endpoint) -> why Dynamo answers otherwise. kvledger's answer is checked
# against its reference fold for every request, these included.
_SGLANG_SALT = ("kvledger's local hashes salt a request's first block only (vLLM declares its salt there; the chain "
                "keeps later blocks apart); Dynamo's compute_block_hash_for_seq(cache_namespace=) salts every block, "
                "so hashes made by one do not find the other's after block 0. /query with cache_salt agrees.")
_VLLM_SALT = ("Dynamo ignores the cache salt in vLLM's extra_keys: it indexes a salted block as the unsalted one, so a "
              "salted query finds nothing and an unsalted one would be credited with another tenant's blocks")
_VLLM_MM = ("Dynamo ignores vLLM's extra_keys multimodal identifiers: it indexes an image block by its placeholder "
            "tokens alone, so images A and B and plain text are one block to it, and the image's own hash finds nothing")
_PLACEHOLDER = ("offload placeholders (BlockStored with no tokens, block_size 0) cannot be hashed by Dynamo and are "
                "dropped; kvledger takes their hashes from the block it knows by engine hash")
GOLDEN_DIFFERENCES: dict[tuple[str, str, str], str] = {
    **{("sglang_dynamo_format", name, "query_by_hash"): _SGLANG_SALT for name in ("salt_a", "salt_b", "lora_salt_a")},
    **{("sglang_salt_session_lora", name, "query_by_hash"): _SGLANG_SALT for name in ("salt_a", "salt_b", "lora_salt_a")},
    **{("vllm_extra_keys", name, path): _VLLM_SALT for name in ("salt_a", "salt_b") for path in ("query", "query_by_hash")},
    ("vllm_extra_keys", "image_a", "query_by_hash"): _VLLM_MM,
    ("vllm_extra_keys", "image_b", "query_by_hash"): _VLLM_MM,
    ("vllm_extra_keys", "lookahead", "query_by_hash"): "Dynamo ignores vLLM's lookahead_token_ids (EAGLE): the block "
        "is indexed without its lookahead token, so the engine's own block hash finds nothing",
    **{("vllm_clear_scope", "A", path): "after vLLM's GPU-only AllBlocksCleared the CPU copies remain; they are "
       "offload placeholders, which Dynamo dropped (" + _PLACEHOLDER + ")" for path in ("query", "query_by_hash")},
    **{("vllm_offload_placeholder", "A", path): _PLACEHOLDER for path in ("query", "query_by_hash")},
}


def reference_summary(fold: InventoryFold, worker: WorkerId, local: list[int], block_size: int, instance: int,
                      rank: int) -> dict:
    """kvledger's answer from the fold itself (`worker`'s records, reported as `rank` of `instance`):
    native prefixes on device, device+host, any local tier."""
    sequence = sequence_hashes(local)
    tiers = ((Tier.DEVICE,), (Tier.DEVICE, Tier.HOST), (Tier.DEVICE, Tier.HOST, Tier.DISK))
    prefixes = []
    for held_on in tiers:
        length = 0
        for sequence_hash in sequence:
            if not any(fold.holds(worker, Provenance.NATIVE, tier, sequence_hash) for tier in held_on):
                break
            length += 1
        prefixes.append(length * block_size)
    gpu, cpu, disk = prefixes
    if not disk:
        return {"scores": {}, "frequencies": [], "instances": {}}
    rank = str(rank)
    return {"scores": {str(instance): {rank: gpu}} if gpu else {}, "frequencies": [],
            "instances": {str(instance): {"longest_matched": disk, "gpu": gpu, "dp": {rank: gpu}, "cpu": cpu, "disk": disk}}}


async def test_golden_frames_answer_as_dynamo_where_dynamo_is_right(nats_server) -> None:
    fixtures = [load(path) for path in FIXTURES]
    ranks = [max({frame_rank(frame) for frame in fixture["frames"]}) for fixture in fixtures]
    engines, sources = [], []
    for fixture, rank in zip(fixtures, ranks):
        pub, replay = engine_endpoints(rank + 1)
        topic = bytes.fromhex(fixture["frames"][0]["topic"])
        engine = await SimulatedEngine(pub, replay, topic=topic, dp_rank=rank).__aenter__()
        engines.append(engine)
        worker = fixture_worker(fixture)
        sources.append(StreamSource(WorkerId(worker.publisher, rank), engine.pub_endpoint, engine.replay_endpoint,
                                    Provenance.NATIVE, Engine(fixture["engine"])))
    found: dict[tuple[str, str, str], tuple[object, object]] = {}
    try:
        async with side_by_side(nats_server.url, sources) as pair:
            for number, (fixture, engine, rank) in enumerate(zip(fixtures, engines, ranks), 1):
                # One partition per fixture, its block size; `publisher` binds the id on kvledger's side (Dynamo ignores it).
                body = {"instance_id": number, "endpoint": engine.pub_endpoint, "model_name": model_of(fixture),
                        "block_size": fixture["block_size"], "dp_rank": rank, "publisher": fixture_worker(fixture).publisher}
                assert await pair.same("POST", "/register", body) == (201, {"status": "ok"})
                await joined(pair, engine, model_of(fixture), number, rank, fixture["block_size"], number)
            for fixture, engine in zip(fixtures, engines):
                for frame in fixture["frames"]:
                    await engine.publish_payload(bytes.fromhex(frame["payload"]))
            for number, (fixture, engine, rank) in enumerate(zip(fixtures, engines, ranks), 1):
                await publish_marker(engine, 100 + number, fixture["block_size"], rank)
                await pair.wait_for_marker(model_of(fixture), marker_tokens(100 + number, fixture["block_size"]),
                                           number, rank, fixture["block_size"])
            await pair.workers()

            for number, (fixture, rank) in enumerate(zip(fixtures, ranks), 1):
                fold, _ = folded(fixture)
                worker = fixture_worker(fixture)
                for request in fixture["truth"]["requests"]:
                    parsed = request_from_json(request_body(fixture, request, request["name"]))
                    expected = reference_summary(fold, worker, list(parsed.local_hashes), fixture["block_size"], number, rank)
                    asks = {"query_by_hash": {"block_hashes": [h - U64 if h >= 1 << 63 else h for h in parsed.local_hashes],
                                              "model_name": model_of(fixture)}}
                    if parsed.local_hashes == tuple(local_block_hashes(
                            request["token_ids"], fixture["block_size"], lora_name=request["lora_name"],
                            cache_salt=request["cache_salt"])):
                        # Only what Dynamo's /query can say: tokens, an adapter, a salt (no images, no lookahead).
                        asks["query"] = {"token_ids": request["token_ids"], "model_name": model_of(fixture),
                                         "lora_name": request["lora_name"], "cache_salt": request["cache_salt"]}
                    for path, ask in asks.items():
                        dynamo, kvledger = await pair.both("POST", "/" + path, ask)
                        assert kvledger == (200, expected), (fixture["feature"], request["name"], path)
                        if kvledger != dynamo:
                            found[fixture_name(fixture), request["name"], path] = (kvledger[1], dynamo[1])
    finally:
        for engine in engines:
            await engine.close()
    # Dynamo agrees on every other fixture: hybrid sliding-window and Mamba groups, Mooncake and
    # two-ownership stores, SGLang pages of 1 and bigram pages, host tiers, dp ranks, clears.
    assert sorted(found) == sorted(GOLDEN_DIFFERENCES)
    for key, (ours, theirs) in found.items():  # where they differ Dynamo always sees less than is there
        assert all(theirs["instances"].get(name, {"longest_matched": 0})["longest_matched"] < match["longest_matched"]
                   for name, match in ours["instances"].items()), key


def frame_rank(frame: dict) -> int:
    import msgspec

    batch = msgspec.msgpack.decode(bytes.fromhex(frame["payload"]))
    rank = batch[2] if isinstance(batch, list) and len(batch) > 2 else None
    return rank or 0


def fixture_name(fixture: dict) -> str:
    return f"{fixture['engine']}_{fixture['feature']}"


def model_of(fixture: dict) -> str:
    return f"golden-{fixture_name(fixture)}"
