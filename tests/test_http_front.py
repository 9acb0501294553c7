"""The HTTP front (kvledger/runtime/http.py) against real sockets: limits, timeouts, chunked bodies,
bearer tokens; and decide's front under 10 000 half-open connections, as a real process."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import nats
import pytest

from engines import http_get, wait_until
from kvledger.runtime.http import HttpFront, HttpLimits, Request, Response, Route, health_routes
from kvledger.runtime.streams import DECISIONS_SUBJECT
from services import free_ports

TOKEN = "s3cret-token"


async def echo(request: Request) -> Response:
    return Response.json(200, {"bytes": len(request.body), "media": request.media_type})


def router() -> dict:
    routes = health_routes(lambda: True, lambda: b"kvledger_up 1\n")
    routes[("POST", "/echo")] = Route(echo, max_body_bytes=1000)
    routes[("POST", "/guarded")] = Route(echo, max_body_bytes=1000, needs_token=True)
    return routes


async def exchange(port: int, raw: bytes, *, read_timeout: float = 5.0) -> bytes:
    """Send raw bytes on a fresh connection and read until the server closes it (or a response is whole)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), read_timeout)
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")), 0)
        body = await asyncio.wait_for(reader.readexactly(length), read_timeout)
        return head + body
    finally:
        writer.close()


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


@pytest.fixture
async def front():
    server = await HttpFront(router(), "127.0.0.1", 0, limits=HttpLimits(idle_timeout_s=1.0, body_timeout_s=1.0),
                             token=TOKEN).start()
    try:
        yield server
    finally:
        await server.close()


