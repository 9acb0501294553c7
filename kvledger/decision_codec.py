"""The decision API's JSON boundary: requests in, decisions out (docs/decide.md, the decision API).

decide parses requests and writes answers with it; store reads answers back from
KV_DECISIONS with it. Validation happens here, once; errors name the offending field.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

import cattrs

from kvledger.events import Tier, WorkerId
from kvledger.hashing import local_block_hashes, parse_extra_keys
from kvledger.reuse import Candidate, Decision, Overlap, ReuseRequest

U64_MAX = (1 << 64) - 1
MAX_REQUEST_BLOCKS = 1 << 20


class RequestError(ValueError):
    """A request that cannot be answered; `field` names what is wrong, `message` how."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def as_json(self, request_id: object = None) -> dict[str, Any]:
        return {"request_id": request_id if isinstance(request_id, str) else None,
                "error": {"field": self.field, "message": self.message}}


MAX_REQUEST_ID_CHARS = 256
_REQUEST_FIELDS = frozenset({
    "request_id", "target", "token_ids", "local_hashes", "block_size", "lora_name", "cache_salt", "extra_keys",
    "lookahead",
})
MAX_LOOKAHEAD = 64


def _int_list(value: object, field: str, *, upper: int) -> list[int]:
    if not isinstance(value, list):
        raise RequestError(field, f"expected a list of integers, got {type(value).__name__}")
    if len(value) > MAX_REQUEST_BLOCKS * 64:
        raise RequestError(field, "too long")
    # The common case, plain ints in range, checked at C speed (bool's type is not int);
    # anything else takes the loop below, which also names the offending element.
    if value and set(map(type, value)) == {int} and min(value) >= 0 and max(value) <= upper:
        return value
    result = []
    for index, item in enumerate(value):
        # Hashes above 2**53 do not survive JSON in every client, so decimal strings are accepted too.
        if isinstance(item, str) and item.isascii() and item.isdigit():
            item = int(item)
        if not isinstance(item, int) or isinstance(item, bool) or not 0 <= item <= upper:
            raise RequestError(f"{field}[{index}]", f"expected an integer in [0, {upper}], got {item!r}")
        result.append(item)
    return result


def _optional_str(body: Mapping[str, Any], field: str) -> str | None:
    value = body.get(field)
    if value is not None and not isinstance(value, str):
        raise RequestError(field, f"expected a string or null, got {type(value).__name__}")
    return value or None


def request_from_json(body: object) -> ReuseRequest:
    """Validate one JSON request object and turn it into a ReuseRequest."""
    if not isinstance(body, dict):
        raise RequestError("request", f"expected a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - _REQUEST_FIELDS)
    if unknown:
        raise RequestError(unknown[0], f"unknown field(s): {unknown}")
    request_id = body.get("request_id")
    if not isinstance(request_id, str) or not request_id:
        raise RequestError("request_id", "required, a non-empty string")
    # The id is the answer's Nats-Msg-Id in KV_DECISIONS. NATS trims header values and
    # folds line breaks, so "a", " a" and "a\nb" vs "a b" would dedupe into one record.
    if len(request_id) > MAX_REQUEST_ID_CHARS or not request_id.isprintable() or request_id != request_id.strip():
        raise RequestError("request_id", f"at most {MAX_REQUEST_ID_CHARS} printable characters, without leading "
                                         f"or trailing spaces, got {request_id[:40]!r}")
    block_size = body.get("block_size")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or not 0 < block_size <= 1 << 20:
        raise RequestError("block_size", f"required, a positive integer, got {block_size!r}")
    target_name = _optional_str(body, "target")
    try:
        target = WorkerId.parse(target_name) if target_name is not None else None
    except ValueError as error:
        raise RequestError("target", str(error)) from None
    lora_name = _optional_str(body, "lora_name")
    cache_salt = _optional_str(body, "cache_salt")
    has_tokens, has_hashes = body.get("token_ids") is not None, body.get("local_hashes") is not None
    if has_tokens == has_hashes:
        raise RequestError("token_ids", "give exactly one of token_ids or local_hashes")
    lookahead = body.get("lookahead", 0)
    if not isinstance(lookahead, int) or isinstance(lookahead, bool) or not 0 <= lookahead <= MAX_LOOKAHEAD:
        raise RequestError("lookahead", f"an integer in [0, {MAX_LOOKAHEAD}] (1: EAGLE's window), got {lookahead!r}")
    if has_hashes and (lookahead or body.get("extra_keys") is not None or cache_salt):
        field = "lookahead" if lookahead else "extra_keys" if body.get("extra_keys") is not None else "cache_salt"
        raise RequestError(field, "applies to token_ids; local_hashes are already hashed")
    if has_tokens:
        tokens = _int_list(body["token_ids"], "token_ids", upper=0xFFFFFFFF)
        try:
            # The same per-block keys as an engine's stores, so a request hashes as its blocks did.
            keys = parse_extra_keys(body.get("extra_keys"), lora_name)
        except ValueError as error:
            raise RequestError("extra_keys", str(error)) from None
        local = local_block_hashes(
            tokens, block_size, lora_name=lora_name, cache_salt=cache_salt, block_keys=keys, lookahead=lookahead,
        )
    else:
        local = _int_list(body["local_hashes"], "local_hashes", upper=U64_MAX)
    if len(local) > MAX_REQUEST_BLOCKS:
        raise RequestError("token_ids" if has_tokens else "local_hashes", f"more than {MAX_REQUEST_BLOCKS} blocks")
    return ReuseRequest(request_id, tuple(local), block_size, target, lora_name)


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


_converter = cattrs.Converter()
_converter.register_unstructure_hook(Tier, lambda tier: tier.value)
_converter.register_structure_hook(Tier, lambda value, _: Tier(value))


def decision_to_json(decision: Decision) -> dict[str, Any]:
    """The answer object of docs/decide.md (plus `settings_digest`)."""
    return _converter.unstructure(decision)


def decision_from_json(body: Mapping[str, Any]) -> Decision:
    """Read an answer back (store does, from KV_DECISIONS)."""
    body = dict(body)
    body["overlaps"] = {name: _converter.structure(value, Overlap) for name, value in body["overlaps"].items()}
    body["candidates"] = tuple(_converter.structure(value, Candidate) for value in body["candidates"])
    body["chosen"] = None if body["chosen"] is None else _converter.structure(body["chosen"], Candidate)
    body["uncertain_workers"] = tuple(body["uncertain_workers"])
    return Decision(**body)
