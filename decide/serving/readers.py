"""Index readers: processes that answer Dynamo's indexer queries from decide's index in shared memory.

decide folds KV_EVENTS in one process, and one process answers HTTP on one core. With
`decide.index_readers = N`, N more processes listen on `decide.index_readers_port` (the
kernel spreads connections over them, `SO_REUSEPORT`) and serve Dynamo's indexer API there:
`/query` and `/query_by_hash` answered in the reader from the arrays decide's index keeps
in shared memory (mapped read-only, never copied), everything else (`/register`,
`/unregister`, `/workers`, `/dump`) passed on to decide itself over a Unix socket, so the
registrations stay decide's alone.

Consistency, as a sequence lock: decide bumps a shared counter before and after it changes
the index (odd while it writes); a reader notes the counter, answers, and keeps the answer
only if the counter has not moved, else asks again, so every answer is one the index gave
between two of decide's writes, as decide's own. The walk is bounds-safe on arrays changing
under it (decide/routers/dynamo_answers.py `prefix_blocks`). When decide replaces an array
(growth), adds a worker or a registration changes, it bumps the layout version; a reader
seeing a new version fetches the layout (the arrays' handles, the workers, the registrations)
from decide before it answers. A reader that finds decide writing for longer than
`_WRITER_BUSY_S` passes the query on to decide instead of waiting.

Readers are forked from decide at its start, sharing its modules and compiled kernels
(`ForkedReader`); they end with decide (the kernel's parent-death signal), and decide starts
a reader again, as a new interpreter, when one dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import attrs
import msgspec
import numpy as np

from kvledger.core.events import WorkerId
from kvledger.runtime.http import HttpFront, HttpLimits, Request, Response, Route
from kvledger.runtime.parent_death import end_with_parent, name_process
from kvledger.runtime.memory import SharedArrayGone, SharedArrays, SharedHandle, map_shared

from kvledger.decide.inventory.index import InventoryIndex
from kvledger.decide.routers.dynamo_indexer import (
    DynamoIndexerApi, DynamoRegistry, Listener, Refusal, Registration, compile_answer_kernels,
)

log = logging.getLogger("kvledger.decide.readers")

LAYOUT_PATH = "/internal/index-layout"
_WRITER_BUSY_S = 0.05  # a reader waits this long for decide to finish a write, then passes the query on
_RESTART_CHECK_S = 1.0
_LAYOUT_RETRY_S = 0.05  # a reader asks decide for its layout this often until decide answers


# --- the layout: what a reader maps, and the registrations it answers for -------------------------


class ArrayLayout(msgspec.Struct, frozen=True):
    pid: int
    fd: int
    name: str
    shape: list[int]
    dtype: str

    def handle(self) -> SharedHandle:
        return SharedHandle(self.pid, self.fd, self.name, tuple(self.shape), self.dtype)


class RankLayout(msgspec.Struct, frozen=True):
    rank: int
    endpoint: str
    replay_endpoint: str | None


class InstanceLayout(msgspec.Struct, frozen=True):
    instance: int
    model_name: str
    routing_group: str
    publisher: str
    ranks: list[RankLayout]


class PartitionLayout(msgspec.Struct, frozen=True):
    model_name: str
    routing_group: str
    block_size: int


class IndexLayout(msgspec.Struct, frozen=True):
    version: int
    table_bits: int
    table_keys: ArrayLayout
    table_rows: ArrayLayout
    holders: ArrayLayout
    spilled: ArrayLayout
    workers: list[tuple[str, int]]  # (publisher, dp_rank) by slot
    instances: list[InstanceLayout]  # in registration order, as decide's answers list them
    partitions: list[PartitionLayout]


_encode_layout = msgspec.json.Encoder().encode
_decode_layout = msgspec.json.Decoder(IndexLayout).decode


def _array_layout(arrays: SharedArrays, array: np.ndarray) -> ArrayLayout:
    handle = arrays.handle(array)
    return ArrayLayout(handle.pid, handle.fd, handle.name, list(handle.shape), handle.dtype)


# --- decide's side ----------------------------------------------------------------------------------


class IndexSharing:
    """decide's half: the index's query arrays in shared memory, the write counter, the layout version."""

    def __init__(self) -> None:
        self.arrays = SharedArrays()
        # [0] the write counter (odd while decide changes the index), [1] the layout version.
        self.control = self.arrays.zeros(2, np.int64)
        self._layout_key: tuple = ()

    def begin_write(self) -> None:
        self.control[0] += 1

    def end_write(self, index: InventoryIndex, registry: DynamoRegistry) -> None:
        self.publish(index, registry)
        self.control[0] += 1

    def publish(self, index: InventoryIndex, registry: DynamoRegistry) -> None:
        """A new layout version when what a reader maps or answers for changed."""
        key = (id(index), id(index.table_keys), id(index.table_rows), id(index.holders), id(index.spilled),
               index.table_bits, len(index.workers), registry.version)
        if key != self._layout_key:
            self._layout_key = key
            self.control[1] += 1

    def layout(self, index: InventoryIndex, registry: DynamoRegistry) -> IndexLayout:
        self.publish(index, registry)
        instances = [
            InstanceLayout(instance, held.partition[0], held.partition[1], held.publisher,
                           [RankLayout(rank, item.endpoint, item.replay_endpoint) for rank, item in held.ranks.items()])
            for instance, held in registry.instances.items()
        ]
        partitions = [PartitionLayout(model, group, size) for (model, group), size in registry.block_sizes.items()]
        return IndexLayout(
            int(self.control[1]), index.table_bits, _array_layout(self.arrays, index.table_keys),
            _array_layout(self.arrays, index.table_rows), _array_layout(self.arrays, index.holders),
            _array_layout(self.arrays, index.spilled), [(worker.publisher, worker.dp_rank) for worker in index.workers],
            instances, partitions,
        )

    def layout_route(self, index: Callable[[], InventoryIndex], registry: DynamoRegistry) -> Route:
        def answer(_: Request) -> Response:
            try:
                return Response(200, _encode_layout(self.layout(index(), registry)), "application/json")
            except ValueError as error:  # an index made before the arrays were shared (replaced at startup)
                return Response.text(503, f"index not shared yet: {error}\n")
        return Route(answer, needs_token=True)


class ReaderProcesses:
    """decide's index readers: started, started again when one dies, stopped with decide."""

    def __init__(self, count: int, *, host: str, port: int, socket_path: str, control: SharedHandle,
                 token: str | None, limits: HttpLimits, max_request_bytes: int, max_query_bytes: int,
                 restarted: Callable[[], object] = lambda: None) -> None:
        self.count = count
        self._restarted = restarted
        # On the reader's stdin, not in its arguments, which every user of the host can read: the token is in it.
        self._config = json.dumps({
            "host": host, "port": port, "socket": socket_path, "parent": os.getpid(), "token": token,
            "control": attrs.asdict(control), "idle_timeout_s": limits.idle_timeout_s,
            "body_timeout_s": limits.body_timeout_s, "max_request_bytes": max_request_bytes,
            "max_query_bytes": max_query_bytes,
        }).encode()
        self.processes: list[ForkedReader | subprocess.Popen] = []
        self.restarts = 0
        self._watcher: asyncio.Task | None = None

    def _start_one(self) -> subprocess.Popen:
        process = subprocess.Popen([sys.executable, "-m", "kvledger.decide.serving.readers"], stdin=subprocess.PIPE)
        process.stdin.write(self._config)
        process.stdin.close()
        return process

    def start(self) -> None:
        """The readers, forked from decide: they share its modules and compiled kernels instead of loading
        their own (`ForkedReader`); one started again after one died is a new interpreter (`_watch`)."""
        config = json.loads(self._config)
        self.processes = [ForkedReader.start(config) for _ in range(self.count)]
        self._watcher = asyncio.create_task(self._watch(), name="decide-index-readers")

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(_RESTART_CHECK_S)
            for number, process in enumerate(self.processes):
                if process.poll() is not None:
                    log.warning("decide: index reader %d (pid %d) ended with %s; starting it again",
                                number, process.pid, process.returncode)
                    self.restarts += 1
                    self._restarted()
                    self.processes[number] = self._start_one()

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + 5
        for process in self.processes:
            try:
                process.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


