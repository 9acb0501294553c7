"""Helpers for ingest tests: simulated engines on free ports, settings, and reading a stream back."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import signal
import socket
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import nats
import nats.errors
import nats.js.errors
import zmq
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from kvledger.core.events import EventBatch, decode_batch
from kvledger.core.settings import Settings, load_settings
from kvledger.sim.vllm import VllmBlockStored
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


# --- vLLM's own publisher, as tests/golden/record_vllm.py loads it out of the wheel -----------

ENGINE_WHEELS = Path.home() / ".cache" / "kvledger" / "wheels"  # or KVLEDGER_TEST_<ENGINE>_WHEEL=PATH


def engine_wheel(engine: str) -> Path | None:
    """The wheel of `engine` (vllm | sglang) its golden recorder pins, where a test can find it without the
    network: KVLEDGER_TEST_<ENGINE>_WHEEL, else the wheel cache `.ci/run` fills."""
    named = os.environ.get(f"KVLEDGER_TEST_{engine.upper()}_WHEEL")
    if named:
        return Path(named)
    version = _golden_recorder(f"record_{engine}").VERSION
    return next(iter(sorted(ENGINE_WHEELS.glob(f"{engine}-{version}-*.whl"))), None)


def _golden_recorder(name: str) -> types.ModuleType:
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).parent / "golden" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def load_engine_kv_events(engine: str, wheel: Path) -> types.ModuleType:
    """`engine`'s own kv_events module (vLLM's `vllm/distributed/kv_events.py`, SGLang's
    `sglang/srt/disaggregation/kv_events.py`), executed from the wheel as its golden recorder does; the
    stand-in `vllm.*` / `sglang.*` modules are taken out of `sys.modules` again afterwards."""
    before = set(sys.modules)
    try:
        return _golden_recorder(f"record_{engine}").load_kv_events(wheel)
    finally:
        for name in set(sys.modules) - before:
            if name == engine or name.startswith(f"{engine}."):
                del sys.modules[name]


class VllmEngine:
    """One vLLM engine rank publishing through vLLM's own `ZmqEventPublisher` (PUB bound, ROUTER replay).

    `restart()` shuts that publisher down and starts a new one on the same ports: a new
    incarnation, counting from seq 0 with an empty replay buffer, as a restarted engine.
    """

    def __init__(self, kv: types.ModuleType, pub_endpoint: str, replay_endpoint: str, *, buffer_steps: int = 10_000) -> None:
        self._kv = kv
        self.pub_endpoint, self.replay_endpoint = pub_endpoint, replay_endpoint
        self._buffer_steps = buffer_steps
        self._publisher = None
        self.next_seq = 0

    def start(self) -> None:
        port = self.pub_endpoint.rpartition(":")[2]
        replay_port = self.replay_endpoint.rpartition(":")[2]
        for attempt in range(50):  # the old incarnation's sockets close in ZMQ's I/O thread
            try:
                self._publisher = self._new_publisher(f"tcp://*:{port}", f"tcp://*:{replay_port}")
                break
            except zmq.ZMQError:
                if attempt == 49:
                    raise
                time.sleep(0.05)
        self.next_seq = 0

    def _new_publisher(self, endpoint: str, replay_endpoint: str) -> object:
        return self._kv.ZmqEventPublisher(
            0, endpoint=endpoint, replay_endpoint=replay_endpoint, buffer_steps=self._buffer_steps, topic="kv-events",
        )

    def stop(self) -> None:
        if self._publisher is not None:
            self._publisher.shutdown()
            self._publisher = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def store(self, block: int, parent: int | None, block_size: int = 4) -> object:
        return self._kv.BlockStored(
            block_hashes=[block], parent_block_hash=parent, token_ids=[block % 50000] * block_size,
            block_size=block_size, lora_id=None, medium="GPU", lora_name=None,
        )

    def remove(self, block: int) -> object:
        return self._kv.BlockRemoved(block_hashes=[block], medium="GPU")

    async def publish(self, events: list[object], ts: float) -> int:
        """Publish one batch through vLLM's queue and thread; returns its seq once it is sent and buffered."""
        seq = self.next_seq
        self.next_seq += 1
        self._publisher.publish(self._kv.KVEventBatch(ts=ts, events=list(events)))
        buffer = self._publisher._buffer  # vLLM's own replay buffer: the batch is sent once it is there
        await wait_until(lambda: buffer and buffer[-1][0] == seq, 5.0, f"vLLM to send seq {seq}", interval=0.002)
        return seq


# --- SGLang's own publisher, as tests/golden/record_sglang.py loads it out of the wheel ---------


