"""The canonical event log: worker identity, event types and the versioned record codec.

One record is one engine batch as it sits in JetStream (docs/core.md, canonical record). Everything after
ingest reads these records; nothing after ingest sees engine wire formats.
"""

from __future__ import annotations

import enum
import functools
import re
from typing import Annotated, Union

import attrs
import msgspec

# Version 2 added each block's group and ownership, cache-spec metadata, and a Cleared's
# tier; version-1 records still read (their events are group 0, no ownership, clear all).
# Version 3 added the `Reachability` event. Only a liveness record is written as version 3:
# engine batches stay version 2, so a reader from before it still reads every engine batch
# and refuses only the liveness records, naming the version.
SCHEMA_VERSION = 3
ENGINE_BATCH_VERSION = 2
READABLE_VERSIONS = (1, 2, 3)
U64_MAX = (1 << 64) - 1

EVENTS_SUBJECT_PREFIX = "kv.ev"
DEAD_LETTER_SUBJECT_PREFIX = "kv.dlq"
LIVENESS_SUBJECT_SUFFIX = "liveness"


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
    # JetStream acknowledged these batches and then lost them (a crash before its fsync), and
    # the engine no longer buffers them: synthesised by ingest's stream check.
    STREAM_LOST = "stream_lost"


class RecordError(ValueError):
    """A canonical record could not be decoded; the message says which part and why."""


# A publisher name becomes a NATS subject token, part of a Msg-Id (':'-separated) and of
# durable consumer names, so it is held to the strictest of those alphabets.
_PUBLISHER_ALLOWED = re.compile(r"[A-Za-z0-9_-]")
_PUBLISHER_MAX_LEN = 128
_VALID_PUBLISHER = re.compile(rf"[A-Za-z0-9_-]{{1,{_PUBLISHER_MAX_LEN}}}")


def validate_publisher(name: object) -> str:
    """Return `name` if it is a valid publisher name, else raise ValueError naming the bad character."""
    if type(name) is str and _VALID_PUBLISHER.fullmatch(name):  # every record names one: one regex call
        return name
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


@attrs.frozen(order=True, cache_hash=True)
class WorkerId:
    """One engine worker: a publisher and its data-parallel rank. Orders by (publisher, dp_rank)."""

    publisher: str = attrs.field(validator=_check_publisher)
    dp_rank: int = attrs.field(default=0, validator=_check_dp_rank)

    @property
    def name(self) -> str:
        """The name used in answers and audit output: `pub` for rank 0, else `pub/rank`."""
        return self.publisher if self.dp_rank == 0 else f"{self.publisher}/{self.dp_rank}"

    @staticmethod
    def parse(name: str) -> WorkerId:
        """The worker a name (`pub` or `pub/rank`) names; ValueError for a bad one. A fleet has few workers and a
        ledger names them in every decision, so the values (frozen) are kept by name."""
        return _worker_named(name)

    @property
    def events_subject(self) -> str:
        return f"{EVENTS_SUBJECT_PREFIX}.{self.publisher}.{self.dp_rank}"


@functools.lru_cache(maxsize=65536, typed=True)  # typed: a dp_rank of True is refused, not taken for 1
def worker_of(publisher: str, dp_rank: int = 0) -> WorkerId:
    """The worker (publisher, dp_rank), made once and kept (a frozen value; SQL rows name a worker in every
    row, and a WorkerId validates its fields when made)."""
    return WorkerId(publisher, dp_rank)


@functools.lru_cache(maxsize=65536)
def _worker_named(name: str) -> WorkerId:
    publisher, sep, rank = name.partition("/")
    if not sep:
        return worker_of(publisher)
    if not rank.isdigit():
        raise ValueError(f"invalid worker name {name!r}: dp_rank after '/' must be a number")
    return worker_of(publisher, int(rank))


# The events are msgspec Structs: the same classes are the values the fold and ingest use and
# the record's encoding (each a tagged array), so nothing is rebuilt between the two.
# Hashes are u64; msgpack cannot carry integers above 2**64 - 1, so a lower bound is all
# a decoded hash needs.
_U64 = Annotated[int, msgspec.Meta(ge=0)]
_NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class Stored(msgspec.Struct, array_like=True, tag="S", frozen=True, gc=False):
    """Blocks stored on a tier, in one KV-cache group and ownership.

    Local hashes are kvledger's token-content hashes (token ids are not kept); they are
    empty for a store that carried no tokens (an offload placeholder), whose hashes the
    fold takes from the block already known by engine hash on that worker.
    """

    tier: Tier
    block_hashes: tuple[_U64, ...]
    parent_hash: _U64 | None
    block_size: _NonNegative
    local_hashes: tuple[_U64, ...]
    lora_name: str | None = None
    cache_salt: str | None = None
    group_idx: _NonNegative = 0
    # Version 2 appended the fields from here on; a version-1 record's shorter array takes the defaults.
    ownership: str | None = None
    # The group's cache spec as the engine declares it (vLLM: "full_attention",
    # "sliding_window", "mamba", ...); kvledger.core.residency decides what it means for a prefix.
    spec_kind: str | None = None
    sliding_window: _NonNegative | None = None

    @property
    def has_tokens(self) -> bool:
        return len(self.local_hashes) == len(self.block_hashes)