async def test_routes_statuses_and_media_types_are_as_before(front) -> None:
    assert status_of(await exchange(front.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")) == 200
    metrics = await exchange(front.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status_of(metrics) == 200 and b"text/plain; version=0.0.4" in metrics and metrics.endswith(b"kvledger_up 1\n")
    assert status_of(await exchange(front.port, b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n")) == 404
    assert status_of(await exchange(front.port, b"POST /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")) == 405
    answer = await exchange(front.port, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
    assert status_of(answer) == 200 and json.loads(answer.split(b"\r\n\r\n", 1)[1]) == {"bytes": 2, "media": "application/json"}


async def test_a_chunked_body_is_accepted(front) -> None:
    chunked = b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    answer = await exchange(front.port, chunked)
    assert status_of(answer) == 200 and json.loads(answer.split(b"\r\n\r\n", 1)[1])["bytes"] == 11


async def test_an_oversized_body_is_413_without_being_read(front) -> None:
    # A gigabyte announced, ten bytes sent: the answer comes at once, so the rest was never awaited.
    started = time.monotonic()
    answer = await exchange(front.port, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n0123456789")
    assert status_of(answer) == 413 and time.monotonic() - started < 0.9
    # Chunked, past the limit: refused once it passes the limit, before the body ends.
    chunk = b"%x\r\n%s\r\n" % (600, b"a" * 600)
    answer = await exchange(front.port, b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk * 2)
    assert status_of(answer) == 413


async def test_a_body_that_stalls_is_408(front) -> None:
    answer = await exchange(front.port, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nhalf", read_timeout=5)
    assert status_of(answer) == 408


async def test_a_missing_or_wrong_token_is_401_and_a_right_one_passes(front) -> None:
    body = b"Content-Length: 2\r\n\r\n{}"
    assert status_of(await exchange(front.port, b"POST /guarded HTTP/1.1\r\nHost: x\r\n" + body)) == 401
    wrong = b"POST /guarded HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer nope\r\n" + body
    assert status_of(await exchange(front.port, wrong)) == 401
    right = f"POST /guarded HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n".encode() + body
    assert status_of(await exchange(front.port, right)) == 200
    # Open routes stay open with a token set.
    assert status_of(await exchange(front.port, b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")) == 200


async def test_connections_that_send_nothing_or_half_a_head_are_closed_after_the_idle_timeout(front) -> None:
    silent = [await asyncio.open_connection("127.0.0.1", front.port) for _ in range(20)]
    halves = []
    for _ in range(20):
        reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
        writer.write(b"POST /echo HTTP/1.1\r\nHost: x\r\n")
        halves.append((reader, writer))
    assert status_of(await exchange(front.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")) == 200
    started = time.monotonic()
    for reader, writer in silent + halves:
        left = await asyncio.wait_for(reader.read(), 5)  # returns at EOF: the server closed it
        assert reader.at_eof() and (left == b"" or left.startswith(b"HTTP/1.1 4")), left[:80]
        writer.close()
    assert time.monotonic() - started < 4


# --- decide's front as a process, under many half-open connections ------------------------------

HALF_OPEN = 10_000
IDLE_TIMEOUT_S = 4.0


def _start_decide(nats_url: str, http_port: int) -> subprocess.Popen:
    env = {name: value for name, value in os.environ.items() if not name.startswith("KVLEDGER_")}
    env.update({
        "KVLEDGER_DECIDE_HTTP_PORT": str(http_port), "KVLEDGER_DECIDE_HTTP_HOST": "127.0.0.1",
        "KVLEDGER_DECIDE_HTTP_TOKEN": TOKEN, "KVLEDGER_DECIDE_HTTP_IDLE_TIMEOUT_S": str(IDLE_TIMEOUT_S),
        "KVLEDGER_DECIDE_BACKEND": "cpu",
    })  # fmt: skip
    return subprocess.Popen([sys.executable, "-m", "kvledger.app.cli", "decide", "--nats", nats_url], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


async def _decide(port: int, request_id: str, token: str | None) -> tuple[int, bytes]:
    body = json.dumps({"request_id": request_id, "local_hashes": ["1", "2"], "block_size": 16}).encode()
    auth = f"Authorization: Bearer {token}\r\n".encode() if token else b""
    raw = (b"POST /v1/decide HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + auth
           + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    answer = await exchange(port, raw, read_timeout=20)
    return status_of(answer), answer.split(b"\r\n\r\n", 1)[1]


@pytest.mark.service
async def test_ten_thousand_half_open_connections_stop_neither_health_nor_decisions_and_are_closed(nats_server) -> None:
    [port] = free_ports(1)
    process = _start_decide(nats_server.url, port)
    opened: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        async def ready() -> bool:
            if process.poll() is not None:
                raise AssertionError(f"decide exited: {process.stderr.read().decode()[-2000:]}")
            try:
                return (await http_get(port, "/readyz"))[0] == 200
            except OSError:
                return False

        await wait_until(ready, 120, "decide /readyz")  # compiling the kernels may take a while the first time

        async def half_open() -> None:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/decide HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
            opened.append((reader, writer))

        for start in range(0, HALF_OPEN, 500):
            await asyncio.gather(*(half_open() for _ in range(min(500, HALF_OPEN - start))))
        assert len(opened) == HALF_OPEN

        # Beside them, the front still answers health and real decisions, and refuses a bad token.
        assert (await http_get(port, "/healthz"))[0] == 200
        status, answer = await _decide(port, "through-the-crowd", TOKEN)
        assert status == 200 and json.loads(answer)["request_id"] == "through-the-crowd"
        status, _ = await _decide(port, "no-token", None)
        assert status == 401
        status, _ = await _decide(port, "wrong-token", "guess")
        assert status == 401

        # After the idle timeout every half-open connection has been closed by the server.
        async def closed(reader: asyncio.StreamReader) -> bool:
            await asyncio.wait_for(reader.read(), IDLE_TIMEOUT_S * 4)
            return reader.at_eof()

        results = await asyncio.gather(*(closed(reader) for reader, _ in opened))
        assert all(results)

        # Refused requests never reached the audit log: only the authorised one is in KV_DECISIONS.
        nc = await nats.connect(nats_server.url)
        try:
            recorded = []
            subscription = await nc.jetstream().subscribe(DECISIONS_SUBJECT, ordered_consumer=True)
            while True:
                try:
                    message = await subscription.next_msg(timeout=1)
                except nats.errors.TimeoutError:
                    break
                recorded.append(json.loads(message.data)["request_id"])
            assert "through-the-crowd" in recorded and "no-token" not in recorded and "wrong-token" not in recorded
        finally:
            await nc.close()
    finally:
        for _, writer in opened:
            writer.close()
        process.terminate()
        process.wait(30)
