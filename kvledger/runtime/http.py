"""The HTTP front of every stage (health, readiness, metrics, decide's JSON API): an asyncio protocol over httptools.

httptools (llhttp, the parser of Node.js) speaks the protocol: keep-alive, pipelining, chunked
bodies, malformed requests. A connection is one `asyncio.Protocol` with no task, no stream
objects and no per-request timer, so a query costs the parse, the handler and one write
(about 12 µs a request on an empty route here, against about 80 µs on aiohttp's server;
bench/router_index.py). This module adds what a front exposed to a network needs, per
`HttpLimits`:

- a connection that sends nothing, or only part of a request head, or idles between
  requests, is closed after `idle_timeout_s` (from when it opened or answered last), so
  half-open connections cannot pile up;
- a body must arrive whole within `body_timeout_s` (else 408), and no larger than its
  route allows: a Content-Length above the limit is 413 before any of the body is read,
  and a chunked body stops being read once it passes the limit (413 as well); a request
  head is at most `MAX_HEAD_BYTES` (else 431);
- a route may require a bearer token (`Authorization: Bearer <token>`): a missing or
  wrong one is 401 before the body is read, so nothing of it reaches a handler;
- `close()` stops listening, lets requests in progress finish (up to
  `shutdown_timeout_s`) and closes idle connections.

A refusal made before the body is read (401, 404, 405, 413, 431) closes the connection
after its answer, so the unread body is never taken for the next request.

Handlers see a small `Request` and return a `Response`; a handler is a coroutine function,
or a plain function for an answer that never waits (decide's index reads), called inline.
Routes are exact (method, path) pairs; an unknown path is 404 and a known path with
another method 405.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import json
import logging
import socket
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from http import HTTPStatus

import attrs
import httptools
import msgspec

log = logging.getLogger("kvledger.http")

MAX_HEAD_BYTES = 64 * 1024
# Timers are one sweep over the connections, not a timer per request: at tens of
# thousands of queries a second a call_later and its cancel per request were measurable.
_SWEEP_MIN_S, _SWEEP_MAX_S = 0.05, 1.0
_REASONS = {status.value: status.phrase.encode() for status in HTTPStatus}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class Request(msgspec.Struct, frozen=True):
    """One request as a handler sees it (a struct: made for every request, and attrs' frozen init costs more)."""

    method: str
    path: str
    headers: Mapping[str, str]  # lower-cased names
    body: bytes
    query: str = ""  # the query string, undecoded

    @property
    def media_type(self) -> str:
        return self.headers.get("content-type", "").split(";")[0].strip().lower()


class Response(msgspec.Struct, frozen=True, gc=False):
    status: int
    body: bytes = b""
    content_type: str = "text/plain; charset=utf-8"

    @classmethod
    def json(cls, status: int, value: object) -> Response:
        return cls(status, json.dumps(value).encode(), "application/json")

    @classmethod
    def text(cls, status: int, text: str) -> Response:
        return cls(status, text.encode())


Handler = Callable[[Request], Awaitable[Response] | Response]


@attrs.frozen
class Route:
    """A handler, the largest body it takes, and whether it needs the front's bearer token."""

    handler: Handler
    max_body_bytes: int = 0
    needs_token: bool = False
    waits: bool = attrs.field(init=False)  # a coroutine function: answered from a task

    @waits.default
    def _waits(self) -> bool:
        return inspect.iscoroutinefunction(self.handler)


# (method, path) -> route
Router = Mapping[tuple[str, str], Route]


@attrs.frozen
class HttpLimits:
    idle_timeout_s: float = 10.0
    body_timeout_s: float = 10.0
    shutdown_timeout_s: float = 5.0


def health_routes(
    is_ready: Callable[[], bool], metrics_text: Callable[[], bytes], *, metrics_need_token: bool = False
) -> dict[tuple[str, str], Route]:
    """The routes every service has: `/healthz` (alive), `/readyz` (ready to serve), `/metrics`."""

    def healthz(_: Request) -> Response:
        return Response.text(200, "ok\n")

    def readyz(_: Request) -> Response:
        return Response.text(200, "ready\n") if is_ready() else Response.text(503, "not ready\n")

    def metrics(_: Request) -> Response:
        return Response(200, metrics_text(), "text/plain; version=0.0.4; charset=utf-8")

    return {
        ("GET", "/healthz"): Route(healthz),
        ("GET", "/readyz"): Route(readyz),
        ("GET", "/metrics"): Route(metrics, needs_token=metrics_need_token),
    }


def encode_response(response: Response, keep_alive: bool, headers: Mapping[str, str] | None = None) -> bytes:
    """The response's bytes on the wire."""
    head = [b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n" % (
        response.status, _REASONS.get(response.status, b"Unknown"), response.content_type.encode(), len(response.body))]
    if headers:
        head.extend(f"{name}: {value}\r\n".encode() for name, value in headers.items())
    if not keep_alive:
        head.append(b"Connection: close\r\n")
    head.append(b"\r\n")
    head.append(response.body)
    return b"".join(head)


