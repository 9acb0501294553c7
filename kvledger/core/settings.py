"""Typed settings, the environment-variable registry, and the one loader that merges them.

Sources, later wins: defaults < TOML file < environment < command-line flags (docs/settings.md).
Every setting is a field of one frozen attrs class per section; the registry is derived
from those classes, so adding a field registers its TOML key, its `KVLEDGER_*` variable
and its documentation row at once. This is the only module that reads the process
environment, and it does so in `read_environment` alone.
"""

import hashlib
import json
import math
import os
import re
import tomllib
import types
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import attrs
import cattrs

__all__ = [
    "ENV_PREFIX",
    "ENV_REGISTRY",
    "SETTINGS_REGISTRY",
    "DbSettings",
    "DecideSettings",
    "IngestSettings",
    "LoadedSettings",
    "NatsSettings",
    "RegisteredSetting",
    "ReuseSettings",
    "Settings",
    "SettingsError",
    "StoreSettings",
    "StreamSettings",
    "as_display_rows",
    "as_json_records",
    "load_settings",
    "read_environment",
    "reference_table_markdown",
    "enabled_reuse",
    "reuse_settings_from",
    "settings_digest",
]

ENV_PREFIX = "KVLEDGER_"
# These belong to other tools, which read them themselves, not to the settings: the test
# harness, and the container files (docker/compose*.yml take images and nats-server's
# per-service passwords from them). An operator who exported them to run compose must still
# be able to run kvledger in that shell.
_HARNESS_ENV_PREFIXES = (
    "KVLEDGER_TEST_", "KVLEDGER_REQUIRE_SERVICES",
    "KVLEDGER_IMAGE", "KVLEDGER_NATS_IMAGE", "KVLEDGER_POSTGRES_IMAGE", "KVLEDGER_PYTHON_IMAGE", "KVLEDGER_TAG",
    "KVLEDGER_NATS_INGEST_PASSWORD", "KVLEDGER_NATS_STORE_PASSWORD", "KVLEDGER_NATS_DECIDE_PASSWORD",
    "KVLEDGER_NATS_ROUTER_PASSWORD",
)
MASK = "***"
UNSET = "(unset)"


class SettingsError(ValueError):
    """Settings could not be loaded; the message names the setting, the source and the problem."""


# --------------------------------------------------------------------------- rules


@attrs.frozen
class _Rule:
    """An attrs validator that can also be checked on its own, so the loader can name the source.

    `problem(value)` returns None when the value is acceptable, else what is wrong with it.
    """

    problem: Callable[[Any], str | None]

    def __call__(self, instance: object, attribute: "attrs.Attribute[Any]", value: object) -> None:
        reason = self.problem(value)
        if reason is not None:
            section = _SECTION_OF_CLASS.get(type(instance))
            key = f"{section}.{attribute.name}" if section else attribute.name
            raise SettingsError(f"setting {key}: {reason}")


def _at_least(minimum: float) -> _Rule:
    return _Rule(lambda v: None if v >= minimum else f"must be >= {minimum}, got {v!r}")


def _positive() -> _Rule:
    return _Rule(lambda v: None if v > 0 else f"must be > 0, got {v!r}")


def _between(low: int, high: int) -> _Rule:
    return _Rule(lambda v: None if low <= v <= high else f"must be between {low} and {high}, got {v!r}")


def _one_of(*choices: str) -> _Rule:
    return _Rule(lambda v: None if v in choices else f"must be one of {', '.join(choices)}, got {v!r}")


def _non_empty() -> _Rule:
    return _Rule(lambda v: None if v.strip() else "must not be empty")


def _horizons() -> _Rule:
    """Distinct horizons in milliseconds, each above 0 and at most an hour."""
    def problem(values: tuple[float, ...]) -> str | None:
        for value in values:
            if not 0 < value <= 3_600_000:
                return f"each horizon must be > 0 and <= 3600000 ms, got {value!r}"
        if len(set(values)) != len(values):
            return f"horizons must be distinct, got {list(values)!r}"
        return None
    return _Rule(problem)


_PORT = _between(0, 65535)

# JetStream refuses these characters in stream names (they are subject or path syntax).
_STREAM_NAME_FORBIDDEN = re.compile(r"[\s.*>/\\]")


def _stream_name() -> _Rule:
    def problem(name: str) -> str | None:
        if not name:
            return "must not be empty"
        if _STREAM_NAME_FORBIDDEN.search(name):
            return f"{name!r} is not a valid JetStream stream name (no whitespace, '.', '*', '>', '/', '\\')"
        return None

    return _Rule(problem)


