"""Request workloads and an engine KV-cache model, for the demo and the benchmarks.

Pure: requests are lists of block ids (equal ids = equal blocks, so prefixes really
repeat), and `EngineCache` is the LRU GPU + CPU cache of one worker, which says what an
engine would announce (stored, offloaded, evicted) when it serves a request.
"""

from __future__ import annotations

import json
import random
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

import attrs
import xxhash

from kvledger.core.hashing import local_block_hashes, sequence_hashes

DEMO_BLOCK_SIZE = 16


@attrs.frozen
class Request:
    request_id: str
    block_ids: tuple[int, ...]


def block_tokens(block_id: int, block_size: int = DEMO_BLOCK_SIZE) -> list[int]:
    """The token ids of a block id: deterministic, distinct per id."""
    return [(block_id * block_size + offset) % (1 << 32) for offset in range(block_size)]


def request_tokens(request: Request, block_size: int = DEMO_BLOCK_SIZE) -> list[int]:
    return [token for block_id in request.block_ids for token in block_tokens(block_id, block_size)]


def mooncake_requests(path: str | Path, limit: int | None = None) -> Iterator[Request]:
    """Requests of a Mooncake-format JSONL trace (`hash_ids`: one id per block)."""
    with open(path, encoding="utf-8") as trace:
        for number, line in enumerate(trace):
            if limit is not None and number >= limit:
                return
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                ids = tuple(int(value) for value in record["hash_ids"])
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(f"{path}:{number + 1}: not a Mooncake trace record ({error})") from None
            yield Request(f"trace-{number}", ids)


def synthetic_requests(count: int, *, seed: int = 7, system_prompts: int = 8, conversations: int = 60) -> Iterator[Request]:
    """Multi-turn conversations over shared system prompts, with Zipf-skewed popularity."""
    rng = random.Random(seed)
    next_id = 0

    def fresh(length: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + length))
        next_id += length
        return ids

    prompts = [fresh(rng.randint(8, 32)) for _ in range(system_prompts)]
    prompt_weights = [1 / (rank + 1) ** 1.2 for rank in range(system_prompts)]
    histories: list[list[int]] = []
    conversation_weights: list[float] = []
    for number in range(conversations):
        histories.append(list(rng.choices(prompts, prompt_weights)[0]))
        conversation_weights.append(1 / (number + 1) ** 0.9)
    for number in range(count):
        conversation = rng.choices(range(conversations), conversation_weights)[0]
        history = histories[conversation]
        history.extend(fresh(rng.randint(2, 8)))  # the next user turn
        yield Request(f"req-{number}", tuple(history))
        history.extend(fresh(rng.randint(1, 4)))  # the answer, part of the next turn's prefix
        if len(history) > 400:  # a conversation that grew too long starts over
            histories[conversation] = list(rng.choices(prompts, prompt_weights)[0])


def engine_hash(sequence_hash: int) -> int:
    """What a simulated engine calls a block: distinct from kvledger's own hashes, stable."""
    return xxhash.xxh3_64_intdigest(sequence_hash.to_bytes(8, "little"), seed=20260)


@attrs.frozen
class CacheChange:
    """What serving one request did to one worker's cache, in announcement order."""

    hit_blocks: int
    stored_gpu: tuple[tuple[int, int | None, int], ...]  # (block id, parent engine hash, engine hash)
    offloaded_cpu: tuple[tuple[int, int | None, int], ...]
    evicted_gpu: tuple[int, ...]  # engine hashes
    evicted_cpu: tuple[int, ...]


class EngineCache:
    """One worker's KV cache: GPU blocks (LRU) that spill to a CPU tier (LRU) on eviction."""

    def __init__(self, gpu_blocks: int, cpu_blocks: int, block_size: int = DEMO_BLOCK_SIZE) -> None:
        self.gpu_blocks = gpu_blocks
        self.cpu_blocks = cpu_blocks
        self.block_size = block_size
        # engine hash -> (block id, parent engine hash)
        self.gpu: OrderedDict[int, tuple[int, int | None]] = OrderedDict()
        self.cpu: OrderedDict[int, tuple[int, int | None]] = OrderedDict()
        self._local: dict[int, int] = {}

    def chain(self, block_ids: tuple[int, ...]) -> list[int]:
        """Engine hashes of a request's blocks (chained, so position matters)."""
        local = []
        for block_id in block_ids:
            value = self._local.get(block_id)
            if value is None:
                value = self._local[block_id] = local_block_hashes(block_tokens(block_id, self.block_size), self.block_size)[0]
            local.append(value)
        return [engine_hash(h) for h in sequence_hashes(local)]

    def prefix_hit(self, block_ids: tuple[int, ...]) -> int:
        """How many leading blocks this cache holds on GPU or CPU, without touching anything."""
        hits = 0
        for block in self.chain(block_ids):
            if block not in self.gpu and block not in self.cpu:
                break
            hits += 1
        return hits

    def serve(self, block_ids: tuple[int, ...]) -> CacheChange:
        """Prefill a request: hits are reused, the rest computed and stored on GPU, LRU spills."""
        hashes = self.chain(block_ids)
        hit = self.prefix_hit(block_ids)
        stored, offloaded, evicted_gpu, evicted_cpu = [], [], [], []
        parent: int | None = None
        for block_id, block in zip(block_ids, hashes):
            if block in self.gpu:
                self.gpu.move_to_end(block)
            else:
                # computed, or brought back from the CPU tier: either way now on GPU
                self.gpu[block] = (block_id, parent)
                stored.append((block_id, parent, block))
            if block in self.cpu:
                self.cpu.move_to_end(block)
            parent = block
        while len(self.gpu) > self.gpu_blocks:
            victim, (victim_id, victim_parent) = self.gpu.popitem(last=False)
            evicted_gpu.append(victim)
            if victim not in self.cpu:
                self.cpu[victim] = (victim_id, victim_parent)
                offloaded.append((victim_id, victim_parent, victim))
        while len(self.cpu) > self.cpu_blocks:
            victim, _ = self.cpu.popitem(last=False)
            evicted_cpu.append(victim)
        return CacheChange(hit, tuple(stored), tuple(offloaded), tuple(evicted_gpu), tuple(evicted_cpu))
