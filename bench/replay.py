"""Benchmark of `kvledger replay` (kvledger/app/replay.py, decide/ranking/whatif.py) on a finished demo's ledger.

In one run, in turns, from SQL (the demo's ledger.db):

- the replay at decide's speed for one settings file and for a sweep of four (one fold shared),
  whole (SQL reads included) and its engine alone (fold, ranking and judging: decide/ranking/whatif.py);
- the reference it replaced (store/whatif_reference.py's `replay`: the reference model one request at a
  time), unless --no-reference; the two reports are compared to the last float;
- the yardstick: decide's own batched rate (`decide.ranking.cpu.rank_batch`, batches of 64) ranking the
  same requests against decide's index folded from the demo's KV_EVENTS.

    kvledger demo --duration 20 --workers 4 --data-dir /tmp/demo
    python bench/replay.py --data-dir /tmp/demo [--placed] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

import sqlalchemy as sa

# Run as a script, this folder would come first on sys.path: the benchmarks are scripts, loaded by
# path where one uses another, and one is named like the standard library (bench/codecs.py).
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]

from kvledger.app import replay as fast  # noqa: E402
from kvledger.core.settings import ReuseSettings  # noqa: E402
from kvledger.store import whatif_reference as reference  # noqa: E402

SWEEP = (
    ("on", ReuseSettings(enable_decode_to_prefill_reuse=True, enable_decode_to_prefill_gpu_reuse=True)),
    ("on32", ReuseSettings(enable_decode_to_prefill_reuse=True, enable_decode_to_prefill_gpu_reuse=True,
                           minimum_transfer_prefix_blocks=32)),
    ("gpu", ReuseSettings(enable_decode_to_prefill_gpu_reuse=True)),
    ("host-cheap", ReuseSettings(enable_decode_to_prefill_reuse=True, transfer_source_estimated_block_us=10.0,
                                 minimum_transfer_prefix_blocks=1, minimum_estimated_ttft_saving_ms=0.0)),
)


def _timed(function):
    started = time.perf_counter()
    value = function()
    return time.perf_counter() - started, value


def whole(url: str, sweep, placed: bool, replay) -> tuple[float, object]:
    engine = sa.create_engine(url)
    with engine.connect() as connection:
        elapsed, report = _timed(lambda: replay(connection, sweep, horizon_s=0.5, placed=placed))
    engine.dispose()
    return elapsed, report


def engine_alone(url: str, sweep, placed: bool) -> tuple[float, float]:
    """(seconds reading SQL, seconds folding, ranking and judging) of the replay at decide's speed."""
    from kvledger.decide.ranking.whatif import StayTimeline

    engine = sa.create_engine(url)
    with engine.connect() as connection:
        started = time.perf_counter()
        window = reference.read_columns(connection, horizon_s=0.5)
        workers = reference.workers_of(connection)
        stays = reference.stays_of(connection, window.first_seq, window.last_seq)
        read = time.perf_counter() - started
    engine.dispose()
    started = time.perf_counter()
    timeline = StayTimeline.of_stays(workers, stays.placements, stays.placement, stays.sequence_hash,
                                     stays.stored_seq, stays.removed_seq, stays.conflict_since)
    fast.answered(window.decisions, sweep, placed, timeline)
    return read, time.perf_counter() - started


async def _events(demo_nats: Path) -> list:
    """The demo's KV_EVENTS batches, in stream order (seq, batch)."""
    import nats

    from kvledger.core.events import decode_batch
    from kvledger.runtime.embedded import EmbeddedNats

    with tempfile.TemporaryDirectory() as copy:
        shutil.copytree(demo_nats, copy, dirs_exist_ok=True)
        with EmbeddedNats(copy) as server:
            async with await nats.connect(server.url) as nc:
                js = nc.jetstream()
                last = (await js.stream_info("KV_EVENTS")).state.last_seq
                return [(seq, decode_batch((await js.get_msg("KV_EVENTS", seq)).data)) for seq in range(1, last + 1)]


def yardstick(url: str, demo_nats: Path, settings: ReuseSettings, repeats: int) -> float:
    """decide's own batched rate: the recorded requests ranked in batches of 64 against decide's index."""
    from kvledger.decide.ranking.cpu import rank_batch
    from kvledger.decide.inventory.index import InventoryIndex

    engine = sa.create_engine(url)
    with engine.connect() as connection:
        requests = [decision.request for decision in reference.read_window(
            connection, horizon_s=0.5, horizons_in_sql=False).decisions]
    engine.dispose()
    index = InventoryIndex()
    for seq, batch in asyncio.run(_events(demo_nats)):
        index.apply(batch, seq)
    batches = [requests[start:start + 64] for start in range(0, len(requests), 64)]
    rank_batch(index, batches[0], settings)
    runs = []
    for _ in range(repeats):
        elapsed, _ = _timed(lambda: [rank_batch(index, batch, settings) for batch in batches])
        runs.append(elapsed)
    return len(requests) / sorted(runs)[(len(runs) - 1) // 2]


def _median(values: list[float]) -> float:
    return sorted(values)[(len(values) - 1) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, required=True, help="a finished demo's --data-dir")
    parser.add_argument("--placed", action="store_true", help="answer requests naming no target for their fallback")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-reference", action="store_true", help="skip the reference (slow: minutes at scale)")
    args = parser.parse_args(argv)

    url = f"sqlite:///{args.data_dir / 'ledger.db'}"
    one, four = list(SWEEP[:1]), list(SWEEP)
    _, report = whole(url, one, args.placed, fast.replay)  # loads the kernels (compiles them on a first run)
    count = report.replayed
    print(f"{count} recorded requests ({report.unreplayable} unreplayable){' as placed' if args.placed else ''}")
    results: dict[str, list[float]] = {}
    mismatches = 0
    for round_number in range(args.repeats):
        for name, sweep in (("one", one), ("four", four)):
            elapsed, got = whole(url, sweep, args.placed, fast.replay)
            results.setdefault(f"whole {name}", []).append(elapsed)
            read, answered = engine_alone(url, sweep, args.placed)
            results.setdefault(f"read {name}", []).append(read)
            results.setdefault(f"engine {name}", []).append(answered)
            if not args.no_reference and round_number == 0:
                elapsed, expected = whole(url, sweep, args.placed, reference.replay)
                results.setdefault(f"reference {name}", []).append(elapsed)
                mismatches += expected != got
    rate = yardstick(url, args.data_dir / "nats", SWEEP[0][1], args.repeats)
    print("| path | seconds (median) | decisions / s per setting | decision-settings / s |")
    print("|---|---|---|---|")
    for key, runs in results.items():
        settings = 1 if key.endswith("one") else len(four)
        seconds = _median(runs)
        print(f"| {key} | {seconds:.3f} | {count / seconds:,.0f} | {count * settings / seconds:,.0f} |")
    print(f"| yardstick: decide's rank_batch, batches of 64, same requests, decide's index | "
          f"{count / rate:.3f} | {rate:,.0f} | {rate:,.0f} |")
    engine_one = count / _median(results["engine one"])
    print(f"engine (one setting) / yardstick: {engine_one / rate:.2f}x; whole (one setting) / yardstick: "
          f"{count / _median(results['whole one']) / rate:.2f}x")
    if not args.no_reference:
        print(f"reference vs replay at decide's speed: {mismatches} reports differ; speed-up (whole, one setting) "
              f"{_median(results['reference one']) / _median(results['whole one']):.1f}x")
    return 0 if not mismatches else 1


if __name__ == "__main__":
    sys.exit(main())