def _optional_publisher() -> _Rule:
    def problem(name: str | None) -> str | None:
        if name is None:
            return None
        # Imported here so loading settings does not depend on the record codec being importable.
        from kvledger.core.events import validate_publisher

        try:
            validate_publisher(name)
        except ValueError as exc:
            return str(exc)
        return None

    return _Rule(problem)


def _unlimited_or_positive() -> _Rule:
    return _Rule(lambda v: None if v == -1 or v > 0 else f"must be -1 (unlimited) or > 0, got {v!r}")


def _masked_repr(value: object) -> str:
    return "None" if value is None else repr(MASK)


def _setting(
    default: object,
    doc: str,
    *,
    rule: _Rule | None = None,
    secret: bool = False,
) -> Any:
    """One settings field: its default, its one-line description, its rule, whether it is secret."""
    converter: Callable[[Any], Any] | None = None
    if isinstance(default, float):
        # So `ReuseSettings(minimum_estimated_ttft_saving_ms=5)` digests like 5.0 does.
        converter = float
    elif isinstance(default, tuple):
        converter = tuple
    return attrs.field(
        default=default,
        validator=rule,
        converter=converter,
        repr=_masked_repr if secret else True,
        metadata={"doc": doc, "secret": secret},
    )


# ----------------------------------------------------------------------- sections


@attrs.frozen
class NatsSettings:
    """How to reach NATS; `token` and `password` are secrets and never shown."""

    url: str = _setting(
        "nats://127.0.0.1:4222", "NATS server URL (comma-separate several for a cluster).", rule=_non_empty()
    )
    token: str | None = _setting(None, "NATS authentication token.", secret=True)
    user: str | None = _setting(None, "NATS user name (with password).")
    password: str | None = _setting(None, "NATS password (with user).", secret=True)
    creds_file: str | None = _setting(None, "Path to a NATS .creds file (JWT + NKey).")
    tls_ca: str | None = _setting(None, "CA bundle used to verify the NATS server's certificate.")
    tls_cert: str | None = _setting(None, "Client certificate for mutual TLS.")
    tls_key: str | None = _setting(None, "Private key of the client certificate.")
    connect_timeout_s: float = _setting(5.0, "Seconds to wait for the NATS connection.", rule=_positive())
    # A server killed with its host's network gone (a container, a machine) may never close
    # its clients' connections: only unanswered pings tell, and nats-py's own default (two
    # pings 120 s apart) left a service writing into a dead connection for minutes.
    ping_interval_s: float = _setting(
        5.0, "Seconds between the client's pings to its NATS server; with `max_outstanding_pings` unanswered the "
        "connection is taken for dead and the client reconnects to another server.", rule=_positive(),
    )
    max_outstanding_pings: int = _setting(
        2, "Unanswered pings after which the NATS connection is taken for dead (noticed within about "
        "`ping_interval_s` × (this + 1)).", rule=_between(1, 100),
    )

    @staticmethod
    def sync_interval_problem(text: str) -> str | None:
        """What is wrong with a JetStream sync policy (None: nothing); the embedded nats-server applies it."""
        if text in ("always", "default"):
            return None
        match = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h)", text)
        if match is None or float(match[1]) == 0:
            return f'must be "always", "default" or a duration > 0 such as "100ms", "1s", "2m", got {text!r}'
        return None

    # JetStream acknowledges before it fsyncs: what a power loss can take is what arrived
    # since the last sync (docs/operations.md, "Durability").
    embedded_sync_interval: str = _setting(
        "1s", 'How often the nats-server that `kvledger up` and the demo start fsyncs JetStream: "always" '
        '(before every ack), a duration ("100ms", "1s", "2m") or "default" (nats-server\'s own, 2 minutes). '
        "A server kvledger does not start keeps its own configuration.",
        rule=_Rule(sync_interval_problem),
    )


@attrs.frozen
class StreamSettings:
    """The JetStream streams (docs/core.md, canonical record)."""

    events_stream: str = _setting(
        "KV_EVENTS", "JetStream stream holding engine event batches.", rule=_stream_name()
    )
    decisions_stream: str = _setting(
        "KV_DECISIONS", "JetStream stream holding every reuse decision.", rule=_stream_name()
    )
    replicas: int = _setting(1, "Stream replicas (1 on a single server, 3 on a cluster).", rule=_between(1, 5))
    # Ingest retries with the same Msg-Id; a shorter window would let a retry through twice.
    duplicate_window_s: float = _setting(
        120.0, "JetStream de-duplication window in seconds (at least 2 minutes).", rule=_at_least(120)
    )
    max_age_s: float = _setting(0.0, "Oldest message kept, in seconds (0 = unlimited).", rule=_at_least(0))
    max_bytes: int = _setting(
        -1, "Stream size limit in bytes (-1 = unlimited).", rule=_unlimited_or_positive()
    )


