"""What a ranking backend computes for a batch, and how it becomes answers.

Both backends fill the same `RankedBatch` of arrays (targets, credit, baseline, reasons,
the overlaps shown and the ranked candidates); `AnswerBatch` turns it into `Decision`
values or straight into the answers' JSON, here once, so cpu and cuda can only differ in
numbers, never in presentation.
"""

from __future__ import annotations

import collections
import functools
import itertools
import json
import operator
import weakref
from collections.abc import Callable, Sequence

import attrs
import numpy as np

from kvledger.core.decision_codec import MAX_RELIED_BLOCKS
from kvledger.core.events import Tier, WorkerId
from kvledger.core.reuse import Candidate, Decision, Overlap, Reason, ReuseRequest, enabled_source_tiers
from kvledger.core.settings import ReuseSettings, settings_digest

from kvledger.decide.inventory.chain import chain_hashes
from kvledger.decide.inventory.view import IndexReader
from kvledger.decide.ranking.kernels import relied_prefix_texts, repr_positions, write_ranked_answers
from kvledger.decide.ranking.packed import packed_requests, split_texts

# Prefix classes reported per worker: the three native tiers alone, any native tier, and
# native ∪ retained device (the target's baseline).
PREFIX_DEVICE, PREFIX_HOST, PREFIX_DISK, PREFIX_ANY, PREFIX_RETAINED_DEVICE = range(5)
PREFIX_CLASSES = 5
SOURCE_TIERS = (Tier.DEVICE, Tier.HOST, Tier.DISK)  # tier code = its prefix class, and its rank

REASONS = (
    Reason.DISABLED, Reason.CHOSEN, Reason.NO_WORKERS, Reason.NO_CANDIDATES,
    Reason.BELOW_THRESHOLD, Reason.BUDGET_EXHAUSTED,
)
DISABLED, CHOSEN, NO_WORKERS, NO_CANDIDATES, BELOW_THRESHOLD, BUDGET_EXHAUSTED = range(len(REASONS))

NO_TARGET = -1  # no target given and no worker to pick, or a target the index has never seen
_block_size = operator.attrgetter("block_size")

Clock = Callable[[], float]


@attrs.frozen
class RankedBatch:
    """Per-request results as arrays; overlaps and candidates are flat, grouped by request.

    Request r's overlaps are items `overlap_bounds[r]:overlap_bounds[r + 1]`, in worker
    order (every worker holding a prefix in some class, and a known target); its
    candidates are `candidate_bounds[r]:candidate_bounds[r + 1]`, ranked.
    """

    target: np.ndarray  # int32 slot per request, NO_TARGET if none or unknown
    credited: np.ndarray  # float64
    baseline: np.ndarray  # int32
    reason: np.ndarray  # int8 index into REASONS
    overlap_bounds: np.ndarray  # int64, requests + 1
    overlap_slot: np.ndarray  # int32
    overlap_lengths: np.ndarray  # int32 (overlaps, PREFIX_CLASSES)
    candidate_bounds: np.ndarray  # int64, requests + 1
    candidate_slot: np.ndarray
    candidate_tier: np.ndarray  # index into SOURCE_TIERS
    candidate_prefix: np.ndarray
    candidate_transfer_blocks: np.ndarray
    candidate_recompute_ms: np.ndarray
    candidate_transfer_ms: np.ndarray
    candidate_saving_ms: np.ndarray
    # Positions, in (credited, recompute, transfer, saving) order, of the floats the JSON
    # kernel cannot write as repr does; None: not known yet (`decide.ranking.kernels.needs_repr`).
    needs_repr: np.ndarray | None = None
    # The requests' sequence hashes end to end, at least as far as each walk went, and where
    # each request starts (`AnswerBatch.relied_prefixes` reads them); both backends keep them.
    sequence: np.ndarray | None = None
    sequence_offsets: np.ndarray | None = None