# Where a connection stands, for the sweep: between requests or in a head (the idle timeout
# applies), in a body (the body timeout), or answering (no timeout: the handler runs).
_IDLE, _BODY, _BUSY = 0, 1, 2


class HttpFront:
    """`front = await HttpFront(router, host, port).start()`; `front.port`; `await front.close()`."""

    def __init__(
        self, router: Router, host: str, port: int, *, limits: HttpLimits = HttpLimits(), token: str | None = None,
        reuse_port: bool = False, unix_path: str | None = None,
    ) -> None:
        if token is not None and not token:
            raise ValueError("an empty bearer token would accept an empty Authorization header")
        self.router = dict(router)
        self.paths = {path for _, path in self.router}
        self._host, self._requested_port = host, port
        self._reuse_port = reuse_port  # several processes listening on one port (decide's index readers)
        self._unix_path = unix_path  # a Unix socket instead of host and port
        self.limits = limits
        self.expected = f"Bearer {token}" if token is not None else None
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task | None = None
        self.connections: set[_Connection] = set()
        self.closing = False
        self.address: tuple = ()
        self.port = 0

    async def start(self) -> HttpFront:
        loop = asyncio.get_running_loop()
        if self._unix_path is not None:
            self._server = await loop.create_unix_server(lambda: _Connection(self), self._unix_path, backlog=4096)
            self.address = (self._unix_path,)
        else:
            self._server = await loop.create_server(lambda: _Connection(self), self._host, self._requested_port,
                                                    reuse_address=True, reuse_port=self._reuse_port or None,
                                                    backlog=4096)
            self.address = self._server.sockets[0].getsockname()[:2]  # (host, port) as bound
            self.port = self.address[1]
        self._sweeper = asyncio.create_task(self._sweep(), name="http-front-timeouts")
        return self

    async def close(self) -> None:
        if self._server is None:
            return
        server, self._server = self._server, None
        self.closing = True
        server.close()
        for connection in list(self.connections):
            connection.close_when_idle()
        deadline = asyncio.get_running_loop().time() + self.limits.shutdown_timeout_s
        while self.connections and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)  # requests in progress are answered first
        for connection in list(self.connections):
            connection.abort()
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        await server.wait_closed()

    async def _sweep(self) -> None:
        limits = self.limits
        interval = min(max(min(limits.idle_timeout_s, limits.body_timeout_s) / 4, _SWEEP_MIN_S), _SWEEP_MAX_S)
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval)
            now = loop.time()
            for connection in [held for held in self.connections if held.deadline < now]:
                connection.expire()

    def authorized(self, given: str | None) -> bool:
        if self.expected is None:
            return True
        return hmac.compare_digest((given or "").encode(), self.expected.encode())