@attrs.frozen
class DbSettings:
    """Where store/ materialises the log for audit."""

    url: str = _setting(
        "sqlite:///.kvledger/ledger.db",
        "SQLAlchemy URL of the audit database (SQLite or PostgreSQL).",
        rule=_non_empty(),
    )


@attrs.frozen
class IngestSettings:
    """The ZMQ-to-JetStream bridge."""

    endpoints: tuple[str, ...] = _setting(
        (), "Engine endpoints `tcp://HOST:PORT[,replay=tcp://HOST:PORT][,provenance=retained]`."
    )
    publisher: str | None = _setting(
        None, "Publisher name for the endpoints (letters, digits, '_', '-').", rule=_optional_publisher()
    )
    publish_window: int = _setting(
        256, "JetStream publishes in flight before waiting for acks.", rule=_at_least(1)
    )
    max_buffered_batches: int = _setting(
        10000, "Batches buffered while NATS is away before reading from ZMQ stops.", rule=_at_least(1)
    )
    replay_timeout_s: float = _setting(2.0, "Seconds to wait for an engine replay reply.", rule=_positive())
    engine_timeout_s: float = _setting(
        2.0, "Seconds an engine may stay silent once its SUB connection dropped (its replay socket not answering "
        "either) before its worker is published as unreachable; the SUB's ZMTP heartbeat is a quarter of it.",
        rule=_positive(),
    )
    max_batch_bytes: int = _setting(16777216, "Largest engine payload accepted, in bytes.", rule=_at_least(1))
    stream_check_interval_s: float = _setting(
        5.0, "Seconds between checks that KV_EVENTS still holds every batch it acknowledged (also checked on every "
        "reconnection); what it lost is fetched again from the engines' replay buffers.", rule=_positive(),
    )
    http_port: int = _setting(
        9101, "Port of ingest's metrics and health endpoint (0 = any free port).", rule=_PORT
    )
    http_host: str = _setting(
        "0.0.0.0", "Address ingest's metrics and health endpoint listens on (0.0.0.0 = every interface, 127.0.0.1 = this host only).",
        rule=_non_empty(),
    )


