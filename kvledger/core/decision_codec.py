"""The decision API's boundary: one schema for requests in and answers out (docs/decide.md, the decision API).

The msgspec Structs below are the whole wire format. decide decodes requests into
`WireRequest` (typed, so an error names the failing field's path) and writes answers that
decode into `Answer`; store reads each KV_DECISIONS record back into `Answer`; the client
sends `DecideRequest` and receives `Answer`. The same Structs serve JSON and msgpack.
"""

from __future__ import annotations

import re
import struct
import uuid
from typing import Annotated, Any

import msgspec

from kvledger.core import reuse
from kvledger.core.events import WorkerId
from kvledger.core.hashing import local_block_hashes, parse_extra_keys

JSON = "application/json"
MSGPACK = "application/msgpack"  # the two media types the API speaks, with the same Structs

U64_MAX = (1 << 64) - 1
U32_MAX = 0xFFFFFFFF
MAX_REQUEST_BLOCKS = 1 << 20
MAX_REQUEST_ID_CHARS = 256
MAX_LOOKAHEAD = 64
MAX_BLOCK_SIZE = 1 << 20
_MAX_LIST_ITEMS = MAX_REQUEST_BLOCKS * 64


class RequestError(ValueError):
    """A request that cannot be answered; `field` names what is wrong (a path such as
    `token_ids[3]`), `message` how, `request_id` whose request it was when that could be read."""

    def __init__(self, field: str, message: str, request_id: str | None = None) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        self.request_id = request_id

    @property
    def top_field(self) -> str:
        """The request field the error is in (`token_ids` for `token_ids[3]`, `unknown` for a field the
        schema lacks): a metrics label of bounded cardinality."""
        field = _top_level(self.field)
        return field if field in _FIELD_RULES or field in _OTHER_FIELDS else "unknown"

    def as_json(self, request_id: object = None) -> dict[str, Any]:
        """The error reply (`ErrorReply`) as Python values."""
        request_id = self.request_id if request_id is None else request_id
        return error_reply(self.field, self.message, request_id if isinstance(request_id, str) else None)


class ErrorBody(msgspec.Struct, frozen=True):
    field: str | None  # None: the failure is the service's, not the request's
    message: str


class ErrorReply(msgspec.Struct, frozen=True, kw_only=True):
    """What decide answers instead of an `Answer` for a request it refuses or fails."""

    request_id: str | None = None
    error: ErrorBody


def error_reply(field: str | None, message: str, request_id: str | None = None) -> dict[str, Any]:
    return msgspec.to_builtins(ErrorReply(request_id=request_id, error=ErrorBody(field, message)))


# --- requests ----------------------------------------------------------------------------------

# Hashes above 2**53 do not survive JSON in every client, so decimal strings are accepted in
# the integer lists too. (msgspec cannot bound an int above int64, so u64 is checked after.)
_Token = Annotated[int, msgspec.Meta(ge=0, le=U32_MAX)] | str
_Hash = Annotated[int, msgspec.Meta(ge=0)] | str


class WireRequest(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """One request about to be prefilled (docs/decide.md, Request fields).

    Give exactly one of `token_ids` (hashed as the engine hashed its blocks) or
    `local_hashes`. `target` is a worker's name as answers write it: `publisher` for
    dp_rank 0, else `publisher/dp_rank`.
    """

    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_REQUEST_ID_CHARS)]
    block_size: Annotated[int, msgspec.Meta(gt=0, le=MAX_BLOCK_SIZE)]
    token_ids: Annotated[list[_Token], msgspec.Meta(max_length=_MAX_LIST_ITEMS)] | None = None
    local_hashes: Annotated[list[_Hash], msgspec.Meta(max_length=_MAX_LIST_ITEMS)] | None = None
    target: str | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    extra_keys: list[Any] | None = None  # vLLM's per-block list, as its BlockStored.extra_keys
    lookahead: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOOKAHEAD)] = 0  # 1: EAGLE's window
    # Where the caller places the request when no worker has credit, native or in flight:
    # the answer's target then, so decide knows where it went (docs/decide.md, In-flight credit).
    fallback: str | None = None


