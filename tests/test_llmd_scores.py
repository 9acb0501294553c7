"""decide as llm-d's indexer service, asked `GetPodScores` through stubs from llm-d's own proto.

Simulated vLLM workers publish prompts' blocks on ZMQ; ingest puts them on NATS, decide
follows them. The tokenizer is built here with the `tokenizers` library (no model hub):
the prompt is tokenized as llm-d's renderer does (special tokens added), and every score
must equal llm-d's `LongestPrefix` scorer, re-stated below from its Go source, run over
what the workers hold.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import grpc.aio
import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from tokenizers.processors import TemplateProcessing

from kvledger.decide.routers.protos import indexer_pb2 as pb
from kvledger.decide.routers.protos import indexer_pb2_grpc as pb_grpc
from kvledger.decide.serving.service import DecideService
from engines import engine_endpoints, wait_until
from kvledger.core.events import Provenance, WorkerId
from kvledger.ingest.bridge import Bridge
from kvledger.ingest.endpoints import StreamSource
from kvledger.sim.engine import SimulatedEngine
from kvledger.sim.vllm import VllmBlockRemoved, VllmBlockStored
from pipeline import pipeline_settings

pytestmark = pytest.mark.service

MODEL = "test-org/tiny-model"
BLOCK = 4
WORDS = [f"w{number}" for number in range(60)] + [f"mark{number}" for number in range(20)]
# kvledger publisher (worker name) -> llm-d pod identifier; both ranks of vllm-b are one pod.
PODS = {"vllm-a": "10.0.0.5:8000", "vllm-b": "10.0.0.6:8000", "vllm-c": "10.0.0.7:8000"}
RANKS = {"vllm-a": (0,), "vllm-b": (0, 1), "vllm-c": (0,)}
TIERS = {"GPU": "gpu", "CPU": "cpu", "DISK": "disk"}
WEIGHTS = {"gpu": 1.0, "cpu": 0.8}  # llm-d's defaults; "disk" has none, so it weighs 1.0


def tiny_tokenizer(path: Path) -> Tokenizer:
    vocab = {"<unk>": 0, "<s>": 1, **{word: number for number, word in enumerate(WORDS, 2)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer.save(str(path))
    return Tokenizer.from_file(str(path))


def llmd_longest_prefix(keys: list[int], key_to_pods: dict[int, list[tuple[str, str]]],
                        weights: dict[str, float]) -> dict[str, float]:
    """llm-d's LongestPrefixScorer.Score, statement by statement."""
    def fill_max_weights(entries: list[tuple[str, str]]) -> dict[str, float]:
        found: dict[str, float] = {}
        for pod, tier in entries:
            weight = weights.get(tier, 1.0)
            if pod not in found or weight > found[pod]:
                found[pod] = weight
        return found

    if not keys:
        return {}
    current = fill_max_weights(key_to_pods.get(keys[0], []))
    scores = dict(current)
    active = set(current)
    for key in keys[1:]:
        if not active:
            break
        current = fill_max_weights(key_to_pods.get(key, []))
        for pod in list(active):
            if pod in current:
                scores[pod] += current[pod]
            else:
                active.discard(pod)
    return scores


class Rank:
    """One simulated vLLM rank and what it holds: (medium, engine hash) -> the token prefix it ends."""

    def __init__(self, worker: WorkerId, engine: SimulatedEngine) -> None:
        self.worker = worker
        self.engine = engine
        self.held: dict[str, set[tuple[int, ...]]] = {medium: set() for medium in TIERS}
        self.salt = random.Random(str(worker)).getrandbits(32)  # vLLM's hashes differ per process

    def engine_hash(self, prefix: tuple[int, ...]) -> int:
        return hash((self.salt, prefix)) & ((1 << 64) - 1)

    async def store(self, medium: str, tokens: list[int], start: int, end: int) -> None:
        prefixes = [tuple(tokens[: (block + 1) * BLOCK]) for block in range(start, end)]
        parent = self.engine_hash(tuple(tokens[: start * BLOCK])) if start else None
        await self.engine.publish([VllmBlockStored(tuple(self.engine_hash(p) for p in prefixes), parent,
                                                   tuple(tokens[start * BLOCK:end * BLOCK]), BLOCK, medium=medium)],
                                  ts=time.time())
        self.held[medium].update(prefixes)

    async def remove(self, medium: str, prefixes: list[tuple[int, ...]]) -> None:
        await self.engine.publish([VllmBlockRemoved(tuple(self.engine_hash(p) for p in prefixes), medium=medium)],
                                  ts=time.time())
        self.held[medium].difference_update(prefixes)

    def holds(self, prefix: tuple[int, ...]) -> bool:
        return any(prefix in blocks for blocks in self.held.values())

    async def step(self, rng: random.Random, prompts: list[list[int]]) -> None:
        medium = rng.choice(list(TIERS))
        if self.held[medium] and rng.random() < 0.3:
            await self.remove(medium, rng.sample(sorted(self.held[medium]), 1))
            return
        tokens = rng.choice(prompts)
        blocks = len(tokens) // BLOCK
        starts = [0] + [b for b in range(1, blocks) if self.holds(tuple(tokens[: b * BLOCK]))]
        start = rng.choice(starts)
        end = start
        while end < blocks and tuple(tokens[: (end + 1) * BLOCK]) not in self.held[medium] and (
                end == start or rng.random() < 0.8):
            end += 1
        if end > start:
            await self.store(medium, tokens, start, end)