@attrs.frozen
class StoreSettings:
    """The projector from KV_EVENTS and KV_DECISIONS into SQL."""

    batch_size: int = _setting(512, "Stream messages folded per SQL transaction.", rule=_at_least(1))
    snapshot_every_events: int = _setting(
        100000, "Write an inventory snapshot after this many events.", rule=_at_least(1)
    )
    snapshot_every_s: float = _setting(
        300.0, "Write an inventory snapshot at least this often, in seconds.", rule=_positive()
    )
    snapshot_keep: int = _setting(
        3, "Newest inventory snapshots kept in KV_SNAPSHOTS; older ones are deleted.", rule=_at_least(1)
    )
    history_retention_s: float = _setting(
        0.0, "Keep closed residencies, event-log rows and decisions this many seconds (of ingest time) "
        "before removing them; the live inventory is never removed. 0 keeps all history.", rule=_at_least(0.0),
    )
    prune_every_s: float = _setting(
        60.0, "How often store removes history older than store.history_retention_s, in seconds.", rule=_positive()
    )
    prune_batch_seqs: int = _setting(
        5000, "Stream seqs of history removed per pruning transaction (bounds how long one holds the database).",
        rule=_at_least(1),
    )
    quality_horizon_s: float = _setting(
        0.5, "Horizon of the decision-quality metrics, in seconds of stream time: they count the verdicts at the "
        "configured horizon (store.quality_horizons_ms) closest to it, and the demo shows that one.",
        rule=_positive(),
    )
    quality_horizons_ms: tuple[float, ...] = _setting(
        (500.0,), "Horizons, in milliseconds of stream time, at which store judges every decision once and keeps "
        "the verdict in SQL (decision_verdicts), in the transaction of the event that settles it; "
        "`kvledger audit quality`, the demo and replay read these verdicts. An empty list judges nothing; "
        "an audit at another horizon judges in SQL.", rule=_horizons(),
    )
    quality_max_pending: int = _setting(
        100000, "Decisions the events fold keeps waiting for their horizon (all horizons together); at this many, the "
        "decisions projector waits for the fold to settle some while the fold is making progress, and otherwise "
        "leaves new ones to the SQL judge (kvledger_store_decision_quality_unjudged{reason=\"too_many_pending\"}).",
        rule=_at_least(1),
    )
    http_port: int = _setting(
        9102, "Port of store's metrics and health endpoint (0 = any free port).", rule=_PORT
    )
    http_host: str = _setting(
        "0.0.0.0", "Address store's metrics and health endpoint listens on (0.0.0.0 = every interface, 127.0.0.1 = this host only).",
        rule=_non_empty(),
    )

    @property
    def metrics_horizon_ms(self) -> float:
        """The configured verdict horizon closest to quality_horizon_s (itself when none is configured): the one
        the metrics count and the demo shows."""
        wanted = self.quality_horizon_s * 1000
        return min(self.quality_horizons_ms, key=lambda h: (abs(h - wanted), h)) if self.quality_horizons_ms else wanted

    @staticmethod
    def shard_problem(text: str) -> str | None:
        """What is wrong with a "K/N" shard value (None: nothing); store.sharding parses it with this rule."""
        match = re.fullmatch(r"\s*([0-9]+)\s*/\s*([0-9]+)\s*", text)
        if match is None:
            return f'must be "K/N" (shard K of N, e.g. "0/2"), got {text!r}'
        index, count = int(match[1]), int(match[2])
        if not 1 <= count <= 64:
            return f"shard count N must be between 1 and 64, got {text!r}"
        if not index < count:
            return f"shard index K must be between 0 and N-1, got {text!r}"
        return None

    shard: str = _setting(
        "0/1", 'This store\'s shard "K/N" (0 <= K < N <= 64): N stores split KV_EVENTS by publisher, '
        "each with its own consumer and checkpoint, into one database (PostgreSQL; SQLite takes one writer at a "
        "time). Shard 0 also projects decisions and dead letters; snapshots are written only when N = 1.",
        rule=_Rule(shard_problem),
    )


@attrs.frozen
class DecideSettings:
    """The decision service and its HTTP front."""

    backend: str = _setting(
        "auto",
        "Ranking backend: auto, cpu or cuda (auto = cuda when a GPU is present).",
        rule=_one_of("auto", "cpu", "cuda"),
    )
    http_port: int = _setting(
        9103, "Port of decide's HTTP front, metrics and health (0 = any free port).", rule=_PORT
    )
    http_host: str = _setting(
        "0.0.0.0", "Address decide's HTTP front, metrics and health listens on (0.0.0.0 = every interface, 127.0.0.1 = this host only).",
        rule=_non_empty(),
    )
    reject_media_status_code: int = _setting(
        415, "HTTP status returned for a request body that is not JSON.", rule=_between(400, 599)
    )
    batch_window_us: float = _setting(
        0.0, "Single requests arriving within this many microseconds of the first are ranked and recorded "
        "together; 0 = those pending when the event loop next turns (the loop's timers have millisecond "
        "resolution, so a shorter window waits a whole millisecond).", rule=_at_least(0),
    )
    max_batch: int = _setting(
        256, "Most single requests answered in one micro-batch.", rule=_between(1, 65536)
    )
    http_token: str | None = _setting(
        None, "Bearer token the HTTP decision API requires (`Authorization: Bearer <token>`); unset = none. "
        "Set it whenever http_host reaches beyond this host: every answer is written to the audit log.",
        secret=True, rule=_Rule(lambda value: "must not be empty" if value == "" else None),
    )
    http_token_for_metrics: bool = _setting(
        False, "Whether /metrics needs decide.http_token too (/healthz and /readyz never do)."
    )
    http_max_request_bytes: int = _setting(
        1024 * 1024, "Largest body of POST /v1/decide, in bytes (larger: 413, unread).", rule=_at_least(1)
    )
    http_max_batch_bytes: int = _setting(
        64 * 1024 * 1024, "Largest body of POST /v1/decide/batch, in bytes (larger: 413, unread).", rule=_at_least(1)
    )
    http_idle_timeout_s: float = _setting(
        10.0, "Seconds an HTTP connection may send nothing, or only part of a request head, before it is closed.",
        rule=_positive(),
    )
    http_body_timeout_s: float = _setting(
        10.0, "Seconds a request body may take to arrive whole (else 408).", rule=_positive()
    )
    shadow: bool = _setting(
        False, "Also answer every request under the shadow reuse settings (decide.shadow_settings) and record "
        "that would-be answer beside the live one, never in the reply.",
    )
    shadow_settings: str | None = _setting(
        None, "A TOML file whose [reuse] section, laid over the live reuse settings, gives the shadow settings; "
        "unset = the live reuse settings with both enable flags on.",
        rule=_Rule(lambda value: "must not be empty" if value == "" else None),
    )
    inflight_ttl_ms: float = _setting(
        0.0, "How long a request decide routed counts as held on its target (in-flight credit) until the "
        "engine's own events confirm it; 0 = off.", rule=_at_least(0),
    )
    record_requests: bool = _setting(
        True, "Record each request (its local hashes, block size, target, fallback) with its answer in "
        "KV_DECISIONS, which `kvledger replay` re-answers; off saves about a tenth of the batched rate.",
    )
    index_readers: int = _setting(
        0, "Processes that answer Dynamo's indexer API on decide.index_readers_port beside decide, from its index "
        "in shared memory (queries answered there, registrations passed on to decide; docs/routers.md); 0 = off. "
        "Linux only.", rule=_between(0, 64),
    )
    index_readers_port: int = _setting(
        9104, "Port the index readers share (on decide.http_host; 0 is refused: the readers must share one port).",
        rule=_between(1, 65535),
    )
    grpc_listen: str | None = _setting(
        None, "host:port of decide's gRPC front, serving SGLang's KVIndexer and llm-d's IndexerService from the "
        "index (docs/routers.md); unset = off.", rule=_Rule(lambda value: "must not be empty" if value == "" else None),
    )
    grpc_routers: str | None = _setting(
        None, "A TOML file for the gRPC front: the SGLang workers' router-facing addresses and llm-d's models "
        "(tokenizer file, block size, pods) (docs/routers.md); unset = no addresses, no llm-d models.",
        rule=_Rule(lambda value: "must not be empty" if value == "" else None),
    )
    grpc_max_message_bytes: int = _setting(
        4 * 1024 * 1024, "Largest gRPC request decide's gRPC front reads, in bytes (both routers' servers default "
        "to 4 MiB).", rule=_at_least(1),
    )


