"""Request bodies in and answers out of the decide service, by media type.

Bodies decode straight into the decision API's schema (`kvledger.core.decision_codec`): a
single request into a `ReuseRequest` or the `RequestError` naming its failing field, a
batch element by element, so one bad request never takes the others with it.
"""

from __future__ import annotations

import json

import attrs
import msgspec

from kvledger.core.decision_codec import JSON, MSGPACK, RequestError, decode_request, not_decodable
from kvledger.core.reuse import ReuseRequest
from kvledger.runtime.http import Response

MAX_BATCH_REQUESTS = 65536
MEDIA_TYPES = (JSON, MSGPACK)

_BATCH = {JSON: msgspec.json.Decoder(list[msgspec.Raw]), MSGPACK: msgspec.msgpack.Decoder(list[msgspec.Raw])}

Parsed = ReuseRequest | RequestError


def parse_single(data: bytes, media_type: str = JSON) -> Parsed:
    try:
        return decode_request(data, msgpack=media_type == MSGPACK)
    except RequestError as error:
        return error


def parse_batch(data: bytes, media_type: str = JSON) -> list[Parsed] | RequestError:
    """Each element of a batch body, or the error that refuses the whole body."""
    try:
        elements = _BATCH[media_type].decode(data)
    except msgspec.ValidationError as error:
        return RequestError("requests", f"expected a list of requests: {error}")
    except msgspec.DecodeError as error:
        return not_decodable(error, msgpack=media_type == MSGPACK)
    if len(elements) > MAX_BATCH_REQUESTS:
        return RequestError("requests", f"more than {MAX_BATCH_REQUESTS} requests in one batch")
    return [parse_single(element, media_type) for element in elements]


def encoded_response(status: int, value: object, media_type: str) -> Response:
    """`value`, or the JSON text `value` already is (bytes), in the client's media type."""
    if media_type == MSGPACK:
        if isinstance(value, bytes):
            value = msgspec.json.decode(value)
        return Response(status, msgspec.msgpack.encode(value), MSGPACK)
    if isinstance(value, bytes):
        return Response(status, value, JSON)
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
