"""Engine wire formats (docs/ingest.md): ZMQ frames in, canonical events out — and vLLM's format out.

Engines differ in framing (batch as `[ts, events, dp_rank]` — SGLang 0.5.23's third is its
attention-dp rank —, a map, or older SGLang's `[ts, events]`; events as tagged maps or
tagged arrays; hashes as u64, negative i64 or bytes). Everything is normalised here, once:
a batch that cannot be read raises `WireError`, one unusable event is left out of its
batch as a `RejectedEvent`, and either reason ends up in a dead-letter copy.
"""

from __future__ import annotations

import array
import enum
import functools
import struct
from collections.abc import Callable, Sequence
from typing import Annotated, Any

import attrs
import msgspec
import xxhash

from kvledger.core.events import Cleared, Event, Removed, Stored, Tier
from kvledger.core.hashing import BlockKeys, block_seed, local_block_hashes, parse_extra_keys

_encoder = msgspec.msgpack.Encoder()  # a rejected event's raw form, for its dead letter

U64 = 1 << 64
_xxh3 = xxhash.xxh3_64_intdigest
END_OF_REPLAY_SEQ = -1

MEDIUM_TIERS: dict[str | None, Tier] = {
    None: Tier.DEVICE, "GPU": Tier.DEVICE, "DEVICE": Tier.DEVICE,
    "CPU": Tier.HOST, "CPU_PINNED": Tier.HOST, "CPU_TIER1": Tier.HOST,
    "CPU_TIER2": Tier.DISK, "DISK": Tier.DISK, "NVME": Tier.DISK, "STORAGE": Tier.DISK, "SHARED_STORAGE": Tier.DISK,
    "EXTERNAL": Tier.EXTERNAL, "NETWORK": Tier.EXTERNAL, "REMOTE": Tier.EXTERNAL, "SHARED": Tier.EXTERNAL,
    "OBJECT_STORE": Tier.EXTERNAL,
}