class SglangEngine(VllmEngine):
    """One SGLang scheduler rank publishing through SGLang's own `ZmqEventPublisher` (its copy of vLLM's: PUB
    bound, ROUTER replay, the same buffer); `restart()` as `VllmEngine`'s."""

    def _new_publisher(self, endpoint: str, replay_endpoint: str) -> object:
        return self._kv.ZmqEventPublisher(
            0, endpoint=endpoint, replay_endpoint=replay_endpoint, buffer_steps=self._buffer_steps,
            topic="kv-events", bind=True,
        )

    def store(self, block: int, parent: int | None, block_size: int = 4) -> object:
        return self._kv.BlockStored(
            block_hashes=[block], parent_block_hash=parent, token_ids=[block % 50000] * block_size,
            block_size=block_size, lora_id=None, medium=self._kv.StorageMedium.GPU,
        )

    def remove(self, block: int) -> object:
        return self._kv.BlockRemoved(block_hashes=[block], medium=self._kv.StorageMedium.GPU)


# --- vLLM's own publisher in a process of its own: killed, frozen (SIGSTOP) and thawed --------

# An engine's own publisher, run by a child process out of its wheel: argv is the golden folder, the engine
# (vllm | sglang), the wheel, both endpoints and the buffer; each stdin line is one batch to publish.
_ENGINE_PROCESS = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
engine = sys.argv[2]
recorder = __import__("record_" + engine)
kv = recorder.load_kv_events(__import__("pathlib").Path(sys.argv[3]))
options = {"bind": True} if engine == "sglang" else {}
medium = kv.StorageMedium.GPU if engine == "sglang" else "GPU"
extra = {} if engine == "sglang" else {"lora_name": None}
publisher = kv.ZmqEventPublisher(
    0, endpoint=sys.argv[4], replay_endpoint=sys.argv[5], buffer_steps=int(sys.argv[6]), topic="kv-events", **options,
)
print("ready", flush=True)
seq = 0
for line in sys.stdin:
    command = json.loads(line)
    events = []
    for kind, block, parent in command["events"]:
        if kind == "store":
            events.append(kv.BlockStored(
                block_hashes=[block], parent_block_hash=parent, token_ids=[block % 50000] * 4, block_size=4,
                lora_id=None, medium=medium, **extra,
            ))
        else:
            events.append(kv.BlockRemoved(block_hashes=[block], medium=medium))
    publisher.publish(kv.KVEventBatch(ts=command["ts"], events=events))
    while not publisher._buffer or publisher._buffer[-1][0] != seq:  # sent once the replay buffer holds it
        time.sleep(0.001)
    print(seq, flush=True)
    seq += 1
"""


class EngineProcess:
    """An engine's own `ZmqEventPublisher` (vLLM's or SGLang's, out of its wheel) in a child process, so it can
    die (SIGKILL) or freeze (SIGSTOP) as an engine does; `publish` sends one batch through it and returns its
    seq once the publisher sent it."""

    def __init__(self, engine: str, wheel: Path, pub_endpoint: str, replay_endpoint: str, *,
                 buffer_steps: int = 10_000) -> None:
        self.engine, self.wheel = engine, wheel
        self.pub_endpoint, self.replay_endpoint = pub_endpoint, replay_endpoint
        self._buffer_steps = buffer_steps
        self.process: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        port = self.pub_endpoint.rpartition(":")[2]
        replay_port = self.replay_endpoint.rpartition(":")[2]
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _ENGINE_PROCESS, str(Path(__file__).parent / "golden"), self.engine, str(self.wheel),
            f"tcp://*:{port}", f"tcp://*:{replay_port}", str(self._buffer_steps),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )
        line = await asyncio.wait_for(self.process.stdout.readline(), 30)
        assert line.strip() == b"ready", f"{self.engine}'s publisher did not start: {line!r}"

    async def publish(self, events: list[tuple[str, int, int | None]], ts: float) -> int:
        """`events`: ("store", block, parent) or ("remove", block, None)."""
        self.process.stdin.write(json.dumps({"ts": ts, "events": events}).encode() + b"\n")
        await self.process.stdin.drain()
        return int(await asyncio.wait_for(self.process.stdout.readline(), 10))

    def signal(self, number: int) -> None:
        self.process.send_signal(number)

    async def stop(self) -> None:
        """Kill the process (SIGKILL: no goodbye on its sockets) and reap it."""
        process = self.process
        if process is None or process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGCONT)  # a frozen process must run to die
            process.kill()
        await process.wait()
