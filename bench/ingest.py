"""Ingest throughput and latency, against raw JetStream `publish_async` on the same server.

    python bench/ingest.py [--batches 40000] [--latency-batches 10000] [--decode-batches 5000]
                           [--sync-rounds 3] [--sync-policies always,100ms,1s,default] [--sync-only]

A simulated engine in its own process publishes batches of 16 stored blocks × 16 tokens
plus 16 removals over real ZMQ; ingest (this process) bridges them into JetStream and we
count acknowledged batches. The yardstick, measured in the same run on the same embedded
nats-server: publishing the very canonical payloads ingest produced with `publish_async`
and the same in-flight window. Then the engine is paced at half of ingest's maximum rate
and every engine-send → JetStream-ack latency is recorded.

Then decoding alone for what current engines send (docs/ingest.md): the plain batch, a
hybrid model's two groups, per-block extra keys (an image and a salt), and offload
placeholders beside the GPU store; each against msgspec's untyped decode of the same bytes.
These first parts run on nats-server's own sync policy (fsync every 2 minutes).

Last, JetStream's sync policies (`nats.embedded_sync_interval`, docs/operations.md,
"Durability"): in each round every policy in turn, the order rotated from round to round,
gets a fresh server (its /varz checked) in a store dir on `--store-root`'s disk, ingest at
full speed, then the engine paced at one rate for all (`--sync-latency-rate`) for the ack
latency. Each figure is set against nats-server's default in the same round, and the ratio
printed is the median of the rounds' ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import re
import socket
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import msgspec
import nats
from nats.js.api import StorageType, StreamConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvledger.core.events import EventBatch, Provenance, WorkerId, encode_batch  # noqa: E402
from kvledger.core.settings import load_settings  # noqa: E402
from kvledger.ingest.bridge import Bridge  # noqa: E402
from kvledger.ingest.endpoints import StreamSource  # noqa: E402
from kvledger.ingest.wire import decode_payload  # noqa: E402
from kvledger.runtime.embedded import EmbeddedNats  # noqa: E402
from kvledger.sim.engine import SimulatedEngine  # noqa: E402
from kvledger.sim.vllm import VllmBlockRemoved, VllmBlockStored, encode_vllm_batch  # noqa: E402

BLOCKS, TOKENS = 16, 16


def engine_events(index: int) -> list:
    first = index * BLOCKS
    stored = VllmBlockStored(
        tuple(range(first, first + BLOCKS)), first - 1 if index else None,
        tuple((first * TOKENS + t) % 32000 for t in range(BLOCKS * TOKENS)), TOKENS, "GPU",
    )
    if index < 4:
        return [stored]
    old = (index - 4) * BLOCKS
    return [stored, VllmBlockRemoved(tuple(range(old, old + BLOCKS)))]


def run_engine(pub: str, replay: str, batches: int, rate: float, go, done) -> None:
    """The engine process: pre-encodes at full speed, or encodes at send time when paced."""

    async def main() -> None:
        async with SimulatedEngine(pub, replay, buffer_steps=batches + 10) as engine:
            payloads = [engine.encode(engine_events(i)) for i in range(batches)] if rate <= 0 else []
            go.wait()
            if rate <= 0:
                for payload in payloads:
                    await engine.publish_payload(payload)
            else:
                start = time.perf_counter()
                for i in range(batches):
                    delay = start + i / rate - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    await engine.publish(engine_events(i))
            done.wait()

    asyncio.run(main())


async def count_in_stream(url: str, stream: str) -> int:
    nc = await nats.connect(url)
    try:
        return (await nc.jetstream().stream_info(stream)).state.messages
    finally:
        await nc.close()


async def raw_publish_rate(url: str, payloads: list[tuple[str, bytes, str]], window: int) -> float:
    """The yardstick: publish_async of ready canonical payloads, `window` in flight, all acked."""
    nc = await nats.connect(url)
    js = nc.jetstream(publish_async_max_pending=window)
    await js.add_stream(StreamConfig(name="RAW", subjects=["raw.>"], storage=StorageType.FILE, duplicate_window=120))
    start = time.perf_counter()
    futures = [await js.publish_async("raw." + subject, payload, headers={"Nats-Msg-Id": msg_id}) for subject, payload, msg_id in payloads]
    await asyncio.gather(*futures)
    elapsed = time.perf_counter() - start
    await nc.close()
    return len(payloads) / elapsed


def free_ports(count: int) -> list[int]:
    """Ports nothing listens on now (fixed ones collided with other work's ephemeral ports)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


async def run_ingest(url: str, batches: int, rate: float) -> tuple[float, list[float]]:
    port, replay_port = free_ports(2)
    pub, replay = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}"
    context = multiprocessing.get_context("spawn")
    go, done = context.Event(), context.Event()
    engine = context.Process(target=run_engine, args=(pub, replay, batches, rate, go, done), daemon=True)
    engine.start()
    settings = load_settings(environ={}, overrides={"nats.url": url, "ingest.http_port": 0}).settings
    latencies: list[float] = []
    worker = WorkerId(f"bench-{port}")
    try:
        async with Bridge(settings, [StreamSource(worker, pub, replay, Provenance.NATIVE)]) as bridge:
            bridge.ack_observer = latencies.append
            await bridge.wait_ready(timeout=30)
            start = time.perf_counter()
            go.set()
            while bridge.publisher.counters.published < batches:
                await asyncio.sleep(0.01)
            elapsed = time.perf_counter() - start
    finally:
        done.set()
        engine.join(10)
    return batches / elapsed, latencies


