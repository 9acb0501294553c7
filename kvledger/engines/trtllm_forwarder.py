"""TensorRT-LLM's pull API as a vLLM-format ZMQ publisher, run beside the engine (docs/ingest.md).

TensorRT-LLM hands its KV-cache events to whoever polls `LLM.get_kv_cache_events_async()`, as
dicts made by its `KVCacheEventSerializer`: `created`, `stored` (blocks with per-token
`token_id`/`token_extra_id`, a `cache_level`), `removed`, `updated` (a `cache_level` diff: a block
moving between GPU and host), each with an `event_id`, a `window_size` and an `attention_dp_rank`.
This module turns them into what ingest reads from vLLM and publishes them the way vLLM does: one
PUB socket per attention-DP rank (base port + rank) with its own 8-byte sequence, and a ROUTER
replay socket answering from a buffer of the last `buffer_steps` batches.

`TrtllmEventMapper` is the mapping alone (pure); `TrtllmForwarder` owns the sockets; and
`forward_kv_events(llm, ...)` polls an LLM until told to stop. It imports nothing of store or
decide, nor TensorRT-LLM itself: it only calls the LLM object it is given.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import msgspec
import zmq
import zmq.asyncio

from kvledger.engines.publisher import DEFAULT_BUFFER_STEPS, EventPublisher
from kvledger.ingest.endpoints import with_port_offset

log = logging.getLogger("kvledger.trtllm")

U64 = 1 << 64
# TensorRT-LLM's cache levels: 0 the GPU pool, 1 the host (secondary) pool, 2 disk (KVCacheManagerV2's CacheTier).
LEVEL_MEDIUM = {0: "GPU", 1: "CPU", 2: "DISK"}
_encoder = msgspec.msgpack.Encoder()


class TrtllmEventError(ValueError):
    """A serialized TensorRT-LLM event the forwarder cannot map; the message says why."""


def engine_hash(value: object) -> int:
    """A TensorRT-LLM block hash as u64: ints as is (a negative one reinterpreted), a hex digest by its
    first 8 bytes big-endian (TensorRT-LLM's own `truncate_sha256_hash_to_int64`, so `v2_sha256` and
    `v2_sha256_64` hashes name a block alike)."""
    if isinstance(value, bool):
        raise TrtllmEventError(f"block hash must be an integer or a hex string, got {value!r}")
    if isinstance(value, int):
        if -(1 << 63) <= value < U64:
            return value % U64
        raise TrtllmEventError(f"block hash {value} does not fit in 64 bits")
    if isinstance(value, str):
        try:
            raw = bytes.fromhex(value)
        except ValueError:
            raise TrtllmEventError(f"block hash {value!r:.40} is not hex") from None
        if not raw:
            raise TrtllmEventError("block hash is an empty string")
        return int.from_bytes(raw[:8].ljust(8, b"\0"), "big")
    raise TrtllmEventError(f"block hash must be an integer or a hex string, got {type(value).__name__}")


def mm_identifier(value: int) -> str:
    """A multimodal key as an extra-keys identifier whose hash is `value` (kvledger.core.hashing.mm_hash reads
    the first 16 of 64 hex digits: Dynamo's form)."""
    return f"{value % U64:016x}".ljust(64, "0")


@attrs.define
class _Block:
    """What the forwarder remembers of a block it announced: enough to announce it again on another tier."""

    tokens: list[int]
    parent: int | None
    extra_keys: list | None
    cache_salt: str | None
    level: int


@attrs.define
class _RankState:
    last_event_id: int | None = None
    blocks: dict[tuple[int, int], _Block] = attrs.Factory(dict)  # (window, hash) -> block
    partial: set[tuple[int, int]] = attrs.Factory(set)  # (window, hash) of partial blocks never announced


@attrs.frozen
class RankBatch:
    """One vLLM-format batch for one attention-DP rank; `lost_before` is how many sequence numbers to skip first."""

    rank: int
    events: tuple[dict, ...]
    lost_before: int = 0


class TrtllmEventMapper:
    """Serialized TensorRT-LLM events -> vLLM-format event maps, per attention-DP rank (docs/ingest.md).

    - `cache_level` -> medium: 0 `GPU`, 1 `CPU` (host), 2 `DISK`;
    - `updated` with a `cache_level` diff -> a `BlockStored` on the new tier (the block's tokens,
      parent and keys, remembered from its store) then a `BlockRemoved` on the old one;
    - `window_size` -> a KV-cache group: the largest window (from the `created` events, or
      `max_window`, else the first seen) is group 0, `full_attention`; every other window its own
      group, `sliding_window` with that window;
    - `token_extra_id` (TensorRT-LLM's id of a token outside the vocabulary: a multimodal digest,
      a prompt-table entry) and `mm_keys` enter the block's extra keys as multimodal identifiers,
      `cache_salt` the salt, as Dynamo hashes them;
    - a block with fewer than `block_size` tokens is a partial block: neither it nor its removal
      is announced (nor blocks after it in the same event);
    - `created` (a new KV-cache manager: every level empty) -> `AllBlocksCleared`;
    - an `event_id` gap (TensorRT-LLM's bounded buffer dropped events nobody polled in time) ->
      the rank's next batch skips a sequence number, which ingest records as a Gap (the worker is
      uncertain); an `event_id` going back (the engine restarted) -> `AllBlocksCleared` first.
    """

    def __init__(self, block_size: int, *, max_window: int | None = None) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.max_window = max_window
        self._groups: dict[int, int] = {}
        self._ranks: dict[int, _RankState] = {}
        self._pending: list[RankBatch] = []  # batches cut short by an event-id gap within one poll
        self.counters = {"partial_blocks": 0, "event_id_gaps": 0, "lost_events": 0, "restarts": 0,
                         "rejected_events": 0, "priority_updates": 0}

    # --- groups ---------------------------------------------------------------------------

    def group_of(self, window: int) -> tuple[int, str, int | None]:
        """(group_idx, kv_cache_spec_kind, sliding window) of a window size."""
        if self.max_window is None:
            self.max_window = window
        if window not in self._groups:
            if window == self.max_window and 0 not in self._groups.values():
                self._groups[window] = 0
            else:
                self._groups[window] = max([0, *self._groups.values()]) + 1
        if window >= self.max_window:
            return self._groups[window], "full_attention", None
        return self._groups[window], "sliding_window", window

    # --- mapping ----------------------------------------------------------------------------

    def map(self, events: Iterable[dict]) -> list[RankBatch]:
        """One poll's events (in order) as one batch per attention-DP rank that had any."""
        events = list(events)
        for event in events:  # the windows of `created` events say which is full attention
            data = event.get("data") if isinstance(event, dict) else None
            if isinstance(data, dict) and data.get("type") == "created" and isinstance(event.get("window_size"), int):
                self.max_window = max(self.max_window or 0, event["window_size"])
        out: dict[int, list[dict]] = {}
        lost: dict[int, int] = {}
        for event in events:
            try:
                rank = self._rank_of(event)
            except TrtllmEventError as error:
                self.counters["rejected_events"] += 1
                log.warning("TensorRT-LLM event left out: %s", error)
                continue
            state = self._ranks.setdefault(rank, _RankState())
            mapped = out.setdefault(rank, [])
            event_id = event.get("event_id")
            if isinstance(event_id, int) and not isinstance(event_id, bool):
                expected = 0 if state.last_event_id is None else state.last_event_id + 1
                if event_id > expected:
                    self.counters["event_id_gaps"] += 1
                    self.counters["lost_events"] += event_id - expected
                    log.warning("attention-DP rank %d: TensorRT-LLM events %d-%d were lost before this poll",
                                rank, expected, event_id - 1)
                    if mapped:  # what came before the loss goes out first, then the hole
                        self._pending.append(RankBatch(rank, tuple(mapped), lost.pop(rank, 0)))
                        out[rank] = mapped = []
                    lost[rank] = lost.get(rank, 0) + 1
                elif event_id < expected and event["data"].get("type") != "created":
                    self.counters["restarts"] += 1
                    mapped.append({"type": "AllBlocksCleared"})
                    state.blocks.clear()
                    state.partial.clear()
                state.last_event_id = event_id
            try:
                mapped.extend(self._map_event(event, state))
            except (TrtllmEventError, KeyError, TypeError, ValueError) as error:
                self.counters["rejected_events"] += 1
                log.warning("attention-DP rank %d: TensorRT-LLM event %r left out: %s", rank, event_id, error)
                # A lost removal or move may hide an eviction: the worker must become uncertain.
                if not (isinstance(event.get("data"), dict) and event["data"].get("type") == "stored"):
                    lost[rank] = lost.get(rank, 0) + 1
        batches, self._pending = self._pending, []
        batches += [RankBatch(rank, tuple(mapped), lost.get(rank, 0))
                    for rank, mapped in out.items() if mapped or lost.get(rank)]
        return batches

    @staticmethod
    def _rank_of(event: object) -> int:
        if not isinstance(event, dict) or not isinstance(event.get("data"), dict):
            raise TrtllmEventError(f"an event must be a map with a 'data' map, got {event!r:.80}")
        rank = event.get("attention_dp_rank")
        if rank is None:
            return 0
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise TrtllmEventError(f"attention_dp_rank must be a non-negative integer, got {rank!r}")
        return rank

    def _map_event(self, event: dict, state: _RankState) -> list[dict]:
        data = event["data"]
        kind = data.get("type")
        window = event.get("window_size")
        if kind == "created":
            state.blocks.clear()
            state.partial.clear()
            return [{"type": "AllBlocksCleared"}]
        if not isinstance(window, int) or isinstance(window, bool):
            raise TrtllmEventError(f"{kind} event without an integer window_size")
        if kind == "stored":
            return self._stored(data, window, state)
        if kind == "removed":
            return self._removed(data, window, state)
        if kind == "updated":
            return self._updated(data, window, state)
        raise TrtllmEventError(f"unknown event type {kind!r}")

    def _stored(self, data: dict, window: int, state: _RankState) -> list[dict]:
        parent = None if data.get("parent_hash") is None else engine_hash(data["parent_hash"])
        out: list[dict] = []
        partial = False
        for block in data.get("blocks") or ():
            block_hash = engine_hash(block["block_hash"])
            tokens = block["tokens"]
            if partial or len(tokens) != self.block_size:
                # TensorRT-LLM announces a partially filled block; it is no cache block (Dynamo drops it too).
                partial = True
                self.counters["partial_blocks"] += 1
                state.partial.add((window, block_hash))
                continue
            level = block.get("cache_level", 0)
            if level not in LEVEL_MEDIUM:
                raise TrtllmEventError(f"unknown cache_level {level!r}")
            info = _Block([int(token["token_id"]) for token in tokens], parent, self._extra_keys(block),
                          block.get("cache_salt"), level)
            state.blocks[(window, block_hash)] = info
            self._append_store(out, window, block_hash, info)
            parent = block_hash
        return out

    def _extra_keys(self, block: dict) -> list | None:
        keys: list[list] = []
        seen: set[int] = set()
        for offset, token in enumerate(block["tokens"]):
            extra = token.get("token_extra_id") or 0
            if extra and extra not in seen:
                seen.add(extra)
                keys.append([mm_identifier(extra), offset])
        for mm_key in block.get("mm_keys") or ():
            # Newer serializers: {"type": "mm_key", "hash": "<hex>", "start_offset": n}; Dynamo hashes its first 16 digits.
            if isinstance(mm_key, dict) and mm_key.get("hash"):
                value = int(str(mm_key["hash"])[:16], 16)
                if value not in seen:
                    seen.add(value)
                    keys.append([mm_identifier(value), int(mm_key.get("start_offset") or 0)])
        return keys or None

    def _append_store(self, out: list[dict], window: int, block_hash: int, info: _Block) -> None:
        group, spec_kind, sliding = self.group_of(window)
        medium = LEVEL_MEDIUM[info.level]
        last = out[-1] if out else None
        if (last is not None and last["type"] == "BlockStored" and last["medium"] == medium
                and last["group_idx"] == group and last["block_hashes"][-1] == info.parent
                and last.get("cache_salt") == info.cache_salt):
            last["block_hashes"].append(block_hash)
            last["token_ids"].extend(info.tokens)
            last["extra_keys"].append(info.extra_keys)
            return
        out.append({
            "type": "BlockStored", "block_hashes": [block_hash], "parent_block_hash": info.parent,
            "token_ids": list(info.tokens), "block_size": self.block_size, "lora_id": None, "medium": medium,
            "lora_name": None, "extra_keys": [info.extra_keys], "group_idx": group,
            "kv_cache_spec_kind": spec_kind, "kv_cache_spec_sliding_window": sliding, "cache_salt": info.cache_salt,
        })

    def _append_removal(self, out: list[dict], window: int, block_hash: int, level: int) -> None:
        group = self.group_of(window)[0]
        medium = LEVEL_MEDIUM[level]
        last = out[-1] if out else None
        if last is not None and last["type"] == "BlockRemoved" and last["medium"] == medium and last["group_idx"] == group:
            last["block_hashes"].append(block_hash)
        else:
            out.append({"type": "BlockRemoved", "block_hashes": [block_hash], "medium": medium, "group_idx": group})

    def _removed(self, data: dict, window: int, state: _RankState) -> list[dict]:
        out: list[dict] = []
        for value in data.get("block_hashes") or ():
            key = (window, engine_hash(value))
            if key in state.partial:
                state.partial.discard(key)
                continue
            info = state.blocks.pop(key, None)
            self._append_removal(out, window, key[1], 0 if info is None else info.level)
        return out

    def _updated(self, data: dict, window: int, state: _RankState) -> list[dict]:
        diff = data.get("cache_level")
        if not isinstance(diff, dict):
            self.counters["priority_updates"] += 1  # a priority change: nothing moved
            return []
        old, new = diff.get("old_value"), diff.get("new_value")
        if old not in LEVEL_MEDIUM or new not in LEVEL_MEDIUM:
            raise TrtllmEventError(f"cache_level move {old!r} -> {new!r} names an unknown level")
        key = (window, engine_hash(data["block_hash"]))
        if old == new or key in state.partial:
            return []
        info = state.blocks.get(key)
        out: list[dict] = []
        if info is None:
            # Stored before the forwarder started: a placeholder the fold resolves by engine hash.
            group, spec_kind, sliding = self.group_of(window)
            out.append({"type": "BlockStored", "block_hashes": [key[1]], "parent_block_hash": None, "token_ids": [],
                        "block_size": 0, "lora_id": None, "medium": LEVEL_MEDIUM[new], "lora_name": None,
                        "group_idx": group, "kv_cache_spec_kind": spec_kind, "kv_cache_spec_sliding_window": sliding})
        else:
            info.level = new
            self._append_store(out, window, key[1], info)
        # The new copy first, then the old one's removal: the block is never unknown in between.
        self._append_removal(out, window, key[1], old)
        return out


def encode_batch(ts: float, events: Sequence[dict], rank: int) -> bytes:
    """vLLM's batch layout: `[ts, [event maps], data_parallel_rank]`."""
    return _encoder.encode([ts, list(events), rank])


class TrtllmForwarder:
    """Publishes mapped TensorRT-LLM events as vLLM does: rank r on the base ports + r (an async context manager)."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        block_size: int,
        attention_dp_size: int = 1,
        max_window: int | None = None,
        topic: bytes = b"kv-events",
        buffer_steps: int = DEFAULT_BUFFER_STEPS,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.mapper = TrtllmEventMapper(block_size, max_window=max_window)
        self.attention_dp_size = attention_dp_size
        self.topic, self.buffer_steps = topic, buffer_steps
        self._context = context or zmq.asyncio.Context.instance()
        self._ranks: dict[int, EventPublisher] = {}
        self.batches_published = 0

    async def __aenter__(self) -> TrtllmForwarder:
        for rank in range(self.attention_dp_size):
            self._sockets(rank)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        ranks, self._ranks = self._ranks, {}
        for sockets in ranks.values():
            await sockets.close()

    def _sockets(self, rank: int) -> EventPublisher:
        if rank not in self._ranks:
            replay = with_port_offset(self.replay_endpoint, rank) if self.replay_endpoint else None
            self._ranks[rank] = EventPublisher(self._context, with_port_offset(self.endpoint, rank), replay,
                                               topic=self.topic, buffer_steps=self.buffer_steps).start()
        return self._ranks[rank]

    def endpoints(self, rank: int = 0) -> tuple[str, str | None]:
        """Where rank `rank` publishes and replays (the bound addresses, ports resolved)."""
        sockets = self._sockets(rank)
        return sockets.pub_endpoint, sockets.replay_endpoint

    async def forward(self, events: Iterable[dict], *, ts: float | None = None) -> list[tuple[int, int]]:
        """Map and publish one poll's events; returns (rank, seq) of every batch sent."""
        sent = []
        for batch in self.mapper.map(events):
            payload = encode_batch(time.time() if ts is None else ts, batch.events, batch.rank)
            sent.append((batch.rank, await self._sockets(batch.rank).publish(payload, lost_before=batch.lost_before)))
            self.batches_published += 1
        return sent


async def forward_kv_events(
    llm: Any,
    forwarder: TrtllmForwarder,
    *,
    stop: asyncio.Event,
    poll_timeout_s: float = 0.5,
    idle_sleep_s: float = 0.05,
) -> None:
    """Poll `llm.get_kv_cache_events_async(timeout)` until `stop` is set; each poll's events are one batch per rank."""
    while not stop.is_set():
        events = []
        try:
            async for event in llm.get_kv_cache_events_async(timeout=poll_timeout_s):
                events.append(event)
        except (asyncio.TimeoutError, TimeoutError, asyncio.QueueEmpty):
            pass
        if events:
            await forwarder.forward(events)
        else:
            try:
                await asyncio.wait_for(stop.wait(), idle_sleep_s)
            except asyncio.TimeoutError:
                pass