class _Connection(asyncio.Protocol):
    """One client connection: requests parsed as bytes arrive, answered in order."""

    __slots__ = ("front", "loop", "transport", "parser", "deadline", "state", "url", "headers", "head_bytes",
                 "body", "body_size", "route", "method", "pending", "answering", "dead", "close_after")

    def __init__(self, front: HttpFront) -> None:
        self.front = front
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.state = _IDLE
        self.deadline = self.loop.time() + front.limits.idle_timeout_s
        self.url = b""
        self.headers: dict[str, str] = {}
        self.head_bytes = 0
        self.body: list[bytes] = []
        self.body_size = 0
        self.route: Route | None = None
        self.method = ""
        self.pending: deque[tuple[Route, Request, bool]] = deque()  # parsed, not answered yet (pipelining)
        self.answering = False
        self.dead = False
        self.close_after = False  # answer what is in progress, then close (shutdown)

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.front.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.dead = True
        self.front.connections.discard(self)

    def data_received(self, data: bytes) -> None:
        if self.dead:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.refuse(Response.text(400, "upgrades are not served here\n"))
        except httptools.HttpParserError:
            if not self.dead:
                self.refuse(Response.text(400, "malformed request\n"))
        if not self.answering and self.pending and not self.dead:
            self.answer_pending()

    # httptools callbacks

    def on_message_begin(self) -> None:
        self.url = b""
        self.headers = {}
        self.head_bytes = 0
        self.body = []
        self.body_size = 0
        self.route = None

    def on_url(self, url: bytes) -> None:
        self.url += url
        self.head_bytes += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.head_bytes += len(name) + len(value)
        if self.head_bytes > MAX_HEAD_BYTES:
            self.refuse(Response.text(431, f"request head larger than {MAX_HEAD_BYTES} bytes\n"))
            raise httptools.HttpParserError("head too large")
        self.headers[name.lower().decode("latin-1")] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        if self.dead:
            return
        front = self.front
        method = self.method = self.parser.get_method().decode("ascii", "replace")
        path, _, _ = self.url.partition(b"?")
        path_text = path.decode("latin-1")
        route = front.router.get((method, path_text))
        if route is None:
            status = 405 if path_text in front.paths else 404
            self.refuse(Response.text(status, f"{method} {path_text}: not here\n"))
            return
        if route.needs_token and not front.authorized(self.headers.get("authorization")):
            self.refuse(Response.text(401, "missing or wrong bearer token\n"), {"WWW-Authenticate": "Bearer"})
            return
        length = self.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > route.max_body_bytes:
            self.refuse(Response.text(413, f"body larger than {route.max_body_bytes} bytes\n"))
            return
        self.route = route
        if length not in (None, "0") or "transfer-encoding" in self.headers:
            self.state = _BODY
            self.deadline = self.loop.time() + front.limits.body_timeout_s
            if self.headers.get("expect", "").lower() == "100-continue":
                self.transport.write(_CONTINUE)

    def on_body(self, data: bytes) -> None:
        if self.dead or self.route is None:
            return
        self.body_size += len(data)
        if self.body_size > self.route.max_body_bytes:
            self.refuse(Response.text(413, f"body larger than {self.route.max_body_bytes} bytes\n"))
            return
        self.body.append(data)

    def on_message_complete(self) -> None:
        if self.dead or self.route is None:
            return
        url = self.url
        path, _, query = url.partition(b"?")
        body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        request = Request(self.method, path.decode("latin-1"), self.headers, body, query.decode("latin-1"))
        self.pending.append((self.route, request, self.parser.should_keep_alive()))
        self.route = None
        self.state = _BUSY

    # answering

    def answer_pending(self) -> None:
        """Answer parsed requests in order: inline while handlers answer at once, from a task when one waits."""
        pending = self.pending
        while pending and not self.dead:
            route, request, keep_alive = pending.popleft()
            if route.waits:
                self.answering = True
                self.transport.pause_reading()
                task = self.loop.create_task(self._answer_later(route, request, keep_alive))
                task.add_done_callback(_retrieve)
                return
            try:
                response = route.handler(request)
            except Exception as error:  # a handler bug must not take the service down
                response = _failure(request, error)
            self.send(response, keep_alive)
        if not self.dead:
            self.state = _IDLE
            self.deadline = self.loop.time() + self.front.limits.idle_timeout_s
            if self.close_after:
                self.transport.close()

    async def _answer_later(self, route: Route, request: Request, keep_alive: bool) -> None:
        try:
            response = await route.handler(request)
        except Exception as error:  # a handler bug must not take the service down
            response = _failure(request, error)
        self.answering = False
        if self.dead:
            return
        self.send(response, keep_alive)
        if not self.dead:
            self.transport.resume_reading()
            self.answer_pending()

    def send(self, response: Response, keep_alive: bool, headers: Mapping[str, str] | None = None) -> None:
        keep_alive = keep_alive and not self.front.closing
        self.transport.write(encode_response(response, keep_alive, headers))
        if not keep_alive:
            self.dead = True
            self.transport.close()

    def refuse(self, response: Response, headers: Mapping[str, str] | None = None) -> None:
        """Answer now, before the rest of the request is read, and close."""
        if self.dead:
            return
        self.pending.clear()
        self.send(response, False, headers)

    # timeouts and shutdown

    def expire(self) -> None:
        if self.dead:
            return
        if self.state == _BODY:
            self.refuse(Response.text(408, f"body not received within {self.front.limits.body_timeout_s:g}s\n"))
        elif self.state == _IDLE:
            self.abort()

    def close_when_idle(self) -> None:
        self.close_after = True
        if self.state != _BUSY:
            self.abort()

    def abort(self) -> None:
        self.dead = True
        if self.transport is not None:
            self.transport.close()


def _failure(request: Request, error: Exception) -> Response:
    log.error("%s %s failed", request.method, request.path, exc_info=error)
    return Response.json(500, {"error": {"field": None, "message": f"internal error: {error}"}})


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("answering a request failed", exc_info=task.exception())