def engine_variants(index: int) -> dict[str, bytes]:
    """One batch of `engine_events(index)` as each engine feature sends it, in vLLM's wire form."""
    plain = [event.as_wire() for event in engine_events(index)]
    stored = plain[0]
    hybrid = [
        {**stored, "kv_cache_spec_kind": "full_attention"},
        {**stored, "group_idx": 1, "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 64},
        *plain[1:],
    ]
    image = "%064x" % (index + 1)
    keys = [[[image, 16 * (8 - block)]] if block < 8 else None for block in range(BLOCKS)]
    keys[0] = [*(keys[0] or []), "tenant-a"] if stored["parent_block_hash"] is None else keys[0]
    extra = [{**stored, "extra_keys": keys}, *plain[1:]]
    placeholder = {**stored, "token_ids": [], "block_size": 0, "medium": "CPU", "parent_block_hash": None}
    offload = [stored, placeholder, *plain[1:]]
    return {
        name: msgspec.msgpack.encode([1.0, events, 0])
        for name, events in (("plain", plain), ("hybrid", hybrid), ("extra keys", extra), ("offload", offload))
    }


def decode_figures(batches: int) -> list[tuple[str, float, float]]:
    """(variant, µs per batch decoded, µs per batch for msgspec's untyped decode of the same bytes)."""
    payloads = [engine_variants(i) for i in range(batches)]
    figures = []
    for name in payloads[0]:
        variant = [payload[name] for payload in payloads]
        timings = []
        for decode in (decode_payload, msgspec.msgpack.decode):
            start = time.perf_counter()
            for payload in variant:
                decode(payload)
            timings.append((time.perf_counter() - start) / batches * 1e6)
        figures.append((name, *timings))
    return figures


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=1000)[int(q * 1000) - 1] if len(values) > 1 else float("nan")


_UNIT_NS = {"ms": 10**6, "s": 10**9, "m": 60 * 10**9, "h": 3600 * 10**9}


def check_sync_policy(server: EmbeddedNats, policy: str) -> None:
    """Refuse to measure a server whose /varz does not show the policy asked for."""
    with urllib.request.urlopen(f"http://{server.host}:{server.monitor_port}/varz", timeout=10) as response:
        config = msgspec.json.decode(response.read())["jetstream"]["config"]
    if policy in ("always", "default"):
        expected = (120 * 10**9, policy == "always")
    else:
        number, unit = re.fullmatch(r"([0-9.]+)([a-z]+)", policy).groups()
        expected = (round(float(number) * _UNIT_NS[unit]), False)
    found = (config["sync_interval"], config.get("sync_always", False))
    if found != expected:
        raise SystemExit(f"nats-server started for sync policy {policy!r} reports (sync_interval, sync_always) {found}")


async def policy_run(
    policy: str, store_root: str | None, batches: int, latency_batches: int, rate: float,
) -> tuple[float, list[float]]:
    """Ingest's full-speed rate and its paced ack latencies (ms) on a fresh server syncing by `policy`."""
    with tempfile.TemporaryDirectory(dir=store_root) as store, \
            EmbeddedNats(store, sync_interval=policy, monitor_port=-1) as server:
        check_sync_policy(server, policy)
        ingest_rate, _ = await run_ingest(server.url, batches, 0)
        _, latencies = await run_ingest(server.url, latency_batches, rate)
    return ingest_rate, [value * 1000 for value in latencies]