class ForkedReader:
    """A reader forked from decide, with the part of `subprocess.Popen` that `ReaderProcesses` uses.

    A reader started as a new interpreter loads numpy, numba and the answer kernels again: about 70 MB
    of its own. Forked (decide forks its readers before it loads its index: no index's pages are
    inherited), it shares those pages with decide until one of them writes a page; decide's
    objects are kept out of the reader's garbage collections (`gc.freeze`), which would otherwise
    write to every one of them. The child closes every descriptor it inherited (decide's sockets,
    NATS connection and files stay decide's alone: a connection decide closes must not stay open in a
    reader) and never returns into decide's code: it runs the reader on a loop of its own and leaves
    by `os._exit`. Readers started again after one died are new interpreters (`ReaderProcesses._watch`):
    forked from a decide that has run a while, a reader would keep the old copy of every page decide
    changes afterwards.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    @classmethod
    def start(cls, config: dict) -> ForkedReader:
        gc.freeze()
        try:
            pid = os.fork()
        except BaseException:
            gc.unfreeze()
            raise
        if pid == 0:  # the reader
            code = 1
            try:
                _run_forked(config)
                code = 0
            except SystemExit as exit:  # decide ended before the reader could ask to end with it
                code = exit.code if isinstance(exit.code, int) else 1
            except BaseException:  # everything ends here: nothing may return into decide's frames
                with contextlib.suppress(BaseException):
                    log.exception("index reader: ended by an error")
            finally:
                os._exit(code)
        gc.unfreeze()
        return cls(pid)

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(ChildProcessError):
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid == 0:
                    return None
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"index reader {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode


def _run_forked(config: dict) -> None:
    """The reader, in a child just forked from decide."""
    _end_with_parent(config["parent"])
    os.closerange(3, _highest_descriptor() + 1)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    with contextlib.suppress(ValueError):
        signal.set_wakeup_fd(-1)
    asyncio.events._set_running_loop(None)  # decide's loop, running in the frames below, is not this process's
    loop = _new_loop()
    asyncio.set_event_loop(loop)
    loop.run_until_complete(_serve(config))


def _highest_descriptor() -> int:
    try:
        return max(int(name) for name in os.listdir("/proc/self/fd"))
    except (OSError, ValueError):
        return os.sysconf("SC_OPEN_MAX")


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


def counted(route: Route, count: Callable[[], object]) -> Route:
    """`route`, counting each request it answers."""
    def answer(request: Request) -> Response:
        count()
        return route.handler(request)
    return Route(answer, route.max_body_bytes, needs_token=route.needs_token)


_SOCKET_FOLDER = "kvledger-decide-"


def private_socket_path() -> str:
    """A Unix socket path in a folder only this user reads (the internal front answers with the token only,
    the folder keeps others from even connecting), named after this process; the folders a decide killed
    left behind (its process gone) are removed first."""
    remove_stale_socket_folders()
    return str(Path(tempfile.mkdtemp(prefix=f"{_SOCKET_FOLDER}{os.getpid()}-")) / "index.sock")


def remove_stale_socket_folders(parent: str | None = None) -> list[str]:
    """Remove this user's socket folders whose decide process no longer runs (a `kill -9` leaves its folder:
    nothing ran to remove it); the folders removed. A folder whose process id is running again, by another
    program, is left: it cannot be told apart."""
    parent = parent or tempfile.gettempdir()
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(parent):
            pid_text = entry.name[len(_SOCKET_FOLDER):].partition("-")[0]
            if not (entry.name.startswith(_SOCKET_FOLDER) and pid_text.isdigit()):
                continue
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_uid != os.getuid() or not entry.is_dir(follow_symlinks=False):
                    continue
                if os.path.exists(f"/proc/{pid_text}"):
                    continue
                shutil.rmtree(entry.path)
                removed.append(entry.path)
    return removed


# --- the reader's side ------------------------------------------------------------------------------


@attrs.define
class MappedIndex:
    """What Dynamo's API reads of an index, over arrays decide shares (`IndexLayout`)."""

    table_keys: np.ndarray
    table_rows: np.ndarray
    table_bits: int
    holders: np.ndarray
    spilled: np.ndarray
    workers: list[WorkerId]
    _slots: dict[WorkerId, int]

    @classmethod
    def of(cls, layout: IndexLayout) -> MappedIndex:
        workers = [WorkerId(publisher, rank) for publisher, rank in layout.workers]
        return cls(map_shared(layout.table_keys.handle()), map_shared(layout.table_rows.handle()), layout.table_bits,
                   map_shared(layout.holders.handle()), map_shared(layout.spilled.handle()), workers,
                   {worker: slot for slot, worker in enumerate(workers)})

    def slot(self, worker: WorkerId) -> int | None:
        return self._slots.get(worker)


