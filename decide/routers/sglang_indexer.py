"""SGLang's external KV indexer (`kv_indexer.v1.KVIndexer`), answered from decide's index.

SGLang's router (`experimental/sgl-router`) asks `MatchExternalKvPrefix` with the block
hashes it computes from a request's tokens exactly as the SGLang worker does (SHA-256
chained per page, truncated to a signed 64-bit integer, in decimal), and intersects each
answer's `worker_address` with the worker URLs it registered. Those hashes are the
engine hashes SGLang publishes in its `BlockStored` events, which kvledger's index keeps
per worker beside the sequence hashes it ranks on. So a worker holds a requested hash
when the index holds that engine hash for it, as sgl-kv-indexer keys its placements by
(hash, worker, tier) — also where the worker's chain began after ingest joined, which
gives its blocks other sequence hashes than another worker's. HBM = native device,
DRAM = native host, SSD = native disk.

The answers follow sgl-kv-indexer's in-memory backend (the same validation, limits, status
codes and messages, prefix rule and ordering); docs/routers.md says where they differ.
`ApplyExternalKvBatch` is refused: kvledger's inventory comes through ingest only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import grpc
import numpy as np

from kvledger.core.events import WorkerId

from kvledger.decide.inventory.engine_hashes import native_holders
from kvledger.decide.inventory.view import IndexReader
from kvledger.decide.routers.protos import kv_indexer_pb2 as pb

SERVICE = "kv_indexer.v1.KVIndexer"
# sgl-kv-indexer's protocol bounds (service.rs) and its in-memory backend's prefix scan cap.
MAX_HASHES_PER_REQUEST = 16_384
PREFIX_SCAN_CAP = 2_048
# SGLang's tiers in the order of the native tiers `native_holders` answers by (device, host, disk).
TIERS = (pb.TIER_HBM, pb.TIER_DRAM, pb.TIER_SSD)
_U64 = (1 << 64) - 1
# Hit counts of blocks no worker holds any more are dropped once the table holds this many.
_HIT_COUNT_PRUNE_AT = 65_536


class Refused(Exception):
    """A request answered with a gRPC status, as sgl-kv-indexer answers it; `reason` labels the counter."""

    def __init__(self, code: grpc.StatusCode, message: str, reason: str) -> None:
        super().__init__(message)
        self.code, self.message, self.reason = code, message, reason


def check_hashes(hashes: Sequence[str]) -> None:
    """sgl-kv-indexer's `validate_hashes`, applied before any backend reads."""
    if not hashes:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "hashes must not be empty", "empty_hashes")
    if len(hashes) > MAX_HASHES_PER_REQUEST:
        raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      f"request contains {len(hashes)} hashes; maximum is {MAX_HASHES_PER_REQUEST}", "too_many_hashes")
    if any(not hash_text for hash_text in hashes):
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "hashes must not contain empty values", "empty_hash_value")


def engine_hash(text: str) -> int | None:
    """A hash as SGLang's bridge and router write it (signed or unsigned decimal) as kvledger's u64; None if it is none.

    sgl-kv-indexer treats hashes as opaque strings, so a string that is not a 64-bit
    integer is simply held by nobody.
    """
    digits = text[1:] if text[:1] == "-" else text
    # isascii first: str.isdigit and int() also take other scripts' digits, which the router never writes.
    if not (digits.isascii() and digits.isdigit() and len(digits) <= 20):
        return None
    value = int(text)
    return value & _U64 if -(1 << 63) <= value <= _U64 else None


def _dedup(hashes: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(hashes))


