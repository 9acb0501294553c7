"""In-flight credit: a request decide routed counts as held on its target for a while.

A burst of requests sharing a prefix, routed by kvledger, sees no credit anywhere until
the first one's KV events land; llm-d's speculative indexing and Dynamo's predicted blocks
count a just-routed request's blocks on its worker for a short TTL. Here: once decide
answers a request with a target it was routed to (a target the request named, or one
decide chose by credit, or the request's `fallback` when nobody had credit), every block
of the request counts as *in flight* on that worker for `decide.inflight_ttl_ms`.

- Each in-flight block is an entry (worker, sequence hash) → (expiry, confirmed).
- Looking a request up, the worker's native prefix (from the ranked answer) confirms the
  entries under it; past it, the prefix goes on over pending entries. An entry already
  confirmed that the worker no longer holds is a contradiction (the engine stored it and
  evicted it since): it is dropped and never counts again. Entries expire at their TTL.
- In-flight blocks are routing credit, reported in the answer's `inflight` field and in
  SQL (`decisions.inflight_blocks`), never execution credit: `credited_blocks` stays the
  native credit the reference model computes, so the answers' parity is untouched.
- Target choice without a named target: each worker's routing credit is its native credit
  plus `inflight blocks × reuse.device_credit_weight` (the prefill puts them on its device);
  a worker whose in-flight blocks could beat the ranked target is ranked again with itself
  as the target, and the best routing credit wins (ties: worker order). Nobody with credit
  and a `fallback` named: the fallback is the target.

The model's own answers come from the backend unchanged: this layer only re-ranks a
request with another target, as a router naming that target would have asked.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence

import attrs

from kvledger.core.decision_codec import MAX_RELIED_BLOCKS, Inflight, hashes_text, with_inflight
from kvledger.core.events import WorkerId
from kvledger.core.reuse import ReuseRequest
from kvledger.core.settings import ReuseSettings

from kvledger.decide.ranking.backend import RankingBackend
from kvledger.decide.ranking.ranked import PREFIX_ANY, REASONS, AnswerBatch, AnswerTexts, Clock, sequence_hashes_of


@attrs.define
class _Entry:
    expiry: float
    confirmed: bool = False


class InflightLedger:
    """The in-flight blocks of routed requests, by sequence hash and worker."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._entries: dict[int, dict[WorkerId, _Entry]] = {}
        self._expiring: collections.deque[tuple[float, WorkerId, list[int]]] = collections.deque()
        self.contradicted = 0  # entries dropped because the engine evicted what it had confirmed

    def __len__(self) -> int:
        return sum(map(len, self._entries.values()))

    def note(self, worker: WorkerId, sequence: Sequence[int], native: int, now: float) -> None:
        """`worker` will hold every block of `sequence` once its prefill ran: in flight until `now` + TTL.

        The first `native` blocks it holds already (confirmed); the rest wait for its engine.
        """
        expiry = now + self.ttl_s
        entries = self._entries
        for position, sequence_hash in enumerate(sequence):
            confirmed = position < native
            held = entries.get(sequence_hash)
            if held is None:
                entries[sequence_hash] = {worker: _Entry(expiry, confirmed)}
            else:
                entry = held.get(worker)
                if entry is None:
                    held[worker] = _Entry(expiry, confirmed)
                else:  # routed there again: what it does not hold is pending again until its engine says
                    entry.expiry, entry.confirmed = expiry, confirmed
        self._expiring.append((expiry, worker, list(sequence)))

    def expire(self, now: float) -> None:
        entries = self._entries
        while self._expiring and self._expiring[0][0] <= now:
            _, worker, sequence = self._expiring.popleft()
            for sequence_hash in sequence:
                held = entries.get(sequence_hash)
                entry = held.get(worker) if held is not None else None
                if entry is not None and entry.expiry <= now:
                    del held[worker]
                    if not held:
                        del entries[sequence_hash]

    def workers_at(self, first_hash: int, now: float) -> list[WorkerId]:
        """Workers with an unexpired in-flight entry on a request's first block."""
        held = self._entries.get(first_hash)
        return [] if held is None else [worker for worker, entry in held.items() if entry.expiry > now]

    def extra_blocks(self, worker: WorkerId, sequence: Sequence[int], native: int, now: float) -> int:
        """How many blocks past its native prefix (`native` blocks) `worker` holds in flight, contiguously."""
        entries = self._entries
        for sequence_hash in sequence[:native]:
            held = entries.get(sequence_hash)
            entry = held.get(worker) if held is not None else None
            if entry is not None and entry.expiry > now:
                entry.confirmed = True  # the engine's own events hold it now
        count = 0
        for sequence_hash in sequence[native:]:
            held = entries.get(sequence_hash)
            entry = held.get(worker) if held is not None else None
            if entry is None or entry.expiry <= now:
                break
            if entry.confirmed:  # held since the note, gone now: the engine contradicted it
                del held[worker]
                self.contradicted += 1
                break
            count += 1
        return count