@attrs.frozen
class ReuseSettings:
    """The reuse cost model (docs/core.md, the reuse model); `settings_digest` of this section tags every decision."""

    enable_decode_to_prefill_reuse: bool = _setting(False, "Allow host and disk tier sources for KV transfer.")
    enable_decode_to_prefill_gpu_reuse: bool = _setting(False, "Allow device (GPU) tier sources for KV transfer.")
    minimum_transfer_prefix_blocks: int = _setting(4, "Fewest blocks worth transferring.", rule=_at_least(0))
    minimum_estimated_ttft_saving_ms: float = _setting(
        5.0, "Smallest estimated time-to-first-token saving worth a transfer, in ms.", rule=_at_least(0)
    )
    transfer_source_prefill_token_us: float = _setting(
        50.0, "Estimated prefill cost per token, in µs.", rule=_at_least(0)
    )
    transfer_source_estimated_block_us: float = _setting(
        400.0, "Estimated transfer cost per block from a host or disk source, in µs.", rule=_at_least(0)
    )
    transfer_source_gpu_estimated_block_us: float = _setting(
        40.0, "Estimated transfer cost per block from a device source, in µs.", rule=_at_least(0)
    )
    transfer_source_lookup_budget_ms: float = _setting(
        2.0,
        "Time budget for scanning candidates, in ms; past it the answer says budget_exhausted.",
        rule=_at_least(0),
    )
    device_credit_weight: float = _setting(
        1.0, "Execution credit of a block held on the target's device tier.", rule=_at_least(0)
    )
    host_credit_weight: float = _setting(
        0.75, "Execution credit of a block held on the target's host tier.", rule=_at_least(0)
    )
    disk_credit_weight: float = _setting(
        0.25, "Execution credit of a block held on the target's disk tier.", rule=_at_least(0)
    )


@attrs.frozen
class Settings:
    nats: NatsSettings = attrs.field(factory=NatsSettings)
    stream: StreamSettings = attrs.field(factory=StreamSettings)
    db: DbSettings = attrs.field(factory=DbSettings)
    ingest: IngestSettings = attrs.field(factory=IngestSettings)
    store: StoreSettings = attrs.field(factory=StoreSettings)
    decide: DecideSettings = attrs.field(factory=DecideSettings)
    reuse: ReuseSettings = attrs.field(factory=ReuseSettings)


