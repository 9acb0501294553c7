"""JetStream's reply to a publish, read the same way by every stage that publishes.

Pure: a reply's status header, description and body in, the ack or an `AckError` out.
ingest reads it from its own publishing connection, decide from nats-py messages.
"""

from __future__ import annotations

import msgspec


class AckError(Exception):
    """JetStream answered a publish with an error (stream full, no stream for the subject…)."""


class _ApiError(msgspec.Struct):
    code: int = 0
    err_code: int = 0
    description: str = ""


class PubAck(msgspec.Struct):
    """JetStream's publish ack, `{"stream", "seq", "duplicate"}`, or `{"error": {...}}`."""

    stream: str = ""
    seq: int = 0
    duplicate: bool = False
    error: _ApiError | None = None


_ack_decoder = msgspec.json.Decoder(PubAck)


def read_ack(status: str | None, description: str, data: bytes) -> PubAck:
    """The JetStream ack in a reply; raises `AckError` for an error reply or a status-only message.

    `status` is the reply's status header, present only on header-only replies (503: no
    stream listens on the subject).
    """
    if status:
        reason = "no stream listens on the subject" if status == "503" else description
        raise AckError(f"JetStream replied with status {status} ({reason})")
    try:
        ack = _ack_decoder.decode(data)
    except msgspec.DecodeError as error:
        raise AckError(f"unreadable JetStream ack {data[:200]!r}: {error}") from None
    if ack.error is not None:
        raise AckError(f"JetStream refused the message: {ack.error.description} (err_code {ack.error.err_code})")
    if not ack.stream:
        raise AckError(f"JetStream ack names no stream: {data[:200]!r}")
    return ack