_JSON_REQUEST = msgspec.json.Decoder(WireRequest)
_MSGPACK_REQUEST = msgspec.msgpack.Decoder(WireRequest)
_PATH = re.compile(r"^(?P<message>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_NAMED_FIELD = re.compile(r"^Object (?:missing required|contains unknown) field `(?P<field>[^`]*)`$")


# What each field must be, said before msgspec's own words on how it failed.
_FIELD_RULES = {
    "request_id": f"required, a non-empty string of at most {MAX_REQUEST_ID_CHARS} characters",
    "block_size": f"required, a positive integer of at most {MAX_BLOCK_SIZE}",
    "token_ids": f"a list of integers in [0, {U32_MAX}] (or their decimal strings)",
    "local_hashes": f"a list of integers in [0, {U64_MAX}] (or their decimal strings)",
    "lookahead": f"an integer in [0, {MAX_LOOKAHEAD}] (1: EAGLE's window)",
    "target": "a worker's name, or null",
    "fallback": "a worker's name, or null",
    "lora_name": "a string or null",
    "cache_salt": "a string or null",
    "extra_keys": "a list with one entry per block, or null",
    "request": "a JSON (or msgpack) object",
}
_OTHER_FIELDS = frozenset({"requests", "content-type"})
# Every value RequestError.top_field can take: the refused-requests metric's labels.
REQUEST_FIELDS = tuple(sorted({*_FIELD_RULES, *_OTHER_FIELDS, "unknown"}))


def _top_level(path: str) -> str:
    """The request field a path starts with: `token_ids` of `token_ids[3]`."""
    return re.split(r"[.\[]", path, maxsplit=1)[0]


def not_decodable(error: msgspec.DecodeError, *, msgpack: bool) -> RequestError:
    """The error for a body that is not JSON (or msgpack) at all."""
    return RequestError("request", f"not valid {'msgpack' if msgpack else 'JSON'}: {error}")


def _request_error(error: msgspec.ValidationError, request_id: object) -> RequestError:
    """msgspec's message, with its path (`$.token_ids[3]`) as the field (`token_ids[3]`)."""
    match = _PATH.match(str(error))
    assert match is not None  # the pattern matches any text
    message, path = match["message"], (match["path"] or "").removeprefix(".")
    if not path:
        named = _NAMED_FIELD.match(message)
        path = named["field"] if named else "request"
    rule = _FIELD_RULES.get(_top_level(path))
    return RequestError(path, f"{rule}: {message}" if rule else message, request_id if isinstance(request_id, str) else None)


def _checked_ints(values: list, field: str, upper: int) -> list[int]:
    # The common case, plain ints in range, checked at C speed; anything else takes the
    # loop below, which also names the offending element.
    if not values or (set(map(type, values)) == {int} and max(values) <= upper):
        return values
    result = []
    for position, item in enumerate(values):
        if isinstance(item, str) and item.isascii() and item.isdigit():
            item = int(item)
        if not isinstance(item, int) or not 0 <= item <= upper:
            raise RequestError(f"{field}[{position}]", f"expected an integer in [0, {upper}], got {item!r}")
        result.append(item)
    return result


def request_of(wire: WireRequest) -> reuse.ReuseRequest:
    """The checks a type cannot state, then the request's blocks hashed: a `ReuseRequest`."""
    try:
        return _request_of(wire)
    except RequestError as error:
        error.request_id = wire.request_id
        raise


def _request_of(wire: WireRequest) -> reuse.ReuseRequest:
    request_id = wire.request_id
    # The id is the answer's Nats-Msg-Id in KV_DECISIONS. NATS trims header values and
    # folds line breaks, so "a", " a" and "a\nb" vs "a b" would dedupe into one record.
    if not request_id.isprintable() or request_id != request_id.strip():
        raise RequestError("request_id", f"at most {MAX_REQUEST_ID_CHARS} printable characters, without leading "
                                         f"or trailing spaces, got {request_id[:40]!r}")
    try:
        target = WorkerId.parse(wire.target) if wire.target else None
    except ValueError as error:
        raise RequestError("target", str(error)) from None
    try:
        fallback = WorkerId.parse(wire.fallback) if wire.fallback else None
    except ValueError as error:
        raise RequestError("fallback", str(error)) from None
    has_tokens, has_hashes = wire.token_ids is not None, wire.local_hashes is not None
    if has_tokens == has_hashes:
        raise RequestError("token_ids", "give exactly one of token_ids or local_hashes")
    lora_name, cache_salt = wire.lora_name or None, wire.cache_salt or None
    if has_hashes:
        if wire.lookahead or wire.extra_keys is not None or cache_salt:
            field = "lookahead" if wire.lookahead else "extra_keys" if wire.extra_keys is not None else "cache_salt"
            raise RequestError(field, "applies to token_ids; local_hashes are already hashed")
        local = _checked_ints(wire.local_hashes, "local_hashes", U64_MAX)
    else:
        tokens = _checked_ints(wire.token_ids, "token_ids", U32_MAX)
        try:
            # The same per-block keys as an engine's stores, so a request hashes as its blocks did.
            keys = parse_extra_keys(wire.extra_keys, lora_name)
        except ValueError as error:
            raise RequestError("extra_keys", str(error)) from None
        local = local_block_hashes(
            tokens, wire.block_size, lora_name=lora_name, cache_salt=cache_salt, block_keys=keys, lookahead=wire.lookahead,
        )
    if len(local) > MAX_REQUEST_BLOCKS:
        raise RequestError("token_ids" if has_tokens else "local_hashes", f"more than {MAX_REQUEST_BLOCKS} blocks")
    return reuse.ReuseRequest(request_id, tuple(local), wire.block_size, target, lora_name, fallback)


def _id_of(data: bytes, decode) -> object:
    """The request id of a body that failed its typed decoding, when one can be read (for the error reply)."""
    try:
        body = decode(data)
    except msgspec.DecodeError:
        return None
    return body.get("request_id") if isinstance(body, dict) else None


def decode_request(data: bytes, *, msgpack: bool = False) -> reuse.ReuseRequest:
    """One encoded request object (JSON, or msgpack) as a ReuseRequest; raises RequestError."""
    decoder = _MSGPACK_REQUEST if msgpack else _JSON_REQUEST
    try:
        wire = decoder.decode(data)
    except msgspec.ValidationError as error:
        raise _request_error(error, _id_of(data, msgspec.msgpack.decode if msgpack else msgspec.json.decode)) from None
    except msgspec.DecodeError as error:
        raise not_decodable(error, msgpack=msgpack) from None
    return request_of(wire)


def request_from_json(body: object) -> reuse.ReuseRequest:
    """One request object already parsed into Python values (a dict) as a ReuseRequest; raises RequestError."""
    try:
        wire = msgspec.convert(body, WireRequest)
    except msgspec.ValidationError as error:
        raise _request_error(error, body.get("request_id") if isinstance(body, dict) else None) from None
    return request_of(wire)


def new_request_id() -> str:
    return uuid.uuid4().hex


class DecideRequest(WireRequest, frozen=True, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """`WireRequest` as a client builds it: the request id defaults to a fresh one."""

    request_id: str = msgspec.field(default_factory=new_request_id)


# --- answers -----------------------------------------------------------------------------------


class Overlap(msgspec.Struct, frozen=True):
    """Contiguous prefix lengths, in blocks, one worker holds of the request."""

    device: int
    host: int
    disk: int
    any: int
    retained_device: int


class Candidate(msgspec.Struct, frozen=True):
    """A worker whose prefix could be transferred to the target instead of recomputed."""

    source: str
    dp_rank: int
    tier: str  # "device", "host" or "disk"
    prefix_blocks: int
    transfer_blocks: int
    recompute_ms: float
    transfer_ms: float
    saving_ms: float


class Inflight(msgspec.Struct, frozen=True):
    """Blocks the answer's target is expected to hold beyond its native prefix, because decide
    routed requests with them there within `decide.inflight_ttl_ms` and no event of its engine
    has yet confirmed or contradicted them. Routing credit, never execution credit
    (`credited_blocks` counts native blocks alone)."""

    blocks: int  # past the target's native prefix: positions `overlaps[target].any` .. + blocks - 1
    credit: float  # blocks × reuse.device_credit_weight: what target choice counted beside credited_blocks


class Answer(msgspec.Struct, frozen=True, omit_defaults=True):
    """decide's answer (docs/decide.md's answer, with `settings_digest`), in the order its writer writes the fields.

    `inflight` is written only when the target has in-flight credit (`decide.inflight_ttl_ms`).
    """

    request_id: str
    inventory_seq: int
    target: str | None
    credited_blocks: float
    baseline_blocks: int
    overlaps: dict[str, Overlap]
    candidates: tuple[Candidate, ...]
    chosen: Candidate | None
    reason: str
    uncertain_workers: tuple[str, ...]
    backend: str
    settings_digest: str
    inflight: Inflight | None = None


ANSWER_DECODER = msgspec.json.Decoder(Answer)


def _candidate(candidate: reuse.Candidate) -> Candidate:
    return Candidate(candidate.source, candidate.dp_rank, candidate.tier.value, candidate.prefix_blocks,
                     candidate.transfer_blocks, candidate.recompute_ms, candidate.transfer_ms, candidate.saving_ms)


def answer_of(decision: reuse.Decision) -> Answer:
    """The reference model's decision in the answer schema (what the backends' writer must produce, byte for byte)."""
    return Answer(
        decision.request_id, decision.inventory_seq, decision.target, decision.credited_blocks,
        decision.baseline_blocks,
        {name: Overlap(o.device, o.host, o.disk, o.any, o.retained_device) for name, o in decision.overlaps.items()},
        tuple(map(_candidate, decision.candidates)),
        None if decision.chosen is None else _candidate(decision.chosen),
        decision.reason, tuple(decision.uncertain_workers), decision.backend, decision.settings_digest,
    )


def decision_to_json(decision: reuse.Decision) -> dict[str, Any]:
    """The answer object of docs/decide.md (plus `settings_digest`) as the JSON values a client reads."""
    return msgspec.json.decode(msgspec.json.encode(answer_of(decision)))


# A KV_DECISIONS record carries, beside the answer, the sequence hashes of the blocks the
# answer relies on (the chosen source's prefix, the target's credited prefix), so store can
# later tell whether they were still held. Little-endian u64 in hex; at most
# MAX_RELIED_BLOCKS of them, which keeps the record well inside NATS's default payload limit.
RELIED_PREFIX_HEADER = "Kvledger-Relied-Prefix"
MAX_RELIED_BLOCKS = 16384


def relied_prefix_from_header(text: str | None) -> list[int]:
    """The hashes a record's `RELIED_PREFIX_HEADER` names (none when absent)."""
    if not text:
        return []
    data = bytes.fromhex(text)
    if len(data) % 8:
        raise ValueError(f"{RELIED_PREFIX_HEADER}: {len(data)} bytes is not a whole number of u64 hashes")
    return list(struct.unpack(f"<{len(data) // 8}Q", data))


# A NATS request may ask for its record's acknowledgement to come to the caller
# (docs/decide.md, "On record"): decide then publishes the answer's record to KV_DECISIONS
# with `record_ack_subject(reply)` as its reply subject and sends the answer at once,
# with the same header on it; the caller takes the answer only once JetStream's ack on
# that subject says the record is stored. A reply without the header was sent after
# decide itself saw the record acknowledged.
RECORD_ACK_HEADER = "Kvledger-Record-Ack"
RECORD_ACK_TO_CALLER = "caller"


def record_ack_subject(reply: str) -> str:
    """Where JetStream acknowledges the record of the answer sent to `reply`: under the caller's own inbox."""
    return reply + ".recorded"


# --- what a KV_DECISIONS record carries beside the answer ------------------------------------

# The request as asked, so a replay can answer it again under other settings (docs/audit.md,
# "What-if replay"): its block size, the target and fallback it named, and its local hashes
# (little-endian u64 in hex, at most MAX_RELIED_BLOCKS; `blocks` says how many it had).
REQUEST_HEADER = "Kvledger-Request"
# What reuse would have chosen under the shadow settings (`decide.shadow`): a `ShadowAnswer`.
SHADOW_HEADER = "Kvledger-Shadow"


class RecordedRequest(msgspec.Struct, frozen=True, omit_defaults=True):
    """A request as its record keeps it (header `REQUEST_HEADER`, compact JSON)."""

    block_size: int
    blocks: int
    local_hashes: str  # hex of the first min(blocks, MAX_RELIED_BLOCKS) local hashes, little-endian u64
    target: str | None = None
    fallback: str | None = None

    @property
    def complete(self) -> bool:
        """Whether every block of the request is recorded (a longer one is replayed on its first blocks only)."""
        return len(self.local_hashes) // 16 == self.blocks

    def reuse_request(self, request_id: str) -> reuse.ReuseRequest:
        data = bytes.fromhex(self.local_hashes)
        local = struct.unpack(f"<{len(data) // 8}Q", data)
        return reuse.ReuseRequest(
            request_id, local, self.block_size, WorkerId.parse(self.target) if self.target else None, None,
            WorkerId.parse(self.fallback) if self.fallback else None,
        )


class ShadowAnswer(msgspec.Struct, frozen=True):
    """The would-be answer under the shadow settings, as its record keeps it (header `SHADOW_HEADER`)."""

    settings_digest: str
    reason: str
    target: str | None
    baseline_blocks: int
    chosen: Candidate | None


_RECORDED_REQUEST = msgspec.json.Decoder(RecordedRequest)
_SHADOW = msgspec.json.Decoder(ShadowAnswer)
_ENCODER = msgspec.json.Encoder()


def request_header(request: reuse.ReuseRequest) -> str:
    """The `REQUEST_HEADER` value of a request."""
    local = request.local_hashes[:MAX_RELIED_BLOCKS]
    return _ENCODER.encode(RecordedRequest(
        request.block_size, len(request.local_hashes), struct.pack(f"<{len(local)}Q", *local).hex(),
        request.target.name if request.target is not None else None,
        request.fallback.name if request.fallback is not None else None,
    )).decode()


def request_from_header(text: str | None) -> RecordedRequest | None:
    return None if not text else _RECORDED_REQUEST.decode(text)


def shadow_header(answer: bytes) -> str:
    """The `SHADOW_HEADER` value for one answer's JSON under the shadow settings (only the fields judged)."""
    return _ENCODER.encode(_SHADOW.decode(answer)).decode()


def shadow_from_header(text: str | None) -> ShadowAnswer | None:
    return None if not text else _SHADOW.decode(text)


def with_inflight(answer: bytes, inflight: Inflight) -> bytes:
    """An answer's JSON with its `inflight` field written last, as `Answer` encodes it."""
    return answer[:-1] + b',"inflight":' + _ENCODER.encode(inflight) + b"}"


def hashes_text(hashes) -> bytes:
    """Sequence hashes as `RELIED_PREFIX_HEADER` writes them (little-endian u64 in hex)."""
    hashes = list(hashes)[:MAX_RELIED_BLOCKS]
    return struct.pack(f"<{len(hashes)}Q", *hashes).hex().encode()