def overlaps_of(lengths: np.ndarray, target: np.ndarray, slots_in_order: np.ndarray,
                order_rank: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`RankedBatch`'s overlaps from dense prefix lengths (requests, PREFIX_CLASSES, slots)."""
    count = lengths.shape[0]
    # Lengths are never negative, so OR is non-zero exactly where either prefix is.
    held = lengths[:, PREFIX_ANY, :] | lengths[:, PREFIX_RETAINED_DEVICE, :]
    shown = held[:, slots_in_order] > 0
    known = target >= 0
    if known.any():
        shown[np.flatnonzero(known), order_rank[target[known]]] = True
    # np.nonzero is several times faster on a flat boolean array than on a 2-D one.
    shown_request, shown_position = np.divmod(np.flatnonzero(shown), max(shown.shape[1], 1))
    shown_slot = slots_in_order[shown_position]
    bounds = np.searchsorted(shown_request, np.arange(count + 1)).astype(np.int64)
    return bounds, shown_slot.astype(np.int32), np.ascontiguousarray(lengths[shown_request, :, shown_slot], dtype=np.int32)


def source_tier_codes(settings: ReuseSettings) -> tuple[int, ...]:
    return tuple(SOURCE_TIERS.index(tier) for tier in enabled_source_tiers(settings))


def local_hashes_of(requests: Sequence[ReuseRequest]) -> tuple[np.ndarray, np.ndarray]:
    """All requests' local hashes end to end, and the offsets where each request starts."""
    batch = RequestArrays.of(requests)
    return batch.local, batch.offsets


def _converted_local_hashes(requests: Sequence[ReuseRequest]) -> tuple[np.ndarray, np.ndarray]:
    """`local_hashes_of` by numpy's conversion, which names a hash it cannot convert."""
    if len(requests) == 1:  # the service's single requests: fewer numpy calls
        local = np.array(requests[0].local_hashes, dtype=np.uint64)
        return local, np.array([0, local.size], dtype=np.int64)
    lengths = np.fromiter(map(len, (request.local_hashes for request in requests)), dtype=np.int64,
                          count=len(requests))
    offsets = np.zeros(len(requests) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    local = np.fromiter(itertools.chain.from_iterable(request.local_hashes for request in requests),
                        dtype=np.uint64, count=int(offsets[-1]))
    return local, offsets


def request_ids_of(requests: Sequence[ReuseRequest]) -> tuple[np.ndarray, np.ndarray]:
    """The request ids' UTF-8 end to end, and the bounds of each."""
    count = len(requests)
    if count == 1:
        text = requests[0].request_id.encode()
        return np.frombuffer(text, dtype=np.uint8), np.array([0, len(text)], dtype=np.int64)
    ids = [request.request_id for request in requests]
    text = "".join(ids).encode()
    bounds = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, ids), dtype=np.int64, count=count), out=bounds[1:])
    if bounds[-1] != len(text):  # not all ASCII: bounds in UTF-8 bytes
        np.cumsum(np.fromiter((len(id_text.encode()) for id_text in ids), dtype=np.int64, count=count),
                  out=bounds[1:])
    return np.frombuffer(text, dtype=np.uint8), bounds


@attrs.frozen
class RequestArrays:
    """A batch's requests as the kernels read them."""

    local: np.ndarray  # every request's local hashes end to end (uint64)
    offsets: np.ndarray  # where each request's hashes start, and the end (int64, requests + 1)
    ids: np.ndarray  # the request ids' UTF-8 end to end
    id_bounds: np.ndarray  # where each id starts, and the end
    block_sizes: np.ndarray  # int64

    @classmethod
    def of(cls, requests: Sequence[ReuseRequest]) -> RequestArrays:
        # A batch goes through one MessagePack encoding (`decide.packed`); a single request,
        # or a batch with a value of another kind, the general way, which names what is wrong.
        if len(requests) > 1 and (packed := packed_requests(requests)) is not None:
            local, offsets, ids, id_bounds, block_sizes = packed
            return cls(local, offsets, ids, id_bounds, block_sizes)
        block_sizes = (np.array([requests[0].block_size], dtype=np.int64) if len(requests) == 1
                       else np.fromiter(map(_block_size, requests), dtype=np.int64, count=len(requests)))
        return cls(*_converted_local_hashes(requests), *request_ids_of(requests), block_sizes)


def sequence_hashes_of(requests: Sequence[ReuseRequest]) -> tuple[np.ndarray, np.ndarray]:
    """All requests' sequence hashes end to end, and the offsets where each request starts."""
    local, offsets = local_hashes_of(requests)
    return chain_hashes(local, offsets), offsets


_UNNAMED = -2  # a request without a target, while the slots are gathered


def target_slot(index: IndexReader, target: WorkerId | None) -> int:
    """The slot of a request's target; NO_TARGET when it names none or one the index has never seen."""
    return NO_TARGET if target is None else index.slot_by_key.get((target.publisher, target.dp_rank), NO_TARGET)