async def sync_policy_figures(args: argparse.Namespace) -> None:
    policies = args.sync_policies.split(",")
    if "default" not in policies:
        raise SystemExit("--sync-policies must include 'default', the yardstick")
    runs: dict[str, list[tuple[float, float, float]]] = {policy: [] for policy in policies}
    print(
        f"JetStream sync policies, {args.sync_rounds} rounds, each policy in turn (order rotated per round), "
        f"store on {args.store_root or tempfile.gettempdir()}: ingest at full speed, {args.batches} batches; "
        f"ack latency (engine send -> JetStream ack) at {args.sync_latency_rate:.0f} batches/s, "
        f"{args.sync_latency_batches} batches"
    )
    for round_ in range(args.sync_rounds):
        shift = round_ % len(policies)
        for policy in policies[shift:] + policies[:shift]:
            rate, ms = await policy_run(
                policy, args.store_root, args.batches, args.sync_latency_batches, args.sync_latency_rate,
            )
            runs[policy].append((rate, percentile(ms, 0.50), percentile(ms, 0.99)))
            print(
                f"  round {round_ + 1} {policy:>8}: ingest {rate:8.0f} batches/s   "
                f"ack p50 {runs[policy][-1][1]:6.2f} ms  p99 {runs[policy][-1][2]:7.2f} ms"
            )
    default = runs["default"]
    print("policy    ingest batches/s (median, range)   ack p50 ms  ack p99 ms   against default: ingest  p50    p99")
    for policy in policies:
        mine = runs[policy]
        ratios = [statistics.median(a[i] / b[i] for a, b in zip(mine, default)) for i in range(3)]
        rates = [run[0] for run in mine]
        print(
            f"{policy:>8}  {statistics.median(rates):8.0f} ({min(rates):6.0f}-{max(rates):6.0f})"
            f"        {statistics.median(run[1] for run in mine):6.2f}      {statistics.median(run[2] for run in mine):7.2f}"
            f"                {ratios[0]:5.2f} x {ratios[1]:5.2f} x {ratios[2]:5.2f} x"
        )


async def yardstick_and_decode_figures(args: argparse.Namespace) -> None:
    """Ingest against raw publish_async, its latency at half its rate, and decoding alone (the module's first parts)."""
    # The canonical payloads ingest will produce, for the yardstick.
    worker = WorkerId("raw")
    canonical = []
    for i in range(args.batches):
        decoded = decode_payload(encode_vllm_batch(time.time(), engine_events(i), 0))
        batch = EventBatch(worker, 0, i, decoded.engine_ts, time.time(), Provenance.NATIVE, decoded.events)
        canonical.append((batch.subject, encode_batch(batch), batch.msg_id))

    with tempfile.TemporaryDirectory() as store, EmbeddedNats(store) as server:
        raw_rate = await raw_publish_rate(server.url, canonical, args.window)
        ingest_rate, _ = await run_ingest(server.url, args.batches, 0)
        paced = ingest_rate / 2
        _, latencies = await run_ingest(server.url, args.latency_batches, paced)

    ms = [value * 1000 for value in latencies]
    print(f"engine batches: {BLOCKS} stored blocks x {TOKENS} tokens + {BLOCKS} removals; window {args.window}")
    print(f"raw publish_async (yardstick): {raw_rate:10.0f} batches/s  {raw_rate * BLOCKS:12.0f} blocks/s")
    print(f"ingest (ZMQ -> JetStream acked): {ingest_rate:8.0f} batches/s  {ingest_rate * BLOCKS:12.0f} blocks/s")
    print(f"ratio ingest / raw: {ingest_rate / raw_rate:.2f}  (goal >= 0.70)")
    print(
        f"latency engine send -> JetStream ack at {paced:.0f} batches/s (half of max), {len(ms)} batches: "
        f"p50 {percentile(ms, 0.50):.2f} ms  p99 {percentile(ms, 0.99):.2f} ms"
    )
    print(f"decoding alone, {args.decode_batches} batches each (yardstick: msgspec's untyped decode of the same bytes):")
    for name, decoded_us, untyped_us in decode_figures(args.decode_batches):
        print(f"  {name:<11} {decoded_us:7.1f} us/batch   untyped {untyped_us:6.1f} us   ratio {decoded_us / untyped_us:5.2f}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=40_000)
    parser.add_argument("--latency-batches", type=int, default=10_000)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--decode-batches", type=int, default=5_000)
    parser.add_argument("--sync-rounds", type=int, default=3, help="rounds of the sync-policy comparison (0: none)")
    parser.add_argument("--sync-policies", default="always,100ms,1s,default", help="comma-separated; must include default")
    parser.add_argument("--sync-latency-rate", type=float, default=2_000, help="engine pace for ack latency, batches/s")
    parser.add_argument("--sync-latency-batches", type=int, default=4_000)
    parser.add_argument("--store-root", help="where the servers keep their stores (default: the temp dir); a real disk")
    parser.add_argument("--sync-only", action="store_true", help="only the sync-policy comparison")
    args = parser.parse_args()
    if not args.sync_only:
        await yardstick_and_decode_figures(args)
    if args.sync_rounds > 0:
        await sync_policy_figures(args)


if __name__ == "__main__":
    asyncio.run(main())