def read_only_view(index: InventoryIndex) -> MappedIndex:
    """`index`'s query arrays as a reader maps them (read-only, which the kernels compile for apart), so
    that decide loads a reader's kernels before it forks its readers and they share them."""
    def read_only(array: np.ndarray) -> np.ndarray:
        view = array.view()
        view.flags.writeable = False
        return view

    workers = list(index.workers)
    return MappedIndex(read_only(index.table_keys), read_only(index.table_rows), index.table_bits,
                       read_only(index.holders), read_only(index.spilled), workers,
                       {worker: slot for slot, worker in enumerate(workers)})


def registry_of(layout: IndexLayout) -> DynamoRegistry:
    registry = DynamoRegistry()
    for partition in layout.partitions:
        registry.block_sizes[(partition.model_name, partition.routing_group)] = partition.block_size
    for entry in layout.instances:
        registry.instances[entry.instance] = Registration(
            (entry.model_name, entry.routing_group), entry.publisher,
            {rank.rank: Listener(rank.endpoint, rank.replay_endpoint) for rank in entry.ranks})
    registry.version = layout.version
    return registry


def fetch_layout(socket_path: str, token: str | None) -> IndexLayout:
    """decide's layout now, over its Unix socket (blocking: a reader needs it before it can answer)."""
    headers = {"authorization": f"Bearer {token}"} if token is not None else {}
    response = ask_decide(socket_path, Request("GET", LAYOUT_PATH, headers, b""))
    if response.status != 200:
        raise SharedArrayGone(f"decide answered the layout with {response.status}: {response.body[:200]!r}")
    return _decode_layout(response.body)