@attrs.define
class SglangIndexer:
    """The read side of SGLang's KV indexer over decide's index, with its hit counters.

    `addresses` names each worker's router-facing URL by worker name (`publisher` or
    `publisher/rank`) or by publisher; a worker without one is unroutable, as a worker whose
    bridge sends no address is to sgl-kv-indexer.
    """

    addresses: Mapping[str, str] = attrs.field(factory=dict)
    hit_counts: dict[int, int] = attrs.field(factory=dict)

    def address_of(self, worker: WorkerId) -> str:
        return self.addresses.get(worker.name, self.addresses.get(worker.publisher, ""))

    def match(self, index: IndexReader, request: pb.MatchExternalKvRequest) -> pb.MatchExternalKvResponse:
        """Per worker, the requested hashes it holds on each tier (workers in order of first match)."""
        check_hashes(request.hashes)
        hashes = _dedup(request.hashes)
        engines = [engine_hash(text) for text in hashes]
        bits = native_holders(index, engines)  # blocks × tiers × workers
        anywhere = bits.any(axis=1)
        if request.count_as_hit:
            for block in np.flatnonzero(anywhere.any(axis=1)).tolist():
                key = engines[block]
                self.hit_counts[key] = self.hit_counts.get(key, 0) + 1
        # Every (worker, tier, block) held, sorted so each worker's tiers and blocks come in order,
        # then cut into one run of blocks per (worker, tier).
        slots, positions, blocks = np.nonzero(bits.transpose(2, 1, 0))
        starts = np.flatnonzero(np.diff(slots * len(TIERS) + positions, prepend=-1))
        texts = np.array(hashes, dtype=object)
        by_slot: dict[int, list[pb.TierHashes]] = {}
        for slot, position, run in zip(slots[starts].tolist(), positions[starts].tolist(),
                                       np.split(blocks, starts[1:])):
            by_slot.setdefault(slot, []).append(pb.TierHashes(tier=TIERS[position], hashes=texts[run].tolist()))
        response = pb.MatchExternalKvResponse()
        _, held_slots = np.nonzero(anywhere)  # row-major: by block, then by slot: workers in order of first match
        for slot in dict.fromkeys(held_slots.tolist()):
            worker = index.workers[slot]
            response.matches.add(worker_id=worker.name, address=self.address_of(worker), hashes_by_tier=by_slot[slot])
        return response

    def match_prefix(self, index: IndexReader,
                     request: pb.MatchExternalKvPrefixRequest) -> pb.MatchExternalKvPrefixResponse:
        """Per routable worker, how many leading blocks it holds on any tier; longest first."""
        check_hashes(request.hashes)
        limit = len(request.hashes) if request.max_blocks == 0 else min(len(request.hashes), request.max_blocks)
        limit = min(limit, PREFIX_SCAN_CAP)
        hashes = list(request.hashes[:limit])
        if not hashes:
            return pb.MatchExternalKvPrefixResponse()
        engines = [engine_hash(text) for text in hashes]
        anywhere = native_holders(index, engines, prefix_only=True).any(axis=1)  # blocks × workers
        if not anywhere[0].any():  # the in-memory backend reads the first block only, then stops
            return pb.MatchExternalKvPrefixResponse(blocks_read=1)
        prefix = np.logical_and.accumulate(anywhere, axis=0).sum(axis=0)
        found = []
        for slot in dict.fromkeys(np.nonzero(anywhere)[1].tolist()):
            worker = index.workers[slot]
            address = self.address_of(worker)
            if address and prefix[slot] > 0:
                found.append((worker.name, address, int(prefix[slot])))
        found.sort(key=lambda entry: -entry[2])  # stable: workers of equal prefix keep their order
        response = pb.MatchExternalKvPrefixResponse(best_prefix_blocks=found[0][2] if found else 0, blocks_read=limit)
        for worker_id, address, blocks in found:
            response.matches.add(worker_address=address, matched_prefix_blocks=blocks, worker_id=worker_id)
        return response

    def hit_counts_of(self, index: IndexReader,
                      request: pb.GetExternalKvHitCountsRequest) -> pb.GetExternalKvHitCountsResponse:
        """The hit count of each requested hash that has one; a block nobody holds any more has none."""
        check_hashes(request.hashes)
        hashes = _dedup(request.hashes)
        engines = [engine_hash(text) for text in hashes]
        held = native_holders(index, engines).any(axis=(1, 2))
        response = pb.GetExternalKvHitCountsResponse()
        for text, key, still_held in zip(hashes, engines, held.tolist()):
            if key is None or key not in self.hit_counts:
                continue
            if not still_held:  # sgl-kv-indexer forgets a block's count once its last placement goes
                del self.hit_counts[key]
                continue
            response.entries.add(hash=text, hit_count_total=self.hit_counts[key])
        if len(self.hit_counts) > _HIT_COUNT_PRUNE_AT:
            self._prune(index)
        return response

    def _prune(self, index: IndexReader) -> None:
        keys = list(self.hit_counts)
        held = native_holders(index, keys).any(axis=(1, 2))
        for key, still_held in zip(keys, held.tolist()):
            if not still_held:
                del self.hit_counts[key]


APPLY_REFUSAL = Refused(
    grpc.StatusCode.UNIMPLEMENTED,
    "kvledger does not take KV events over ApplyExternalKvBatch: run `kvledger ingest` against the worker's "
    "ZMQ publisher instead (it tracks sequence numbers, replays what was missed and keeps the tokens the index "
    "hashes); see docs/routers.md",
    "apply_refused",
)