@attrs.frozen
class _Routed:
    """One request's answer after in-flight credit: from the ranked batch (`batch`, `position`)."""

    batch: AnswerBatch
    texts: AnswerTexts
    position: int
    worker: WorkerId | None
    routing_credit: float  # native credit plus in-flight blocks × device_credit_weight


class InflightRouting:
    """Answers a batch with in-flight credit counted in target choice and noted for what follows."""

    def __init__(self, ledger: InflightLedger) -> None:
        self.ledger = ledger

    def answer(
        self, backend: RankingBackend, requests: Sequence[ReuseRequest], settings: ReuseSettings, *,
        clock: Clock = time.perf_counter,
    ) -> AnswerTexts:
        """The batch's answers, its requests taken in order: each one sees what those before it put in flight."""
        ledger = self.ledger
        now = ledger.clock()
        ledger.expire(now)
        weight = settings.device_credit_weight
        batch = backend.answer_batch(requests, settings, clock=clock)
        texts = AnswerTexts.of(batch)
        sequence, offsets = sequence_hashes_of(requests)
        tracking = ledger.ttl_s > 0

        def ranked_for(request: ReuseRequest, worker: WorkerId, extra: dict[WorkerId, int]) -> _Routed:
            # As a router naming `worker` would have asked: the model's answer for that target.
            again = backend.answer_batch([attrs.evolve(request, target=worker)], settings, clock=clock)
            credit = float(again.ranked.credited[0]) + extra.get(worker, 0) * weight
            return _Routed(again, AnswerTexts.of(again), 0, worker, credit)

        answers, relied, reasons = [], [], collections.Counter()
        for r, request in enumerate(requests):
            hashes = sequence[offsets[r]:offsets[r + 1]].tolist()
            natives = self._natives(batch, r)
            target = self._target(batch, r)
            extra: dict[WorkerId, int] = {}
            if tracking and hashes:
                for worker in {*ledger.workers_at(hashes[0], now), *([target] if target is not None else [])}:
                    blocks = ledger.extra_blocks(worker, hashes, natives.get(worker, 0), now)
                    if blocks:
                        extra[worker] = blocks
            credit = float(batch.ranked.credited[r]) + extra.get(target, 0) * weight if target is not None else 0.0
            routed = _Routed(batch, texts, r, target, credit)
            if request.target is None:
                for worker in sorted(extra):
                    if worker != routed.worker:
                        other = ranked_for(request, worker, extra)
                        if other.routing_credit > routed.routing_credit or (
                                other.routing_credit == routed.routing_credit and (routed.worker is None or worker < routed.worker)):
                            routed = other
                if routed.routing_credit == 0 and request.fallback is not None and routed.worker != request.fallback:
                    routed = ranked_for(request, request.fallback, extra)
            answer = routed.texts.answers[routed.position]
            relied_text = routed.texts.relied_prefixes[routed.position]
            reasons[REASONS[int(routed.batch.ranked.reason[routed.position])]] += 1
            worker = routed.worker
            blocks = extra.get(worker, 0) if worker is not None else 0
            if blocks:
                answer = with_inflight(answer, Inflight(blocks, blocks * weight))
                held = min(natives.get(worker, 0) + blocks, MAX_RELIED_BLOCKS)
                if held > len(relied_text) // 16:
                    relied_text = hashes_text(hashes[:held])
            # Where the request goes: the target it named, the one its credit chose, or its fallback.
            placed = request.target is not None or routed.routing_credit > 0 or (
                worker is not None and worker == request.fallback)
            if tracking and placed and worker is not None:
                ledger.note(worker, hashes, natives.get(worker, 0), now)
            answers.append(answer)
            relied.append(relied_text)
        return AnswerTexts(answers, relied, dict(reasons))

    @staticmethod
    def _natives(batch: AnswerBatch, r: int) -> dict[WorkerId, int]:
        """Each shown worker's native prefix on any local tier."""
        ranked = batch.ranked
        items = range(int(ranked.overlap_bounds[r]), int(ranked.overlap_bounds[r + 1]))
        return {batch.workers[int(ranked.overlap_slot[i])]: int(ranked.overlap_lengths[i, PREFIX_ANY]) for i in items}

    @staticmethod
    def _target(batch: AnswerBatch, r: int) -> WorkerId | None:
        slot = int(batch.ranked.target[r])
        return batch.workers[slot] if slot >= 0 else batch.requests[r].target