def ask_decide(socket_path: str, request: Request) -> Response:
    """`request` sent to decide over its Unix socket and answered, blocking (a reader's synchronous routes
    cannot wait: only the layout and the queries decide was too busy for go this way)."""
    head = f"{request.method} {request.path}{'?' + request.query if request.query else ''} HTTP/1.1\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in request.headers.items()
                    if name not in ("host", "connection", "content-length", "transfer-encoding"))
    head += f"Host: decide\r\nContent-Length: {len(request.body)}\r\nConnection: close\r\n\r\n"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.settimeout(10)
        connection.connect(socket_path)
        connection.sendall(head.encode("latin-1") + request.body)
        received = bytearray()
        while chunk := connection.recv(1 << 20):
            received += chunk
    head_bytes, _, body = bytes(received).partition(b"\r\n\r\n")
    lines = head_bytes.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines[1:])}
    return Response(int(lines[0].split()[1]), body, headers.get("content-type", "text/plain; charset=utf-8"))


class IndexReplica:
    """A reader's view of decide's index: the layout it mapped, refreshed when decide's version moves."""

    def __init__(self, control: np.ndarray, fetch: Callable[[], IndexLayout]) -> None:
        self.control = memoryview(control).cast("B").cast("q")  # an item read as a Python int: cheaper than numpy's
        self._fetch = fetch
        self.version = -1
        self.index: MappedIndex | None = None
        self.registry = DynamoRegistry()

    def refresh(self) -> None:
        for _attempt in range(100):
            layout = self._fetch()
            try:
                index = MappedIndex.of(layout)
            except SharedArrayGone:
                continue  # replaced again since decide wrote the layout
            self.index, self.registry, self.version = index, registry_of(layout), layout.version
            return
        raise SharedArrayGone("decide's arrays kept changing while they were mapped")

    def answer(self, answer: Callable[[], Response]) -> Response | None:
        """`answer()` given between two of decide's writes, or None when decide stayed busy writing."""
        control = self.control
        deadline = None
        while True:
            begin = control[0]
            if not begin & 1:
                if control[1] != self.version:
                    self.refresh()
                    continue
                response = answer()
                if control[0] == begin:
                    return response
            now = time.monotonic()
            if deadline is None:
                deadline = now + _WRITER_BUSY_S
            elif now > deadline:
                return None
            os.sched_yield()  # on a machine with few cores, let decide finish its write


