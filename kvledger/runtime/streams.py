"""Names and shapes of the JetStream streams and subjects every stage agrees on.

Every stage provisions the streams it touches with `ensure_stream`, through the JetStream
context it opened itself (this module opens no connection). A stage that finds an
existing stream whose settings differ from these refuses to start rather than silently
changing it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import attrs
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, StorageType, StreamConfig

from kvledger.core.events import DEAD_LETTER_SUBJECT_PREFIX, EVENTS_SUBJECT_PREFIX, EventBatch, encode_batch
from kvledger.core.settings import StreamSettings

log = logging.getLogger("kvledger.streams")

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


class StreamConflictError(RuntimeError):
    """An existing stream differs from the spec all stages agree on; no stage modifies it."""


def stream_config(spec: StreamSpec) -> StreamConfig:
    return StreamConfig(
        name=spec.name, subjects=list(spec.subjects), storage=StorageType.FILE,
        duplicate_window=spec.duplicate_window_s, max_age=spec.max_age_s, max_bytes=spec.max_bytes,
        num_replicas=spec.replicas,
    )


def config_differences(spec: StreamSpec, config: StreamConfig) -> list[str]:
    """How an existing stream's config differs from `spec`, one line per setting (empty: it agrees)."""
    found = {
        "subjects": sorted(config.subjects or []),
        "storage": StorageType(config.storage).value if config.storage else None,
        "duplicate_window_s": float(config.duplicate_window or 0),
        "max_age_s": float(config.max_age or 0),
        "max_bytes": config.max_bytes if config.max_bytes is not None else -1,
        "replicas": config.num_replicas or 1,
    }
    wanted = {
        "subjects": sorted(spec.subjects),
        "storage": StorageType.FILE.value,
        "duplicate_window_s": float(spec.duplicate_window_s),
        "max_age_s": float(spec.max_age_s),
        "max_bytes": spec.max_bytes,
        "replicas": spec.replicas,
    }
    return [f"{key}: stream has {found[key]!r}, settings want {wanted[key]!r}" for key in wanted if found[key] != wanted[key]]


async def ensure_stream(js: JetStreamContext, spec: StreamSpec) -> None:
    """Create the stream if missing; if it exists with other settings, refuse (never modify it)."""
    try:
        info = await js.stream_info(spec.name)
    except nats.js.errors.NotFoundError:
        try:
            await js.add_stream(stream_config(spec))
            log.info("created stream %s on %s", spec.name, ", ".join(spec.subjects))
            return
        except nats.js.errors.BadRequestError:
            info = await js.stream_info(spec.name)  # another stage created it meanwhile
    differences = config_differences(spec, info.config)
    if differences:
        raise StreamConflictError(
            f"stream {spec.name} exists with different settings ({'; '.join(differences)}); "
            "change the settings to match, or migrate the stream by hand"
        )


async def publish_batches(js: JetStreamContext, batches: Iterable[EventBatch], window: int = 256) -> int:
    """Publish canonical batches to KV_EVENTS as ingest would (record bytes, Msg-Id), `window` acks
    awaited together; returns the last stream seq (0 for none). For benchmarks and tools that prefill a stream."""
    last, pending = 0, []
    for batch in batches:
        pending.append(js.publish(batch.subject, encode_batch(batch), headers={"Nats-Msg-Id": batch.msg_id}))
        if len(pending) >= window:
            last = max(last, *(ack.seq for ack in await asyncio.gather(*pending)))
            pending = []
    if pending:
        last = max(last, *(ack.seq for ack in await asyncio.gather(*pending)))
    return last


async def message_ids(js: JetStreamContext, stream: str, subject: str, timeout_s: float = 120.0) -> list[str]:
    """The Nats-Msg-Id of every message of `stream` on `subject`, in stream order (one
    ordered pass, headers only): what a benchmark or a test checks KV_DECISIONS with."""
    last_seq = (await js.stream_info(stream)).state.last_seq
    ids: list[str] = []
    if not last_seq:
        return ids
    read_all = asyncio.Event()

    async def collect(msg) -> None:
        ids.append(msg.headers["Nats-Msg-Id"])
        if msg.metadata.sequence.stream >= last_seq:
            read_all.set()

    subscription = await js.subscribe(subject, stream=stream, cb=collect, ordered_consumer=True,
                                      config=ConsumerConfig(headers_only=True))
    try:
        await asyncio.wait_for(read_all.wait(), timeout_s)
    finally:
        await subscription.unsubscribe()
    return ids


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