def requested_targets(index: IndexReader, requests: Sequence[ReuseRequest]) -> tuple[np.ndarray, np.ndarray]:
    """Slots of the requests' targets (NO_TARGET when none or unknown) and which requests named one."""
    if len(requests) == 1:  # a third of the numpy calls
        target = requests[0].target
        return np.array([target_slot(index, target)], dtype=np.int32), np.array([target is not None])
    # Inline below: a call per request costs a third of the loop. Rank 0 is looked up by its
    # publisher alone, sparing a tuple's making and hashing.
    slot_of, rank_zero_slot_of = index.slot_by_key.get, index.rank_zero_slots.get
    slots = np.array([_UNNAMED if (target := request.target) is None
                      else rank_zero_slot_of(target.publisher, NO_TARGET) if target.dp_rank == 0
                      else slot_of((target.publisher, target.dp_rank), NO_TARGET)
                      for request in requests], dtype=np.int32).reshape(len(requests))
    named = slots != _UNNAMED
    slots[~named] = NO_TARGET
    return slots, named


class PerSettings:
    """`function(settings)`, computed again only when the settings value changes: a service
    asks with the same value every time, and the values are costly (a SHA-256 over JSON,
    the kernels' arguments)."""

    def __init__(self, function: Callable[[ReuseSettings], object]) -> None:
        self._function = function
        self._settings: ReuseSettings | None = None
        self._value: object = None

    def __call__(self, settings: ReuseSettings):
        if settings is not self._settings:
            self._settings, self._value = settings, self._function(settings)
        return self._value


digest_of = PerSettings(settings_digest)


