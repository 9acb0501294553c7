"""Asking ingest to fetch a hole mid-stream again (docs/ingest.md, "Holes mid-stream").

store and decide fold KV_EVENTS in each worker's engine order; a batch stored after a hole in
its worker's seqs is held back until the missing seqs come (kvledger.core.fold, `HOLE_WAIT_MESSAGES`).
Whoever finds such a hole asks here, on core NATS (no reply: the answer is the stream itself), and
the ingest that follows the engine fetches the seqs from its replay buffer and publishes them again,
or a `Gap(stream_lost)` for those it no longer buffers. Both store and decide may ask for one hole:
ingest fetches each once within a short while.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import msgspec

from kvledger.core.events import Provenance, WorkerId
from kvledger.core.fold import HoleToFetch

log = logging.getLogger("kvledger.refetch")

REFETCH_SUBJECT = "kvledger.ingest.refetch"


class RefetchRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Engine seqs [first, end) of one worker's epoch that KV_EVENTS lacks, as a fold found them."""

    publisher: str
    dp_rank: int
    provenance: str
    epoch: int
    first: int
    end: int
    asked_by: str

    @property
    def worker(self) -> WorkerId:
        return WorkerId(self.publisher, self.dp_rank)


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(RefetchRequest)


def encode_refetch(hole: HoleToFetch, asked_by: str) -> bytes:
    return _ENCODER.encode(RefetchRequest(hole.worker.publisher, hole.worker.dp_rank, hole.provenance.value,
                                          hole.epoch, hole.first, hole.end, asked_by))


def decode_refetch(data: bytes) -> RefetchRequest:
    """The request; ValueError naming what is wrong (msgspec's message, or a bad range or provenance)."""
    try:
        request = _DECODER.decode(data)
    except msgspec.DecodeError as error:
        raise ValueError(f"undecodable refetch request: {error}") from None
    if not 0 <= request.first < request.end:
        raise ValueError(f"refetch request for seqs [{request.first}, {request.end}): not a range")
    try:
        Provenance(request.provenance)
        WorkerId(request.publisher, request.dp_rank)
    except ValueError as error:
        raise ValueError(f"refetch request: {error}") from None
    return request


async def ask_refetch(nc, holes: Iterable[HoleToFetch], asked_by: str) -> int:
    """Publish one request per hole on REFETCH_SUBJECT; how many were asked. A connection that is closed or
    refused the subject loses the request, and the hole is given up on in time (never silently: the worker is
    uncertain while it waits)."""
    asked = 0
    for hole in holes:
        try:
            await nc.publish(REFETCH_SUBJECT, encode_refetch(hole, asked_by))
            asked += 1
        except Exception as error:  # noqa: BLE001 - a lost request costs the wait, nothing else
            log.warning("%s: could not ask ingest to fetch %s seqs %d-%d again: %s", asked_by, hole.worker.name,
                        hole.first, hole.end - 1, error)
    return asked
