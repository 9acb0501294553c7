"""Request bodies in and answers out of the decide service, by media type.

Bodies are parsed here into plain values (or a `RequestError` naming what is wrong); turning
them into `ReuseRequest`s is `kvledger.decision_codec`'s job.
"""

from __future__ import annotations

import json

import attrs
import msgspec

from kvledger.decision_codec import RequestError
from kvledger.runtime.http import Response

MAX_BATCH_REQUESTS = 65536
MEDIA_TYPES = ("application/json", "application/msgpack")


def parse_json(data: bytes) -> tuple[object, RequestError | None]:
    # msgspec's untyped decoding gives the same values as json.loads (integers of any size
    # included), about five times faster; validation follows in request_from_json.
    try:
        return msgspec.json.decode(data), None
    except msgspec.DecodeError as error:
        return None, RequestError("request", f"not valid JSON: {error}")


def parse_msgpack(data: bytes) -> tuple[object, RequestError | None]:
    try:
        return msgspec.msgpack.decode(data), None
    except msgspec.DecodeError as error:
        return None, RequestError("request", f"not valid msgpack: {error}")


def batch_problem(body: object) -> RequestError | None:
    """Why a parsed batch body cannot be answered element by element, or None when it can."""
    if not isinstance(body, list):
        return RequestError("requests", f"expected a JSON list of requests, got {type(body).__name__}")
    if len(body) > MAX_BATCH_REQUESTS:
        return RequestError("requests", f"more than {MAX_BATCH_REQUESTS} requests in one batch")
    return None


def encoded_response(status: int, value: object, media_type: str) -> Response:
    """`value`, or the JSON text `value` already is (bytes), in the client's media type."""
    if media_type == "application/msgpack":
        if isinstance(value, bytes):
            value = msgspec.json.decode(value)
        return Response(status, msgspec.msgpack.encode(value), "application/msgpack")
    if isinstance(value, bytes):
        return Response(status, value, "application/json")
    return Response.json(status, value)


def json_bytes(value: object) -> bytes:
    return json.dumps(value).encode()


@attrs.frozen
class EncodedAnswers:
    """The JSON of each answer or error object, in request order."""

    parts: tuple[bytes, ...]
    refused: frozenset[int]  # positions answered with an error object

    def as_list(self) -> bytes:
        return b"[" + b",".join(self.parts) + b"]"
