"""What JetStream acknowledged and then lost, per engine stream: found by position, repaired from replay.

JetStream acknowledges a publish before it fsyncs: an OS crash or a power loss drops the
acknowledged tail of KV_EVENTS, and later messages reuse the lost stream seqs. Each engine
stream keeps `AckedPositions`, where its recently acknowledged batches were stored. A check
asks whether the stream still holds the newest of them at its stream seq under its Msg-Id;
if not, a binary search finds the first one it lost (the lost part is a tail, so what the
stream holds of them is a prefix). `plan_repair` then turns the lost positions and what the
engine's replay buffer still has into batches to republish, in order, under their old ids;
what no engine buffers any more becomes `Gap(stream_lost)`.

No I/O here: the stream's answers come through the callables a check is given.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable

import attrs

from kvledger.core.events import Gap, GapReason
from kvledger.ingest.sequence import Emit
from kvledger.runtime.memory import mapped_words

# (epoch, seq, stream seq) of one acknowledged batch
Position = tuple[int, int, int]
# Does KV_EVENTS still hold this batch at its stream seq (same Msg-Id)?
Held = Callable[[Position], Awaitable[bool]]
# (epoch, seq, stream seq) of the last batch KV_EVENTS holds on the subject, or None
LastHeld = Callable[[], Awaitable[Position | None]]

RECENT_POSITIONS = 16384  # per engine stream: 384 KiB once full, taken only as written


@attrs.frozen
class LostRun:
    """Engine seqs [first, end) of one epoch that KV_EVENTS acknowledged and no longer holds."""

    epoch: int
    first: int
    end: int

    def __len__(self) -> int:
        return self.end - self.first


@attrs.frozen
class Loss:
    """What one check found lost, oldest first; `reaches_back` is False when the positions
    kept did not go back to where the loss starts (then the stream's last message on the
    subject said where, and nothing older than it can be told apart)."""

    runs: tuple[LostRun, ...]
    reaches_back: bool = True

    @property
    def batches(self) -> int:
        return sum(len(run) for run in self.runs)

    def describe(self) -> str:
        return ", ".join(
            f"epoch {run.epoch} seq {run.first}" if len(run) == 1 else f"epoch {run.epoch} seqs {run.first}-{run.end - 1}"
            for run in self.runs
        )


class AckedPositions:
    """Where JetStream stored one engine stream's recently acknowledged batches, in ack order.

    A ring of three arrays (epoch, seq, stream seq), 24 bytes a batch; acks of one subject
    come in engine order from the ordered publisher, so the ring is sorted both ways. The
    `Gap`s a batch carried are kept beside it (rare): a batch fetched again from the engine
    must carry them again.
    """

    def __init__(self, limit: int = RECENT_POSITIONS) -> None:
        self._limit = limit
        self._epochs = mapped_words(limit, "q")
        self._seqs = mapped_words(limit, "q")
        self._stream_seqs = mapped_words(limit, "q")
        self._count = 0  # entries ever written: entry i lives in slot i % limit
        self._oldest = 0  # the oldest entry still kept
        self._gaps: OrderedDict[tuple[int, int], tuple[Gap, ...]] = OrderedDict()  # in publish order
        self._check_until: int | None = None  # entries after this were acked after the stream went back

    def __len__(self) -> int:
        return self._count - self._oldest

    def acked(self, epoch: int, seq: int, stream_seq: int) -> None:
        slot = self._count % self._limit
        self._epochs[slot] = epoch
        self._seqs[slot] = seq
        self._stream_seqs[slot] = stream_seq
        self._count += 1
        if self._count - self._oldest > self._limit:
            self._oldest = self._count - self._limit
            if self._gaps:
                self._forget_gaps_before(self.entry(self._oldest))

    def entry(self, index: int) -> Position:
        slot = index % self._limit
        return self._epochs[slot], self._seqs[slot], self._stream_seqs[slot]

    @property
    def last(self) -> Position | None:
        return self.entry(self._count - 1) if self._count > self._oldest else None

    def note_gaps(self, epoch: int, seq: int, gaps: tuple[Gap, ...]) -> None:
        """The `Gap`s batch (epoch, seq) was published with (kept while its position is)."""
        self._gaps[epoch, seq] = gaps

    def gaps_of(self, epoch: int, seq: int) -> tuple[Gap, ...]:
        return self._gaps.get((epoch, seq), ())

    def stream_went_back(self) -> None:
        """KV_EVENTS acknowledged a new message at a seq it had used before: what was acked
        so far may be lost, what is acked from now on is not (it is stored after the loss)."""
        if self._check_until is None:
            self._check_until = self._count

    async def find_loss(self, held: Held, last_held: LastHeld) -> Loss | None:
        """What of the acknowledged batches KV_EVENTS no longer holds; None if it holds them all.

        Checks the newest acknowledged one (or, after the stream went back, the newest
        acknowledged before that), then binary-searches for the first one lost. Forgets the
        lost positions and those acked after them: the repair's acks take their place.
        """
        top = (self._count if self._check_until is None else self._check_until) - 1
        if top < self._oldest or await held(self.entry(top)):
            self._check_until = None
            return None
        reaches_back = await held(self.entry(self._oldest))
        if reaches_back:
            low, high = self._oldest, top  # held at low, lost at high
            while high - low > 1:
                middle = (low + high) // 2
                if await held(self.entry(middle)):
                    low = middle
                else:
                    high = middle
            first = high
        else:
            first = self._oldest
        runs = _runs(self.entry(index)[:2] for index in range(first, top + 1))
        if not reaches_back:
            runs = await self._before_the_ring(runs, last_held)
        # Changed only now, once every answer is in: a check that fails leaves all as it was.
        self._count = first  # newer entries are forgotten too: the repaired batches are acked before them
        self._check_until = None
        return Loss(tuple(runs), reaches_back)

    async def _before_the_ring(self, runs: list[LostRun], last_held: LastHeld) -> list[LostRun]:
        """The loss reaches past the oldest position kept: the last message the stream holds
        on the subject says where it starts (within the first lost epoch)."""
        oldest = runs[0]
        last = await last_held()
        if last is None:
            start = 0
        elif last[0] == oldest.epoch and last[1] < oldest.first:
            start = last[1] + 1
        else:
            return runs  # an older epoch, or newer than the ring: nothing older can be told apart
        if start < oldest.first:
            runs[0] = LostRun(oldest.epoch, start, oldest.end)
        return runs

    def _forget_gaps_before(self, oldest: Position) -> None:
        key, gaps = (oldest[0], oldest[1]), self._gaps
        while gaps and next(iter(gaps)) < key:
            gaps.popitem(last=False)


def _runs(positions: Iterable[tuple[int, int]]) -> list[LostRun]:
    runs: list[LostRun] = []
    for epoch, seq in positions:
        if runs and runs[-1].epoch == epoch and runs[-1].end == seq:
            runs[-1] = LostRun(epoch, runs[-1].first, seq + 1)
        else:
            runs.append(LostRun(epoch, seq, seq + 1))
    return runs


@attrs.frozen
class LostBatch:
    """A batch of its own for lost seqs no engine buffers any more: identity (epoch, seq), one `Gap`."""

    epoch: int
    seq: int
    gap: Gap


@attrs.frozen
class Repair:
    """What to republish for a loss, in order: batches from the engine's buffer (with their
    gaps) and `LostBatch`es; `repaired` and `lost` count engine batches."""

    batches: tuple[Emit | LostBatch, ...]
    repaired: int
    lost: int


def plan_repair(
    loss: Loss, epoch: int, replayed: list[tuple[int, bytes]], same_batch: Callable[[int, bytes], bool],
    gaps_of: Callable[[int, int], tuple[Gap, ...]],
) -> Repair:
    """The batches to republish for `loss`, oldest first.

    `replayed` is what the engine buffers now, in the current `epoch`; a batch is taken
    only if `same_batch` says it is the one published under that seq (an engine that
    restarted unnoticed reuses seqs). A lost batch the engine no longer has becomes
    `Gap(stream_lost)` before the next repaired one of its run, or, at a run's end, a batch
    of its own with identity (epoch, last lost seq) whose only event is that gap: consumers
    deduplicate by identity, so it takes the place of the batch it stands for.
    """
    supplied = dict(replayed)
    batches: list[Emit | LostBatch] = []
    repaired = lost = 0
    for run in loss.runs:
        expected = run.first
        if run.epoch == epoch:
            for seq in sorted(seq for seq in supplied if run.first <= seq < run.end):
                payload = supplied[seq]
                if not same_batch(seq, payload):
                    continue
                missing = (Gap(expected, seq, GapReason.STREAM_LOST),) if seq > expected else ()
                lost += seq - expected
                batches.append(Emit(run.epoch, seq, payload, (*missing, *gaps_of(run.epoch, seq))))
                repaired += 1
                expected = seq + 1
        if expected < run.end:
            lost += run.end - expected
            batches.append(LostBatch(run.epoch, run.end - 1, Gap(expected, run.end, GapReason.STREAM_LOST)))
    return Repair(tuple(batches), repaired, lost)
