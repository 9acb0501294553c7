"""A minimal HTTP/1.1 front for the services: health, readiness, metrics, small JSON APIs.

This module only speaks the protocol over an asyncio stream pair it is handed; each stage
opens its own listening socket (`asyncio.start_server(partial(serve_connection, router=...))`),
so the core stays free of sockets.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping

import attrs

MAX_BODY_BYTES = 64 * 1024 * 1024
_REASONS = {
    200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 411: "Length Required",
    413: "Payload Too Large", 415: "Unsupported Media Type", 500: "Internal Server Error", 503: "Service Unavailable",
}


@attrs.frozen
class Request:
    method: str
    path: str
    headers: Mapping[str, str]  # lower-cased names
    body: bytes

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
# (method, path) -> handler
Router = Mapping[tuple[str, str], Handler]


def health_routes(is_ready: Callable[[], bool], metrics_text: Callable[[], bytes]) -> dict[tuple[str, str], Handler]:
    """The routes every service has: `/healthz` (alive), `/readyz` (ready to serve), `/metrics`."""

    async def healthz(_: Request) -> Response:
        return Response.text(200, "ok\n")

    async def readyz(_: Request) -> Response:
        return Response.text(200, "ready\n") if is_ready() else Response.text(503, "not ready\n")

    async def metrics(_: Request) -> Response:
        return Response(200, metrics_text(), "text/plain; version=0.0.4; charset=utf-8")

    return {("GET", "/healthz"): healthz, ("GET", "/readyz"): readyz, ("GET", "/metrics"): metrics}


async def serve_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, router: Router) -> None:
    """Answer requests on one connection until the client closes it or asks to."""
    try:
        while True:
            request, error = await _read_request(reader)
            if request is None and error is None:
                return
            if error is not None:
                await _write(writer, error, keep_alive=False)
                return
            response = await _dispatch(router, request)
            keep_alive = request.headers.get("connection", "").lower() != "close"
            await _write(writer, response, keep_alive)
            if not keep_alive:
                return
    except (ConnectionError, asyncio.IncompleteReadError):
        return
    finally:
        writer.close()


async def _dispatch(router: Router, request: Request) -> Response:
    handler = router.get((request.method, request.path))
    if handler is None:
        allowed = any(path == request.path for _, path in router)
        return Response.text(405 if allowed else 404, f"{request.method} {request.path}: not here\n")
    try:
        return await handler(request)
    except Exception as error:  # a handler bug must not take the service down
        return Response.json(500, {"error": {"field": None, "message": f"internal error: {error}"}})


async def _read_request(reader: asyncio.StreamReader) -> tuple[Request | None, Response | None]:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as partial:
        if partial.partial.strip():
            return None, Response.text(400, "incomplete request\n")
        return None, None
    except asyncio.LimitOverrunError:
        return None, Response.text(400, "request head too large\n")
    lines = head.decode("latin-1").split("\r\n")
    try:
        method, target, _version = lines[0].split(" ", 2)
    except ValueError:
        return None, Response.text(400, "malformed request line\n")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding"):
        return None, Response.text(411, "chunked bodies are not supported; send Content-Length\n")
    try:
        length = int(headers.get("content-length", "0"))
    except ValueError:
        return None, Response.text(400, "bad Content-Length\n")
    if length < 0 or length > MAX_BODY_BYTES:
        return None, Response.text(413, f"body larger than {MAX_BODY_BYTES} bytes\n")
    body = await reader.readexactly(length) if length else b""
    return Request(method.upper(), target.split("?", 1)[0], headers, body), None


async def _write(writer: asyncio.StreamWriter, response: Response, keep_alive: bool) -> None:
    reason = _REASONS.get(response.status, "Status")
    head = (
        f"HTTP/1.1 {response.status} {reason}\r\n"
        f"Content-Type: {response.content_type}\r\n"
        f"Content-Length: {len(response.body)}\r\n"
        f"Connection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n"
    )
    writer.write(head.encode("latin-1") + response.body)
    await writer.drain()