class Removed(msgspec.Struct, array_like=True, tag="R", frozen=True, gc=False):
    tier: Tier
    block_hashes: tuple[_U64, ...]
    group_idx: _NonNegative = 0
    ownership: str | None = None


class Cleared(msgspec.Struct, array_like=True, tag="C", frozen=True, gc=False):
    """Every block of the worker's inventory on `tier` went away; None: on every tier."""

    tier: Tier | None = None


class Gap(msgspec.Struct, array_like=True, tag="G", frozen=True, gc=False):
    """Synthesised by ingest where the engine's sequence could not be followed."""

    expected_seq: _NonNegative
    received_seq: _NonNegative
    reason: GapReason


class Reachability(msgspec.Struct, array_like=True, tag="L", frozen=True, gc=False):
    """Whether ingest can reach the engine behind one stream of a worker: synthesised by ingest.

    Always the only event of its batch (a liveness record, `is_liveness`), which sits outside
    the engine's sequence: it neither advances nor checks the worker's (epoch, seq).
    `since_ts` is when the change began: for an unreachable engine, when its SUB connection
    dropped (or ingest first failed to reach it); for a reachable one, when it answered again.
    """

    reachable: bool
    reason: str
    since_ts: float


Event = Union[Stored, Removed, Cleared, Gap, Reachability]


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
        """`kv.ev.<publisher>.<dp_rank>`; a retained endpoint's batches add `.retained`, a liveness
        record `.liveness` after that.

        Each stream of a worker keeps its own subject so ingest can read its last
        (epoch, seq) back with one "last message on subject" lookup; liveness records have their
        own so that lookup never finds one, and ingest reads the last one back the same way.
        """
        if is_liveness(self):
            return liveness_subject(self.worker, self.provenance)
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


def liveness_subject(worker: WorkerId, provenance: Provenance) -> str:
    """The KV_EVENTS subject of one stream's liveness records (`Reachability`)."""
    return f"{events_subject(worker, provenance)}.{LIVENESS_SUBJECT_SUFFIX}"


def is_liveness(batch: EventBatch) -> bool:
    """A record ingest published to say whether the engine is reachable (its one event a `Reachability`)."""
    events = batch.events
    return len(events) == 1 and type(events[0]) is Reachability


# --- the record codec -----------------------------------------------------------------
# msgspec validates the record layout in C (hash ranges included) and builds the events
# themselves: validation once, where bytes enter.


class _RecordWire(msgspec.Struct, frozen=True):
    v: int
    publisher: str
    dp_rank: _NonNegative
    epoch: _NonNegative
    seq: _NonNegative
    engine_ts: float
    ingest_ts: float
    provenance: Provenance
    events: tuple[Union[Stored, Removed, Cleared, Gap, Reachability], ...]


class _VersionOnly(msgspec.Struct):
    v: int


_encoder = msgspec.msgpack.Encoder()
_record_decoder = msgspec.msgpack.Decoder(_RecordWire)
_version_decoder = msgspec.msgpack.Decoder(_VersionOnly)


def encode_batch(batch: EventBatch) -> bytes:
    """Encode a batch as the versioned msgpack record stored in KV_EVENTS."""
    return _encoder.encode(
        _RecordWire(
            SCHEMA_VERSION if is_liveness(batch) else ENGINE_BATCH_VERSION, batch.worker.publisher, batch.worker.dp_rank, batch.epoch, batch.seq,
            batch.engine_ts, batch.ingest_ts, batch.provenance, batch.events,
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
    for event in wire.events:
        if type(event) is Stored and event.local_hashes and len(event.block_hashes) != len(event.local_hashes):
            raise RecordError(
                f"Stored event has {len(event.block_hashes)} block hashes but {len(event.local_hashes)} local hashes"
            )
    try:
        worker = WorkerId(wire.publisher, wire.dp_rank)
    except ValueError as error:
        raise RecordError(f"malformed kvledger record: {error}") from None
    return EventBatch(worker, wire.epoch, wire.seq, wire.engine_ts, wire.ingest_ts, wire.provenance, wire.events)


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


class DeadLetter(msgspec.Struct, frozen=True):
    """Input ingest could not turn into events, kept whole with the reason, on `kv.dlq.<publisher>`.

    The same Struct is the dead-letter record (a msgpack map, so fields are read by name).
    """

    publisher: str
    dp_rank: int
    reason: str
    frames: tuple[bytes, ...]
    ingest_ts: float
    endpoint: str = ""
    v: int = ENGINE_BATCH_VERSION


_dead_letter_decoder = msgspec.msgpack.Decoder(DeadLetter)


def encode_dead_letter(letter: DeadLetter) -> bytes:
    return _encoder.encode(letter)


def decode_dead_letter(data: bytes) -> DeadLetter:
    try:
        return _dead_letter_decoder.decode(data)
    except msgspec.DecodeError as error:
        raise RecordError(f"malformed dead letter: {error}") from None
