"""Helpers for ingest tests: simulated engines on free ports, settings, and reading a stream back."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable

import nats
import nats.errors
import nats.js.errors
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from kvledger.sim.vllm import VllmBlockStored
from kvledger.events import EventBatch, decode_batch
from kvledger.settings import Settings, load_settings
from services import free_ports


def settings_for(nats_url: str, **overrides: object) -> Settings:
    """Settings built from nothing but these values: no environment, no file."""
    values = {"nats.url": nats_url, "ingest.http_port": 0, **overrides}
    return load_settings(environ={}, overrides=values).settings


_handed_out: set[int] = set()


def _port_run(length: int) -> int:
    """A base port whose next `length` ports are all free now and not handed out before."""
    while True:
        [base] = free_ports(1)
        run = range(base, base + length)
        if base + length > 65535 or _handed_out.intersection(run):
            continue
        with contextlib.ExitStack() as stack:
            try:
                for port in run:
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.update(run)
        return base


def engine_endpoints(ranks: int = 1) -> tuple[str, str]:
    """Publish and replay base endpoints, each with `ranks` consecutive free ports (rank r = base + r)."""
    return f"tcp://127.0.0.1:{_port_run(ranks)}", f"tcp://127.0.0.1:{_port_run(ranks)}"


def one_block(block_id: int, medium: str | None = "GPU", parent: int | None = None, block_size: int = 4) -> VllmBlockStored:
    return VllmBlockStored((block_id,), parent, tuple([block_id % 50000] * block_size), block_size, medium)


async def read_stream(nats_url: str, stream: str = "KV_EVENTS", subject: str | None = None, **connect) -> list[tuple[int, str, bytes]]:
    """Every message in the stream (optionally one subject), as (stream seq, subject, data)."""
    nc = await nats.connect(nats_url, **connect)
    try:
        js = nc.jetstream()
        try:
            info = await js.stream_info(stream)
        except nats.js.errors.NotFoundError:
            return []
        total = info.state.messages
        if total == 0:
            return []
        config = ConsumerConfig(deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE, filter_subject=subject)
        sub = await js.pull_subscribe(subject or ">", durable=None, stream=stream, config=config)
        out: list[tuple[int, str, bytes]] = []
        while True:
            try:
                messages = await sub.fetch(1000, timeout=1.0)
            except (nats.errors.TimeoutError, asyncio.TimeoutError):
                break
            out.extend((m.metadata.sequence.stream, m.subject, m.data) for m in messages)
            if subject is None and len(out) >= total:
                break
        await sub.unsubscribe()
        return out
    finally:
        await nc.close()


async def read_batches(nats_url: str, subject: str | None = None, **connect) -> list[EventBatch]:
    return [decode_batch(data) for _, _, data in await read_stream(nats_url, "KV_EVENTS", subject, **connect)]


async def wait_until(check: Callable[[], object], timeout: float, what: str, interval: float = 0.05):
    """Poll an async or plain check until it returns something truthy, or fail saying `what`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last = None
    while loop.time() < deadline:
        last = check()
        if asyncio.iscoroutine(last):
            last = await last
        if last:
            return last
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


async def http_get(port: int, path: str) -> tuple[int, str]:
    """A plain HTTP/1.1 GET on 127.0.0.1, returning (status, body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    await writer.drain()
    raw = await reader.read()
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()
