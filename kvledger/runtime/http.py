"""The HTTP front of every stage (health, readiness, metrics, decide's JSON API) on aiohttp's server.

aiohttp speaks the protocol (keep-alive, pipelining, chunked bodies, malformed requests);
this module adds what a front exposed to a network needs, per `HttpLimits`:

- a connection that sends nothing, or only part of a request head, or idles between
  requests, is closed after `idle_timeout_s` (aiohttp's keep-alive timer, which starts
  when the connection opens), so half-open connections cannot pile up;
- a body must arrive whole within `body_timeout_s` (else 408), and no larger than its
  route allows: a Content-Length above the limit is 413 before any of the body is read,
  and a chunked body stops being read once it passes the limit (413 as well);
- a route may require a bearer token (`Authorization: Bearer <token>`): a missing or
  wrong one is 401 before the body is read, so nothing of it reaches a handler;
- `close()` stops listening, lets requests in progress finish (up to
  `shutdown_timeout_s`) and closes idle connections.

Handlers see a small `Request` and return a `Response`; routes are exact (method, path)
pairs, an unknown path is 404 and a known path with another method 405.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Awaitable, Callable, Mapping

import attrs
from aiohttp import web

log = logging.getLogger("kvledger.http")
# aiohttp reports each malformed request (a missing Host, a bad request line) on this logger
# with a traceback: the client's fault, already answered 400, so it is not logged again.
_protocol_log = logging.getLogger("kvledger.http.protocol")
_protocol_log.setLevel(logging.CRITICAL)

_CHUNK = 64 * 1024


@attrs.frozen
class Request:
    method: str
    path: str
    headers: Mapping[str, str]  # lower-cased names
    body: bytes
    query: str = ""  # the query string, undecoded

    @property
    def media_type(self) -> str:
        return self.headers.get("content-type", "").split(";")[0].strip().lower()


@attrs.frozen
class Response:
    status: int
    body: bytes = b""
    content_type: str = "text/plain; charset=utf-8"

    @classmethod
    def json(cls, status: int, value: object) -> Response:
        return cls(status, json.dumps(value).encode(), "application/json")

    @classmethod
    def text(cls, status: int, text: str) -> Response:
        return cls(status, text.encode())


Handler = Callable[[Request], Awaitable[Response]]


@attrs.frozen
class Route:
    """A handler, the largest body it takes, and whether it needs the front's bearer token."""

    handler: Handler
    max_body_bytes: int = 0
    needs_token: bool = False


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

    async def healthz(_: Request) -> Response:
        return Response.text(200, "ok\n")

    async def readyz(_: Request) -> Response:
        return Response.text(200, "ready\n") if is_ready() else Response.text(503, "not ready\n")

    async def metrics(_: Request) -> Response:
        return Response(200, metrics_text(), "text/plain; version=0.0.4; charset=utf-8")

    return {
        ("GET", "/healthz"): Route(healthz),
        ("GET", "/readyz"): Route(readyz),
        ("GET", "/metrics"): Route(metrics, needs_token=metrics_need_token),
    }


class HttpFront:
    """`front = await HttpFront(router, host, port).start()`; `front.port`; `await front.close()`."""

    def __init__(
        self, router: Router, host: str, port: int, *, limits: HttpLimits = HttpLimits(), token: str | None = None,
    ) -> None:
        if token is not None and not token:
            raise ValueError("an empty bearer token would accept an empty Authorization header")
        self._router = dict(router)
        self._paths = {path for _, path in self._router}
        self._host, self._requested_port = host, port
        self._limits = limits
        self._expected = f"Bearer {token}".encode() if token is not None else None
        self._runner: web.ServerRunner | None = None
        self.address: tuple = ()
        self.port = 0

    async def start(self) -> HttpFront:
        server = web.Server(
            self._handle, keepalive_timeout=self._limits.idle_timeout_s, access_log=None,
            handler_cancellation=True, logger=_protocol_log,
        )  # fmt: skip
        self._runner = web.ServerRunner(server, shutdown_timeout=self._limits.shutdown_timeout_s)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._requested_port)
        await site.start()
        self.address = self._runner.addresses[0]  # (host, port) as bound
        self.port = self.address[1]
        return self

    async def close(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def _handle(self, raw: web.BaseRequest) -> web.StreamResponse:
        route = self._router.get((raw.method, raw.path))
        if route is None:
            status = 405 if raw.path in self._paths else 404
            return _reply(Response.text(status, f"{raw.method} {raw.path}: not here\n"))
        if route.needs_token and not self._authorized(raw):
            return _reply(Response.text(401, "missing or wrong bearer token\n"), {"WWW-Authenticate": "Bearer"})
        body, refusal = await self._read_body(raw, route.max_body_bytes)
        if refusal is not None:
            return _reply(refusal, {"Connection": "close"})
        headers = {name.lower(): value for name, value in raw.headers.items()}
        request = Request(raw.method, raw.path, headers, body, raw.query_string)
        try:
            response = await route.handler(request)
        except Exception as error:  # a handler bug must not take the service down
            log.exception("%s %s failed", raw.method, raw.path)
            response = Response.json(500, {"error": {"field": None, "message": f"internal error: {error}"}})
        return _reply(response)

    def _authorized(self, raw: web.BaseRequest) -> bool:
        if self._expected is None:
            return True
        given = raw.headers.get("Authorization", "").encode()
        return hmac.compare_digest(given, self._expected)

    async def _read_body(self, raw: web.BaseRequest, limit: int) -> tuple[bytes, Response | None]:
        too_large = Response.text(413, f"body larger than {limit} bytes\n")
        if raw.content_length is not None and raw.content_length > limit:
            return b"", too_large  # refused before reading any of it
        if not raw.body_exists:
            return b"", None
        parts: list[bytes] = []
        size = 0

        async def read_all() -> Response | None:
            nonlocal size
            while True:
                chunk = await raw.content.read(_CHUNK)
                if not chunk:
                    return None
                size += len(chunk)
                if size > limit:
                    return too_large
                parts.append(chunk)

        try:
            refusal = await asyncio.wait_for(read_all(), self._limits.body_timeout_s)
        except TimeoutError:
            return b"", Response.text(408, f"body not received within {self._limits.body_timeout_s:g}s\n")
        return b"".join(parts), refusal


def _reply(response: Response, headers: Mapping[str, str] | None = None) -> web.Response:
    reply = web.Response(status=response.status, body=response.body, headers=headers)
    reply.headers["Content-Type"] = response.content_type
    return reply
