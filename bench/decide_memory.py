"""Memory and update rate of decide's index, beside Dynamo's RadixTree, on the same inventory.

    DYN_LOG=error python bench/decide_memory.py [--residencies 1000000] [--workers 64,1024] [--chain 16]

The inventory: prompts of `--chain` blocks drawn from a shared pool (so workers share
prefixes, as a fleet serving common system prompts does), each worker storing prompts
until the fleet holds `--residencies` (worker, block) residencies on the device tier.
Each side runs in a process of its own and builds its structure from the same stored
events, generated as they are applied so that everything the structure keeps is
counted: decide's `InventoryIndex` (with the `InventoryFold` it owns) from canonical
`EventBatch`es, Dynamo's `RadixTree` from its JSON events. Printed per fleet size: bytes
per residency (the process's resident memory after the build minus before it, over the
residencies), the build's blocks per second, and decide / Dynamo ratios; then, for
decide, the objects the garbage collector tracks, how long one full collection takes, and
the bytes of its arrays (compact records, rows' holders, bitmask rows of rows with many
holders, hash table) per residency. decide's
kernels are compiled (or loaded) before the first reading, as the service does before it
reports ready.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import random
import sys
import time
from pathlib import Path

# Run as a script, this folder would come first on sys.path: the benchmarks are scripts, loaded by
# path where one uses another, and one is named like the standard library (bench/codecs.py).
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]


def resident_bytes() -> int:
    """The process's resident set now (not its peak)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def stored_prompts(residencies: int, workers: int, chain: int, seed: int):
    """(worker number, engine hashes, local hashes) per stored prompt, until `residencies` are held."""
    from kvledger.core.hashing import sequence_hashes

    rng = random.Random(seed)
    pool_size = max(residencies // chain // 4, 1)  # on average each prompt is held by four workers
    held = 0
    worker = 0
    prompts_of = [set() for _ in range(workers)]
    while held < residencies:
        prompt = rng.randrange(pool_size)
        if prompt in prompts_of[worker]:
            continue  # a worker stores a prompt once, so every stored block is a residency
        prompts_of[worker].add(prompt)
        prompt_rng = random.Random(prompt * 7919 + seed)
        local = [prompt_rng.getrandbits(64) for _ in range(chain)]
        yield worker, sequence_hashes(local), local
        held += chain
        worker = (worker + 1) % workers


def build_decide(residencies: int, workers: int, chain: int, seed: int) -> dict[str, float]:
    from kvledger.core.events import EventBatch, Provenance, Stored, Tier, WorkerId

    from kvledger.decide.inventory.index import InventoryIndex

    from kvledger.decide.ranking.cpu import compile_kernels
    from kvledger.core.settings import ReuseSettings

    names = [WorkerId(f"w{number:04d}") for number in range(workers)]
    sequences = [0] * workers
    # The service compiles (or loads) its kernels before it reports ready: not part of the inventory.
    compile_kernels(ReuseSettings())
    gc.collect()
    before = resident_bytes()
    index = InventoryIndex()
    started = time.perf_counter()
    for stream_seq, (worker, engine, local) in enumerate(stored_prompts(residencies, workers, chain, seed), 1):
        batch = EventBatch(names[worker], 0, sequences[worker], 0.0, 0.0, Provenance.NATIVE,
                           (Stored(Tier.DEVICE, tuple(engine), None, 16, tuple(local)),))
        sequences[worker] += 1
        index.apply(batch, stream_seq)
    elapsed = time.perf_counter() - started
    full_collections = gc.get_stats()[2]["collections"]
    collect_started = time.perf_counter()
    gc.collect()
    # What one full collection stalls decide for, with this inventory held.
    collect_ms = (time.perf_counter() - collect_started) * 1e3
    return {"bytes": resident_bytes() - before, "seconds": elapsed, "hashes": index.size, "arrays": index.array_parts(),
            "promoted": index.promoted_count,
            "collect_ms": collect_ms, "tracked": len(gc.get_objects()), "full_collections": full_collections}


def build_dynamo(residencies: int, workers: int, chain: int, seed: int) -> dict[str, float]:
    import dynamo._core

    gc.collect()
    before = resident_bytes()
    tree = dynamo._core.RadixTree()
    started = time.perf_counter()
    for event_id, (worker, engine, local) in enumerate(stored_prompts(residencies, workers, chain, seed), 1):
        event = {"event_id": event_id, "data": {"stored": {"parent_hash": None, "blocks": [
            {"block_hash": block, "tokens_hash": content} for block, content in zip(engine, local)]}}}
        tree.apply_event(worker, json.dumps(event).encode())
    elapsed = time.perf_counter() - started
    gc.collect()
    return {"bytes": resident_bytes() - before, "seconds": elapsed}


def _measured(side: str, residencies: int, workers: int, chain: int, seed: int, connection) -> None:
    build = build_decide if side == "decide" else build_dynamo
    connection.send(build(residencies, workers, chain, seed))


def measure(side: str, residencies: int, workers: int, chain: int, seed: int) -> dict[str, float]:
    """One build in a fresh process, so no other structure shares its memory."""
    parent, child = multiprocessing.Pipe()
    process = multiprocessing.get_context("spawn").Process(
        target=_measured, args=(side, residencies, workers, chain, seed, child))
    process.start()
    result = parent.recv()
    process.join()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--residencies", type=int, default=1_000_000)
    parser.add_argument("--workers", default="64,1024")
    parser.add_argument("--chain", type=int, default=16, help="blocks per stored prompt")
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args(argv)
    print(f"{args.residencies:,} device residencies in prompts of {args.chain} blocks drawn from a shared pool "
          "(each prompt held by about four workers); each side built in its own process\n")
    print("| workers | decide bytes / residency | Dynamo bytes / residency | memory ratio | decide blocks/s "
          "| Dynamo blocks/s | update ratio | decide sequence hashes |")
    print("|---|---|---|---|---|---|---|---|")
    collections = []
    for workers in (int(text) for text in args.workers.split(",")):
        ours = measure("decide", args.residencies, workers, args.chain, args.seed)
        collections.append((workers, ours))
        theirs = measure("dynamo", args.residencies, workers, args.chain, args.seed)
        ours_per, theirs_per = ours["bytes"] / args.residencies, theirs["bytes"] / args.residencies
        ours_rate, theirs_rate = args.residencies / ours["seconds"], args.residencies / theirs["seconds"]
        print(f"| {workers} | {ours_per:,.0f} | {theirs_per:,.0f} | {ours_per / theirs_per:.2f} | {ours_rate:,.0f} "
              f"| {theirs_rate:,.0f} | {ours_rate / theirs_rate:.2f} | {ours['hashes']:,} |")
    print("\nmemory ratio: decide / Dynamo (goal <= 1); update ratio: decide's blocks/s / Dynamo's")
    for workers, ours in collections:
        print(f"decide at {workers} workers: {ours['tracked']:,} objects tracked by the garbage collector after the "
              f"build; one full collection {ours['collect_ms']:.0f} ms; {ours['full_collections']} full collections "
              "during the build")
        shares = ", ".join(f"{name} {size / args.residencies:.0f}" for name, size in ours["arrays"].items())
        print(f"decide at {workers} workers, array bytes per residency: {shares} (the rest: the interpreter's "
              f"objects and the allocator's); {ours['promoted']} workers promoted into the fold")
    return 0


if __name__ == "__main__":
    sys.exit(main())
