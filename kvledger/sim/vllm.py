"""vLLM's current KV-event format, encoded as vLLM's own publisher sends it: what the engine
simulator, the demo and the tests speak. (ingest's decoding of it lives in `ingest/wire.py`.)"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import msgspec


@attrs.frozen
class VllmBlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = "GPU"
    lora_name: str | None = None

    def as_wire(self) -> dict[str, Any]:
        # As vLLM 0.33 sends a plain model's store (tests/golden/vllm_plain.json): one
        # extra-keys entry per block, group 0, the group's kind.
        return {
            "type": "BlockStored", "block_hashes": list(self.block_hashes),
            "parent_block_hash": self.parent_block_hash, "token_ids": list(self.token_ids),
            "block_size": self.block_size, "lora_id": None, "medium": self.medium,
            "lora_name": self.lora_name, "extra_keys": [None] * len(self.block_hashes), "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }


@attrs.frozen
class VllmBlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str | None = "GPU"

    def as_wire(self) -> dict[str, Any]:
        return {"type": "BlockRemoved", "block_hashes": list(self.block_hashes), "medium": self.medium, "group_idx": 0}


@attrs.frozen
class VllmAllBlocksCleared:
    def as_wire(self) -> dict[str, Any]:
        return {"type": "AllBlocksCleared"}


VllmEvent = VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared
_encoder = msgspec.msgpack.Encoder()


def encode_vllm_batch(ts: float, events: Sequence[VllmEvent], dp_rank: int | None = None) -> bytes:
    """A batch exactly as vLLM publishes it: `[ts, [tagged maps], data_parallel_rank]`."""
    return _encoder.encode([ts, [event.as_wire() for event in events], dp_rank])
