"""Sequence rules per engine stream (docs/core.md, canonical record): in order, repaired by replay, restarts detected.

One `SequenceTracker` follows one (publisher, dp_rank, provenance). It turns what the SUB
socket and the replay socket deliver into an ordered list of batches to publish, each with
the `Gap` events that must precede it. It does no I/O of its own: replay is a callable it
is given, so the rules are testable without sockets.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import attrs
import xxhash

from kvledger.core.events import Gap, GapReason
from kvledger.runtime.memory import mapped_words

# seq -> payload, as the engine's replay buffer returns them from a start seq on
Fetch = Callable[[int], Awaitable[list[tuple[int, bytes]]]]


@attrs.frozen
class Emit:
    """A batch to publish, in this order: engine `seq` within `epoch`, preceded by `gaps`."""

    epoch: int
    seq: int
    payload: bytes
    gaps: tuple[Gap, ...] = ()


@attrs.define
class TrackerCounters:
    duplicates: int = 0
    replays: int = 0
    replayed_batches: int = 0
    restarts: int = 0
    incarnation_checks: int = 0  # reconnections whose engine was checked by content (ingest/incarnation.py)
    unverified_incarnations: int = 0  # checks that could tell neither continuation nor restart: a Gap


class SequenceTracker:
    """Decides, batch by batch, what one engine stream contributes to the canonical log."""

    def __init__(self, epoch: int, next_seq: int, fetch: Fetch | None, *, recent: int = 65536) -> None:
        self.epoch = epoch
        self.next_seq = next_seq
        self._fetch = fetch
        self._pending_gaps: list[Gap] = []
        # Digests of recently emitted batches: a seq seen again with the same bytes is a
        # duplicate (replay overlapping the SUB socket); with other bytes, a restarted engine.
        self._recent = RecentDigests(recent)
        self.counters = TrackerCounters()

    async def catch_up(self) -> list[Emit]:
        """Replay everything the engine still buffers from `next_seq` on (at start and on idle)."""
        if self._fetch is None:
            return []
        return self._accept_replayed(await self._replay(self.next_seq))

    def accept_replayed(self, replies: list[tuple[int, bytes]]) -> list[Emit]:
        """`catch_up` with a replay already fetched (the incarnation check's, which starts one seq earlier)."""
        self.counters.replays += 1
        self.counters.replayed_batches += len(replies)
        return self._accept_replayed(replies)

    def emitted_matches(self, seq: int, payload: bytes) -> bool | None:
        """Whether `seq` of this epoch was emitted with these bytes; None if it is not among the recent ones."""
        digest = self._recent.get(seq)
        return None if digest is None else digest == _digest(payload)

    def restarted(self) -> Gap:
        """The engine was found to have restarted before its next batch: a new epoch from seq 0,
        which begins with the returned `Gap(publisher_restart)`."""
        self.counters.restarts += 1
        gap = Gap(self.next_seq, 0, GapReason.PUBLISHER_RESTART)
        self._pending_gaps.append(gap)
        self.epoch += 1
        self.next_seq = 0
        self._recent.clear()
        return gap

    def unverified(self, first: int | None) -> None:
        """Continuity from the last seq emitted could not be established (the engine no longer
        buffers it): go on in this epoch from `first`, behind a `Gap(replay_incomplete)` from
        that last seq, which makes the worker uncertain."""
        self.counters.unverified_incarnations += 1
        last = self.next_seq - 1
        self._gap(GapReason.REPLAY_INCOMPLETE, last, max(self.next_seq, first if first is not None else 0))

    def next_in_order(self, seq: int, payload: bytes) -> Emit | None:
        """The common case without a coroutine: the expected seq is emitted; anything else is None
        (and changes nothing), for `on_live` to judge."""
        return self._emit(seq, payload) if seq == self.next_seq else None

    async def on_live(self, seq: int, payload: bytes) -> list[Emit]:
        """A batch from the SUB socket."""
        if seq == self.next_seq:
            return [self._emit(seq, payload)]
        if seq > self.next_seq:
            return await self._repair_then(seq, payload)
        if self._recent.get(seq) == _digest(payload):
            self.counters.duplicates += 1
            return []
        return await self._restart_at(seq, payload)

    def published(self, seq: int, payload: bytes) -> bool:
        """Whether `seq` of the current epoch was emitted with exactly these bytes (among the
        recent ones): a batch fetched again from the engine is the one published under its seq."""
        return self._recent.get(seq) == _digest(payload)

    async def _repair_then(self, seq: int, payload: bytes) -> list[Emit]:
        emits: list[Emit] = []
        if self._fetch is not None:
            emits = self._accept_replayed(await self._replay(self.next_seq), until=seq)
        if seq > self.next_seq:
            reason = GapReason.REPLAY_INCOMPLETE if self._fetch is not None else GapReason.MISSED
            self._gap(reason, self.next_seq, seq)
        if seq == self.next_seq:
            emits.append(self._emit(seq, payload))
        return emits

    async def _restart_at(self, seq: int, payload: bytes) -> list[Emit]:
        # A restarted engine has an empty cache and counts from 0 again.
        self.counters.restarts += 1
        self._pending_gaps.append(Gap(self.next_seq, seq, GapReason.PUBLISHER_RESTART))
        self.epoch += 1
        self.next_seq = 0
        self._recent.clear()
        if seq == 0:
            return [self._emit(seq, payload)]
        return await self._repair_then(seq, payload)

    async def _replay(self, start: int) -> list[tuple[int, bytes]]:
        self.counters.replays += 1
        replies = await self._fetch(start)
        self.counters.replayed_batches += len(replies)
        return replies

    def _accept_replayed(self, replies: list[tuple[int, bytes]], until: int | None = None) -> list[Emit]:
        """Emit replayed batches in order; a hole in what the engine still buffers is a gap."""
        emits: list[Emit] = []
        for seq, payload in sorted(replies):
            if until is not None and seq >= until:
                break
            if seq < self.next_seq:
                continue  # already published; replay starts where we asked, or earlier
            if seq > self.next_seq:
                self._gap(GapReason.REPLAY_INCOMPLETE, self.next_seq, seq)
            emits.append(self._emit(seq, payload))
        return emits

    def _gap(self, reason: GapReason, expected: int, received: int) -> None:
        self._pending_gaps.append(Gap(expected, received, reason))
        self.next_seq = received

    def _emit(self, seq: int, payload: bytes) -> Emit:
        emit = Emit(self.epoch, seq, payload, tuple(self._pending_gaps))
        self._pending_gaps.clear()
        self.next_seq = seq + 1
        self._recent.put(seq, _digest(payload))
        return emit


class RecentDigests:
    """The digests of the last `limit` seqs emitted, as a ring of two arrays.

    An ordered dict of them cost about 170 bytes a seq, 10.6 MiB per engine stream once
    full (2.7 GB for 256 engines, growing for hours); the ring costs 16 bytes a seq, taken
    only as it is written (`mapped_words`).
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self.clear()

    def clear(self) -> None:
        # A slot holds seq + 1 (0: empty) beside that seq's digest.
        self._seqs = mapped_words(self._limit, "q")
        self._digests = mapped_words(self._limit, "Q")

    def put(self, seq: int, digest: int) -> None:
        slot = seq % self._limit
        self._seqs[slot] = seq + 1
        self._digests[slot] = digest

    def get(self, seq: int) -> int | None:
        slot = seq % self._limit
        return self._digests[slot] if self._seqs[slot] == seq + 1 else None


def _digest(payload: bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload)