@attrs.frozen
class LoadedSettings:
    """Effective settings plus, for every dotted key, where its value came from."""

    settings: Settings
    # "default", "file <path>", "env KVLEDGER_…" or "cli"
    sources: Mapping[str, str]


_SECTION_CLASSES: dict[str, type] = {a.name: a.type for a in attrs.fields(Settings)}
_SECTION_OF_CLASS: dict[type, str] = {cls: name for name, cls in _SECTION_CLASSES.items()}

# ---------------------------------------------------------------- value kinds


class _Mismatch(Exception):
    """A raw value does not have the setting's type (the loader turns it into a SettingsError)."""


@attrs.frozen
class _Kind:
    """How one field type is named and read from typed data (TOML, flags) and from text (env)."""

    name: str
    from_data: Callable[[object], object]
    from_text: Callable[[str], object]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _str_from_data(value: object) -> object:
    if not isinstance(value, str):
        raise _Mismatch
    return value


def _optional_str_from_data(value: object) -> object:
    return None if value is None else _str_from_data(value)


def _int_from_data(value: object) -> object:
    if not _is_int(value):
        raise _Mismatch
    return value


def _int_from_text(text: str) -> object:
    if not re.fullmatch(r"[+-]?[0-9]+", text.strip()):
        raise _Mismatch
    return int(text)


def _float_from_data(value: object) -> object:
    if not (_is_int(value) or isinstance(value, float)):
        raise _Mismatch
    number = float(value)  # type: ignore[arg-type]
    if not math.isfinite(number):
        raise _Mismatch
    return number


def _float_from_text(text: str) -> object:
    try:
        number = float(text)
    except ValueError:
        raise _Mismatch from None
    return _float_from_data(number)


def _float_list_from_data(value: object) -> object:
    if not isinstance(value, (list, tuple)):
        raise _Mismatch
    return tuple(_float_from_data(item) for item in value)


def _float_list_from_text(text: str) -> object:
    return tuple(_float_from_text(piece.strip()) for piece in text.split(",") if piece.strip())


def _bool_from_data(value: object) -> object:
    if not isinstance(value, bool):
        raise _Mismatch
    return value


_BOOL_WORDS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _bool_from_text(text: str) -> object:
    try:
        return _BOOL_WORDS[text.strip().lower()]
    except KeyError:
        raise _Mismatch from None


def _str_list_from_data(value: object) -> object:
    if not isinstance(value, (list, tuple)) or not all(isinstance(item, str) for item in value):
        raise _Mismatch
    return tuple(value)


# `name=value` pieces continue the previous item, so an endpoint such as
# `tcp://h:1,replay=tcp://h:2` survives the comma split of a list variable.
_ITEM_OPTION = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


def _str_list_from_text(text: str) -> object:
    items: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        if items and _ITEM_OPTION.match(piece):
            items[-1] = f"{items[-1]},{piece}"
        else:
            items.append(piece)
    return tuple(items)


_KINDS: dict[object, _Kind] = {
    str: _Kind("str", _str_from_data, lambda text: text),
    # An empty variable unsets an optional string, as `export KVLEDGER_NATS_TOKEN=` suggests.
    str | None: _Kind("str | None", _optional_str_from_data, lambda text: text or None),
    int: _Kind("int", _int_from_data, _int_from_text),
    float: _Kind("float", _float_from_data, _float_from_text),
    bool: _Kind("bool", _bool_from_data, _bool_from_text),
    tuple[str, ...]: _Kind("list[str]", _str_list_from_data, _str_list_from_text),
    tuple[float, ...]: _Kind("list[float]", _float_list_from_data, _float_list_from_text),
}

# ------------------------------------------------------------------- registry


class RegisteredSetting(NamedTuple):
    """One registry entry: unpacks as (section, field, type, description)."""

    section: str
    field: str
    type: object
    description: str

    @property
    def key(self) -> str:
        return f"{self.section}.{self.field}"

    @property
    def env_name(self) -> str:
        return f"{ENV_PREFIX}{self.section}_{self.field}".upper()

    @property
    def type_name(self) -> str:
        return _KINDS[self.type].name

    @property
    def attribute(self) -> "attrs.Attribute[Any]":
        return attrs.fields_dict(_SECTION_CLASSES[self.section])[self.field]

    @property
    def default(self) -> object:
        return self.attribute.default

    @property
    def secret(self) -> bool:
        return bool(self.attribute.metadata.get("secret", False))