class ReaderApi:
    """The routes of one index reader: queries answered here, the rest passed on to decide."""

    def __init__(self, replica: IndexReplica, socket_path: str) -> None:
        self.replica = replica
        self.api = DynamoIndexerApi(lambda: replica.index)
        self._socket_path = socket_path
        self._session: aiohttp.ClientSession | None = None

    def routes(self, *, max_request_bytes: int, max_query_bytes: int) -> dict[tuple[str, str], Route]:
        routes = {key: Route(self.pass_on, route.max_body_bytes, needs_token=route.needs_token)
                  for key, route in self.api.routes(max_request_bytes=max_request_bytes,
                                                    max_query_bytes=max_query_bytes).items()}
        for path, handler in (("/query", self.api.query), ("/query_by_hash", self.api.query_by_hash)):
            routes[("POST", path)] = Route(self._local(handler), max_query_bytes, needs_token=True)
        routes[("GET", "/health")] = Route(lambda _: Response(200, b""))
        return routes

    def _local(self, handler: Callable[[Request], Response]) -> Callable[[Request], Response]:
        def answer(request: Request) -> Response:
            def once() -> Response:
                self.api.registry = self.replica.registry
                try:
                    return handler(request)
                except Refusal as refusal:
                    return refusal.response
            try:
                response = self.replica.answer(once)
            except (SharedArrayGone, OSError) as error:
                log.warning("index reader: decide's layout unreadable (%s); passing the query on", error)
                response = None
            return response if response is not None else ask_decide(self._socket_path, request)
        return answer

    async def pass_on(self, request: Request) -> Response:
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=self._socket_path))
        url = f"http://decide{request.path}" + (f"?{request.query}" if request.query else "")
        headers = {name: value for name, value in request.headers.items()
                   if name not in ("host", "connection", "content-length", "transfer-encoding")}
        async with self._session.request(request.method, url, data=request.body, headers=headers) as response:
            return Response(response.status, await response.read(),
                            response.headers.get("Content-Type", "text/plain; charset=utf-8"))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


READER_NAME = b"kvledger-reader"  # the process's name (/proc/PID/comm, `ps -o comm`), forked or not


def _end_with_parent(parent: int) -> None:
    """SIGTERM to this process when its parent (decide) ends, even by SIGKILL; and the reader's name."""
    name_process(READER_NAME)
    if not end_with_parent(signal.SIGTERM, parent):  # decide ended before the signal was asked for
        raise SystemExit(0)


async def _serve(config: dict) -> None:
    token = config["token"]
    control = map_shared(SharedHandle(**{**config["control"], "shape": tuple(config["control"]["shape"])}))
    replica = IndexReplica(control, lambda: fetch_layout(config["socket"], token))
    api = ReaderApi(replica, config["socket"])
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    # Listening once decide answers: decide forks its readers before it has loaded its index.
    while not stop.is_set():
        try:
            replica.refresh()
            break
        except (SharedArrayGone, OSError):
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), _LAYOUT_RETRY_S)
    if stop.is_set():
        await api.close()
        return
    compile_answer_kernels(replica.index)
    limits = HttpLimits(idle_timeout_s=config["idle_timeout_s"], body_timeout_s=config["body_timeout_s"])
    front = await HttpFront(api.routes(max_request_bytes=config["max_request_bytes"],
                                       max_query_bytes=config["max_query_bytes"]),
                            config["host"], config["port"], limits=limits, token=token, reuse_port=True).start()
    try:
        await stop.wait()
    finally:
        await front.close()
        await api.close()


def main() -> int:
    config = json.loads(sys.stdin.buffer.read())  # ReaderProcesses writes it and closes the pipe
    _end_with_parent(config["parent"])
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    asyncio.run(_serve(config))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
