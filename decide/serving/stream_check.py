"""Whether KV_EVENTS still holds what decide's index applied, and which snapshot it may start from.

JetStream acknowledges a publish before it fsyncs: an OS crash or power loss drops the
acknowledged tail, and later messages then reuse the lost stream seqs (issue 31). An index
that followed the lost tail sits at a seq the stream no longer holds, and its ordered
consumer would resume past the reused seqs (or the fold would drop them as redelivered), so
it would never again agree with the stream. A position is therefore checked by identity:
the seq *and* the Nats-Msg-Id of the message there (docs/decide.md, "When KV_EVENTS loses
messages").
"""

from __future__ import annotations

import logging

import attrs
import nats.errors
import nats.js
import nats.js.errors

from kvledger.core.snapshot import SnapshotError, StreamPosition, decode_snapshot, snapshot_position
from kvledger.runtime.streams import SNAPSHOTS_BUCKET, snapshot_seq

from kvledger.decide.inventory.index import InventoryIndex
from kvledger.decide.inventory.view import IndexReader

log = logging.getLogger("kvledger.decide")

NO_POSITION = StreamPosition(0, "")
MSG_ID_HEADER = "Nats-Msg-Id"
# Errors that mean "could not check now" (the server restarting, JetStream not yet recovered), not loss.
CHECK_ERRORS = (nats.errors.Error, nats.js.errors.Error, OSError, TimeoutError)


@attrs.frozen
class StreamRegression:
    """KV_EVENTS no longer holds the message the index applied last: what was found instead."""

    applied: StreamPosition
    first_seq: int
    last_seq: int
    found_msg_id: str | None  # the Msg-Id now at applied.seq; None: no message there

    def describe(self) -> str:
        applied = self.applied
        if self.last_seq < applied.seq:
            return (f"KV_EVENTS went backwards: its last seq is {self.last_seq} (first {self.first_seq}), "
                    f"below the index's inventory_seq {applied.seq}")
        if self.found_msg_id is None:
            return (f"KV_EVENTS went backwards: no message at the index's inventory_seq {applied.seq} "
                    f"(first seq {self.first_seq}, last {self.last_seq})")
        return (f"KV_EVENTS went backwards: seq {applied.seq} now holds Msg-Id {self.found_msg_id!r}, "
                f"the index applied {applied.msg_id!r} there (last seq {self.last_seq})")


@attrs.frozen
class WarmStart:
    """An index rebuilt from a snapshot the stream still reproduces, and where it stands in KV_EVENTS."""

    index: IndexReader
    name: str
    position: StreamPosition


async def msg_id_at(js: nats.js.JetStreamContext, stream: str, seq: int) -> str | None:
    """The Nats-Msg-Id of the message at `seq` ("" without one), or None when there is none."""
    try:
        message = await js.get_msg(stream, seq)
    except nats.js.errors.NotFoundError:
        return None
    return (message.headers or {}).get(MSG_ID_HEADER, "")


async def stream_regression(
    js: nats.js.JetStreamContext, stream: str, applied: StreamPosition,
) -> StreamRegression | None:
    """The regression when KV_EVENTS no longer holds `applied` (one stream_info, at most one get_msg); else None.

    Lost: the stream ends below `applied.seq`, or has no message there though its first seq
    is not above it, or holds one with another Msg-Id (`applied.msg_id` "": any message will
    do, an old snapshot's position names none). A position older than the stream's first
    seq has aged out and cannot be compared; that is retention, not loss.
    """
    state = (await js.stream_info(stream)).state
    first, last = state.first_seq, state.last_seq
    if last < applied.seq:
        return StreamRegression(applied, first, last, None)
    if applied.seq <= 0 or applied.seq < first:
        return None
    found = await msg_id_at(js, stream, applied.seq)
    if found is None or (applied.msg_id and found != applied.msg_id):
        return StreamRegression(applied, first, last, found)
    return None


async def snapshot_refusal(js: nats.js.JetStreamContext, stream: str, position: StreamPosition) -> str | None:
    """Why a snapshot standing at `position` cannot be trusted against KV_EVENTS as it is now; None: it can."""
    state = (await js.stream_info(stream)).state
    if not position.msg_id:
        # Written before snapshots kept their position: only its seq can be checked.
        if position.seq > state.last_seq:
            return f"it stands at seq {position.seq}, past the stream's last seq {state.last_seq}"
        return None
    if position.seq < state.first_seq or position.seq > state.last_seq:
        return (f"the stream (seqs {state.first_seq}-{state.last_seq}) no longer holds its message, "
                f"seq {position.seq} Msg-Id {position.msg_id!r}")
    found = await msg_id_at(js, stream, position.seq)
    if found != position.msg_id:
        now = "no message" if found is None else f"Msg-Id {found!r}"
        return f"seq {position.seq} holds {now}, not the snapshot's last message {position.msg_id!r}"
    return None


async def trusted_snapshot(js: nats.js.JetStreamContext, stream: str) -> WarmStart | None:
    """The index from the newest KV_SNAPSHOTS object whose position the stream still holds, or None.

    Newest first by name; one that cannot be read, or whose last message the stream no
    longer holds, is passed over for the next older. The index stands at the snapshot's
    stream seq (`StreamPosition.seq`), not its `inventory_seq`: that is store's ledger seq,
    which runs ahead of the stream seq once the stream has lost messages.
    """
    try:
        store = await js.object_store(SNAPSHOTS_BUCKET)
        objects = await store.list()
    except (nats.js.errors.BucketNotFoundError, nats.js.errors.NotFoundError, nats.js.errors.ObjectNotFoundError):
        return None
    named = sorted(((snapshot_seq(info.name), info.name) for info in objects
                    if not info.deleted and snapshot_seq(info.name) is not None), reverse=True)
    for _seq, name in named:
        try:
            data = (await store.get(name)).data
            position = snapshot_position(data)
            refusal = await snapshot_refusal(js, stream, position)
            if refusal is not None:
                log.warning("decide: snapshot %s refused: %s; trying an older one", name, refusal)
                continue
            fold = decode_snapshot(data)
        except (SnapshotError, nats.js.errors.Error) as error:
            log.warning("decide: snapshot %s unusable (%s); trying an older one", name, error)
            continue
        fold.inventory_seq = position.seq  # the fold's redelivery rule compares stream seqs
        return WarmStart(InventoryIndex(fold), name, position)
    return None