def _build_registry() -> tuple[Mapping[str, RegisteredSetting], Mapping[str, RegisteredSetting]]:
    by_env: dict[str, RegisteredSetting] = {}
    by_key: dict[str, RegisteredSetting] = {}
    for section, cls in _SECTION_CLASSES.items():
        for attribute in attrs.fields(cls):
            if attribute.type not in _KINDS:
                raise TypeError(f"{cls.__name__}.{attribute.name}: no settings parser for type {attribute.type!r}")
            doc = attribute.metadata.get("doc")
            if not doc:
                raise TypeError(f"{cls.__name__}.{attribute.name}: settings fields need metadata={{'doc': ...}}")
            entry = RegisteredSetting(section, attribute.name, attribute.type, doc)
            if entry.env_name in by_env:
                raise TypeError(f"two settings map to {entry.env_name}")
            by_env[entry.env_name] = entry
            by_key[entry.key] = entry
    return types.MappingProxyType(by_env), types.MappingProxyType(by_key)


ENV_REGISTRY, SETTINGS_REGISTRY = _build_registry()
"""`ENV_REGISTRY`: env name → entry; `SETTINGS_REGISTRY`: dotted key → entry (same entries, same order)."""

_converter = cattrs.Converter(detailed_validation=False)

# ------------------------------------------------------------------- loading


def read_environment() -> dict[str, str]:
    """The process's `KVLEDGER_*` variables; the one place in kvledger that reads the environment."""
    return {name: value for name, value in os.environ.items() if name.startswith(ENV_PREFIX)}


def _origin(source: str) -> str:
    """Phrase a source label for an error message: 'from KVLEDGER_X', 'from file f.toml'."""
    if source.startswith("env "):
        return f"from {source[len('env '):]}"
    if source == "cli":
        return "from the command line"
    return f"from {source}"


def _accept(entry: RegisteredSetting, raw: object, source: str, *, text: bool) -> object:
    """Type-check and rule-check one raw value, or raise SettingsError naming key, type and source."""
    kind = _KINDS[entry.type]
    try:
        value = kind.from_text(raw) if text else kind.from_data(raw)  # type: ignore[arg-type]
    except _Mismatch:
        raise SettingsError(
            f"setting {entry.key}: expected {kind.name}, got {raw!r} ({type(raw).__name__}) {_origin(source)}"
        ) from None
    rule = entry.attribute.validator
    if isinstance(rule, _Rule):
        reason = rule.problem(value)
        if reason is not None:
            raise SettingsError(f"setting {entry.key}: {reason} {_origin(source)}")
    return value