def _texts(texts: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Byte texts as one uint8 buffer and the bounds of each (item i is `buffer[bounds[i]:bounds[i + 1]]`)."""
    bounds = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, texts), dtype=np.int64, count=len(texts)), out=bounds[1:])
    return np.frombuffer(b"".join(texts), dtype=np.uint8), bounds


NO_TEXT = _texts([])[0]


def json_string_text(text: str) -> np.ndarray:
    """A string as JSON, as the kernels take texts."""
    return np.frombuffer(_json_string(text), dtype=np.uint8)


@functools.lru_cache(maxsize=4)
def inventory_target_text(inventory_seq: int) -> np.ndarray:
    """What an answer says between its request id and its target (the same for every answer
    until the index changes)."""
    return np.frombuffer(f',"inventory_seq":{inventory_seq},"target":'.encode(), dtype=np.uint8)


@attrs.frozen
class BatchTargets:
    """A batch's targets as the ranking read them: each request's target slot (NO_TARGET for none or a
    worker the index has never seen), whether it named one, and the index's worker names as JSON strings
    by slot (`WorkerTexts.name_texts`)."""

    slots: np.ndarray  # int32
    named: np.ndarray  # uint8 (a bool's bytes)
    names: tuple[np.ndarray, np.ndarray]

    @property
    def all_known(self) -> bool:
        """Whether every request that named a target named one the index knows (its name is in `names`)."""
        return not np.any((self.slots < 0) & (self.named != 0))


@attrs.frozen
class WorkerTexts:
    """Each worker's pieces of answer JSON, by slot: made once per index and worker count,
    since workers only ever join an index."""

    names: tuple[bytes, ...]  # the name as a JSON string
    name_texts: tuple[np.ndarray, np.ndarray]
    sources: tuple[np.ndarray, np.ndarray]  # `{"source":…,"dp_rank":…`, the opening of a candidate

    @classmethod
    def of(cls, index: IndexReader) -> WorkerTexts:
        texts = _worker_texts.get(index)
        if texts is None or len(texts.names) != index.worker_count:
            workers = index.workers
            names = tuple(_json_string(worker.name) for worker in workers)
            texts = _worker_texts[index] = cls(names, _texts(names), _texts([
                b'{"source":' + _json_string(worker.publisher) + b',"dp_rank":' + str(worker.dp_rank).encode()
                for worker in workers
            ]))
        return texts


_worker_texts: weakref.WeakKeyDictionary[IndexReader, WorkerTexts] = weakref.WeakKeyDictionary()


@functools.lru_cache(maxsize=64)
def answer_endings(uncertain_workers: tuple[str, ...], backend: str, digest: str) -> tuple[np.ndarray, np.ndarray]:
    """An answer's last fields, one text per reason code."""
    uncertain = b"[" + b",".join(map(_json_string, uncertain_workers)) + b"]"
    return _texts([
        b',"reason":"' + reason.encode() + b'","uncertain_workers":' + uncertain + b',"backend":'
        + _json_string(backend) + b',"settings_digest":' + _json_string(digest) + b"}"
        for reason in REASONS
    ])


# A shared constant array, left writable: numba compiles a read-only array as another
# type, and the kernels never write it.
@functools.lru_cache(maxsize=16)
def _zeros(size: int) -> np.ndarray:
    return np.zeros(size, dtype=np.int64)


@attrs.frozen
class AnswerBatch:
    """The answers to one batch, still as arrays: `decisions()` and `encoded()` build them.

    What the answers read from the index (worker names, inventory_seq, uncertain workers)
    is captured when the batch is ranked, so later events cannot change an answer given.
    """

    requests: Sequence[ReuseRequest]
    ranked: RankedBatch
    workers: tuple[WorkerId, ...]  # by slot
    inventory_seq: int
    uncertain_workers: tuple[str, ...]
    backend: str
    settings_digest: str
    worker_texts: WorkerTexts

    @classmethod
    def of(
        cls, index: IndexReader, requests: Sequence[ReuseRequest], ranked: RankedBatch, settings: ReuseSettings,
        backend: str,
    ) -> AnswerBatch:
        return cls(requests, ranked, tuple(index.workers), index.inventory_seq, index.uncertain_names(), backend,
                   digest_of(settings), WorkerTexts.of(index))

    def __len__(self) -> int:
        return len(self.requests)

    def reasons(self) -> list[str]:
        return [REASONS[code] for code in self.ranked.reason.tolist()]

    def _unknown_target(self, position: int) -> str | None:
        """A named target the inventory has never seen: its name (it is shown holding nothing)."""
        target = self.requests[position].target
        return target.name if target is not None and self.ranked.target[position] < 0 else None

    def decisions(self) -> list[Decision]:
        """The answers as `Decision` values, field for field as `kvledger.core.reuse.decide` would build them."""
        ranked, workers = self.ranked, self.workers
        overlap_bounds, candidate_bounds = ranked.overlap_bounds.tolist(), ranked.candidate_bounds.tolist()
        overlap_lengths, overlap_slots = ranked.overlap_lengths.tolist(), ranked.overlap_slot.tolist()
        candidates = [
            Candidate(workers[slot].publisher, workers[slot].dp_rank, SOURCE_TIERS[tier], prefix, transfer_blocks,
                      recompute, transfer, saving)
            for slot, tier, prefix, transfer_blocks, recompute, transfer, saving in zip(
                ranked.candidate_slot.tolist(), ranked.candidate_tier.tolist(), ranked.candidate_prefix.tolist(),
                ranked.candidate_transfer_blocks.tolist(), ranked.candidate_recompute_ms.tolist(),
                ranked.candidate_transfer_ms.tolist(), ranked.candidate_saving_ms.tolist(),
            )
        ]
        names = [worker.name for worker in workers]
        zero = Overlap(0, 0, 0, 0, 0)
        decisions = []
        for position, (request, target, credited, baseline, reason) in enumerate(zip(
            self.requests, ranked.target.tolist(), ranked.credited.tolist(), ranked.baseline.tolist(),
            ranked.reason.tolist(),
        )):
            shown = range(overlap_bounds[position], overlap_bounds[position + 1])
            overlaps = {names[overlap_slots[item]]: Overlap(*overlap_lengths[item]) for item in shown}
            target_name = names[target] if target >= 0 else self._unknown_target(position)
            if target < 0 and target_name is not None:
                overlaps[target_name] = zero  # a target the inventory has never seen holds nothing
            ranked_here = tuple(candidates[candidate_bounds[position]:candidate_bounds[position + 1]])
            decisions.append(Decision(
                request_id=request.request_id,
                inventory_seq=self.inventory_seq,
                target=target_name,
                credited_blocks=credited,
                baseline_blocks=baseline,
                overlaps=overlaps,
                candidates=ranked_here,
                chosen=ranked_here[0] if ranked_here else None,
                reason=REASONS[reason],
                uncertain_workers=self.uncertain_workers,
                backend=self.backend,
                settings_digest=self.settings_digest,
            ))
        return decisions

    def relied_prefixes(self) -> list[bytes]:
        """Per answer, the sequence hashes of the blocks it relies on (the chosen source's prefix,
        or the target's credited prefix, whichever is longer) as little-endian u64 in hex
        (`kvledger.core.decision_codec.RELIED_PREFIX_HEADER`), b"" when none: what store needs to
        tell later whether the chosen source and the target still held them."""
        ranked, count = self.ranked, len(self.requests)
        if not count:
            return []
        if not ranked.overlap_bounds[-1]:  # nobody holds any of it: nothing chosen, nothing credited
            return [b""] * count
        assert ranked.sequence is not None and ranked.sequence_offsets is not None, "both backends keep the hashes they chained"
        return split_texts(*relied_prefix_texts(
            ranked.sequence, ranked.sequence_offsets, ranked.target, ranked.overlap_bounds, ranked.overlap_slot,
            ranked.overlap_lengths, ranked.candidate_bounds, ranked.candidate_prefix, MAX_RELIED_BLOCKS,
        ), count)

    def encoded(self) -> list[bytes]:
        """Every answer as JSON bytes: `json.dumps(decision_to_json(d), separators=(",", ":"))`, byte for byte,
        written by the compiled `decide.ranking.kernels.write_ranked_answers`."""
        count = len(self.requests)
        if not count:
            return []
        ranked = self.ranked
        flagged = ranked.needs_repr
        if flagged is None:
            flagged = repr_positions(ranked.credited, ranked.candidate_recompute_ms, ranked.candidate_transfer_ms,
                                     ranked.candidate_saving_ms)
        buffer, bounds = write_ranked_answers(
            *answer_pieces(self.requests, *request_ids_of(self.requests), ranked.target, self.inventory_seq,
                           self.worker_texts),
            ranked.target, ranked.credited, ranked.baseline, ranked.reason,
            ranked.overlap_bounds, ranked.overlap_slot, ranked.overlap_lengths,
            ranked.candidate_bounds, ranked.candidate_slot, ranked.candidate_tier, ranked.candidate_prefix,
            ranked.candidate_transfer_blocks, ranked.candidate_recompute_ms, ranked.candidate_transfer_ms,
            ranked.candidate_saving_ms, flagged,
            *answer_endings(self.uncertain_workers, self.backend, self.settings_digest),
        )
        return split_texts(buffer, bounds, count)


def answer_pieces(requests: Sequence[ReuseRequest], ids: np.ndarray, id_bounds: np.ndarray, target: np.ndarray,
                  inventory_seq: int, worker_texts: WorkerTexts) -> tuple[np.ndarray, ...]:
    """The texts an answer is written from, as `write_answers` takes them first: the request ids
    (UTF-8) with their bounds, the `inventory_seq` text, the workers' names and candidate openings,
    and each named target the index has never seen (`target` < 0 for a request that named one)."""
    count = len(requests)
    unknown = NO_TEXT, _zeros(count + 1)
    if target.min() < 0:
        unknown_names = [b""] * count
        for position in np.flatnonzero(target < 0).tolist():
            named = requests[position].target
            if named is not None:
                unknown_names[position] = _json_string(named.name)
        if any(unknown_names):
            unknown = _texts(unknown_names)
    return (ids, id_bounds, inventory_target_text(inventory_seq),
            *worker_texts.name_texts, *worker_texts.sources, *unknown)


@attrs.frozen
class AnswerTexts:
    """What the service sends and records for a batch: each answer's JSON, each answer's
    relied-on prefix (`AnswerBatch.relied_prefixes`), and how many answers had each reason."""

    answers: list[bytes]
    relied_prefixes: list[bytes]
    reason_counts: dict[str, int]
    # The batch's requests as the kernels read them, when the backend made them: each record's
    # request header is written from them (`decide.serving.recorder.request_texts`) without converting again.
    arrays: RequestArrays | None = attrs.field(default=None, eq=False)
    # Their targets' slots, as ranked, for the request headers' target names.
    targets: BatchTargets | None = attrs.field(default=None, eq=False)

    @classmethod
    def of(cls, batch: AnswerBatch) -> AnswerTexts:
        return cls(batch.encoded(), batch.relied_prefixes(), dict(collections.Counter(batch.reasons())))


def _json_string(text: str) -> bytes:
    return json.dumps(text).encode()  # ASCII only: json escapes everything else
