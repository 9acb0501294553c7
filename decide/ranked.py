"""What a ranking backend computes for a batch, and how it becomes answers.

Both backends fill the same `RankedBatch` of arrays (prefix lengths per worker and class,
targets, credit, baseline, reasons, ranked candidates); `AnswerBatch` turns it into
`Decision` values or straight into the answers' JSON, here once, so cpu and cuda can only
differ in numbers, never in presentation.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
import weakref
from collections.abc import Callable, Sequence

import attrs
import numpy as np

from kvledger.decision_codec import decision_to_json
from kvledger.events import Tier, WorkerId
from kvledger.hashing import batch_sequence_hashes
from kvledger.reuse import Candidate, Decision, Overlap, Reason, ReuseRequest, enabled_source_tiers
from kvledger.settings import ReuseSettings, settings_digest

from decide.index import InventoryIndex

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
COLUMNWISE_ANSWERS = 16  # batches this large are encoded column-wise (see AnswerBatch.encoded)

Clock = Callable[[], float]


@attrs.frozen
class RankedBatch:
    """Per-request results as arrays; candidates are flat, grouped by request, ranked within it."""

    lengths: np.ndarray  # int32 (requests, PREFIX_CLASSES, worker slots)
    target: np.ndarray  # int32 slot per request, NO_TARGET if none or unknown
    credited: np.ndarray  # float64
    baseline: np.ndarray  # int32
    reason: np.ndarray  # int8 index into REASONS
    candidate_request: np.ndarray  # int64, non-decreasing
    candidate_slot: np.ndarray
    candidate_tier: np.ndarray  # index into SOURCE_TIERS
    candidate_prefix: np.ndarray
    candidate_transfer_blocks: np.ndarray
    candidate_recompute_ms: np.ndarray
    candidate_transfer_ms: np.ndarray
    candidate_saving_ms: np.ndarray


def source_tier_codes(settings: ReuseSettings) -> tuple[int, ...]:
    return tuple(SOURCE_TIERS.index(tier) for tier in enabled_source_tiers(settings))


def flatten_requests(requests: Sequence[ReuseRequest]) -> tuple[np.ndarray, np.ndarray]:
    """All requests' sequence hashes end to end, and the offsets where each request starts."""
    lengths = np.fromiter(map(len, (request.local_hashes for request in requests)), dtype=np.int64,
                          count=len(requests))
    offsets = np.zeros(len(requests) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    local = np.fromiter(itertools.chain.from_iterable(request.local_hashes for request in requests),
                        dtype=np.uint64, count=int(offsets[-1]))
    return batch_sequence_hashes(local, offsets), offsets


def requested_targets(index: InventoryIndex, requests: Sequence[ReuseRequest]) -> tuple[np.ndarray, np.ndarray]:
    """Slots of the requests' targets (NO_TARGET when none or unknown) and which requests named one."""
    # Hashing a WorkerId (attrs) costs far more than hashing its two fields as a tuple.
    slot_of = {(worker.publisher, worker.dp_rank): slot for slot, worker in enumerate(index.workers)}
    targets = [request.target for request in requests]
    named = np.array([target is not None for target in targets], dtype=bool).reshape(len(targets))
    slots = np.array([NO_TARGET if target is None else slot_of.get((target.publisher, target.dp_rank), NO_TARGET)
                      for target in targets], dtype=np.int32).reshape(len(targets))
    return slots, named


class DigestCache:
    """`settings_digest` is a SHA-256 over JSON; one per settings value is enough."""

    def __init__(self) -> None:
        self._settings: ReuseSettings | None = None
        self._digest = ""

    def __call__(self, settings: ReuseSettings) -> str:
        if settings is not self._settings:
            self._settings, self._digest = settings, settings_digest(settings)
        return self._digest


_digests = DigestCache()


@attrs.frozen
class WorkerTexts:
    """Each worker's pieces of answer JSON, by slot: made once per index and worker count,
    since workers only ever join an index."""

    names: tuple[str, ...]  # the name as a JSON string
    name_bytes: np.ndarray  # the same, as bytes
    sources: np.ndarray  # bytes `{"source":…,"dp_rank":…`, the opening of a candidate

    @classmethod
    def of(cls, index: InventoryIndex) -> WorkerTexts:
        texts = _worker_texts.get(index)
        if texts is None or len(texts.names) != index.worker_count:
            workers = index.workers
            names = tuple(_json_string(worker.name) for worker in workers)
            texts = _worker_texts[index] = cls(
                names, _texts(list(names)),
                _texts([f'{{"source":{_json_string(worker.publisher)},"dp_rank":{worker.dp_rank}'
                        for worker in workers] + [""]),
            )
        return texts


_worker_texts: weakref.WeakKeyDictionary[InventoryIndex, WorkerTexts] = weakref.WeakKeyDictionary()


@attrs.frozen
class AnswerBatch:
    """The answers to one batch, still as arrays: `decisions()` and `encoded()` build them.

    What the answers read from the index (worker names, inventory_seq, uncertain workers)
    is captured when the batch is ranked, so later events cannot change an answer given.
    """

    requests: Sequence[ReuseRequest]
    ranked: RankedBatch
    workers: tuple[WorkerId, ...]  # by slot
    slots_in_order: np.ndarray
    order_rank: np.ndarray
    inventory_seq: int
    uncertain_workers: tuple[str, ...]
    backend: str
    settings_digest: str
    worker_texts: WorkerTexts

    @classmethod
    def of(
        cls, index: InventoryIndex, requests: Sequence[ReuseRequest], ranked: RankedBatch, settings: ReuseSettings,
        backend: str,
    ) -> AnswerBatch:
        return cls(requests, ranked, tuple(index.workers), index.slots_in_order, index.order_rank,
                   index.inventory_seq, index.uncertain_names(), backend, _digests(settings), WorkerTexts.of(index))

    def __len__(self) -> int:
        return len(self.requests)

    def reasons(self) -> list[str]:
        return [REASONS[code] for code in self.ranked.reason.tolist()]

    def _shown(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The overlaps each answer lists, in worker order: (request, slot, the five lengths) per entry."""
        ranked, in_order = self.ranked, self.slots_in_order
        # Lengths are never negative, so OR is non-zero exactly where either prefix is.
        held = ranked.lengths[:, PREFIX_ANY, :] | ranked.lengths[:, PREFIX_RETAINED_DEVICE, :]
        shown = held[:, in_order] > 0
        known = ranked.target >= 0
        if known.any():
            shown[np.flatnonzero(known), self.order_rank[ranked.target[known]]] = True
        # np.nonzero is several times faster on a flat boolean array than on a 2-D one.
        shown_request, shown_position = np.divmod(np.flatnonzero(shown), shown.shape[1])
        shown_slot = in_order[shown_position]
        return shown_request, shown_slot, ranked.lengths[shown_request, :, shown_slot]

    def _unknown_target(self, position: int) -> str | None:
        """A named target the inventory has never seen: its name (it is shown holding nothing)."""
        target = self.requests[position].target
        return target.name if target is not None and self.ranked.target[position] < 0 else None

    def decisions(self) -> list[Decision]:
        """The answers as `Decision` values, field for field as `kvledger.reuse.decide` would build them."""
        count = len(self.requests)
        ranked, workers = self.ranked, self.workers
        shown_request, shown_slot, shown_lengths = self._shown()
        shown_lengths, shown_slots = shown_lengths.tolist(), shown_slot.tolist()
        shown_bounds = np.searchsorted(shown_request, np.arange(count + 1)).tolist()
        candidate_bounds = np.searchsorted(ranked.candidate_request, np.arange(count + 1)).tolist()
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
            overlaps = {
                names[slot]: Overlap(*values)
                for slot, values in zip(
                    shown_slots[shown_bounds[position]:shown_bounds[position + 1]],
                    shown_lengths[shown_bounds[position]:shown_bounds[position + 1]],
                )
            }
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

    def encoded(self) -> list[bytes]:
        """Every answer as JSON bytes: `json.dumps(decision_to_json(d), separators=(",", ":"))`, byte for byte.

        A few answers go through the codec one by one; from `COLUMNWISE_ANSWERS` on, building
        them column-wise costs less than its fixed start-up.
        """
        if len(self.requests) < COLUMNWISE_ANSWERS:
            return [json.dumps(decision_to_json(decision), separators=(",", ":")).encode()
                    for decision in self.decisions()]
        return self.encoded_columnwise()

    def encoded_columnwise(self) -> list[bytes]:
        """`encoded()`, built column-wise whatever the batch size.

        Each field of every answer is formatted in one vectorised pass over fixed-width byte
        strings (a number with its key through a table of texts), and only the final joining
        of each answer's pieces runs per answer.
        """
        count = len(self.requests)
        if not count:
            return []
        ranked = self.ranked
        names = list(self.worker_texts.names)

        # Overlaps: `"name":{...}`, a comma before all but each answer's first.
        shown_request, shown_slot, shown_lengths = self._shown()
        overlap = _join(self.worker_texts.name_bytes[shown_slot], *(
            _labelled_integers(label, column) for label, column in zip(_OVERLAP_LABELS, shown_lengths.T)
        ), b"}")
        unknown = [(position, name) for position in np.flatnonzero(ranked.target < 0).tolist()
                   if (name := self._unknown_target(position)) is not None]
        if unknown:
            unknown_at = np.array([position for position, _ in unknown], dtype=np.int64)
            zero = _texts([_json_string(name) + _ZERO_OVERLAP for _, name in unknown])
            # A never-seen target comes after the answer's other overlaps, as in the Decision's dict.
            order = np.argsort(np.concatenate((shown_request, unknown_at)), kind="stable")
            shown_request = np.concatenate((shown_request, unknown_at))[order]
            overlap = np.concatenate((overlap, zero))[order]

        # Candidates, ranked within each answer; the first is also the answer's `chosen`.
        candidate_request = ranked.candidate_request
        candidate = _join(
            self.worker_texts.sources[ranked.candidate_slot], _TIER_LABELS[ranked.candidate_tier], _integers(ranked.candidate_prefix),
            _labelled_integers(b',"transfer_blocks":', ranked.candidate_transfer_blocks),
            _labelled_floats(b',"recompute_ms":', ranked.candidate_recompute_ms),
            _labelled_floats(b',"transfer_ms":', ranked.candidate_transfer_ms),
            _labelled_floats(b',"saving_ms":', ranked.candidate_saving_ms), b"}",
        )
        first = np.ones(candidate_request.size, dtype=bool)
        first[1:] = candidate_request[1:] != candidate_request[:-1]
        chosen = np.full(count, b'],"chosen":null', dtype=object)
        chosen[candidate_request[first]] = np.char.add(b'],"chosen":', candidate[first]).tolist()

        # Object arrays from here on: a fixed-width array would silently cut a longer value.
        targets = np.array([f',"inventory_seq":{self.inventory_seq},"target":{name}'.encode()
                            for name in names + ["null"]], dtype=object)[
            np.where(ranked.target >= 0, ranked.target, len(self.workers))]
        for position, name in unknown:
            targets[position] = f',"inventory_seq":{self.inventory_seq},"target":{_json_string(name)}'.encode()
        uncertain = "[" + ",".join(map(_json_string, self.uncertain_workers)) + "]"
        endings = np.array([
            f',"reason":"{reason}","uncertain_workers":{uncertain},"backend":{_json_string(self.backend)},'
            f'"settings_digest":{_json_string(self.settings_digest)}}}'.encode()
            for reason in REASONS
        ], dtype=object)
        head = np.char.add(b'{"request_id":', _json_strings([request.request_id for request in self.requests]))
        head = head.astype(object) + targets + _join(
            _labelled_floats(b',"credited_blocks":', ranked.credited),
            _labelled_integers(b',"baseline_blocks":', ranked.baseline), b',"overlaps":{',
        ).astype(object)
        return _answers_end_to_end(count, head, (_comma_separated(overlap, shown_request), shown_request),
                                   b'},"candidates":[', (_comma_separated(candidate, candidate_request), candidate_request),
                                   chosen + endings[ranked.reason])


_OVERLAP_LABELS = (b':{"device":', b',"host":', b',"disk":', b',"any":', b',"retained_device":')
_ZERO_OVERLAP = ':{"device":0,"host":0,"disk":0,"any":0,"retained_device":0}'
_TIER_LABELS = np.array([f',"tier":"{tier.value}","prefix_blocks":'.encode() for tier in SOURCE_TIERS])
_TABLED_INTEGERS = 4096  # integers below this are written from tables, one per label
_SMALL_INTEGERS = np.array([str(number).encode() for number in range(_TABLED_INTEGERS)])
_PLAIN_JSON_TEXT = re.compile(r'[\x00-\x1f"\\]')


@functools.cache
def _integer_table(label: bytes) -> np.ndarray:
    return np.char.add(label, _SMALL_INTEGERS)


def _labelled_integers(label: bytes, values: np.ndarray) -> np.ndarray:
    """`label` followed by each integer's decimal text, as `str` writes it."""
    values = np.asarray(values, dtype=np.int64)
    if not values.size or (values.min() >= 0 and values.max() < _TABLED_INTEGERS):
        return _integer_table(label)[values]
    return np.char.add(label, values.astype(bytes))


def _integers(values: np.ndarray) -> np.ndarray:
    return _labelled_integers(b"", values)


def _labelled_floats(label: bytes, values: np.ndarray) -> np.ndarray:
    """`label` followed by each float as `json.dumps` writes it, formatting each distinct value (by bits) once."""
    distinct, where = np.unique(np.ascontiguousarray(values, dtype=np.float64).view(np.uint64), return_inverse=True)
    distinct = distinct.view(np.float64)
    if np.isfinite(distinct).all():
        text = [label + repr(value).encode() for value in distinct.tolist()]  # json.dumps writes a finite float so
    else:
        text = [label + json.dumps(value).encode() for value in distinct.tolist()]
    return np.array(text, dtype=bytes)[where.reshape(-1)]


def _json_string(text: str) -> str:
    return json.dumps(text)  # ASCII only: json escapes everything else


def _texts(texts: list[str]) -> np.ndarray:
    return np.array([text.encode() for text in texts], dtype=bytes)


def _json_strings(texts: list[str]) -> np.ndarray:
    """JSON string literals for many texts; plain ones (the usual case) only need their quotes."""
    joined = "".join(texts)
    if joined.isascii() and not _PLAIN_JSON_TEXT.search(joined):
        return np.char.add(np.char.add(b'"', np.array(texts, dtype=bytes)), b'"')
    return _texts([_json_string(text) for text in texts])


def _join(*pieces: bytes | np.ndarray) -> np.ndarray:
    """Elementwise concatenation of byte-string columns and constants."""
    result = pieces[0]
    for piece in pieces[1:]:
        result = np.char.add(result, piece)
    return np.asarray(result)


def _comma_separated(items: np.ndarray, owner: np.ndarray) -> list[bytes]:
    """Prefix a comma to every item but the first of its owner (items are grouped by owner)."""
    later = np.zeros(owner.size, dtype=bool)
    later[1:] = owner[1:] == owner[:-1]
    return np.where(later, np.char.add(b",", items), items).tolist()


def _answers_end_to_end(count: int, head: np.ndarray, overlaps: tuple[list[bytes], np.ndarray], middle: bytes,
                        candidates: tuple[list[bytes], np.ndarray], tail: np.ndarray) -> list[bytes]:
    """Join each answer's pieces: head, its overlaps, `middle`, its candidates, tail.

    Items of a group are already in request order, so each piece's place in one flat list
    follows from counts alone; each answer is then one join over its slice of that list.
    """
    overlap_items, overlap_owner = overlaps
    candidate_items, candidate_owner = candidates
    overlap_count = np.bincount(overlap_owner, minlength=count)
    candidate_count = np.bincount(candidate_owner, minlength=count)
    pieces_per_answer = 3 + overlap_count + candidate_count
    bounds = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(pieces_per_answer, out=bounds[1:])
    first_piece = bounds[:-1]
    pieces = np.empty(int(bounds[-1]), dtype=object)
    pieces[first_piece] = head
    overlap_start = np.cumsum(overlap_count) - overlap_count
    pieces[first_piece[overlap_owner] + 1 + np.arange(overlap_owner.size) - overlap_start[overlap_owner]] = overlap_items
    pieces[first_piece + 1 + overlap_count] = middle
    candidate_start = np.cumsum(candidate_count) - candidate_count
    pieces[first_piece[candidate_owner] + 2 + overlap_count[candidate_owner] + np.arange(candidate_owner.size)
           - candidate_start[candidate_owner]] = candidate_items
    pieces[bounds[1:] - 1] = tail
    pieces = pieces.tolist()
    join = b"".join
    bounds = bounds.tolist()
    return [join(pieces[start:stop]) for start, stop in zip(bounds[:-1], bounds[1:])]
