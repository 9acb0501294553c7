"""The decision service under concurrent single requests, against a bare NATS responder.

    python bench/decide_concurrency.py [--clients 1,8,64] [--seconds 5] [--window-us 0] [--compare-raw] [--cold-start]

`kvledger decide` runs in its own process on an embedded nats-server (empty inventory, so
the figures are the service's own cost: parsing, ranking, JSON, the KV_DECISIONS record
and its ack). N clients in this process each send single requests of 8 blocks (token
ids) to `kvledger.decide` through `kvledger.client.DecideClient`, one at a time, for a
fixed time. The yardstick, measured in the same run with bare nats-py requests from the
same number of connections: a bare nats-py responder in its own process replying a fixed
body. Printed per concurrency: requests/s, p50 and p99, and the ratios of the rates and of
the p50s. DecideClient takes its answers' records' acks from JetStream itself, so an
answer counts only once it is on record. The ratios charge kvledger with its client's
cost (a typed request encoded, the answer decoded into typed values, the ack read);
`--compare-raw` also asks decide with bare nats-py requests, whose replies decide sends
only after it saw their records acknowledged, and prints the two side by side. Afterwards every answer the clients got is looked up in KV_DECISIONS.
`--cold-start` first measures the time from starting `kvledger decide` to its first
answer, once with an empty kernel cache and once with the cache that left.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import nats

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvledger.client import DecideClient, DecideRequest, RetryPolicy  # noqa: E402
from kvledger.core.settings import StreamSettings  # noqa: E402
from kvledger.runtime.embedded import EmbeddedNats  # noqa: E402
from kvledger.runtime.streams import DECIDE_SUBJECT, DECISIONS_SUBJECT, message_ids  # noqa: E402

BLOCK_SIZE = 16
BARE_SUBJECT = "bench.bare"
_BARE_RESPONDER = f"""
import asyncio, sys, nats
async def main():
    nc = await nats.connect(sys.argv[1])
    async def reply(msg):
        await msg.respond(b'{{"request_id": "x", "credited_blocks": 0}}')
    await nc.subscribe("{BARE_SUBJECT}", cb=reply)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


def tokens(client: int, number: int) -> list[int]:
    return [(client * 7919 + number * 31 + i) % 32000 for i in range(8 * BLOCK_SIZE)]


def body(client: int, number: int, prefix: str = "c") -> bytes:
    return json.dumps({"request_id": f"{prefix}{client}-{number}", "token_ids": tokens(client, number),
                       "block_size": BLOCK_SIZE}).encode()


async def load(url: str, subject: str, clients: int, seconds: float, prefix: str = "c") -> tuple[float, list[float]]:
    """Bare nats-py requests (the yardstick's clients): `clients` loops over up to 8 connections."""
    connections = [await nats.connect(url) for _ in range(min(clients, 8))]
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def client(number: int) -> None:
        nc = connections[number % len(connections)]
        sent = 0
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            await nc.request(subject, body(number, sent, prefix), timeout=30)
            latencies.append(time.perf_counter() - started)
            sent += 1

    started = time.perf_counter()
    await asyncio.gather(*(client(number) for number in range(clients)))
    elapsed = time.perf_counter() - started
    for nc in connections:
        await nc.close()
    return len(latencies) / elapsed, latencies


async def load_with_client(url: str, clients: int, seconds: float, answered: set[str]) -> tuple[float, list[float]]:
    """As `load`, through DecideClient (one per connection), adding each answer's request id to `answered`."""
    decide_clients = [await DecideClient.connect_nats(url, timeout=timedelta(seconds=30)) for _ in range(min(clients, 8))]
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def client(number: int) -> None:
        decide_client = decide_clients[number % len(decide_clients)]
        sent = 0
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            answer = await decide_client.decide(DecideRequest(token_ids=tokens(number, sent), block_size=BLOCK_SIZE))
            latencies.append(time.perf_counter() - started)
            answered.add(answer.request_id)
            sent += 1

    started = time.perf_counter()
    await asyncio.gather(*(client(number) for number in range(clients)))
    elapsed = time.perf_counter() - started
    for decide_client in decide_clients:
        await decide_client.close()
    return len(latencies) / elapsed, latencies


async def recorded_ids(url: str, stream: str) -> set[str]:
    """The Nats-Msg-Id of every answer in KV_DECISIONS."""
    async with await nats.connect(url) as nc:
        return set(await message_ids(nc.jetstream(), stream, DECISIONS_SUBJECT))


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=1000)[int(q * 1000) - 1] * 1000 if len(values) > 1 else float("nan")


