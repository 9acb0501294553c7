"""Small builders for canonical batches, so tests read as the rules they check."""

from __future__ import annotations

from kvledger.core.events import (
    Cleared, EventBatch, Gap, GapReason, Provenance, Removed, Stored, Tier, WorkerId, encode_batch,
)
from kvledger.core.hashing import local_block_hashes

BLOCK_SIZE = 4


def tokens_for(block_ids: list[int]) -> list[int]:
    """Distinct token content per block id, so each id gets a distinct local hash."""
    return [token for block_id in block_ids for token in [block_id] * BLOCK_SIZE]


def local_hashes(block_ids: list[int]) -> tuple[int, ...]:
    return tuple(local_block_hashes(tokens_for(block_ids), BLOCK_SIZE))


def stored(block_ids: list[int], parent: int | None = None, tier: Tier = Tier.DEVICE, engine_offset: int = 0) -> Stored:
    """Blocks whose engine hash is `id + engine_offset` and whose content is keyed by `id`."""
    return Stored(
        tier, tuple(b + engine_offset for b in block_ids), parent, BLOCK_SIZE, local_hashes(block_ids),
    )


def removed(block_ids: list[int], tier: Tier = Tier.DEVICE) -> Removed:
    return Removed(tier, tuple(block_ids))


def gap(reason: GapReason, expected: int = 1, received: int = 5) -> Gap:
    return Gap(expected, received, reason)


class Stream:
    """Numbers batches like JetStream does and keeps each worker's engine seq."""

    def __init__(self) -> None:
        self.stream_seq = 0
        self._engine_seq: dict[tuple[WorkerId, Provenance], int] = {}

    def batch(
        self, worker: WorkerId, *events, provenance: Provenance = Provenance.NATIVE, epoch: int = 0, seq: int | None = None,
    ) -> tuple[EventBatch, int]:
        key = (worker, provenance)
        if seq is None:
            seq = self._engine_seq.get(key, -1) + 1
        self._engine_seq[key] = seq
        self.stream_seq += 1
        return EventBatch(worker, epoch, seq, 1.0, 2.0, provenance, tuple(events)), self.stream_seq


__all__ = ["BLOCK_SIZE", "Cleared", "Stream", "gap", "local_hashes", "removed", "stored", "tokens_for"]


async def publish(js, batches) -> None:
    """(batch, seq) pairs published to JetStream as ingest would: each under its Msg-Id, so a repeat is dropped."""
    for batch, _ in batches:
        await js.publish(batch.subject, encode_batch(batch), headers={"Nats-Msg-Id": batch.msg_id})
