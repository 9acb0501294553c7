"""Benchmark of `kvledger replay` (store/replay.py) against replaying through the live service.

Both answer a finished demo's recorded requests again under one settings file, each at its own
inventory seq:

- the replay reads SQL (the demo's ledger.db) and answers with the reference model;
- the yardstick starts `kvledger decide` (cpu backend) with those settings on a fresh embedded
  nats-server, copies the demo's KV_EVENTS messages into it up to each recorded inventory seq,
  waits for decide to stand there, and asks that seq's requests in one batch over NATS (each
  answer recorded in KV_DECISIONS, as always).

Runs are taken in turns; the replay's answers are checked against the service's (target and
chosen source, tier and prefix of every request).

    kvledger demo --duration 30 --data-dir /tmp/demo          # reuse off: the recorded ledger
    python bench/replay.py --data-dir /tmp/demo --settings on.toml [--placed] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import attrs
import sqlalchemy as sa

REPO = Path(__file__).resolve().parent.parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]

from kvledger.settings import ReuseSettings, load_settings, reuse_settings_from  # noqa: E402
from store.replay import REPLAY_REQUESTS, _request_of, replay  # noqa: E402
from store.audit import run as run_query  # noqa: E402


def recorded_requests(url: str, placed: bool) -> list[tuple[int, dict]]:
    """(inventory seq, the request as a client sends it) for every recorded request, in KV_DECISIONS order."""
    engine = sa.create_engine(url)
    with engine.connect() as connection:
        rows = run_query(connection, REPLAY_REQUESTS, horizon_s=0.5, from_ts=-1e18, to_ts=1e18)
    engine.dispose()
    asked = []
    for row in rows:
        request = _request_of(row)
        target = request.target or (request.fallback if placed else None)
        asked.append((row["inventory_seq"], {
            "request_id": f"{row['request_id']}-replayed", "block_size": request.block_size,
            "local_hashes": [str(h) for h in request.local_hashes],
            **({"target": target.name} if target else {}),
            **({"fallback": request.fallback.name} if request.fallback and not placed else {}),
        }))
    return asked


async def events_of(demo_nats: Path) -> list:
    """The demo's KV_EVENTS messages, in stream order (subject, data, headers)."""
    import nats

    from kvledger.runtime.embedded import EmbeddedNats

    with tempfile.TemporaryDirectory() as copy:
        shutil.copytree(demo_nats, copy, dirs_exist_ok=True)
        with EmbeddedNats(copy) as server:
            nc = await nats.connect(server.url)
            js = nc.jetstream()
            last = (await js.stream_info("KV_EVENTS")).state.last_seq
            messages = []
            for seq in range(1, last + 1):
                message = await js.get_msg("KV_EVENTS", seq)
                messages.append((message.subject, message.data, dict(message.headers or {})))
            await nc.close()
    return messages


async def through_the_service(events: list, asked: list[tuple[int, dict]], reuse: ReuseSettings,
                              round_number: int) -> tuple[float, dict[str, tuple]]:
    """Seconds to answer every request at its seq through a live decide, and its answers' choices by request."""
    import nats

    from decide.service import DecideService
    from kvledger.runtime.embedded import EmbeddedNats
    from kvledger.runtime.streams import DECIDE_BATCH_SUBJECT, ensure_stream, events_stream

    overrides = {f"reuse.{field.name}": getattr(reuse, field.name) for field in attrs.fields(ReuseSettings)}
    by_seq: dict[int, list[dict]] = collections.defaultdict(list)
    for seq, body in asked:
        by_seq[seq].append({**body, "request_id": f"{body['request_id']}-{round_number}"})
    choices = {}
    with tempfile.TemporaryDirectory() as store, EmbeddedNats(store) as server:
        overrides |= {"nats.url": server.url, "decide.http_port": 0, "decide.backend": "cpu"}
        settings = load_settings(environ={}, overrides=overrides).settings
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        await ensure_stream(js, events_stream(settings.stream))
        async with DecideService(settings) as service:
            await service.wait_ready(600)
            started = time.perf_counter()
            published = 0
            for seq in sorted(by_seq):
                while published < seq:
                    subject, data, headers = events[published]
                    await js.publish(subject, data, headers=headers)
                    published += 1
                while service.index.inventory_seq < seq:
                    await asyncio.sleep(0.0005)
                reply = await nc.request(DECIDE_BATCH_SUBJECT, json.dumps(by_seq[seq]).encode(), timeout=60)
                for answer in json.loads(reply.data):
                    chosen = answer["chosen"]
                    choices[answer["request_id"].rsplit("-", 1)[0]] = (
                        answer["target"], None if chosen is None else (chosen["source"], chosen["dp_rank"], chosen["tier"],
                                                                       chosen["prefix_blocks"]))
            elapsed = time.perf_counter() - started
        await nc.close()
    return elapsed, choices