def _unknown(names: list[str]) -> SettingsError:
    return SettingsError(f"unknown setting(s): {sorted(names)!r}")


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise SettingsError(f"config file {path}: not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"config file {path}: invalid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise SettingsError(f"config file {path}: not UTF-8 text: {exc}") from None
    except OSError as exc:
        raise SettingsError(f"config file {path}: cannot read: {exc.strerror or exc}") from None


def _from_file(path: str) -> dict[str, tuple[object, str]]:
    source = f"file {path}"
    document = _read_toml(path)
    unknown: list[str] = []
    found: dict[str, tuple[object, str]] = {}
    for section, table in document.items():
        if section not in _SECTION_CLASSES:
            unknown.append(section)
            continue
        if not isinstance(table, dict):
            raise SettingsError(
                f"setting {section}: expected a [{section}] table, "
                f"got {table!r} ({type(table).__name__}) {_origin(source)}"
            )
        for name, raw in table.items():
            entry = SETTINGS_REGISTRY.get(f"{section}.{name}")
            if entry is None:
                unknown.append(f"{section}.{name}")
            else:
                found[entry.key] = (raw, source)
    if unknown:
        raise _unknown(unknown)
    return {key: (_accept(SETTINGS_REGISTRY[key], raw, src, text=False), src) for key, (raw, src) in found.items()}


def _from_environment(environ: Mapping[str, str]) -> dict[str, tuple[object, str]]:
    unknown: list[str] = []
    found: dict[str, tuple[object, str]] = {}
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name.startswith(_HARNESS_ENV_PREFIXES):
            continue
        entry = ENV_REGISTRY.get(name)
        if entry is None:
            unknown.append(name)
            continue
        source = f"env {name}"
        found[entry.key] = (environ[name], source)
    if unknown:
        raise _unknown(unknown)
    return {key: (_accept(SETTINGS_REGISTRY[key], raw, src, text=True), src) for key, (raw, src) in found.items()}


def _from_overrides(overrides: Mapping[str, object]) -> dict[str, tuple[object, str]]:
    unknown = [key for key in overrides if key not in SETTINGS_REGISTRY]
    if unknown:
        raise _unknown(unknown)
    found: dict[str, tuple[object, str]] = {}
    for key, raw in overrides.items():
        entry = SETTINGS_REGISTRY[key]
        # Flags arrive as text unless their parser typed them already.
        as_text = isinstance(raw, str) and entry.type not in (str, str | None)
        found[key] = (_accept(entry, raw, "cli", text=as_text), "cli")
    return found


def load_settings(
    config_file: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> LoadedSettings:
    """Merge defaults < TOML file < environment < overrides (dotted keys, from CLI flags).

    `environ=None` reads the process environment; pass a mapping (even `{}`) to isolate.
    Raises SettingsError for unknown keys, wrongly typed values, rule violations, and
    unreadable or malformed files.
    """
    layers: list[dict[str, tuple[object, str]]] = []
    if config_file is not None:
        layers.append(_from_file(os.fspath(config_file)))
    layers.append(_from_environment(read_environment() if environ is None else environ))
    if overrides:
        layers.append(_from_overrides(overrides))

    chosen: dict[str, tuple[object, str]] = {}
    for layer in layers:
        chosen.update(layer)

    data: dict[str, dict[str, object]] = {section: {} for section in _SECTION_CLASSES}
    sources: dict[str, str] = {}
    for key, entry in SETTINGS_REGISTRY.items():
        if key in chosen:
            value, source = chosen[key]
            data[entry.section][entry.field] = value
            sources[key] = source
        else:
            sources[key] = "default"
    settings = _converter.structure(data, Settings)
    return LoadedSettings(settings=settings, sources=types.MappingProxyType(sources))


# ------------------------------------------------------------------- output


def reuse_settings_from(path: str | os.PathLike[str], base: ReuseSettings) -> ReuseSettings:
    """The [reuse] section of a TOML settings file laid over `base`: what a shadow or a replay compares.

    Other sections of the file are checked like any settings file's, then ignored.
    """
    found = _from_file(os.fspath(path))
    values = {SETTINGS_REGISTRY[key].field: value for key, (value, _) in found.items()
              if SETTINGS_REGISTRY[key].section == "reuse"}
    return _converter.structure({**_converter.unstructure(base), **values}, ReuseSettings)


def enabled_reuse(base: ReuseSettings) -> ReuseSettings:
    """`base` with both enable flags on: what reuse would do under the configured cost model."""
    return attrs.evolve(base, enable_decode_to_prefill_reuse=True, enable_decode_to_prefill_gpu_reuse=True)


def settings_digest(reuse: ReuseSettings) -> str:
    """A short stable digest of the reuse settings, recorded with every decision they produced."""
    canonical = json.dumps(_converter.unstructure(reuse), sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


def _plain_values(loaded: LoadedSettings) -> list[tuple[RegisteredSetting, object, str]]:
    plain = _converter.unstructure(loaded.settings)
    rows = []
    for key, entry in SETTINGS_REGISTRY.items():
        value = plain[entry.section][entry.field]
        if entry.secret and value is not None:
            value = MASK
        rows.append((entry, value, loaded.sources[key]))
    return rows


def _as_text(value: object) -> str:
    if value is None:
        return UNSET
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return json.dumps(list(value))
    return str(value)


def as_display_rows(loaded: LoadedSettings) -> list[tuple[str, str, str]]:
    """(key, value, source) for every setting, as text, with secrets shown as `***`."""
    return [(entry.key, _as_text(value), source) for entry, value, source in _plain_values(loaded)]


def as_json_records(loaded: LoadedSettings) -> list[dict[str, object]]:
    """{key, value, source} for every setting with JSON-typed values, secrets shown as `***`."""
    return [{"key": entry.key, "value": value, "source": source} for entry, value, source in _plain_values(loaded)]


def _toml_literal(value: object) -> str:
    if value is None:
        return UNSET
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, list, tuple)):
        return json.dumps(list(value) if isinstance(value, tuple) else value)
    return repr(value)


def reference_table_markdown() -> str:
    """The settings reference table for docs/settings.md, generated from the registry."""
    lines = [
        "| TOML key | environment variable | type | default | description |",
        "|---|---|---|---|---|",
    ]
    for entry in SETTINGS_REGISTRY.values():
        cells = (
            f"`{entry.key}`",
            f"`{entry.env_name}`",
            entry.type_name,
            f"`{_toml_literal(entry.default)}`" if entry.default is not None else UNSET,
            entry.description + (" Secret: shown as `***`." if entry.secret else ""),
        )
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines) + "\n"
