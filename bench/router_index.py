"""decide's Dynamo-compatible indexer API beside Dynamo's own indexer, on the same inventory.

    DYN_LOG=error python bench/router_index.py [--workers 8] [--prompts 4000] [--chain 16]
        [--clients 1,8,64] [--seconds 3] [--rounds 2] [--memory] [--restart] [--json]

Both indexers follow the same simulated vLLM engines over ZMQ: Dynamo's
(`python -m dynamo.indexer`, the `ai-dynamo-runtime` wheel, its default threads) subscribes
to each engine itself; kvledger's `kvledger ingest` follows them into an embedded
nats-server and `kvledger decide` folds KV_EVENTS. Each indexer runs as its own process; every
worker is registered with the same `/register` body on both. The inventory: each worker
stores `--prompts` prompts of `--chain` blocks drawn from a shared pool (each prompt held by
four workers on average), on the device tier. Both answer the same questions before the load
(compared, must be equal).

The load: N keep-alive HTTP clients in this process (uvloop, raw sockets, one request in flight
each) ask `POST /query` with the token ids of a pool prompt cut at a random block (so
every answer walks a real prefix), for `--seconds`, at each concurrency; the two servers take
turns, the order alternating from round to round. The yardstick is Dynamo's indexer, measured
in the same run: printed per concurrency are both q/s, p50 and p99 and kvledger / Dynamo.

`--memory`: each process's resident memory after the build and per residency (the build's
growth over the (worker, block) residencies), and no load; without it the memory is printed
again after the load. `--residencies N` sizes the inventory instead of `--prompts`. `--restart`: both processes are killed (SIGKILL) and started again, the
workers registered again, and each is asked what it still knows: kvledger's decide comes back
from KV_EVENTS, Dynamo's indexer from what each engine's replay buffer still holds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Run as a script, this folder would come first on sys.path: the benchmarks are scripts, loaded by
# path where one uses another, and one is named like the standard library (bench/codecs.py).
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp  # noqa: E402
import xxhash  # noqa: E402

from kvledger.runtime.embedded import EmbeddedNats  # noqa: E402
from kvledger.sim.engine import SimulatedEngine  # noqa: E402
from kvledger.sim.vllm import VllmBlockStored  # noqa: E402

BLOCK_SIZE = 16
MODEL = "bench-model"
TOKEN = "bench-token"
MARKER_TOKEN = 4_000_000_000 % (1 << 32)  # token ids no prompt uses


# --- the inventory ---------------------------------------------------------------------------------


def prompt_tokens(prompt: int, chain: int, seed: int) -> list[int]:
    rng = random.Random(prompt * 7919 + seed)
    return [rng.randrange(50_000) for _ in range(chain * BLOCK_SIZE)]


def engine_hashes(tokens: list[int]) -> list[int]:
    """vLLM's block hashes stand-in: a prefix hash per block (same prefix, same hash)."""
    return [xxhash.xxh3_64_intdigest(repr(tokens[: (block + 1) * BLOCK_SIZE]).encode())
            for block in range(len(tokens) // BLOCK_SIZE)]


def held_prompts(workers: int, prompts: int, seed: int) -> tuple[list[list[int]], int]:
    """Each worker's prompts (pool numbers), every prompt held by four workers on average (fewer in a smaller
    fleet); the pool size."""
    pool = max(workers * prompts // 4, prompts)
    rng = random.Random(seed)
    return [rng.sample(range(pool), min(prompts, pool)) for _ in range(workers)], pool


# --- the processes ---------------------------------------------------------------------------------


def resident_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def proportional_bytes(pid: int) -> int:
    """The process's proportional set size: its own pages, and a share of each page it maps with others (the
    index arrays decide shares with its readers count once over them all)."""
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        for line in rollup:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Side:
    """One indexer process, its base URL and how to (re)start it."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], port: int, headers: dict[str, str],
                 health_port: int | None = None) -> None:
        self.name, self.args, self.env, self.port, self.headers = name, args, env, port, headers
        self.base = f"http://127.0.0.1:{port}"
        self.health_base = f"http://127.0.0.1:{health_port or port}"  # decide's own port when readers answer
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(self.args, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()

    @property
    def rss(self) -> int:
        return resident_bytes(self.process.pid)

    def _family(self) -> dict[int, list[str]]:
        """The process and its children (decide's index readers): their /proc stat fields by pid."""
        found = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(entry) == self.process.pid or int(fields[1]) == self.process.pid:
                found[int(entry)] = fields
        return found

    @property
    def cpu_s(self) -> float:
        """User and system CPU the process and its children have used, every thread."""
        return sum(int(fields[11]) + int(fields[12]) for fields in self._family().values()) / os.sysconf("SC_CLK_TCK")

    @property
    def family_pss(self) -> tuple[int, int]:
        """(processes, their proportional set sizes summed): the memory they take together."""
        family = self._family()
        return len(family), sum(proportional_bytes(pid) for pid in family)


async def ask(session: aiohttp.ClientSession, side: Side, method: str, path: str, body: object = None) -> tuple[int, object]:
    async with session.request(method, side.base + path, json=body, headers=side.headers) as reply:
        text = await reply.text()
        return reply.status, json.loads(text) if reply.content_type == "application/json" else text


async def until(check, timeout: float, what: str, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError, OSError):
            if await check():
                return
        await asyncio.sleep(interval)
    raise TimeoutError(f"waited {timeout:g}s for {what}")


# --- the load ----------------------------------------------------------------------------------------


class _Client(asyncio.Protocol):
    """One keep-alive connection sending pre-encoded requests one at a time, timing each answer."""

    def __init__(self, requests: list[bytes], deadline: float, latencies: list[float], done: asyncio.Future) -> None:
        self.requests, self.deadline, self.latencies, self.done = requests, deadline, latencies, done
        self.number = random.randrange(len(requests))
        self.buffer = b""
        self.transport = None
        self.sent_at = 0.0

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.send()

    def send(self) -> None:
        self.number = (self.number + 1) % len(self.requests)
        self.sent_at = time.perf_counter()
        self.transport.write(self.requests[self.number])

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        head_end = self.buffer.find(b"\r\n\r\n")
        if head_end < 0:
            return
        head = self.buffer[:head_end].lower()
        start = head.find(b"content-length:")
        length = int(head[start + 15: head.find(b"\r\n", start) if head.find(b"\r\n", start) > 0 else None])
        if len(self.buffer) < head_end + 4 + length:
            return
        if not head.startswith(b"http/1.1 200"):
            self.done.set_exception(RuntimeError(self.buffer[:300].decode(errors="replace")))
            self.transport.close()
            return
        self.buffer = self.buffer[head_end + 4 + length:]
        now = time.perf_counter()
        self.latencies.append(now - self.sent_at)
        if now < self.deadline:
            self.send()
        else:
            self.transport.close()
            if not self.done.done():
                self.done.set_result(None)

    def connection_lost(self, exc) -> None:
        if not self.done.done():
            self.done.set_exception(exc or ConnectionError("closed by the server"))


def encoded_queries(side: Side, bodies: list[bytes]) -> list[bytes]:
    auth = "".join(f"{name}: {value}\r\n" for name, value in side.headers.items())
    return [(f"POST /query HTTP/1.1\r\nHost: 127.0.0.1:{side.port}\r\nContent-Type: application/json\r\n{auth}"
             f"Content-Length: {len(body)}\r\n\r\n").encode() + body for body in bodies]


async def load(side: Side, bodies: list[bytes], clients: int, seconds: float) -> tuple[float, list[float]]:
    loop = asyncio.get_running_loop()
    requests = encoded_queries(side, bodies)
    latencies: list[float] = []
    started = time.perf_counter()
    deadline = started + seconds
    done = [loop.create_future() for _ in range(clients)]
    for future in done:
        await loop.create_connection(lambda future=future: _Client(requests, deadline, latencies, future), "127.0.0.1", side.port)
    await asyncio.gather(*done)
    return len(latencies) / (time.perf_counter() - started), latencies


def percentile_ms(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=1000)[int(q * 1000) - 1] * 1000 if len(values) > 1 else float("nan")


# --- the run --------------------------------------------------------------------------------------


async def build(args, engines: list[SimulatedEngine], sides: list[Side], session: aiohttp.ClientSession,
                holdings: list[list[int]]) -> int:
    """Register every worker on both, publish the inventory, wait until both hold it; the residencies."""
    kvledger, dynamo = sides

    for number, engine in enumerate(engines):
        body = {"instance_id": number + 1, "endpoint": engine.pub_endpoint, "replay_endpoint": engine.replay_endpoint,
                "model_name": MODEL, "block_size": BLOCK_SIZE, "publisher": f"w{number}"}
        for side in sides:
            status, answer = await ask(session, side, "POST", "/register", body)
            assert status == 201, (side.name, status, answer)
    # Past ZMQ's slow joiner: a marker per worker until Dynamo's subscription has it.
    for number, engine in enumerate(engines):
        await marked(engine, number, sides, session, publish_until_seen=True)
    residencies = 0
    for number, (engine, prompts) in enumerate(zip(engines, holdings)):
        events = []
        for prompt in prompts:
            tokens = prompt_tokens(prompt, args.chain, args.seed)
            events.append(VllmBlockStored(tuple(engine_hashes(tokens)), None, tuple(tokens), BLOCK_SIZE, "GPU"))
            residencies += args.chain
            if len(events) == 8:
                await engine.publish(events)
                events = []
        if events:
            await engine.publish(events)
        await asyncio.sleep(0)
    for number, engine in enumerate(engines):
        await marked(engine, 1000 + number, sides, session, publish_until_seen=False, timeout=600)
    return residencies


async def marked(engine: SimulatedEngine, number: int, sides: list[Side], session: aiohttp.ClientSession, *,
                 publish_until_seen: bool, timeout: float = 60) -> None:
    tokens = [(MARKER_TOKEN - number) % (1 << 32)] * BLOCK_SIZE
    marker = VllmBlockStored((0x7E57_0000_0000 + number,), None, tuple(tokens), BLOCK_SIZE)
    query = {"token_ids": tokens, "model_name": MODEL}
    if not publish_until_seen:
        await engine.publish([marker])

    async def seen() -> bool:
        if publish_until_seen:
            await engine.publish([marker])
        for side in sides:
            status, answer = await ask(session, side, "POST", "/query", query)
            if status != 200 or not answer["instances"]:
                return False
        return True

    await until(seen, timeout, f"marker {number} in both indexers", interval=0.1)


def query_bodies(args, pool: int, count: int) -> list[bytes]:
    rng = random.Random(args.seed + 1)
    bodies = []
    for _ in range(count):
        tokens = prompt_tokens(rng.randrange(pool), args.chain, args.seed)
        cut = rng.randint(1, args.chain) * BLOCK_SIZE
        bodies.append(json.dumps({"token_ids": tokens[:cut] + [7] * rng.randrange(BLOCK_SIZE),
                                  "model_name": MODEL}).encode())
    return bodies


async def same_answers(sides: list[Side], session: aiohttp.ClientSession, bodies: list[bytes]) -> int:
    """Both answer each sample query alike; the tokens matched over them (on kvledger)."""
    matched = 0
    for body in bodies:
        kvledger, dynamo = [await ask(session, side, "POST", "/query", json.loads(body)) for side in sides]
        assert kvledger == dynamo, (kvledger, dynamo)
        matched += sum(item["longest_matched"] for item in kvledger[1]["instances"].values())
    return matched


async def matched_tokens(side: Side, session: aiohttp.ClientSession, bodies: list[bytes]) -> int:
    total = 0
    for body in bodies:
        status, answer = await ask(session, side, "POST", "/query", json.loads(body))
        if status == 200:
            total += sum(item["longest_matched"] for item in answer["instances"].values())
    return total


async def run(args) -> dict:
    report: dict = {"workers": args.workers, "chain": args.chain, "block_size": BLOCK_SIZE}
    with tempfile.TemporaryDirectory() as store, EmbeddedNats(store) as server:
        engines = []
        for _ in range(args.workers):
            engine = SimulatedEngine(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}",
                                     buffer_steps=args.replay_buffer)
            engines.append(await engine.__aenter__())
        env = {name: value for name, value in os.environ.items() if not name.startswith("KVLEDGER_")}
        env.setdefault("DYN_LOG", "error")
        ingest_env = {**env, "KVLEDGER_INGEST_HTTP_PORT": "0"}
        ingest_args = [sys.executable, "-m", "kvledger.app.cli", "ingest", "--nats", server.url]
        for number, engine in enumerate(engines):
            ingest_args += ["--endpoint", f"{engine.pub_endpoint},replay={engine.replay_endpoint}", "--publisher", f"w{number}"]
        decide_port, dynamo_port, readers_port = free_port(), free_port(), free_port()
        decide_env = {**env, "KVLEDGER_DECIDE_HTTP_PORT": str(decide_port), "KVLEDGER_DECIDE_HTTP_HOST": "127.0.0.1",
                      "KVLEDGER_DECIDE_HTTP_TOKEN": TOKEN, "KVLEDGER_DECIDE_BACKEND": "cpu",
                      "KVLEDGER_DECIDE_INDEX_READERS": str(args.readers),
                      "KVLEDGER_DECIDE_INDEX_READERS_PORT": str(readers_port)}
        kvledger = Side("kvledger", [sys.executable, "-m", "kvledger.app.cli", "decide", "--nats", server.url],
                        decide_env, readers_port if args.readers else decide_port, {"Authorization": f"Bearer {TOKEN}"},
                        health_port=decide_port)
        dynamo_args = [sys.executable, "-m", "dynamo.indexer", "--port", str(dynamo_port)]
        if args.dynamo_threads:
            dynamo_args += ["--threads", str(args.dynamo_threads)]
        dynamo = Side("dynamo", dynamo_args, env, dynamo_port, {})
        sides = [kvledger, dynamo]
        ingest = subprocess.Popen(ingest_args, env=ingest_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            async with aiohttp.ClientSession() as session:
                for side in sides:
                    side.start()
                await until(lambda: healthy(session, kvledger, "/readyz"), 300, "decide ready")
                await until(lambda: healthy(session, kvledger, "/health"), 60, "decide's Dynamo API (its readers')")
                await until(lambda: healthy(session, dynamo, "/health"), 60, "Dynamo's indexer")
                rss_before = {side.name: side.rss for side in sides}
                holdings, pool = held_prompts(args.workers, args.prompts, args.seed)
                started = time.perf_counter()
                residencies = await build(args, engines, sides, session, holdings)
                report["residencies"] = residencies
                report["build_s"] = time.perf_counter() - started
                rss_after = {side.name: side.rss for side in sides}
                report["memory"] = {name: {"rss_bytes": rss_after[name], "bytes_per_residency":
                                           (rss_after[name] - rss_before[name]) / residencies} for name in rss_after}
                report["memory"]["ratio_rss"] = rss_after["kvledger"] / rss_after["dynamo"]
                if args.readers:
                    processes, pss = kvledger.family_pss
                    report["memory"]["kvledger"].update(processes=processes, pss_bytes_together=pss)
                    report["memory"]["ratio_pss_together"] = pss / proportional_bytes(dynamo.process.pid)
                bodies = query_bodies(args, pool, args.queries)
                report["matched_tokens"] = await same_answers(sides, session, bodies[: args.compared])
                if not args.memory:
                    report["load"] = await measure(args, sides, bodies)
                    # What the load added: a reader's own pages grow as it answers (buffers, its heap, and the
                    # pages of decide's it wrote to when it was forked from decide).
                    report["memory_after_load"] = {side.name: side.rss for side in sides}
                    if args.readers:
                        report["memory_after_load"]["kvledger_pss_together"] = kvledger.family_pss[1]
                        report["memory_after_load"]["dynamo_pss"] = proportional_bytes(dynamo.process.pid)
                if args.restart:
                    report["restart"] = await restart(args, engines, sides, session, bodies[: args.compared],
                                                      report["matched_tokens"])
        finally:
            for side in sides:
                side.stop()
            ingest.terminate()
            ingest.wait(15)
            for engine in engines:
                await engine.close()
    return report


async def healthy(session: aiohttp.ClientSession, side: Side, path: str) -> bool:
    async with session.get((side.health_base if path == "/readyz" else side.base) + path) as reply:
        return reply.status == 200


async def measure(args, sides: list[Side], bodies: list[bytes]) -> dict:
    results: dict = {}
    for clients in args.clients:
        runs: dict[str, list[tuple[float, list[float]]]] = {side.name: [] for side in sides}
        for round_number in range(args.rounds):
            order = sides if round_number % 2 == 0 else sides[::-1]
            for side in order:
                await load(side, bodies, clients, min(0.5, args.seconds))  # warm the connections' paths
                cpu_before = side.cpu_s
                rate, latencies = await load(side, bodies, clients, args.seconds)
                runs[side.name].append((rate, latencies, (side.cpu_s - cpu_before) / len(latencies)))
        figures = {}
        for name, taken in runs.items():
            latencies = [value for _, values, _ in taken for value in values]
            figures[name] = {"qps": [round(rate) for rate, _, _ in taken],
                             "qps_median": statistics.median(rate for rate, _, _ in taken),
                             "p50_ms": percentile_ms(latencies, 0.5), "p99_ms": percentile_ms(latencies, 0.99),
                             "cpu_us_per_query": statistics.median(cpu for _, _, cpu in taken) * 1e6}
        figures["ratio_qps"] = figures["kvledger"]["qps_median"] / figures["dynamo"]["qps_median"]
        figures["ratio_p50"] = figures["kvledger"]["p50_ms"] / figures["dynamo"]["p50_ms"]
        results[str(clients)] = figures
        print(f"{clients:>3} clients: kvledger {figures['kvledger']['qps_median']:>8.0f} q/s "
              f"p50 {figures['kvledger']['p50_ms']:.3f} p99 {figures['kvledger']['p99_ms']:.3f} ms | "
              f"Dynamo {figures['dynamo']['qps_median']:>8.0f} q/s p50 {figures['dynamo']['p50_ms']:.3f} "
              f"p99 {figures['dynamo']['p99_ms']:.3f} ms | q/s {figures['ratio_qps']:.2f}x, p50 {figures['ratio_p50']:.2f}x | "
              f"CPU/query {figures['kvledger']['cpu_us_per_query']:.0f} vs {figures['dynamo']['cpu_us_per_query']:.0f} us",
              file=sys.stderr, flush=True)
    return results


async def restart(args, engines: list[SimulatedEngine], sides: list[Side], session: aiohttp.ClientSession,
                  bodies: list[bytes], before: int) -> dict:
    """Kill -9 both, start both, register the workers again; what each still answers."""
    kvledger, dynamo = sides
    for side in sides:
        side.kill()
        side.start()
    await until(lambda: healthy(session, kvledger, "/readyz"), 300, "decide ready again")
    await until(lambda: healthy(session, kvledger, "/health"), 60, "decide's Dynamo API again")
    await until(lambda: healthy(session, dynamo, "/health"), 60, "Dynamo's indexer again")
    for number, engine in enumerate(engines):
        body = {"instance_id": number + 1, "endpoint": engine.pub_endpoint, "replay_endpoint": engine.replay_endpoint,
                "model_name": MODEL, "block_size": BLOCK_SIZE, "publisher": f"w{number}"}
        for side in sides:
            await ask(session, side, "POST", "/register", body)
    # One live batch per engine, as traffic would bring: Dynamo's listener asks the engine to
    # replay what it missed from seq 0 (what the engine's buffer still holds).
    for number, engine in enumerate(engines):
        await marked(engine, 2000 + number, sides, session, publish_until_seen=True, timeout=120)
    await asyncio.sleep(1)
    after = {side.name: await matched_tokens(side, session, bodies) for side in sides}
    return {name: {"matched_tokens": value, "kept": value / before if before else float("nan")}
            for name, value in after.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=4000, help="prompts each worker stores")
    parser.add_argument("--residencies", type=int, default=0, help="size the inventory by residencies instead")
    parser.add_argument("--chain", type=int, default=16, help="blocks per prompt")
    parser.add_argument("--clients", default="1,8,64")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--queries", type=int, default=2000, help="distinct query bodies the clients cycle through")
    parser.add_argument("--compared", type=int, default=200, help="queries whose answers are compared first")
    parser.add_argument("--dynamo-threads", type=int, default=0, help="Dynamo's --threads (0: its default)")
    parser.add_argument("--readers", type=int, default=0,
                        help="decide's index reader processes (decide.index_readers); the load goes to their port")
    parser.add_argument("--replay-buffer", type=int, default=10_000, help="batches each engine keeps for replay")
    parser.add_argument("--memory", action="store_true", help="build and report memory only, no load")
    parser.add_argument("--restart", action="store_true", help="kill -9 both, restart, report what each kept")
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    args = parser.parse_args(argv)
    args.clients = [int(value) for value in args.clients.split(",")]
    if args.residencies:
        args.prompts = max(args.residencies // (args.chain * args.workers), 1)
    import uvloop

    report = uvloop.run(run(args))
    if args.json:
        print(json.dumps(report))
    else:
        memory = report["memory"]
        print(f"{report['residencies']} residencies, built in {report['build_s']:.1f} s")
        for name in ("kvledger", "dynamo"):
            print(f"  {name}: RSS {memory[name]['rss_bytes'] / 2**20:.0f} MiB, "
                  f"{memory[name]['bytes_per_residency']:.1f} B per residency")
        print(f"  RSS kvledger / Dynamo {memory['ratio_rss']:.2f}x")
        if "pss_bytes_together" in memory["kvledger"]:
            print(f"  kvledger's {memory['kvledger']['processes']} processes together (decide and its readers, "
                  f"proportional set size): {memory['kvledger']['pss_bytes_together'] / 2**20:.0f} MiB, "
                  f"{memory['ratio_pss_together']:.2f}x Dynamo's")
        if "memory_after_load" in report:
            after = report["memory_after_load"]
            line = f"  after the load: RSS kvledger {after['kvledger'] / 2**20:.0f} MiB, Dynamo {after['dynamo'] / 2**20:.0f} MiB"
            if "kvledger_pss_together" in after:
                line += (f"; kvledger's processes together {after['kvledger_pss_together'] / 2**20:.0f} MiB PSS, "
                         f"{after['kvledger_pss_together'] / after['dynamo_pss']:.2f}x Dynamo's")
            print(line)
        if "restart" in report:
            for name, kept in report["restart"].items():
                print(f"  after kill -9 and restart, {name} answers {kept['kept']:.0%} of the tokens it matched before")
    return 0


if __name__ == "__main__":
    sys.exit(main())
