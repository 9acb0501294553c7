"""Names and shapes of the JetStream streams and subjects every stage agrees on.

Pure values: each stage provisions or reads them with its own NATS client. A stage that
finds an existing stream whose settings differ from these refuses to start rather than
silently changing it.
"""

from __future__ import annotations

import attrs

from kvledger.events import DEAD_LETTER_SUBJECT_PREFIX, EVENTS_SUBJECT_PREFIX
from kvledger.settings import StreamSettings

DEAD_LETTERS_STREAM = "KV_DEAD_LETTERS"
SNAPSHOTS_BUCKET = "KV_SNAPSHOTS"
DECISIONS_SUBJECT = "kv.dec"
DECIDE_SUBJECT = "kvledger.decide"
DECIDE_BATCH_SUBJECT = "kvledger.decide.batch"


@attrs.frozen
class StreamSpec:
    """What a stream must look like: file storage, its subjects, limits and de-duplication window."""

    name: str
    subjects: tuple[str, ...]
    duplicate_window_s: float
    max_age_s: float  # 0 = unlimited
    max_bytes: int  # -1 = unlimited
    replicas: int


def events_stream(settings: StreamSettings) -> StreamSpec:
    return StreamSpec(
        settings.events_stream, (f"{EVENTS_SUBJECT_PREFIX}.>",), settings.duplicate_window_s,
        settings.max_age_s, settings.max_bytes, settings.replicas,
    )


def dead_letters_stream(settings: StreamSettings) -> StreamSpec:
    return StreamSpec(
        DEAD_LETTERS_STREAM, (f"{DEAD_LETTER_SUBJECT_PREFIX}.>",), settings.duplicate_window_s,
        settings.max_age_s, settings.max_bytes, settings.replicas,
    )


def decisions_stream(settings: StreamSettings) -> StreamSpec:
    return StreamSpec(
        settings.decisions_stream, (DECISIONS_SUBJECT,), settings.duplicate_window_s,
        settings.max_age_s, settings.max_bytes, settings.replicas,
    )


def dead_letter_subject(publisher: str) -> str:
    return f"{DEAD_LETTER_SUBJECT_PREFIX}.{publisher}"


_SNAPSHOT_PREFIX = "inventory-"


def snapshot_object_name(inventory_seq: int) -> str:
    """Object name of a snapshot in KV_SNAPSHOTS; names sort by the stream seq they reflect."""
    return f"{_SNAPSHOT_PREFIX}{inventory_seq:020d}"


def snapshot_seq(object_name: str) -> int | None:
    """The stream seq a snapshot object reflects, or None for a name that is not a snapshot."""
    if not object_name.startswith(_SNAPSHOT_PREFIX):
        return None
    digits = object_name[len(_SNAPSHOT_PREFIX):]
    return int(digits) if digits.isdigit() else None
