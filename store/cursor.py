"""Where a projector stands in a stream that can lose acknowledged messages.

JetStream acknowledges before it fsyncs: a crash can drop a stream's acknowledged tail, and
the messages published after it then reuse the lost sequence numbers. A stream seq is
therefore a cursor, not an identity. SQL keys its rows by a *ledger seq* that only ever
grows: equal to the stream seq until the first loss, then the stream seq plus the offset of
the stream's newest *generation* that starts at or below it (table `stream_generations`).

Before a projector binds its consumer, `StreamCursor.verify` checks that the stream still
holds the last message SQL committed, at the seq SQL says. When it does not (the stream
ends below it, or another message sits there), it walks down to the newest seq where stream
and SQL still agree, and opens a generation there: the stream is read again from the next
seq on, each message mapped past every ledger seq already used, so nothing in SQL is
overwritten and the projector's identity rules (the fold's per-worker (epoch, seq); a
decision's request id) drop what SQL already holds. The rows whose ledger seqs the new
generation passed over stay, and `stream_generations` says the stream lost them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import attrs
import sqlalchemy as sa
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from kvledger.store import tables

log = logging.getLogger("kvledger.store")

# How far below the checkpoint a rewind looks for agreement before it gives up and reads the
# stream again from its first message (identity rules keep that correct, only slower).
SCAN_LIMIT = 200_000

# ledger seq -> the identity SQL recorded for the message at it (None: no row says)
SqlIdentity = Callable[[sa.Connection, list[int]], dict[int, str]]


@attrs.frozen
class Generation:
    """Stream seqs from `first_stream_seq` on are ledger seqs `stream seq + offset` (until a newer generation)."""

    first_stream_seq: int
    offset: int


@attrs.frozen
class Verdict:
    """What a check found: where to start reading the stream, and the generation opened (if any)."""

    start_stream_seq: int
    opened: Generation | None = None
    lost_first_ledger: int | None = None  # the ledger seqs SQL holds whose stream messages are gone
    lost_last_ledger: int | None = None
    aged_out: tuple[int, int] | None = None  # stream seqs removed before they were projected


class StreamCursor:
    """One stream's generations, read from and written to SQL; shared by every projector of that stream."""

    def __init__(self, engine: sa.Engine, stream: str) -> None:
        self.engine = engine
        self.stream = stream
        self.generations: list[Generation] = []  # oldest first

    # --- the map ---------------------------------------------------------------------

    def load(self) -> None:
        g = tables.stream_generations.c
        with self.engine.connect() as connection:
            rows = connection.execute(
                sa.select(g.first_stream_seq, g.ledger_offset).where(g.stream == self.stream).order_by(g.generation)
            ).all()
        self.generations = [Generation(row.first_stream_seq, row.ledger_offset) for row in rows]

    @property
    def offset(self) -> int:
        """The offset of messages read from now on (the newest generation's)."""
        return self.generations[-1].offset if self.generations else 0

    def ledger(self, stream_seq: int) -> int:
        """The ledger seq of the message the stream now holds at `stream_seq`."""
        for generation in reversed(self.generations):
            if stream_seq >= generation.first_stream_seq:
                return stream_seq + generation.offset
        return stream_seq

    def stream_seq(self, ledger_seq: int) -> int | None:
        """The stream seq that maps to `ledger_seq`, or None where the stream lost that message."""
        for generation in reversed(self.generations):
            candidate = ledger_seq - generation.offset
            if candidate >= generation.first_stream_seq and self.ledger(candidate) == ledger_seq:
                return candidate
        candidate = ledger_seq
        return candidate if candidate > 0 and self.ledger(candidate) == ledger_seq else None

    def anchor(self, checkpoint: int) -> tuple[int, int]:
        """(stream seq, ledger seq) of the last message SQL committed that the map still reaches; (0, 0): none."""
        if checkpoint <= 0:
            return 0, 0
        if not self.generations:
            return checkpoint, checkpoint
        stream_seq = self.stream_seq(checkpoint)
        if stream_seq is not None:
            return stream_seq, checkpoint
        # The checkpoint lies in a range the newest generation passed over: nothing has been
        # committed since it opened, and it opened just after the seq below.
        below = self.generations[-1].first_stream_seq - 1
        return (below, self.ledger(below)) if below > 0 else (0, 0)

    # --- checking the stream against SQL ------------------------------------------------

    async def verify(
        self, js: JetStreamContext, checkpoint: int, sql_identity: SqlIdentity, message_identity: Callable,
        *, name: str, ledger_high: Callable[[], int],
    ) -> Verdict:
        """Check the stream still holds what SQL last committed; open a generation where it does not.

        `checkpoint` is the ledger seq SQL committed last (for `name`), `sql_identity` reads the
        identity SQL recorded at ledger seqs, `message_identity` gives a stream message's,
        `ledger_high` the highest ledger seq any row of this stream uses (every shard's).
        """
        self.load()
        state = (await js.stream_info(self.stream)).state
        first, last = state.first_seq, state.last_seq
        anchor_stream, anchor_ledger = self.anchor(checkpoint)
        if anchor_stream == 0:
            return Verdict(max(first, 1))
        if anchor_stream < first and anchor_stream <= last:
            # Aged out after it was committed (limits, retention): nothing left to compare with.
            return self._resume(anchor_stream, first, name)
        top = min(anchor_stream, last)
        agreed, disagreed = await self._last_agreement(js, top, first, sql_identity, message_identity)
        if anchor_stream <= last and not disagreed:
            return self._resume(anchor_stream, first, name)
        rewind = max(agreed + 1, first, 1)
        return self._open(rewind, checkpoint, ledger_high(), anchor_stream, last, name)

    def _resume(self, anchor_stream: int, first: int, name: str) -> Verdict:
        start = anchor_stream + 1
        if start < first:
            log.error(
                "%s: %s no longer holds seqs %d-%d, which were never projected (removed by the stream's limits "
                "before store read them): the workers they belonged to are reported by their sequence holes",
                name, self.stream, start, first - 1,
            )
            return Verdict(first, aged_out=(start, first - 1))
        return Verdict(start)

    async def _last_agreement(
        self, js, top: int, first: int, sql_identity: SqlIdentity, message_identity,
    ) -> tuple[int, bool]:
        """The newest stream seq at or below `top` whose message is the one SQL recorded there (first - 1 if
        none), and whether a message above it disagreed. Seqs SQL kept no row for (an empty batch, another
        shard's message not yet projected) cannot be compared and are passed over."""
        disagreed = False
        seq = top
        floor = max(first, top - SCAN_LIMIT, 1)
        while seq >= floor:
            chunk = list(range(seq, max(seq - 256, floor - 1), -1))
            ledgers = {stream_seq: self.ledger(stream_seq) for stream_seq in chunk}
            with self.engine.connect() as connection:
                recorded = sql_identity(connection, list(ledgers.values()))
            for stream_seq in chunk:
                expected = recorded.get(ledgers[stream_seq])
                if expected is None:
                    continue  # nothing to compare with at this seq
                if await _message_identity_at(js, self.stream, stream_seq, message_identity) == expected:
                    return stream_seq, disagreed
                disagreed = True
            seq = chunk[-1] - 1
        return first - 1, disagreed

    def _open(self, rewind: int, checkpoint: int, ledger_high: int, anchor_stream: int, last: int, name: str) -> Verdict:
        offset = max(checkpoint, ledger_high, self.ledger(rewind - 1) if rewind > 1 else 0) + 1 - rewind
        lost_first = self.ledger(rewind)
        generation = Generation(rewind, offset)
        g = tables.stream_generations.c
        with self.engine.begin() as connection:
            number = connection.execute(
                sa.select(sa.func.coalesce(sa.func.max(g.generation), 0)).where(g.stream == self.stream)
            ).scalar_one() + 1
            connection.execute(tables.stream_generations.insert(), {
                "stream": self.stream, "generation": number, "first_stream_seq": rewind, "ledger_offset": offset,
                "lost_first_ledger_seq": lost_first, "lost_last_ledger_seq": max(checkpoint, lost_first - 1),
                "stream_last_seq": last, "checkpoint_name": name, "detected_ts": time.time(),
            })  # fmt: skip
        self.generations.append(generation)
        log.warning(
            "%s: %s lost acknowledged messages: SQL committed up to stream seq %d (ledger %d) but the stream now "
            "ends at %d or holds other messages from seq %d on; reading it again from seq %d as ledger seqs %d on "
            "(generation %d); ledger seqs %d-%d stay in SQL, their stream messages gone",
            name, self.stream, anchor_stream, checkpoint, last, rewind, rewind, rewind + offset, number,
            lost_first, checkpoint,
        )
        return Verdict(rewind, generation, lost_first, checkpoint)


async def _message_identity_at(js: JetStreamContext, stream: str, seq: int, message_identity) -> str | None:
    try:
        message = await js.get_msg(stream, seq)
    except NotFoundError:
        return None
    return message_identity(message)


def msg_id_of(message) -> str | None:
    """A stored or delivered message's Nats-Msg-Id header (None without one)."""
    headers = message.headers or {}
    return headers.get("Nats-Msg-Id")


def ledger_high(engine: sa.Engine, stream: str) -> int:
    """The highest ledger seq committed for `stream` by any projector (every shard's checkpoint)."""
    c = tables.checkpoints.c
    with engine.connect() as connection:
        value = connection.execute(sa.select(sa.func.max(c.stream_seq)).where(c.stream == stream)).scalar_one()
    return value or 0
