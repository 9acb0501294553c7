"""decide's gRPC front (SGLang's MatchExternalKv) under concurrent clients, against a bare gRPC responder.

    python bench/grpc_front.py [--clients 1,8] [--seconds 3] [--workers 16] [--blocks 64] [--prefix]

A server process holds an index of `--workers` SGLang workers, each holding a random
prefix (on HBM, DRAM or SSD) of one `--blocks`-page request, and serves it through
`decide.routers.grpc_front.GrpcFront`. N clients in this process, one channel each, ask
`MatchExternalKv` (with `--prefix`, `MatchExternalKvPrefix`, what SGLang's router asks)
with the request's `--blocks` hashes, one call at a time, for a fixed time. The yardstick, measured in the same run with the same clients: a bare grpc.aio
responder in its own process answering the same method with a fixed, already serialised
answer of the same size, without parsing the request. Printed per concurrency: calls/s,
p50 and p99 of both, and the ratio of the rates.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import multiprocessing
import random
import statistics
import sys
import time
from pathlib import Path

import grpc
import grpc.aio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvledger.decide.routers.protos import kv_indexer_pb2 as pb  # noqa: E402

PAGE = 16


def sglang_hashes(tokens: list[int]) -> list[int]:
    out, prior = [], b""
    for start in range(0, len(tokens), PAGE):
        digest = hashlib.sha256(prior + b"".join(t.to_bytes(4, "little") for t in tokens[start:start + PAGE])).digest()
        out.append(int.from_bytes(digest[:8], "big", signed=True))
        prior = digest
    return out


def request_tokens(blocks: int) -> list[int]:
    rng = random.Random(7)
    return [rng.randrange(1, 100_000) for _ in range(blocks * PAGE)]


def build_index(workers: int, blocks: int):
    from kvledger.decide.inventory.index import InventoryIndex
    from kvledger.core.events import EventBatch, Provenance, Stored, Tier, WorkerId
    from kvledger.core.hashing import local_block_hashes

    tokens = request_tokens(blocks)
    engines = [h % (1 << 64) for h in sglang_hashes(tokens)]
    local = local_block_hashes(tokens, PAGE)
    rng = random.Random(11)
    index = InventoryIndex()
    for number in range(workers):
        end = rng.randint(1, blocks)
        tier = rng.choice([Tier.DEVICE, Tier.HOST, Tier.DISK])
        event = Stored(tier, tuple(engines[:end]), None, PAGE, tuple(local[:end]))
        index.apply(EventBatch(WorkerId(f"sgl-{number}"), 0, 0, 1.0, 1.0, Provenance.NATIVE, (event,)), number + 1)
    return index


def serve_front(port: multiprocessing.Value, ready: multiprocessing.Event, workers: int, blocks: int) -> None:
    async def main() -> None:
        from kvledger.decide.routers.grpc_front import GrpcFront, RouterSettings
        from kvledger.decide.metrics import DecideMetrics

        index = build_index(workers, blocks)
        routers = RouterSettings({f"sgl-{n}": f"http://10.0.0.{n}:30000" for n in range(workers)})
        async with GrpcFront(lambda: index, DecideMetrics(), "127.0.0.1:0", routers=routers) as front:
            port.value = front.port
            ready.set()
            await asyncio.Event().wait()

    asyncio.run(main())


def serve_bare(port: multiprocessing.Value, ready: multiprocessing.Event, method: str, answer: bytes) -> None:
    async def main() -> None:
        async def handle(raw: bytes, context) -> bytes:
            return answer

        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "kv_indexer.v1.KVIndexer", {method: grpc.unary_unary_rpc_method_handler(handle)}),))
        port.value = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ready.set()
        await server.wait_for_termination()

    asyncio.run(main())


async def measure(port: int, method: str, clients: int, seconds: float,
                  request: bytes) -> tuple[float, float, float, bytes]:
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for _ in range(clients)]
    calls = [channel.unary_unary(f"/kv_indexer.v1.KVIndexer/{method}") for channel in channels]
    last = b""
    for call in calls:  # connected and warm before the clock starts
        last = await call(request)
    latencies: list[float] = []
    stop = time.perf_counter() + seconds

    async def client(call) -> None:
        while (started := time.perf_counter()) < stop:
            await call(request)
            latencies.append(time.perf_counter() - started)

    began = time.perf_counter()
    await asyncio.gather(*(client(call) for call in calls))
    elapsed = time.perf_counter() - began
    for channel in channels:
        await channel.close()
    latencies.sort()
    return (len(latencies) / elapsed, statistics.median(latencies) * 1e3,
            latencies[int(len(latencies) * 0.99)] * 1e3, last)


def start(target, *args) -> tuple[multiprocessing.Process, int]:
    port, ready = multiprocessing.Value("i", 0), multiprocessing.Event()
    process = multiprocessing.Process(target=target, args=(port, ready, *args), daemon=True)
    process.start()
    if not ready.wait(120):
        raise RuntimeError(f"{target.__name__} did not start")
    return process, port.value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="1,8")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--prefix", action="store_true", help="ask MatchExternalKvPrefix instead")
    args = parser.parse_args()
    method, kind, answer_kind = (
        ("MatchExternalKvPrefix", pb.MatchExternalKvPrefixRequest, pb.MatchExternalKvPrefixResponse) if args.prefix
        else ("MatchExternalKv", pb.MatchExternalKvRequest, pb.MatchExternalKvResponse))
    raw = kind(hashes=[str(h) for h in sglang_hashes(request_tokens(args.blocks))]).SerializeToString()

    front, front_port = start(serve_front, args.workers, args.blocks)
    answer = asyncio.run(measure(front_port, method, 1, 0.2, raw))[3]
    matched = answer_kind.FromString(answer)
    bare, bare_port = start(serve_bare, method, answer)
    print(f"{method}: {args.blocks} hashes, {args.workers} workers, {len(matched.matches)} matched, "
          f"answer {len(answer)} bytes")
    print(f"{'clients':>7} {'front q/s':>10} {'p50 ms':>7} {'p99 ms':>7} {'bare q/s':>10} {'p50 ms':>7} "
          f"{'p99 ms':>7} {'front/bare':>10}")
    try:
        for clients in (int(value) for value in args.clients.split(",")):
            rate, p50, p99, _ = asyncio.run(measure(front_port, method, clients, args.seconds, raw))
            bare_rate, bare_p50, bare_p99, _ = asyncio.run(measure(bare_port, method, clients, args.seconds, raw))
            print(f"{clients:>7} {rate:>10.0f} {p50:>7.3f} {p99:>7.3f} {bare_rate:>10.0f} {bare_p50:>7.3f} "
                  f"{bare_p99:>7.3f} {rate / bare_rate:>10.2f}")
    finally:
        for process in (front, bare):
            process.terminate()
            process.join(10)


if __name__ == "__main__":
    main()
