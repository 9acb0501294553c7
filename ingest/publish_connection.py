"""One NATS connection that only publishes with reply subjects and reads the replies: ingest's hot path.

nats-py spends about 8 µs of CPU per acknowledged JetStream publish (subject and header
validation, a dict of headers per message, a Msg object, a queue and a task hop per ack);
this connection frames `HPUB` lines itself and parses `MSG`/`HMSG` replies straight into
`(token, status, data)`, about 2.5 µs. It speaks the client protocol's publishing subset:
INFO, CONNECT (user/password, token, creds file), TLS upgrade, PING/PONG, SUB, HPUB, -ERR.
Streams are provisioned, and positions read, through nats-py.

It follows a cluster as nats-py does: `ServerPool` holds the URLs given and those the
cluster announces in INFO `connect_urls`; each new connection tries the servers in the
pool's order, the one just left last; a server entering lame-duck mode (INFO `ldm`) is
left for another before it goes.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import secrets
import ssl
from collections.abc import Callable
from pathlib import Path
from urllib.parse import unquote, urlsplit

from kvledger.core.settings import NatsSettings
from kvledger.runtime.nats_options import is_refusal, tls_context

_CRLF = b"\r\n"
_HEADER_START = b"NATS/1.0"
DEFAULT_PORT = 4222


class PublishConnectionError(ConnectionError):
    """The server refused us or went away; the message is the server's own words where it gave any."""


class AckReply:
    """A reply on the ack inbox: a `status` only for header-only replies (503: no stream listens)."""

    __slots__ = ("token", "status", "description", "data")

    def __init__(self, token: int, status: str | None, description: str, data: bytes) -> None:
        self.token = token
        self.status = status
        self.description = description
        self.data = data


class _Protocol(asyncio.Protocol):
    """Parses what the server sends; everything but ack replies is handled here."""

    def __init__(self, connection: PublishConnection) -> None:
        self._connection = connection
        self._buffer = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, error: Exception | None) -> None:
        # An abandoned attempt's socket may report its end late: only the current one counts.
        if self._connection._protocol is self:
            self._connection._lost(error)

    def data_received(self, data: bytes) -> None:
        if self._connection._protocol is not self:
            return
        buffer = self._buffer
        buffer += data
        position = 0
        plain_ack = self._connection._plain_ack
        try:
            while True:
                ack = plain_ack(buffer, position)  # the common case: `MSG <inbox><token> 1 <size>`
                if ack is not None:
                    start, size = ack.end(), int(ack[2])
                    if len(buffer) < start + size + 2:
                        break
                    self._connection._on_reply(AckReply(int(ack[1]), None, "", bytes(buffer[start : start + size])))
                    position = start + size + 2
                    continue
                end = buffer.find(_CRLF, position)
                if end < 0:
                    break
                if buffer.startswith(b"MSG ", position) or buffer.startswith(b"HMSG ", position):
                    parts = bytes(buffer[position:end]).split()
                    size = int(parts[-1])
                    if len(buffer) < end + 2 + size + 2:
                        break  # the rest of this message is still on its way
                    body = bytes(buffer[end + 2 : end + 2 + size])
                    header_size = int(parts[-2]) if parts[0] == b"HMSG" else 0
                    self._connection._reply(parts[1], body[:header_size], body[header_size:])
                    position = end + 2 + size + 2
                    continue
                line = bytes(buffer[position:end])
                position = end + 2
                self._connection._control(line)
        finally:
            del buffer[:position]


class ServerPool:
    """The servers a publishing connection may use: the URLs given, then those the cluster announces.

    `candidates()` lists them in the order to try: the server connected last goes to the
    end, so a reconnect goes to another node first. Announced URLs keep the scheme and the
    credentials of the first URL given (the cluster announces bare host:port).
    """

    def __init__(self, urls: str) -> None:
        self._urls = [url.strip() for url in urls.split(",") if url.strip()]
        first = urlsplit(self._urls[0] if "://" in self._urls[0] else f"nats://{self._urls[0]}") if self._urls else None
        self._scheme = first.scheme if first is not None else "nats"
        self._credentials = f"{first.netloc.rpartition('@')[0]}@" if first is not None and "@" in first.netloc else ""
        self._last: str | None = None

    def candidates(self) -> list[str]:
        if self._last in self._urls:
            return [url for url in self._urls if url != self._last] + [self._last]
        return list(self._urls)

    def connected(self, url: str, announced: list[str]) -> None:
        """`url` is now in use; `announced` are the INFO `connect_urls` (host:port) of its cluster."""
        self._last = url
        known = {_address(url) for url in self._urls}
        for address in announced:
            if address not in known:
                self._urls.append(f"{self._scheme}://{self._credentials}{address}")
                known.add(address)

    @property
    def urls(self) -> list[str]:
        return list(self._urls)


