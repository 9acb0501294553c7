"""The decision service under concurrent single requests, against a bare NATS responder.

    python bench/decide_concurrency.py [--clients 1,8,64] [--seconds 5] [--window-us 0]

`kvledger decide` runs in its own process on an embedded nats-server (empty inventory, so
the figures are the service's own cost: parsing, ranking, JSON, the KV_DECISIONS record
and its ack). N clients in this process each send single requests of 8 blocks (token
ids) to `kvledger.decide`, one at a time, for a fixed time. The yardstick, measured in
the same run with the same clients: a bare nats-py responder in its own process replying
a fixed body. Printed per concurrency: requests/s, p50 and p99, and the ratio.
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
from pathlib import Path

import nats

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvledger.embedded import EmbeddedNats  # noqa: E402
from kvledger.streams import DECIDE_SUBJECT  # noqa: E402

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


def body(client: int, number: int) -> bytes:
    tokens = [(client * 7919 + number * 31 + i) % 32000 for i in range(8 * BLOCK_SIZE)]
    return json.dumps({"request_id": f"c{client}-{number}", "token_ids": tokens, "block_size": BLOCK_SIZE}).encode()


async def load(url: str, subject: str, clients: int, seconds: float) -> tuple[float, list[float]]:
    connections = [await nats.connect(url) for _ in range(min(clients, 8))]
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def client(number: int) -> None:
        nc = connections[number % len(connections)]
        sent = 0
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            await nc.request(subject, body(number, sent), timeout=30)
            latencies.append(time.perf_counter() - started)
            sent += 1

    started = time.perf_counter()
    await asyncio.gather(*(client(number) for number in range(clients)))
    elapsed = time.perf_counter() - started
    for nc in connections:
        await nc.close()
    return len(latencies) / elapsed, latencies


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=1000)[int(q * 1000) - 1] * 1000 if len(values) > 1 else float("nan")


async def wait_for_decide(url: str) -> None:
    nc = await nats.connect(url)
    try:
        for _ in range(600):
            try:
                await nc.request(DECIDE_SUBJECT, body(0, 0), timeout=1)
                return
            except Exception:  # not subscribed yet
                await asyncio.sleep(0.1)
        raise RuntimeError("kvledger decide did not answer")
    finally:
        await nc.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", default="1,8,64")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--window-us", type=float, default=0.0, help="decide.batch_window_us for the service")
    args = parser.parse_args()
    levels = [int(level) for level in args.clients.split(",")]

    with tempfile.TemporaryDirectory() as store, EmbeddedNats(store) as server:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVLEDGER_")}
        env.update(KVLEDGER_DECIDE_HTTP_PORT="0", KVLEDGER_DECIDE_BACKEND="cpu",
                   KVLEDGER_DECIDE_BATCH_WINDOW_US=str(args.window_us))
        decide = subprocess.Popen([sys.executable, "-m", "kvledger.cli", "decide", "--nats", server.url], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        bare = subprocess.Popen([sys.executable, "-c", _BARE_RESPONDER, server.url], stdout=subprocess.PIPE)
        try:
            bare.stdout.readline()
            await wait_for_decide(server.url)
            print(f"single requests of 8 blocks (token ids), {args.seconds:g} s per level; "
                  f"decide.batch_window_us = {args.window_us:g}")
            print("| clients | kvledger decide | bare nats-py responder | ratio |")
            print("|---|---|---|---|")
            for clients in levels:
                rate, latencies = await load(server.url, DECIDE_SUBJECT, clients, args.seconds)
                bare_rate, bare_latencies = await load(server.url, BARE_SUBJECT, clients, args.seconds)
                print(f"| {clients} | {rate:,.0f} req/s, p50 {percentile(latencies, 0.5):.2f} ms, "
                      f"p99 {percentile(latencies, 0.99):.2f} ms | {bare_rate:,.0f} req/s, "
                      f"p50 {percentile(bare_latencies, 0.5):.2f} ms, p99 {percentile(bare_latencies, 0.99):.2f} ms "
                      f"| {rate / bare_rate:.2f} |")
        finally:
            for process in (decide, bare):
                process.terminate()
                process.wait(10)


if __name__ == "__main__":
    asyncio.run(main())