async def wait_for_decide(url: str, request_id: str = "probe") -> None:
    """Until decide answers: no responders, 0.05 s apart, while it starts (five minutes at most)."""
    patience = RetryPolicy(attempts=6000, first_backoff=timedelta(seconds=0.05), max_backoff=timedelta(seconds=0.05),
                           jitter=0.0)
    async with await DecideClient.connect_nats(url, timeout=timedelta(seconds=1), retry=patience) as client:
        await client.decide(DecideRequest(request_id=request_id, token_ids=tokens(0, 0), block_size=BLOCK_SIZE))


def start_decide(url: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvledger.app.cli", "decide", "--nats", url], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def cold_starts(url: str, env: dict[str, str]) -> list[tuple[str, float]]:
    """Seconds from starting `kvledger decide` to its first answer: with an empty kernel
    cache (the kernels compile), then with the cache that start left (they load)."""
    figures = []
    with tempfile.TemporaryDirectory() as cache:
        for number, label in enumerate(("kernels compiled (empty cache)", "kernels loaded from the cache")):
            started = time.perf_counter()
            decide = start_decide(url, {**env, "NUMBA_CACHE_DIR": cache})
            try:
                await wait_for_decide(url, request_id=f"cold-start-{number}")
                figures.append((label, time.perf_counter() - started))
            finally:
                decide.terminate()
                decide.wait(10)
    return figures


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="1,8,64")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--window-us", type=float, default=0.0, help="decide.batch_window_us for the service")
    parser.add_argument("--compare-raw", action="store_true",
                        help="also ask decide with bare nats-py requests, to show what DecideClient costs")
    parser.add_argument("--cold-start", action="store_true",
                        help="first measure decide's cold start: process start to first answer, kernels compiled "
                             "and kernels cached")
    args = parser.parse_args()
    levels = [int(level) for level in args.clients.split(",")]

    with tempfile.TemporaryDirectory() as store, EmbeddedNats(store) as server:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVLEDGER_")}
        env.update(KVLEDGER_DECIDE_HTTP_PORT="0", KVLEDGER_DECIDE_BACKEND="cpu",
                   KVLEDGER_DECIDE_BATCH_WINDOW_US=str(args.window_us))
        if args.cold_start:
            for label, seconds in await cold_starts(server.url, env):
                print(f"first answer {seconds:.2f} s after `kvledger decide` started: {label}")
            print()
        decide = start_decide(server.url, env)
        bare = subprocess.Popen([sys.executable, "-c", _BARE_RESPONDER, server.url], stdout=subprocess.PIPE)
        try:
            bare.stdout.readline()
            await wait_for_decide(server.url)
            print(f"single requests of 8 blocks (token ids), {args.seconds:g} s per level; "
                  f"decide.batch_window_us = {args.window_us:g}")
            print("| clients | kvledger decide | bare nats-py responder | rate ratio | p50 ratio |")
            print("|---|---|---|---|---|")
            answered: set[str] = set()
            client_rates = {}
            for clients in levels:
                rate, latencies = await load_with_client(server.url, clients, args.seconds, answered)
                bare_rate, bare_latencies = await load(server.url, BARE_SUBJECT, clients, args.seconds)
                client_rates[clients] = rate, latencies
                print(f"| {clients} | {rate:,.0f} req/s, p50 {percentile(latencies, 0.5):.2f} ms, "
                      f"p99 {percentile(latencies, 0.99):.2f} ms | {bare_rate:,.0f} req/s, "
                      f"p50 {percentile(bare_latencies, 0.5):.2f} ms, p99 {percentile(bare_latencies, 0.99):.2f} ms "
                      f"| {rate / bare_rate:.2f} | {percentile(latencies, 0.5) / percentile(bare_latencies, 0.5):.2f} |")
            if args.compare_raw:
                print("\nwhat DecideClient costs: the same load as bare nats-py requests to kvledger.decide")
                print("| clients | decide, bare nats-py requests | DecideClient / bare requests |")
                print("|---|---|---|")
                for clients in levels:
                    raw_rate, raw_latencies = await load(server.url, DECIDE_SUBJECT, clients, args.seconds,
                                                         prefix=f"raw{clients}-")
                    rate, latencies = client_rates[clients]
                    print(f"| {clients} | {raw_rate:,.0f} req/s, p50 {percentile(raw_latencies, 0.5):.2f} ms, "
                          f"p99 {percentile(raw_latencies, 0.99):.2f} ms | {rate / raw_rate:.2f} |")
            missing = answered - await recorded_ids(server.url, StreamSettings().decisions_stream)
            if missing:
                raise SystemExit(f"{len(missing)} of {len(answered)} answers are not in KV_DECISIONS, e.g. "
                                 f"{sorted(missing)[:3]}")
            print(f"\nevery one of the {len(answered):,} answers DecideClient got is on record in KV_DECISIONS")
        finally:
            for process in (decide, bare):
                process.terminate()
                process.wait(10)


if __name__ == "__main__":
    asyncio.run(main())