def _address(url: str) -> str:
    parts = urlsplit(url if "://" in url else f"nats://{url}")
    return f"{parts.hostname or '127.0.0.1'}:{parts.port or DEFAULT_PORT}"


class PublishConnection:
    """`async with PublishConnection(settings, on_reply=...)`: `publish_many` frames, replies come back by token."""

    def __init__(
        self, settings: NatsSettings, *, name: str, on_reply: Callable[[AckReply], None], on_lost: Callable[[], None],
        servers: ServerPool | None = None,
    ) -> None:
        self._settings = settings
        self._servers = servers if servers is not None else ServerPool(settings.url)
        self._name = name
        self._on_reply = on_reply
        self._on_lost = on_lost
        self._protocol: _Protocol | None = None
        self._info: dict = {}
        self._handshake: asyncio.Future | None = None
        self._awaiting: bytes | None = None  # what settles the handshake now: b"INFO", then b"PONG"
        self._inbox = f"_INBOX.{secrets.token_hex(11)}."
        self._inbox_bytes = self._inbox.encode()
        self._plain_ack = re.compile(b"MSG " + re.escape(self._inbox_bytes) + rb"(\d+) 1 (\d+)\r\n").match
        self.closed = asyncio.Event()
        self.error: str | None = None  # the server's -ERR, or why the connection ended
        self.url: str | None = None  # the server in use

    @property
    def max_payload(self) -> int:
        return int(self._info.get("max_payload") or 1024 * 1024)

    async def __aenter__(self) -> PublishConnection:
        errors = []
        for url in self._servers.candidates():
            try:
                await asyncio.wait_for(self._open(url), self._settings.connect_timeout_s)
                self.url = url
                self._servers.connected(url, self._info.get("connect_urls") or [])
                return self
            except PublishConnectionError as error:
                await self.close()
                if is_refusal(str(error)):
                    raise  # another server of the cluster would refuse us too
                errors.append(error)
            except (OSError, asyncio.TimeoutError, ssl.SSLError) as error:
                await self.close()
                errors.append(error)
            except BaseException:  # cancelled while connecting: leave no socket behind
                await self.close()
                raise
        raise PublishConnectionError(f"no NATS server could be reached: {'; '.join(map(str, errors))}")

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        # abort, not close: unacknowledged frames are resent on the next connection, and a
        # stalled server must not receive stale ones after those resends.
        protocol, self._protocol = self._protocol, None
        if protocol is not None and protocol.transport is not None:
            protocol.transport.abort()
        self.closed.set()

    def publish_many(self, messages: list[tuple[str, bytes, str, int]]) -> None:
        """Write `(subject, payload, msg_id, token)` as HPUBs with reply `<inbox><token>`, in one write."""
        inbox = self._inbox_bytes
        frames = []
        for subject, payload, msg_id, token in messages:
            header = msg_id_header(msg_id)
            frames.append(
                b"HPUB %s %s%d %d %d\r\n%s%s\r\n"
                % (subject.encode(), inbox, token, len(header), len(header) + len(payload), header, payload)
            )
        transport = self._protocol.transport if self._protocol is not None else None
        if transport is None or transport.is_closing():
            raise PublishConnectionError(self.error or "connection to NATS lost")
        transport.write(b"".join(frames))

    # --- the handshake ---------------------------------------------------------------

    async def _open(self, url: str) -> None:
        parts = urlsplit(url if "://" in url else f"nats://{url}")
        host, port = parts.hostname or "127.0.0.1", parts.port or DEFAULT_PORT
        loop = asyncio.get_running_loop()
        self.closed.clear()
        self.error = None
        self._info = {}  # nothing carries over from another server of the list
        self._handshake, self._awaiting = loop.create_future(), b"INFO"
        protocol = self._protocol = _Protocol(self)
        await loop.create_connection(lambda: protocol, host, port)
        await self._handshake  # the server's INFO
        context = self._tls_context(parts.scheme)
        if self._info.get("tls_required") or context is not None:
            if context is None:
                context = ssl.create_default_context()
            transport = await loop.start_tls(self._protocol.transport, self._protocol, context, server_hostname=host)
            self._protocol.transport = transport
        self._handshake, self._awaiting = loop.create_future(), b"PONG"
        connect = self._connect_fields(parts)
        # SUB before PING: a refused inbox subscription fails the handshake, not a later publish.
        self._protocol.transport.write(
            b"CONNECT " + json.dumps(connect).encode() + _CRLF + b"SUB %s* 1\r\n" % self._inbox_bytes + b"PING\r\n"
        )
        await self._handshake  # PONG, or -ERR for a refused login
        self._awaiting = None

    def _tls_context(self, scheme: str) -> ssl.SSLContext | None:
        settings = self._settings
        if settings.tls_ca or settings.tls_cert or scheme == "tls":
            return tls_context(settings)
        return None

    def _connect_fields(self, parts) -> dict:
        settings = self._settings
        fields = {
            "verbose": False, "pedantic": False, "lang": "python", "version": "kvledger-ingest", "protocol": 1,
            "headers": True, "no_responders": True, "name": self._name,
            "tls_required": bool(self._info.get("tls_required")),
        }
        user, password = settings.user, settings.password
        if not (user or password) and parts.username is not None:
            if parts.password is not None:
                user, password = unquote(parts.username), unquote(parts.password)
            elif not settings.token:
                fields["auth_token"] = unquote(parts.username)
        if user:
            fields["user"] = user
        if password:
            fields["pass"] = password
        if settings.token:
            fields["auth_token"] = settings.token
        if settings.creds_file:
            jwt, signature = _sign_with_creds(Path(settings.creds_file), self._info.get("nonce", ""))
            fields["jwt"], fields["sig"] = jwt, signature
        return fields

    # --- what the protocol hands over ------------------------------------------------

    def _control(self, line: bytes) -> None:
        if line.startswith(b"INFO "):
            info = json.loads(line[5:])
            self._info.update(info)
            if self.url is not None:  # a topology update after the handshake
                self._servers.connected(self.url, info.get("connect_urls") or [])
                if info.get("ldm"):
                    # Lame-duck mode: the server will close us soon; move to another now, and
                    # resend what it has not acknowledged there.
                    self.error = f"{self.url} entered lame-duck mode"
                    self._protocol.transport.close()
            self._settle(b"INFO")
        elif line == b"PING":
            self._protocol.transport.write(b"PONG\r\n")
        elif line == b"PONG":
            self._settle(b"PONG")
        elif line.startswith(b"-ERR"):
            self.error = line[4:].strip().strip(b"'").decode(errors="replace")
            if self._handshake is not None and not self._handshake.done():
                self._handshake.set_exception(PublishConnectionError(f"nats: {self.error}"))
            elif is_refusal(self.error):
                # The server keeps the connection after a permissions violation; nothing sent will be acked.
                self._protocol.transport.close()

    def _settle(self, what: bytes) -> None:
        # An INFO while CONNECT awaits its PONG (a topology update) says nothing about the login.
        if what == self._awaiting and self._handshake is not None and not self._handshake.done():
            self._handshake.set_result(None)

    def _reply(self, subject: bytes, header: bytes, data: bytes) -> None:
        if not subject.startswith(self._inbox_bytes):
            return
        token = subject[len(self._inbox_bytes):]
        if not token.isdigit():
            return
        status, description = None, ""
        if header:
            # "NATS/1.0 503 No Responders\r\n...": a status line without a body.
            first = header.split(_CRLF, 1)[0][len(_HEADER_START):].strip().split(b" ", 1)
            if first and first[0].isdigit():
                status = first[0].decode()
                description = first[1].decode(errors="replace") if len(first) > 1 else ""
        self._on_reply(AckReply(int(token), status, description, data))

    def _lost(self, error: Exception | None) -> None:
        if self.error is None:
            self.error = f"connection to NATS lost ({error})" if error else "connection to NATS closed"
        if self._handshake is not None and not self._handshake.done():
            self._handshake.set_exception(PublishConnectionError(self.error))
        self.closed.set()
        self._on_lost()


def msg_id_header(msg_id: str) -> bytes:
    """The HPUB header block of a message; nats-server counts it against `max_payload` too."""
    return b"NATS/1.0\r\nNats-Msg-Id: %s\r\n\r\n" % msg_id.encode()


def _sign_with_creds(path: Path, nonce: str) -> tuple[str, str]:
    """The user JWT and the nonce signed with the seed of a `.creds` file (nkeys, as nats-py uses)."""
    import nkeys  # nats-py's own optional dependency for creds files

    lines = [line.strip() for line in path.read_text().splitlines()]
    jwt = next(lines[i + 1] for i, line in enumerate(lines) if "BEGIN NATS USER JWT" in line)
    seed = next(lines[i + 1] for i, line in enumerate(lines) if "BEGIN USER NKEY SEED" in line)
    signature = nkeys.from_seed(seed.encode()).sign(nonce.encode())
    return jwt, base64.urlsafe_b64encode(signature).decode().rstrip("=")