def expected_scores(ranks: list[Rank], tokens: list[int], wanted: set[str]) -> dict[str, float]:
    keys = list(range(len(tokens) // BLOCK))
    key_to_pods = {key: [(PODS[rank.worker.publisher], TIERS[medium]) for rank in ranks
                         for medium, blocks in rank.held.items() if tuple(tokens[: (key + 1) * BLOCK]) in blocks
                         and (not wanted or PODS[rank.worker.publisher] in wanted)]
                   for key in keys}
    return llmd_longest_prefix(keys, key_to_pods, WEIGHTS)


@contextlib.asynccontextmanager
async def llmd_fleet(nats_url: str, tmp_path: Path) -> AsyncIterator[tuple[DecideService, list[Rank], Tokenizer,
                                                                          pb_grpc.IndexerServiceStub]]:
    tokenizer = tiny_tokenizer(tmp_path / "tokenizer.json")
    routers = tmp_path / "routers.toml"
    routers.write_text(f'[llmd.models."{MODEL}"]\ntokenizer = "{tmp_path / "tokenizer.json"}"\nblock_size = {BLOCK}\n'
                       f'[llmd.models."{MODEL}".pods]\n' + "".join(f'"{name}" = "{pod}"\n' for name, pod in PODS.items()))
    settings = pipeline_settings(nats_url, "sqlite://", **{
        "decide.backend": "cpu", "decide.grpc_listen": "127.0.0.1:0", "decide.grpc_routers": str(routers),
        "decide.grpc_max_message_bytes": 64 * 1024})
    ranks, sources = [], []
    async with contextlib.AsyncExitStack() as stack:
        for name, worker_ranks in RANKS.items():
            pub, replay = engine_endpoints(len(worker_ranks))
            for dp_rank in worker_ranks:
                engine = await stack.enter_async_context(SimulatedEngine(pub, replay, dp_rank=dp_rank))
                ranks.append(Rank(WorkerId(name, dp_rank), engine))
                sources.append(StreamSource(WorkerId(name, dp_rank), engine.pub_endpoint, engine.replay_endpoint,
                                            Provenance.NATIVE))
        bridge = await stack.enter_async_context(Bridge(settings, sources))
        service = await stack.enter_async_context(DecideService(settings))
        await bridge.wait_ready(timeout=30)
        await service.wait_ready(timeout=60)
        channel = await stack.enter_async_context(grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc.port}"))
        yield service, ranks, tokenizer, pb_grpc.IndexerServiceStub(channel)


async def caught_up(stub: pb_grpc.IndexerServiceStub, ranks: list[Rank], tokenizer: Tokenizer, number: int) -> None:
    """A marker prompt per rank, stored on its GPU, waited for until decide scores every one."""
    prompts = [f"mark{number} w{position} w{position}" for position in range(len(ranks))]
    for rank, prompt in zip(ranks, prompts):
        await rank.store("GPU", tokenizer.encode(prompt).ids, 0, 1)

    async def all_seen() -> bool:
        for rank, prompt in zip(ranks, prompts):
            answer = await stub.GetPodScores(pb.GetPodScoresRequest(prompt=prompt, model_name=MODEL))
            if PODS[rank.worker.publisher] not in {score.pod for score in answer.scores}:
                return False
        return True

    await wait_until(all_seen, 30, f"decide scoring marker {number} of every rank")


def as_dict(response: pb.GetPodScoresResponse) -> dict[str, float]:
    return {score.pod: score.score for score in response.scores}


async def test_scores_equal_llmds_longest_prefix_scorer(nats_server, tmp_path: Path) -> None:
    rng = random.Random(5)
    async with llmd_fleet(nats_server.url, tmp_path) as (service, ranks, tokenizer, stub):
        trunk = [f"w{rng.randrange(60)}" for _ in range(23)]
        texts = [" ".join(trunk)] + [" ".join(trunk[: rng.randrange(3, 20)] + [f"w{rng.randrange(60)}"
                                                                               for _ in range(rng.randrange(4, 12))])
                                     for _ in range(5)]
        prompts = [tokenizer.encode(text).ids for text in texts]
        compared = 0
        for phase in range(4):
            for _ in range(40):
                await rng.choice(ranks).step(rng, prompts)
            await caught_up(stub, ranks, tokenizer, phase)
            for text, tokens in zip(texts, prompts):
                words = text.split()
                for length in range(1, len(words) + 1):
                    prompt = " ".join(words[:length])
                    answer = await stub.GetPodScores(pb.GetPodScoresRequest(prompt=prompt, model_name=MODEL))
                    assert as_dict(answer) == pytest.approx(expected_scores(ranks, tokens[: length + 1], set()))
                    scores = [score.score for score in answer.scores]
                    assert scores == sorted(scores, reverse=True)
                    compared += 1
                wanted = {PODS["vllm-b"], "10.9.9.9:8000"}
                answer = await stub.GetPodScores(pb.GetPodScoresRequest(prompt=text, model_name=MODEL,
                                                                        pod_identifiers=sorted(wanted)))
                assert as_dict(answer) == pytest.approx(expected_scores(ranks, tokens, wanted))
        assert compared > 100
        # Some scores were partial (a cpu block weighs 0.8), and both ranks of vllm-b made one pod.
        every = [as_dict(await stub.GetPodScores(pb.GetPodScoresRequest(prompt=text, model_name=MODEL)))
                 for text in texts]
        assert any(score != int(score) for scores in every for score in scores.values())
        assert any(PODS["vllm-b"] in scores for scores in every)


async def test_bad_input_gets_llmds_status_codes_and_is_counted(nats_server, tmp_path: Path) -> None:
    async with llmd_fleet(nats_server.url, tmp_path) as (service, ranks, tokenizer, stub):
        refusals = service.grpc.refusals
        await caught_up(stub, ranks, tokenizer, 0)
        prompt = "mark0 w0 w0"

        # A model decide has no tokenizer for is one llm-d holds no blocks for: no scores, status OK.
        answer = await stub.GetPodScores(pb.GetPodScoresRequest(prompt=prompt, model_name="other/model"))
        assert list(answer.scores) == []
        assert refusals.labels("indexer.v1.IndexerService", "GetPodScores", "OK", "unknown_model").value == 1
        # A prompt shorter than one block, and an empty one, score nobody.
        for short in ("mark0 w0", ""):
            assert list((await stub.GetPodScores(pb.GetPodScoresRequest(prompt=short, model_name=MODEL))).scores) == []

        channel = grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc.port}")
        async with channel:
            raw = channel.unary_unary("/indexer.v1.IndexerService/GetPodScores")

            async def refused(call) -> tuple[grpc.StatusCode, str]:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call
                return caught.value.code(), caught.value.details()

            code, details = await refused(raw(b"\x12\x09abc"))  # model_name cut short
            assert code is grpc.StatusCode.INTERNAL and details.startswith("grpc: error unmarshalling request: ")
            too_big = pb.GetPodScoresRequest(prompt="w1 " * 30_000, model_name=MODEL).SerializeToString()
            assert await refused(raw(too_big)) == (
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"grpc: received message larger than max ({len(too_big)} vs. 65536)")
        assert refusals.labels("indexer.v1.IndexerService", "GetPodScores", "INTERNAL", "malformed").value == 1
        assert refusals.labels("indexer.v1.IndexerService", "GetPodScores", "RESOURCE_EXHAUSTED",
                               "message_too_large").value == 1
        # Still answering after all that.
        answer = await stub.GetPodScores(pb.GetPodScoresRequest(prompt=prompt, model_name=MODEL))
        assert PODS["vllm-a"] in as_dict(answer)


async def test_a_bad_routers_file_stops_decide_at_startup(tmp_path: Path) -> None:
    from kvledger.decide.routers.grpc_front import load_router_settings
    from kvledger.decide.startup import StartupError

    routers = tmp_path / "routers.toml"
    routers.write_text(f'[llmd.models."{MODEL}"]\ntokenizer = "{tmp_path / "missing.json"}"\nblock_size = 4\n')
    with pytest.raises(StartupError, match="cannot load"):
        load_router_settings(str(routers))
    routers.write_text(f'[llmd.models."{MODEL}"]\ntokenizer = "x.json"\nblock_size = 0\n')
    with pytest.raises(StartupError, match="block_size must be a positive integer"):
        load_router_settings(str(routers))
