"""Is the engine ingest reconnects to the one it followed? Told by content, since engines announce no incarnation id.

An engine that restarted while ingest was away counts from seq 0 again on the same ports;
once it has published past the seq ingest resumes at, its seqs look like a continuation.
So before replayed batches are taken as one, ingest asks the replay socket for the last
seq it acknowledged (`last`) and compares the engine's batch there with the one it
published: the engine's own timestamp and events, decoded into the canonical form (the
ingest timestamp and ingest's gaps are not the engine's, so they are left out).

- The batch at `last` is the same: a continuation (an engine stamps each batch with its
  wall clock, so a new incarnation repeating both the time and the events is not a risk).
- It differs, or the engine's replay ends below `last` (a live engine keeps its newest
  batches, so a buffer without `last` or anything after it is a younger counter): a restart.
- The engine's buffer starts after `last` (rotated out, or a restarted engine that has
  published more than its buffer holds), or the replay did not answer in time: the seqs
  cannot tell the two apart, so neither is claimed. The stream goes on in its epoch behind
  a `Gap(replay_incomplete)`, which makes the worker uncertain until its next clear or
  restart: a restart taken for a continuation here is reported, never silently wrong.

No I/O here: the stream hands in what the replay socket answered and how to compare.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import attrs

from kvledger.core.events import EventBatch, Gap, GapReason
from kvledger.ingest.wire import Engine, WireError, decode_payload


class Incarnation(enum.Enum):
    CONTINUATION = "continuation"
    RESTART = "restart"
    UNVERIFIED = "unverified"


@attrs.frozen
class Verdict:
    """What the check found; `first` is the first seq the engine buffers from `last` on (None if none)."""

    incarnation: Incarnation
    why: str
    first: int | None = None


def judge(
    last: int, replies: list[tuple[int, bytes]], complete: bool, same_batch: Callable[[bytes], bool | None],
) -> Verdict:
    """Continuation, restart or unverified, from a replay asked to start at `last`.

    `same_batch` compares the engine's payload at `last` with what ingest published there
    (None: the two cannot be compared, e.g. ingest published only a gap for it).
    """
    at_last = [payload for seq, payload in replies if seq == last]
    after = [seq for seq, _ in replies if seq > last]
    first = min((seq for seq, _ in replies if seq >= last), default=None)
    if at_last:
        same = same_batch(at_last[0])
        if same is True:
            return Verdict(Incarnation.CONTINUATION, f"the engine's batch at seq {last} is the one published", first)
        if same is False:
            return Verdict(Incarnation.RESTART, f"the engine's batch at seq {last} is not the one published", first)
        return Verdict(Incarnation.UNVERIFIED, f"the batch published at seq {last} holds nothing to compare", first)
    if not complete:
        return Verdict(Incarnation.UNVERIFIED, f"the replay socket did not answer for seq {last} in time", first)
    if not after:
        return Verdict(Incarnation.RESTART, f"the engine's newest seq is below {last}: its counter started over", first)
    return Verdict(
        Incarnation.UNVERIFIED,
        f"the engine buffers from seq {first} on, no longer {last}: rotated out, or a restart that published more", first,
    )


def same_engine_batch(record: EventBatch, payload: bytes, *, engine: Engine, max_bytes: int | None) -> bool | None:
    """Whether `payload` is the engine batch `record` was made of: its timestamp and events, canonical.

    None where the record kept nothing of the engine's batch to compare (ingest could not
    decode it, or published only a gap in its place).
    """
    gaps = [event for event in record.events if type(event) is Gap]
    events = tuple(event for event in record.events if type(event) is not Gap)
    # A batch ingest could not publish whole (undecodable, too big for NATS) is a Gap at its own seq.
    stand_in = Gap(record.seq, record.seq + 1, GapReason.MISSED) in gaps and not events
    try:
        decoded = decode_payload(payload, max_bytes=max_bytes, engine=engine)
    except WireError:
        return None if stand_in else False
    if stand_in:
        return None if record.engine_ts == 0 else decoded.engine_ts == record.engine_ts
    if not events and record.engine_ts == 0:
        return None  # a stand-in for a lost batch (Gap stream_lost, a restart marker)
    return decoded.engine_ts == record.engine_ts and decoded.events == events


def is_restart_marker(record: EventBatch) -> bool:
    """A batch ingest published only to say the engine restarted (`EngineStream`), at the old epoch's next seq."""
    return record.events == (Gap(record.seq, 0, GapReason.PUBLISHER_RESTART),)
