"""The canonical event log: worker identity, event types and the versioned record codec.

One record is one engine batch as it sits in JetStream (docs/core.md, canonical record). Everything after
ingest reads these records; nothing after ingest sees engine wire formats.
"""

from __future__ import annotations

import enum
import re
from typing import Annotated, Literal, Union

import attrs
import msgspec

# Version 2 added each block's group and ownership, cache-spec metadata, and a Cleared's
# tier; version-1 records still read (their events are group 0, no ownership, clear all).
SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)
U64_MAX = (1 << 64) - 1

EVENTS_SUBJECT_PREFIX = "kv.ev"
DEAD_LETTER_SUBJECT_PREFIX = "kv.dlq"


class Tier(enum.Enum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"
    EXTERNAL = "external"

    # Tiers key the fold's per-block dicts; Enum's own __hash__ is Python code (a third of
    # the fold's time went there). Members are singletons, so identity hashing is exact.
    __hash__ = object.__hash__


class Provenance(enum.Enum):
    """Who announced a batch: the engine itself, or a layer that retains blocks after it."""

    NATIVE = "native"
    RETAINED = "retained"

    __hash__ = object.__hash__  # as Tier's: it keys per-worker dicts on the hot path


class GapReason(enum.Enum):
    MISSED = "missed"
    PUBLISHER_RESTART = "publisher_restart"
    REPLAY_INCOMPLETE = "replay_incomplete"


class RecordError(ValueError):
    """A canonical record could not be decoded; the message says which part and why."""


# A publisher name becomes a NATS subject token, part of a Msg-Id (':'-separated) and of
# durable consumer names, so it is held to the strictest of those alphabets.
_PUBLISHER_ALLOWED = re.compile(r"[A-Za-z0-9_-]")
_PUBLISHER_MAX_LEN = 128


def validate_publisher(name: object) -> str:
    """Return `name` if it is a valid publisher name, else raise ValueError naming the bad character."""
    if not isinstance(name, str):
        raise ValueError(f"publisher name must be a string, got {type(name).__name__}")
    if not name:
        raise ValueError("publisher name must not be empty")
    if len(name) > _PUBLISHER_MAX_LEN:
        raise ValueError(f"publisher name {name!r} is longer than {_PUBLISHER_MAX_LEN} characters")
    for position, char in enumerate(name):
        if not _PUBLISHER_ALLOWED.fullmatch(char):
            raise ValueError(
                f"invalid publisher name {name!r}: character {char!r} at position {position} "
                "is not allowed in a NATS subject token (use letters, digits, '_' or '-')"
            )
    return name


def _check_publisher(_instance: object, _attribute: object, value: object) -> None:
    validate_publisher(value)


def _check_dp_rank(_instance: object, _attribute: object, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"dp_rank must be a non-negative integer, got {value!r}")


@attrs.frozen(order=True)
class WorkerId:
    """One engine worker: a publisher and its data-parallel rank. Orders by (publisher, dp_rank)."""

    publisher: str = attrs.field(validator=_check_publisher)
    dp_rank: int = attrs.field(default=0, validator=_check_dp_rank)

    @property
    def name(self) -> str:
        """The name used in answers and audit output: `pub` for rank 0, else `pub/rank`."""
        return self.publisher if self.dp_rank == 0 else f"{self.publisher}/{self.dp_rank}"

    @classmethod
    def parse(cls, name: str) -> WorkerId:
        publisher, sep, rank = name.partition("/")
        if not sep:
            return cls(publisher)
        if not rank.isdigit():
            raise ValueError(f"invalid worker name {name!r}: dp_rank after '/' must be a number")
        return cls(publisher, int(rank))

    @property
    def events_subject(self) -> str:
        return f"{EVENTS_SUBJECT_PREFIX}.{self.publisher}.{self.dp_rank}"


@attrs.frozen
class Stored:
    """Blocks stored on a tier, in one KV-cache group and ownership.

    Local hashes are kvledger's token-content hashes (token ids are not kept); they are
    empty for a store that carried no tokens (an offload placeholder), whose hashes the
    fold takes from the block already known by engine hash on that worker.
    """

    tier: Tier
    block_hashes: tuple[int, ...]
    parent_hash: int | None
    block_size: int
    local_hashes: tuple[int, ...]
    lora_name: str | None = None
    cache_salt: str | None = None
    group_idx: int = 0
    ownership: str | None = None
    # The group's cache spec as the engine declares it (vLLM: "full_attention",
    # "sliding_window", "mamba", ...); kvledger.residency decides what it means for a prefix.
    spec_kind: str | None = None
    sliding_window: int | None = None

    @property
    def has_tokens(self) -> bool:
        return len(self.local_hashes) == len(self.block_hashes)


@attrs.frozen
class Removed:
    tier: Tier
    block_hashes: tuple[int, ...]
    group_idx: int = 0
    ownership: str | None = None


@attrs.frozen
class Cleared:
    """Every block of the worker's inventory on `tier` went away; None: on every tier."""

    tier: Tier | None = None


@attrs.frozen
class Gap:
    """Synthesised by ingest where the engine's sequence could not be followed."""

    expected_seq: int
    received_seq: int
    reason: GapReason


Event = Union[Stored, Removed, Cleared, Gap]


@attrs.frozen
class EventBatch:
    """One engine batch: the unit of the canonical log, one JetStream message."""

    worker: WorkerId
    epoch: int
    seq: int
    engine_ts: float
    ingest_ts: float
    provenance: Provenance
    events: tuple[Event, ...]

    @property
    def subject(self) -> str:
        """`kv.ev.<publisher>.<dp_rank>`; a retained endpoint's batches add `.retained`.

        Each stream of a worker keeps its own subject so ingest can read its last
        (epoch, seq) back with one "last message on subject" lookup.
        """
        return events_subject(self.worker, self.provenance)

    @property
    def msg_id(self) -> str:
        """JetStream de-duplication id, `<publisher>:<dp_rank>:<epoch>:<seq>` (docs/core.md, canonical record).

        A retained endpoint announcing for the same worker counts its own sequence, so its
        ids carry `retained` to keep both streams of one worker apart.
        """
        worker = self.worker
        if self.provenance is Provenance.NATIVE:
            return f"{worker.publisher}:{worker.dp_rank}:{self.epoch}:{self.seq}"
        return f"{worker.publisher}:{worker.dp_rank}:retained:{self.epoch}:{self.seq}"


def events_subject(worker: WorkerId, provenance: Provenance) -> str:
    """The KV_EVENTS subject of one stream of a worker (see `EventBatch.subject`)."""
    if provenance is Provenance.NATIVE:
        return worker.events_subject
    return f"{worker.events_subject}.retained"


# --- the record codec -----------------------------------------------------------------
# msgspec validates the record layout in C (hash ranges included), then plain
# constructors build the attrs values: validation once, where bytes enter.

# msgpack cannot carry integers above 2**64 - 1, so a lower bound is all a u64 needs.
_U64 = Annotated[int, msgspec.Meta(ge=0)]
_NonNegative = Annotated[int, msgspec.Meta(ge=0)]
_TierName = Literal["device", "host", "disk", "external"]


class _StoredWire(msgspec.Struct, array_like=True, tag="S", frozen=True):
    tier: _TierName
    block_hashes: list[_U64]
    parent_hash: _U64 | None
    block_size: _NonNegative
    local_hashes: list[_U64]
    lora_name: str | None
    cache_salt: str | None
    group_idx: _NonNegative
    # Version 2 appended these; a version-1 record's shorter array takes the defaults.
    ownership: str | None = None
    spec_kind: str | None = None
    sliding_window: _NonNegative | None = None


class _RemovedWire(msgspec.Struct, array_like=True, tag="R", frozen=True):
    tier: _TierName
    block_hashes: list[_U64]
    group_idx: _NonNegative = 0
    ownership: str | None = None


class _ClearedWire(msgspec.Struct, array_like=True, tag="C", frozen=True):
    tier: _TierName | None = None


class _GapWire(msgspec.Struct, array_like=True, tag="G", frozen=True):
    expected_seq: _NonNegative
    received_seq: _NonNegative
    reason: Literal["missed", "publisher_restart", "replay_incomplete"]


class _RecordWire(msgspec.Struct, frozen=True):
    v: int
    publisher: str
    dp_rank: _NonNegative
    epoch: _NonNegative
    seq: _NonNegative
    engine_ts: float
    ingest_ts: float
    provenance: Literal["native", "retained"]
    events: list[Union[_StoredWire, _RemovedWire, _ClearedWire, _GapWire]]


class _VersionOnly(msgspec.Struct):
    v: int


_encoder = msgspec.msgpack.Encoder()
_record_decoder = msgspec.msgpack.Decoder(_RecordWire)
_version_decoder = msgspec.msgpack.Decoder(_VersionOnly)
_TIERS = {tier.value: tier for tier in Tier}
_GAP_REASONS = {reason.value: reason for reason in GapReason}


def _event_to_wire(event: Event) -> msgspec.Struct:
    if type(event) is Stored:
        return _StoredWire(
            event.tier.value, list(event.block_hashes), event.parent_hash, event.block_size,
            list(event.local_hashes), event.lora_name, event.cache_salt, event.group_idx,
            event.ownership, event.spec_kind, event.sliding_window,
        )
    if type(event) is Removed:
        return _RemovedWire(event.tier.value, list(event.block_hashes), event.group_idx, event.ownership)
    if type(event) is Cleared:
        return _ClearedWire(None if event.tier is None else event.tier.value)
    if type(event) is Gap:
        return _GapWire(event.expected_seq, event.received_seq, event.reason.value)
    raise TypeError(f"not a canonical event: {event!r}")


def _event_from_wire(wire: msgspec.Struct) -> Event:
    kind = type(wire)
    if kind is _StoredWire:
        if wire.local_hashes and len(wire.block_hashes) != len(wire.local_hashes):
            raise RecordError(
                f"Stored event has {len(wire.block_hashes)} block hashes "
                f"but {len(wire.local_hashes)} local hashes"
            )
        return Stored(
            _TIERS[wire.tier], tuple(wire.block_hashes), wire.parent_hash, wire.block_size,
            tuple(wire.local_hashes), wire.lora_name, wire.cache_salt, wire.group_idx,
            wire.ownership, wire.spec_kind, wire.sliding_window,
        )
    if kind is _RemovedWire:
        return Removed(_TIERS[wire.tier], tuple(wire.block_hashes), wire.group_idx, wire.ownership)
    if kind is _ClearedWire:
        return Cleared(None if wire.tier is None else _TIERS[wire.tier])
    return Gap(wire.expected_seq, wire.received_seq, _GAP_REASONS[wire.reason])


def encode_batch(batch: EventBatch) -> bytes:
    """Encode a batch as the versioned msgpack record stored in KV_EVENTS."""
    return _encoder.encode(
        _RecordWire(
            SCHEMA_VERSION, batch.worker.publisher, batch.worker.dp_rank, batch.epoch, batch.seq,
            batch.engine_ts, batch.ingest_ts, batch.provenance.value,
            [_event_to_wire(event) for event in batch.events],
        )
    )


def decode_batch(data: bytes) -> EventBatch:
    """Decode a KV_EVENTS record; raise RecordError on anything malformed or from a newer schema."""
    try:
        wire = _record_decoder.decode(data)
    except msgspec.DecodeError as error:
        _raise_if_newer_version(data)
        raise RecordError(f"malformed kvledger record: {error}") from None
    if wire.v not in READABLE_VERSIONS:
        _raise_version_error(wire.v)
    try:
        worker = WorkerId(wire.publisher, wire.dp_rank)
    except ValueError as error:
        raise RecordError(f"malformed kvledger record: {error}") from None
    return EventBatch(
        worker, wire.epoch, wire.seq, wire.engine_ts, wire.ingest_ts,
        Provenance(wire.provenance), tuple(_event_from_wire(event) for event in wire.events),
    )


def _raise_if_newer_version(data: bytes) -> None:
    try:
        version = _version_decoder.decode(data).v
    except msgspec.DecodeError:
        return
    if version not in READABLE_VERSIONS:
        _raise_version_error(version)


def _raise_version_error(version: int) -> None:
    if version > SCHEMA_VERSION:
        raise RecordError(
            f"record schema version {version} is newer than this kvledger understands "
            f"(up to {SCHEMA_VERSION}); upgrade kvledger to read it"
        )
    raise RecordError(f"record schema version {version} is not supported (expected one of {READABLE_VERSIONS})")


# --- dead letters -------------------------------------------------------------------


@attrs.frozen
class DeadLetter:
    """Input ingest could not turn into events, kept whole with the reason, on `kv.dlq.<publisher>`."""

    publisher: str
    dp_rank: int
    reason: str
    frames: tuple[bytes, ...]
    ingest_ts: float
    endpoint: str = ""


class _DeadLetterWire(msgspec.Struct, frozen=True):
    v: int
    publisher: str
    dp_rank: int
    reason: str
    frames: list[bytes]
    ingest_ts: float
    endpoint: str = ""


_dead_letter_decoder = msgspec.msgpack.Decoder(_DeadLetterWire)


def encode_dead_letter(letter: DeadLetter) -> bytes:
    return _encoder.encode(
        _DeadLetterWire(
            SCHEMA_VERSION, letter.publisher, letter.dp_rank, letter.reason, list(letter.frames),
            letter.ingest_ts, letter.endpoint,
        )
    )


def decode_dead_letter(data: bytes) -> DeadLetter:
    try:
        wire = _dead_letter_decoder.decode(data)
    except msgspec.DecodeError as error:
        raise RecordError(f"malformed dead letter: {error}") from None
    return DeadLetter(wire.publisher, wire.dp_rank, wire.reason, tuple(wire.frames), wire.ingest_ts, wire.endpoint)