# Positional layouts of the older tagged-array events (after the tag).
_STORED_FIELDS = (
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
    "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality",
    "ownership", "session_id",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")
_OWNERSHIP_MAX_LEN = 128  # the SQL columns' sizes
_SPEC_KIND_MAX_LEN = 32


class Engine(enum.Enum):
    """Which engine an endpoint is: the wire is shared, what a clear covers is not (docs/ingest.md)."""

    VLLM = "vllm"
    SGLANG = "sglang"
    TRTLLM = "trtllm"


# vLLM's AllBlocksCleared comes from its GPU pool's reset_prefix_cache: offload tiers survive.
# SGLang's flush_cache resets the radix tree and its host pool together. TensorRT-LLM's own
# ZMQ publisher never sends one (kv_cache_events.py defines AllBlocksCleared and emits none);
# on an engine=trtllm endpoint a clear is kvledger's forwarder announcing a `created` event,
# a new KV-cache manager whose every cache level (GPU, host, disk) starts empty.
CLEAR_SCOPE: dict[Engine, Tier | None] = {Engine.VLLM: Tier.DEVICE, Engine.SGLANG: None, Engine.TRTLLM: None}


class WireError(ValueError):
    """Engine input that cannot be turned into canonical events; the message is the reason."""


@attrs.frozen
class RejectedEvent:
    """One event of a batch that could not be used: dead-lettered alone, the rest of its batch applies."""

    position: int  # in the engine's batch
    tag: str  # its type tag as sent, or "" when it had none
    reason: str
    raw: bytes  # the event re-encoded as msgpack, for the dead-letter copy

    @property
    def loses_state(self) -> bool:
        """Whether dropping it leaves the fold believing blocks the engine no longer holds.

        A lost store only leaves blocks out (decisions stay safe, and the store is counted);
        a lost removal, clear or unknown event may hide an eviction, so the worker is uncertain.
        """
        return self.tag != "BlockStored"


@attrs.frozen
class EngineBatch:
    """One decoded engine batch: what the frames said, normalised, plus what was left out."""

    engine_ts: float
    events: tuple[Event, ...]
    dp_rank: int | None
    skipped_remote: int = 0  # events about blocks held elsewhere (locality REMOTE)
    rejected: tuple[RejectedEvent, ...] = ()
    unaligned_tokens: int = 0  # stores whose tokens do not line up with their hashes (null blocks)


@attrs.frozen
class Frames:
    """A publisher message `[topic, seq, payload]`; seq is the engine's u64 counter."""

    topic: bytes
    seq: int
    payload: bytes


def well_framed_seq(frames: Sequence[bytes]) -> int | None:
    """The seq of a well-formed `[topic, seq, payload]`, or None (the hot path's check, without a Frames)."""
    if len(frames) == 3 and len(frames[1]) == 8:
        return int.from_bytes(frames[1], "big")
    return None


def split_publisher_frames(frames: Sequence[bytes]) -> Frames:
    """Check the 3-frame publisher framing and read the 8-byte big-endian sequence."""
    if len(frames) != 3:
        raise WireError(f"expected 3 frames [topic, seq, payload], got {len(frames)}")
    topic, seq, payload = frames
    if len(seq) != 8:
        raise WireError(f"sequence frame must be 8 bytes, got {len(seq)}")
    return Frames(bytes(topic), int.from_bytes(seq, "big"), bytes(payload))


@attrs.frozen
class ReplayReply:
    """One reply from a replay socket; `seq` is None for the end-of-replay marker."""

    seq: int | None
    payload: bytes


def split_replay_frames(frames: Sequence[bytes]) -> ReplayReply:
    """Accept `[b"", seq, payload]`, `[topic, seq, payload]` and `[b"", topic, seq, payload]`."""
    if len(frames) == 4 and frames[0] == b"":
        _, _, seq, payload = frames
    elif len(frames) == 3:
        _, seq, payload = frames
    else:
        raise WireError(f"unexpected replay framing with {len(frames)} frames")
    if len(seq) != 8:
        raise WireError(f"replay sequence frame must be 8 bytes, got {len(seq)}")
    value = int.from_bytes(seq, "big", signed=True)
    if value == END_OF_REPLAY_SEQ:
        return ReplayReply(None, b"")
    return ReplayReply(int.from_bytes(seq, "big"), bytes(payload))


def replay_request(start_seq: int) -> list[bytes]:
    """The DEALER's request for every buffered batch from `start_seq` on."""
    return [b"", start_seq.to_bytes(8, "big")]


# --- decoding ----------------------------------------------------------------------


def block_hash(value: object) -> int:
    """Normalise an engine block hash to u64: ints as is (negative ones reinterpreted), bytes by their low 8."""
    if isinstance(value, bool):
        raise WireError(f"block hash must be an integer or bytes, got {value!r}")
    if isinstance(value, int):
        if -(1 << 63) <= value < 0:
            return value + U64
        if 0 <= value < U64:
            return value
        raise WireError(f"block hash {value} does not fit in 64 bits")
    if isinstance(value, (bytes, bytearray)):
        if not value:
            raise WireError("block hash is empty bytes")
        return int.from_bytes(value[-8:], "big")
    raise WireError(f"block hash must be an integer or bytes, got {type(value).__name__}")


def _tier(medium: object) -> Tier:
    if medium is not None and not isinstance(medium, str):
        raise WireError(f"medium must be a string or null, got {type(medium).__name__}")
    key = medium.upper() if isinstance(medium, str) else None
    tier = MEDIUM_TIERS.get(key)
    if tier is None:
        raise WireError(f"unknown medium {medium!r}")
    return tier


def _fields(event: object) -> tuple[str, dict[str, Any]]:
    """Turn a tagged map or a tagged array into (tag, named fields)."""
    if isinstance(event, dict):
        tag = event.get("type")
        if not isinstance(tag, str):
            raise WireError("event map has no string 'type' tag")
        return tag, event
    if isinstance(event, (list, tuple)) and event and isinstance(event[0], str):
        tag, values = event[0], event[1:]
        names = _STORED_FIELDS if tag == "BlockStored" else _REMOVED_FIELDS if tag == "BlockRemoved" else ()
        if len(values) > len(names) and tag in ("BlockStored", "BlockRemoved"):
            values = values[: len(names)]  # newer engines append fields; unknown ones are ignored
        return tag, dict(zip(names, values))
    raise WireError(f"event must be a tagged map or a tagged array, got {type(event).__name__}")


def _hash_list(value: object, field: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise WireError(f"{field} must be a list, got {type(value).__name__}")
    try:
        # The common case, plain u64 ints, converted at C speed; anything else goes one by one.
        return tuple(array.array("Q", value))
    except (OverflowError, TypeError):
        return tuple(block_hash(item) for item in value)


def _optional_str(fields: dict[str, Any], name: str, max_len: int | None = None) -> str | None:
    value = fields.get(name)
    if value is not None and not isinstance(value, str):
        raise WireError(f"{name} must be a string or null, got {type(value).__name__}")
    if value is not None and max_len is not None and len(value) > max_len:
        raise WireError(f"{name} is longer than {max_len} characters")
    return value


def _optional_int(fields: dict[str, Any], name: str) -> int | None:
    value = fields.get(name)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise WireError(f"{name} must be a non-negative integer or null, got {value!r}")
    return value


def _bigram_tokens(pairs: Sequence[object]) -> list[int]:
    """EAGLE's bigram keys (SGLang: token ids as `[t[j], t[j+1]]` pairs) as the flat tokens they cover.

    A page of n pairs covers n + 1 tokens; hashed with a one-token lookahead it is exactly
    Dynamo's EAGLE window (block_size + 1 tokens), so a request with `lookahead=1` matches.
    """
    flat = []
    for position, pair in enumerate(pairs):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise WireError(f"token_ids mixes pairs and single tokens (item {position} is {pair!r:.40})")
        if flat and pair[0] != flat[-1][1]:
            raise WireError(f"bigram token pairs do not chain at item {position}: {flat[-1]!r} then {pair!r}")
        flat.append(pair)
    return [pair[0] for pair in flat] + [flat[-1][1]] if flat else []


def _stored(fields: dict[str, Any]) -> tuple[Stored, bool]:
    """The canonical store, and whether its tokens had to be set aside as unaligned."""
    hashes = _hash_list(fields.get("block_hashes"), "block_hashes")
    parent = fields.get("parent_block_hash")
    block_size = fields.get("block_size")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 0:
        raise WireError(f"block_size must be a non-negative integer, got {block_size!r}")
    tokens = fields.get("token_ids")
    if tokens is None:
        tokens = ()
    if not isinstance(tokens, (list, tuple)):
        raise WireError(f"token_ids must be a list, got {type(tokens).__name__}")
    lora_name = _optional_str(fields, "lora_name")
    cache_salt = _optional_str(fields, "cache_salt")
    ownership = _optional_str(fields, "ownership", _OWNERSHIP_MAX_LEN)
    spec_kind = _optional_str(fields, "kv_cache_spec_kind", _SPEC_KIND_MAX_LEN)
    window = _optional_int(fields, "kv_cache_spec_sliding_window")
    group_idx = _optional_int(fields, "group_idx") or 0
    lookahead = 0
    if tokens and isinstance(tokens[0], (list, tuple)):
        tokens, lookahead = _bigram_tokens(tokens), 1
    event = Stored(
        _tier(fields.get("medium")), hashes, None if parent is None else block_hash(parent), block_size,
        (), lora_name, cache_salt, group_idx, ownership, spec_kind, window,
    )
    if not tokens or not hashes:
        # An offload placeholder or a connector's store: no tokens, so the fold takes the
        # block's hashes from the worker's engine-hash map.
        return event, False
    if block_size == 0:
        raise WireError(f"block_size must be positive when token ids are given, got {block_size}")
    expected = len(hashes) * block_size + lookahead
    if len(tokens) != expected:
        if len(tokens) > expected and (len(tokens) - lookahead) % block_size == 0:
            # vLLM leaves null blocks (outside a sliding window, Mamba's skipped states) out of
            # block_hashes but keeps their tokens: which slice belongs to which hash is not
            # in the event, so the hashes come from the same blocks in another group.
            return event, True
        raise WireError(f"BlockStored has {len(hashes)} blocks of {block_size} tokens but {len(tokens) - lookahead} token ids")
    try:
        keys = _with_mm_keys(parse_extra_keys(fields.get("extra_keys"), lora_name), fields.get("mm_keys"), len(hashes))
        if keys and len(keys) != len(hashes):
            raise ValueError(f"extra_keys has {len(keys)} entries for {len(hashes)} blocks")
        lookahead_tokens = fields.get("lookahead_token_ids")
        if lookahead_tokens is not None and (
            not isinstance(lookahead_tokens, (list, tuple)) or len(lookahead_tokens) != len(hashes)
            or not all(isinstance(extra, (list, tuple)) for extra in lookahead_tokens)
        ):
            raise ValueError(f"lookahead_token_ids must be one list of token ids per block ({len(hashes)})")
        local = local_block_hashes(
            tokens, block_size, lora_name=lora_name, cache_salt=cache_salt if parent is None else None,
            block_keys=keys, lookahead=lookahead, lookahead_token_ids=lookahead_tokens,
        )
    except ValueError as error:
        raise WireError(str(error)) from None
    return msgspec.structs.replace(event, local_hashes=tuple(local)), False


def _with_mm_keys(keys: tuple[BlockKeys, ...], mm_keys: object, count: int) -> tuple[BlockKeys, ...]:
    """Add TensorRT-LLM's `mm_keys` (one list per block of `{"type": "mm_key", "hash": hex, "start_offset"}`)
    to the blocks' keys: each image by the first 16 hex digits of its hash, as Dynamo reads it."""
    if mm_keys is None:
        return keys
    if not isinstance(mm_keys, (list, tuple)) or len(mm_keys) != count:
        raise ValueError(f"mm_keys must be one list per block ({count})")
    merged = []
    for position, entry in enumerate(mm_keys):
        base = keys[position] if position < len(keys) else BlockKeys()
        hashes = list(base.mm_hashes)
        for item in entry or ():
            digest = item.get("hash") if isinstance(item, dict) else None
            if not isinstance(digest, str) or not digest:
                raise ValueError(f"mm_keys[{position}] has an item without a hex hash: {item!r:.80}")
            try:
                hashes.append(int(digest[:16], 16))
            except ValueError:
                raise ValueError(f"mm_keys[{position}] hash {digest!r:.40} is not hex") from None
        merged.append(BlockKeys(tuple(sorted(hashes)), base.cache_salt) if hashes else base)
    return tuple(merged)


def _is_remote(fields: dict[str, Any]) -> bool:
    locality = fields.get("locality")
    return isinstance(locality, str) and locality.upper() == "REMOTE"


def decode_event(event: object, engine: Engine = Engine.VLLM) -> Event | None:
    """One engine event as a canonical event, or None for an event about remote blocks."""
    return _decode_event(event, engine)[0]


def _decode_event(event: object, engine: Engine) -> tuple[Event | None, bool]:
    tag, fields = _fields(event)
    if tag in ("BlockStored", "BlockRemoved") and _is_remote(fields):
        return None, False  # about blocks held elsewhere: kept out whatever else it says
    if tag == "BlockStored":
        return _stored(fields)
    if tag == "BlockRemoved":
        removed = Removed(
            _tier(fields.get("medium")), _hash_list(fields.get("block_hashes"), "block_hashes"),
            _optional_int(fields, "group_idx") or 0, _optional_str(fields, "ownership", _OWNERSHIP_MAX_LEN),
        )
        return removed, False
    if tag == "AllBlocksCleared":
        return Cleared(CLEAR_SCOPE[engine]), False
    raise WireError(f"unknown event type {tag!r}")


def _tag_of(event: object) -> str:
    if isinstance(event, dict) and isinstance(event.get("type"), str):
        return event["type"]
    if isinstance(event, (list, tuple)) and event and isinstance(event[0], str):
        return event[0]
    return ""


def _batch_parts(batch: object) -> tuple[object, object, object]:
    if isinstance(batch, dict):
        return batch.get("ts"), batch.get("events"), batch.get("data_parallel_rank")
    if isinstance(batch, (list, tuple)) and len(batch) in (2, 3):
        return batch[0], batch[1], batch[2] if len(batch) == 3 else None
    raise WireError("batch must be [ts, events, dp_rank], [ts, events] or a map with those keys")


def decode_payload(payload: bytes, *, max_bytes: int | None = None, engine: Engine = Engine.VLLM) -> EngineBatch:
    """Decode one msgpack engine batch in any accepted variant.

    A batch that cannot be read at all raises WireError; an event that cannot be used is
    left out and listed in `rejected`, and the rest of its batch decodes as usual.
    """
    if max_bytes is not None and len(payload) > max_bytes:
        raise WireError(f"batch of {len(payload)} bytes exceeds the limit of {max_bytes}")
    fast = _decode_vllm_layout(payload, engine)
    if fast is not None:
        return fast
    return _decode_any_variant(payload, engine)


def _decode_any_variant(payload: bytes, engine: Engine) -> EngineBatch:
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as error:
        raise WireError(f"payload is not msgpack: {error}") from None
    ts, raw_events, dp_rank = _batch_parts(raw)
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise WireError(f"batch ts must be a number, got {type(ts).__name__}")
    if not isinstance(raw_events, (list, tuple)):
        raise WireError(f"batch events must be a list, got {type(raw_events).__name__}")
    if dp_rank is not None and (not isinstance(dp_rank, int) or isinstance(dp_rank, bool) or dp_rank < 0):
        raise WireError(f"data_parallel_rank must be a non-negative integer or null, got {dp_rank!r}")
    events: list[Event] = []
    rejected: list[RejectedEvent] = []
    skipped = unaligned = 0
    for position, raw_event in enumerate(raw_events):
        try:
            event, set_aside = _decode_event(raw_event, engine)
        except WireError as error:
            rejected.append(RejectedEvent(position, _tag_of(raw_event), str(error), _encoder.encode(raw_event)))
            continue
        unaligned += set_aside
        if event is None:
            skipped += 1
        else:
            events.append(event)
    return EngineBatch(float(ts), tuple(events), dp_rank, skipped, tuple(rejected), unaligned)


# --- the fast path: vLLM's own layout, decoded typed ---------------------------------
# `[ts, [tagged maps], dp_rank]` is what vLLM and TensorRT-LLM send. Decoding exactly that
# into msgspec Structs skips a dict per event and a Python check per field. Whatever it
# does not take (other variants, negative or bytes hashes, any odd value) goes through
# the generic path, which decides it and words any error.


class _NotFast(Exception):
    """A value the typed path leaves to the generic one."""


# msgspec checks the u64 range in C (a negative hash fails decoding: the generic path
# reinterprets it) and builds the tuples directly: no Python pass over the values.
_U64 = Annotated[int, msgspec.Meta(ge=0)]


# gc=False: these hold only tuples, numbers and strings (never a cycle), so the collector need not track them.
class _VllmStored(msgspec.Struct, tag_field="type", tag="BlockStored", gc=False):
    block_hashes: tuple[_U64, ...]
    token_ids: tuple[int, ...]  # a tuple: the packer takes it as its arguments without a copy
    block_size: int
    parent_block_hash: _U64 | None = None
    medium: str | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    # Anything but None here (per-block keys, lookahead) is left to the generic path.
    extra_keys: tuple[None, ...] | None = None
    lookahead_token_ids: None = None
    mm_keys: None = None  # TensorRT-LLM's per-block multimodal keys: the generic path hashes them
    ownership: str | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _VllmRemoved(msgspec.Struct, tag_field="type", tag="BlockRemoved", gc=False):
    block_hashes: tuple[_U64, ...]
    medium: str | None = None
    locality: str | None = None
    group_idx: int | None = None
    ownership: str | None = None


class _VllmCleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared", gc=False):
    pass


class _VllmBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_VllmStored | _VllmRemoved | _VllmCleared]
    data_parallel_rank: int | None


_vllm_batch_decoder = msgspec.msgpack.Decoder(_VllmBatch)
_FIXARRAY_OF_3 = 0x93  # msgpack's first byte of a 3-element array: the typed path takes no other length


def _decode_vllm_layout(payload: bytes, engine: Engine) -> EngineBatch | None:
    """The batch if it is in vLLM's own layout with plain values, else None (for the generic path)."""
    if not payload or payload[0] != _FIXARRAY_OF_3:
        return None
    try:
        batch = _vllm_batch_decoder.decode(payload)
        if batch.data_parallel_rank is not None and batch.data_parallel_rank < 0:
            return None
        events: list[Event] = []
        skipped = 0
        for raw_event in batch.events:
            kind = type(raw_event)
            if kind is _VllmCleared:
                events.append(Cleared(CLEAR_SCOPE[engine]))
                continue
            event = _typed_stored(raw_event) if kind is _VllmStored else _typed_removed(raw_event)
            if raw_event.locality is not None and raw_event.locality.upper() == "REMOTE":
                skipped += 1
            else:
                events.append(event)
    except (msgspec.DecodeError, _NotFast, OverflowError, TypeError, ValueError, struct.error):
        return None
    return EngineBatch(batch.ts, tuple(events), batch.data_parallel_rank, skipped)


def _typed_tier(medium: str | None) -> Tier:
    tier = MEDIUM_TIERS.get(None if medium is None else medium.upper())
    if tier is None:
        raise _NotFast
    return tier


def _typed_stored(event: _VllmStored) -> Stored:
    hashes = event.block_hashes
    block_size = event.block_size
    tokens = event.token_ids
    group_idx = event.group_idx or 0
    window = event.kv_cache_spec_sliding_window
    if (
        group_idx < 0 or (window is not None and window < 0)
        or (event.ownership is not None and len(event.ownership) > _OWNERSHIP_MAX_LEN)
        or (event.kv_cache_spec_kind is not None and len(event.kv_cache_spec_kind) > _SPEC_KIND_MAX_LEN)
    ):
        raise _NotFast
    if not tokens and block_size >= 0 and hashes:
        local: tuple[int, ...] = ()  # an offload placeholder: the fold resolves it by engine hash
    elif (
        block_size <= 0 or not tokens or len(tokens) != len(hashes) * block_size
        or (event.cache_salt and event.parent_block_hash is None)
        or (event.extra_keys is not None and len(event.extra_keys) != len(hashes))
    ):
        raise _NotFast  # the generic path decides, and words what is wrong
    else:
        local = tuple(_local_hashes(tokens, block_size, block_seed(event.lora_name)))
    return Stored(
        _typed_tier(event.medium), hashes, event.parent_block_hash, block_size,
        local, event.lora_name, event.cache_salt, group_idx, event.ownership, event.kv_cache_spec_kind, window,
    )


@functools.lru_cache(maxsize=64)
def _token_packer(count: int) -> Callable[..., bytes]:
    return struct.Struct(f"<{count}I").pack


def _local_hashes(tokens: tuple[int, ...], block_size: int, seed: int) -> list[int]:
    """`kvledger.core.hashing.local_block_hashes` for whole blocks of checked ints, with a cached packer."""
    raw = _token_packer(len(tokens))(*tokens)  # struct.error (a token >= 2**32) leaves it to the generic path
    step = block_size * 4
    return [_xxh3(raw[offset : offset + step], seed) for offset in range(0, len(raw), step)]


def _typed_removed(event: _VllmRemoved) -> Removed:
    group_idx = event.group_idx or 0
    if group_idx < 0 or (event.ownership is not None and len(event.ownership) > _OWNERSHIP_MAX_LEN):
        raise _NotFast
    return Removed(_typed_tier(event.medium), event.block_hashes, group_idx, event.ownership)