def through_sql(url: str, name: str, reuse: ReuseSettings, placed: bool):
    engine = sa.create_engine(url)
    started = time.perf_counter()
    with engine.connect() as connection:
        report = replay(connection, [(name, reuse)], horizon_s=0.5, placed=placed)
    elapsed = time.perf_counter() - started
    engine.dispose()
    return elapsed, report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, required=True, help="a finished demo's --data-dir")
    parser.add_argument("--settings", required=True, help="the TOML file whose [reuse] keys are replayed")
    parser.add_argument("--placed", action="store_true", help="answer requests naming no target for their fallback")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    url = f"sqlite:///{args.data_dir / 'ledger.db'}"
    reuse = reuse_settings_from(args.settings, ReuseSettings())
    asked = recorded_requests(url, args.placed)
    events = asyncio.run(events_of(args.data_dir / "nats"))
    print(f"{len(asked)} recorded requests at {len({seq for seq, _ in asked})} inventory seqs, "
          f"{len(events)} KV_EVENTS messages; settings {args.settings}{' as placed' if args.placed else ''}")
    sql_runs, service_runs, mismatches = [], [], 0
    for round_number in range(args.repeats):
        time.sleep(1.0)
        elapsed, report = through_sql(url, args.settings, reuse, args.placed)
        sql_runs.append(elapsed)
        time.sleep(1.0)
        served, choices = asyncio.run(through_the_service(events, asked, reuse, round_number))
        service_runs.append(served)
        if round_number == 0:
            replayed = replayed_choices(url, reuse, args.placed)
            mismatches = sum(choices.get(request_id) != choice for request_id, choice in replayed.items())
            print(f"replay vs service: {mismatches} of {len(replayed)} answers differ (target, chosen source, tier, "
                  f"prefix); replay: {report.settings[0].hints} hints, {report.settings[0].changed} changed")
    count = len(asked)
    sql, service = sorted(sql_runs)[(len(sql_runs) - 1) // 2], sorted(service_runs)[(len(service_runs) - 1) // 2]
    print("| path | decisions / s (median of runs; range) |")
    print("|---|---|")
    print(f"| kvledger replay (store/replay.py: SQL reads, reference model, judged at 500 ms) | {count / sql:,.0f} "
          f"({count / max(sql_runs):,.0f} – {count / min(sql_runs):,.0f}) |")
    print(f"| through the live service (events copied up to each seq, a batch per seq over NATS, recorded) | "
          f"{count / service:,.0f} ({count / max(service_runs):,.0f} – {count / min(service_runs):,.0f}) |")
    print(f"replay / service: {service / sql:.2f}x")
    return 0 if not mismatches else 1


def replayed_choices(url: str, reuse: ReuseSettings, placed: bool) -> dict[str, tuple]:
    """Each request's replayed (target, chosen) from the reference model, as the service writes them."""
    from kvledger.reuse import decide as reference  # noqa: F401  (the replay's model)
    from store.replay import REPLAY_STAYS, REPLAY_WORKERS, Timeline, answer_again

    engine = sa.create_engine(url)
    with engine.connect() as connection:
        rows = run_query(connection, REPLAY_REQUESTS, horizon_s=0.5, from_ts=-1e18, to_ts=1e18)
        last = max((row["inventory_seq"] for row in rows), default=0)
        timeline = Timeline(run_query(connection, REPLAY_STAYS, first_seq=0, last_seq=last),
                            run_query(connection, REPLAY_WORKERS))
    engine.dispose()
    choices = {}
    for row in rows:
        request = _request_of(row)
        if placed and request.target is None and request.fallback is not None:
            request = attrs.evolve(request, target=request.fallback)
        decision = answer_again(timeline.at(row["inventory_seq"]), request, reuse)
        chosen = decision.chosen
        choices[f"{row['request_id']}-replayed"] = (decision.target, None if chosen is None else (
            chosen.source, chosen.dp_rank, chosen.tier.value, chosen.prefix_blocks))
    return choices


if __name__ == "__main__":
    sys.exit(main())
