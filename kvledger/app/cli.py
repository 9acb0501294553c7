"""The `kvledger` command: one small function per subcommand, all registered in COMMANDS.

Stage packages (`ingest`, `store`, `decide`) are imported inside the subcommand that runs
them, never at module import, so the core and `config show` work without their
dependencies (and the layering of docs/core.md stays true).
"""

import argparse
import asyncio
import contextlib
import datetime
import json
import logging
import os
import sys
from pathlib import Path
from collections.abc import Callable, Mapping, Sequence

import attrs

import kvledger
from kvledger.app import replay, trtllm_forward
from kvledger.runtime.entry import REFUSED, configure_logging
from kvledger.core.settings import (
    LoadedSettings,
    Settings,
    SettingsError,
    as_display_rows,
    as_json_records,
    load_settings,
)

# A flag whose argparse `dest` starts with this prefix is a settings override for the
# dotted key after it; main() gathers them all, so a subcommand adds one in one line.
_OVERRIDE_DEST = "setting:"


def add_setting_flag(parser: "argparse._ActionsContainer", *flags: str, key: str, **kwargs: object) -> None:
    """Add a flag that overrides the setting `key` (e.g. "nats.url") when given."""
    kwargs.setdefault("default", argparse.SUPPRESS)
    parser.add_argument(*flags, dest=f"{_OVERRIDE_DEST}{key}", **kwargs)


def _global_options(default: object) -> argparse.ArgumentParser:
    """The options every command accepts; `default` is SUPPRESS on subcommand parsers, so an
    option given before the subcommand is not overwritten by the subcommand's default."""
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("global options")
    group.add_argument("--config", metavar="FILE", default=default, help="TOML settings file")
    add_setting_flag(group, "--nats", key="nats.url", metavar="URL", default=default, help="NATS server URL")
    add_setting_flag(group, "--db", key="db.url", metavar="URL", default=default, help="database URL (SQLAlchemy)")
    return parent


def _overrides(args: argparse.Namespace) -> dict[str, object]:
    return {
        dest[len(_OVERRIDE_DEST) :]: value
        for dest, value in vars(args).items()
        if dest.startswith(_OVERRIDE_DEST) and value is not None
    }


# ------------------------------------------------------------------ commands


def _config_show_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON objects {key, value, source}")


def _config_show(args: argparse.Namespace, loaded: LoadedSettings) -> int:
    """Print the effective settings and where each value came from; secrets are masked."""
    if args.json:
        print(json.dumps(as_json_records(loaded), indent=2))
        return 0
    rows = [("key", "value", "source"), *as_display_rows(loaded)]
    widths = [max(len(row[column]) for row in rows) for column in range(2)]
    for key, value, source in rows:
        print(f"{key:<{widths[0]}}  {value:<{widths[1]}}  {source}")
    return 0


def _ingest_arguments(parser: argparse.ArgumentParser) -> None:
    add_setting_flag(
        parser, "--endpoint", key="ingest.endpoints", action="append", metavar="SPEC",
        help="tcp://HOST:PORT[,replay=tcp://HOST:PORT][,provenance=retained][,dp_ranks=N][,engine=vllm|sglang|trtllm] (repeatable)",
    )
    parser.add_argument(
        "--publisher", action="append", default=[], metavar="NAME",
        help="publisher name for the endpoint in the same position (repeatable)",
    )


def _ingest(args: argparse.Namespace, loaded: LoadedSettings) -> int:
    """Bridge engine KV events from ZMQ into JetStream until stopped."""
    from kvledger.ingest.service import run

    return run(loaded.settings, args.publisher)


def _decide_arguments(parser: argparse.ArgumentParser) -> None:
    add_setting_flag(parser, "--backend", key="decide.backend", choices=("auto", "cpu", "cuda"),
                     help="ranking backend (auto = cuda when a GPU answers)")
    add_setting_flag(parser, "--http-port", key="decide.http_port", type=int, metavar="PORT",
                     help="port of the HTTP front, metrics and health")


def _decide(args: argparse.Namespace, loaded: LoadedSettings) -> int:
    """Run the reuse decision service (imported here: only the command composes stages)."""
    from kvledger.decide.serving.service import run

    return run(loaded.settings)


def _store_arguments(parser: argparse.ArgumentParser) -> None:
    add_setting_flag(parser, "--shard", key="store.shard", metavar="K/N",
                     help="project shard K of N of KV_EVENTS (split by publisher; default 0/1, the whole stream)")


def _store(args: argparse.Namespace, loaded: LoadedSettings) -> int:
    """Project KV_EVENTS, KV_DECISIONS and KV_DEAD_LETTERS into SQL until stopped."""
    from kvledger.store.commands import run_store

    return run_store(loaded.settings)


def _up_arguments(parser: argparse.ArgumentParser) -> None:
    _ingest_arguments(parser)
    parser.add_argument("--data-dir", default=".kvledger", metavar="DIR",
                        help="where the embedded nats-server and SQLite keep their data (default .kvledger)")


def _stage_services(settings: Settings, sources: list) -> dict:
    """ingest (when there are engine streams), store and decide as services for kvledger.runtime.system; store
    in a child process of its own: the engines' streams, ingest and decide keep this process's GIL busy, and
    store's SQL writing queued behind them fell 15-20 s behind in a 60 s, 8-worker demo when it ran here."""
    from kvledger.decide.serving.service import DecideService
    from kvledger.ingest.bridge import Bridge
    from kvledger.runtime.system import in_own_process

    store = in_own_process("store", _store_in_child, settings, logging.getLogger().getEffectiveLevel())

    async def decide(stop: asyncio.Event) -> None:
        async with DecideService(settings):
            await stop.wait()

    services = {"store": store, "decide": decide}
    if sources:
        async def ingest(stop: asyncio.Event) -> None:
            async with Bridge(settings, sources):
                await stop.wait()

        services["ingest"] = ingest
    return services


def _store_in_child(settings: Settings, log_level: int) -> None:
    """store as `in_own_process` runs it: as `kvledger store` does (until SIGTERM; a refusal is one line on stderr
    and exit code 2), logging at its parent's level."""
    from kvledger.store.commands import run_store

    configure_logging(log_level)  # (run_stage's own configuration then leaves this one in place)
    sys.exit(run_store(settings))


@contextlib.contextmanager
def _local_system(
    loaded: LoadedSettings, data_dir: str, extra: Mapping[str, object] | None = None, *, nats_port: int | None = None,
):
    """Settings for `up`/`demo`: an embedded nats-server and a migrated SQLite unless URLs were given."""
    from kvledger.runtime.embedded import EmbeddedNats
    from kvledger.runtime.system import local_overrides, wants_embedded_nats
    from kvledger.store import database

    overrides = {**local_overrides(loaded, data_dir), **(extra or {})}
    Path(data_dir).mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        if wants_embedded_nats(loaded):
            port = nats_port if nats_port is not None else int(loaded.settings.nats.url.rsplit(":", 1)[1])
            server = stack.enter_context(EmbeddedNats(
                Path(data_dir) / "nats", port=port, sync_interval=loaded.settings.nats.embedded_sync_interval,
                end_with_parent=True,
            ))
            overrides["nats.url"] = server.url
        settings = _with_overrides(loaded, overrides)
        with database.opened(settings.db.url) as engine:
            database.upgrade(engine)
        yield settings


def _with_overrides(loaded: LoadedSettings, overrides: Mapping[str, object]) -> Settings:
    merged = {**{key: value for key, value in _flat(loaded.settings).items() if loaded.sources[key] != "default"}, **overrides}
    return load_settings(None, environ={}, overrides=merged).settings


def _flat(settings: Settings) -> dict[str, object]:
    return {f"{section}.{key}": value for section, fields in attrs.asdict(settings).items() for key, value in fields.items()}


def _up(args: argparse.Namespace, loaded: LoadedSettings) -> int:
    """Run every stage until Ctrl-C or SIGTERM (store in a child process); run it again to resume."""
    from kvledger.ingest.service import sources_from
    from kvledger.runtime.system import install_stop_signals, run_services

    configure_logging()

    async def main(settings: Settings) -> None:
        stop = asyncio.Event()
        install_stop_signals(stop)
        sources = sources_from(settings, args.publisher) if settings.ingest.endpoints else []
        logging.getLogger("kvledger.up").info(
            "kvledger up: NATS %s, database %s, %d engine streams", settings.nats.url, settings.db.url, len(sources),
        )
        await run_services(_stage_services(settings, sources), stop)

    with _local_system(loaded, args.data_dir) as settings:
        asyncio.run(main(settings))
    return 0


def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", default=".kvledger/demo", metavar="DIR", help="demo state (default .kvledger/demo)")
    parser.add_argument("--duration", type=float, default=45.0, metavar="SECONDS", help="how long to send requests (default 45)")
    parser.add_argument("--workers", type=int, default=4, help="simulated engines (default 4)")
    parser.add_argument("--trace", metavar="FILE", help="a Mooncake-format JSONL trace instead of the built-in workload")
    parser.add_argument("--enable-reuse", action="store_true", help="turn on decode-to-prefill reuse (GPU and host)")
    parser.add_argument("--inflight-ms", type=float, default=0.0, metavar="MS",
                        help="in-flight credit: a routed request counts on its worker this long (default 0: off)")
    parser.add_argument("--gpu-blocks", type=int, default=256, help="GPU cache per worker, in blocks (default 256)")
    parser.add_argument("--cpu-blocks", type=int, default=1024, help="CPU tier per worker, in blocks (default 1024)")


def _demo(args: argparse.Namespace, loaded: LoadedSettings) -> int:
    """`up` plus simulated engines replaying a workload through the decision service, then a summary."""
    import shutil

    if args.workers < 1:
        print("kvledger demo: --workers must be at least 1", file=sys.stderr)
        return 2
    if args.trace and not Path(args.trace).is_file():
        print(f"kvledger demo: trace file {args.trace} not found", file=sys.stderr)
        return 2
    data_dir = Path(args.data_dir)
    marker = data_dir / ".kvledger-demo"
    if data_dir.exists() and any(data_dir.iterdir()) and not marker.exists():
        print(f"kvledger demo: {data_dir} exists and was not made by a demo; choose another --data-dir", file=sys.stderr)
        return 2
    shutil.rmtree(data_dir, ignore_errors=True)  # each demo starts from a clean slate
    data_dir.mkdir(parents=True)
    marker.touch()
    extra: dict[str, object] = {"ingest.http_port": 0, "store.http_port": 0, "decide.http_port": 0}
    if args.enable_reuse:
        extra |= {"reuse.enable_decode_to_prefill_reuse": True, "reuse.enable_decode_to_prefill_gpu_reuse": True}
    else:  # what reuse would have done, recorded beside each answer and judged below
        extra |= {"decide.shadow": True}
    if args.inflight_ms:
        extra |= {"decide.inflight_ttl_ms": args.inflight_ms}
    configure_logging(logging.WARNING)
    # The demo is self-contained: its own nats-server on a free port, not `up`'s 4222.
    with _local_system(loaded, args.data_dir, extra, nats_port=-1) as settings:
        return asyncio.run(_run_demo(settings, args))


async def _run_demo(settings: Settings, args: argparse.Namespace) -> int:
    import nats
    from rich.console import Console
    from rich.live import Live
    from rich.table import Table

    from kvledger.ingest.endpoints import StreamSource
    from kvledger.sim.fleet import SimulatedFleet
    from kvledger.client import DecideClient
    from kvledger.app.demo import DemoScore, decide_asker, run_closed_loop
    from kvledger.core.events import Provenance
    from kvledger.runtime.nats_options import connect_options
    from kvledger.runtime.system import run_services
    from kvledger.sim.workload import DEMO_BLOCK_SIZE, mooncake_requests, synthetic_requests
    from kvledger.store.ceiling import warm_kernels
    from kvledger.store.commands import ceiling_figures, inflight_totals, ledger_counts, quality_totals, shadow_totals

    console = Console()
    # The summary's kernels made ready while the fleet starts and serves: a machine's first demo would otherwise
    # compile them after its traffic (about 5 s of a summary promised within 10).
    summary_kernels = asyncio.create_task(asyncio.to_thread(warm_kernels))
    requests = mooncake_requests(args.trace) if args.trace else synthetic_requests(100_000)
    async with SimulatedFleet(args.workers, gpu_blocks=args.gpu_blocks, cpu_blocks=args.cpu_blocks) as fleet:
        sources = [
            StreamSource(w.worker, w.engine.pub_endpoint, w.engine.replay_endpoint, Provenance.NATIVE) for w in fleet.workers
        ]
        services = _stage_services(settings, sources)
        stop = asyncio.Event()
        score = DemoScore()

        def progress_line(current: DemoScore) -> Table:
            table = Table.grid(padding=(0, 2))
            table.add_row(
                f"{current.elapsed_s:5.1f}/{args.duration:.0f}s", f"[bold]{current.requests}[/] requests",
                f"hits [green]{current.hit_rate:5.1%}[/] kvledger", f"[yellow]{current.baseline_hit_rate:5.1%}[/] round-robin",
                f"reuse {current.reuse_chosen}",
            )
            return table

        async def driver(stop: asyncio.Event) -> None:
            nonlocal score
            nc = await nats.connect(**connect_options(settings.nats, name="kvledger-demo"))
            try:
                await _wait_decide_ready(nc, on_slow=lambda: console.print(
                    "[dim]waiting for decide (its first start on a machine compiles its kernels, "
                    "about a minute; later starts load them)...[/]"))
                ask = decide_asker(await DecideClient.connect_nats(nc, timeout=datetime.timedelta(seconds=10)))
                with Live(progress_line(score), console=console, refresh_per_second=4) as live:
                    score = await run_closed_loop(
                        fleet.workers, requests, ask, duration_s=args.duration, reuse=args.enable_reuse,
                        on_progress=lambda current: live.update(progress_line(current)),
                    )
                console.print("\n[dim]waiting for the store to catch up...[/]")
                if not await _wait_store_caught_up(nc, settings):
                    console.print("[yellow]the store had not caught up after 60 s: the SQL counts below are partial[/]")
            finally:
                await nc.close()
                stop.set()

        await run_services({**services, "demo": driver}, stop)

    await summary_kernels
    # The verdicts store wrote as it folded (store.quality_horizons_ms), at the metrics' horizon if judged.
    horizon_ms = settings.store.metrics_horizon_ms
    console.print(f"[dim]reading the ledger's counts, verdicts at {horizon_ms:g} ms and ceiling...[/]")
    # Side by side: each is a read of its own, mostly inside SQLite, which leaves the GIL to the others.
    db, horizon_s = settings.db.url, horizon_ms / 1000
    counts, quality, shadow, inflight, ceiling = await asyncio.gather(
        asyncio.to_thread(ledger_counts, db), asyncio.to_thread(quality_totals, db, horizon_s),
        asyncio.to_thread(shadow_totals, db, horizon_s), asyncio.to_thread(inflight_totals, db, horizon_s),
        asyncio.to_thread(ceiling_figures, db, settings.reuse),
    )
    bridged, events, inventory, decisions = counts["batches"], counts["events"], counts["blocks_held"], counts["decisions"]
    summary = Table(title="kvledger demo", show_header=False, min_width=72)
    summary.add_column(style="bold")
    summary.add_column(justify="right")
    rows = [
        ("workload", args.trace or "built-in multi-turn conversations"),
        ("workers", str(args.workers)),
        ("requests served", f"{score.requests} in {score.elapsed_s:.1f}s"),
        ("batches bridged (in SQL)", str(bridged)),
        ("events (in SQL)", str(events)),
        ("blocks in inventory now", str(inventory)),
        ("decisions recorded", str(decisions)),
        ("placement", "round-robin + kvledger reuse" if args.enable_reuse else "by kvledger credit"),
        ("routed by kvledger credit", str(score.routed_by_credit)),
        ("reuse candidates chosen", f"{score.reuse_chosen}" + ("" if args.enable_reuse else " (reuse off: --enable-reuse)")),
        ("estimated TTFT saved by routing",
         "n/a (round-robin placement)" if args.enable_reuse
         else f"{score.routing_saving_ms(DEMO_BLOCK_SIZE, settings.reuse) / 1000:.1f} s"),
        ("estimated TTFT saved by reuse transfers", f"{score.reuse_saving_ms / 1000:.1f} s"),
        ("prefix hit rate with kvledger", f"{score.hit_rate:.1%}"),
        ("prefix hit rate round-robin", f"{score.baseline_hit_rate:.1%}"),
    ]
    if ceiling is not None:
        # The same recorded requests, from SQL: kvledger's prefix hits, round-robin over the fleet's measured
        # capacity, and the oracle's bound (docs/audit.md, "Ceiling").
        rows += [
            (f"prefix hit rate / TTFT saved, {name} (recorded)",
             f"{ceiling[policy]['prefix_hit_rate'] or 0:.1%} / {ceiling[policy]['ttft_saving_ms'] / 1000:.1f} s")
            for policy, name in (("achieved", "kvledger"), ("round_robin", "round-robin"), ("oracle", "oracle ceiling"))
        ]
    rows += [
        (f"stale-hint rate at {horizon_ms:g} ms", _rate(quality["stale_hints"], quality["hints"], "hints")),
        (f"lost-credit rate at {horizon_ms:g} ms", _rate(quality["lost_credit"], quality["credited"], "credited decisions")),
    ]
    if not args.enable_reuse:
        rows += [
            ("shadow: would-be reuse hints (reuse off)", f"{shadow['hints']:.0f}"),
            (f"shadow: stale-hint rate at {horizon_ms:g} ms", _rate(shadow["stale_hints"], shadow["hints"], "hints")),
            ("shadow: estimated TTFT saved (fresh hints)",
             f"{shadow['estimated_ttft_saved_ms'] / 1000:.1f} s ({shadow['fresh_ttft_saved_ms'] / 1000:.1f} s)"),
            ("shadow: blocks that would have moved", f"{shadow['blocks_moved']:.0f}"),
        ]
    if args.inflight_ms:
        rows += [
            (f"in-flight credit ({args.inflight_ms:g} ms): routed by it", str(score.routed_by_inflight)),
            (f"in-flight credit confirmed at {horizon_ms:g} ms",
             _rate(inflight["confirmed"], inflight["inflight_decisions"], "decisions with in-flight credit")),
            (f"lost-credit rate with in-flight blocks at {horizon_ms:g} ms",
             _rate(inflight["lost_with_inflight"], inflight["credited_with_inflight"], "credited decisions")),
        ]
    for name, value in rows:
        summary.add_row(name, value)
    console.print(summary)
    first = fleet.workers[0].worker.name
    print(f"Try these audit queries (the data stays in {args.data_dir}):")
    print(f"  kvledger audit workers --db {db}")
    print(f"  kvledger audit inventory --worker {first} --tier device --db {db}")
    print(f"  kvledger audit gaps --db {db}")
    print(f"  kvledger audit quality --db {db}")
    return 0


def _rate(part: int, whole: int, of: str) -> str:
    return f"{part / whole:.1%} of {whole} {of}" if whole else f"n/a (no {of} judged)"


# A first start compiles decide's kernels: 40-70 s on a two-core machine.
DECIDE_READY_TIMEOUT_S = 600
_SLOW_START_S = 5.0


async def _wait_decide_ready(nc, on_slow: Callable[[], None] = lambda: None) -> None:
    """The decision service answers once it is up; until then requests find no responder.
    `on_slow` is called once if that takes more than a few seconds."""
    import nats.errors

    from kvledger.runtime.streams import DECIDE_SUBJECT

    started = asyncio.get_running_loop().time()
    deadline = started + DECIDE_READY_TIMEOUT_S
    told = False
    attempt = 0
    while True:
        if not told and asyncio.get_running_loop().time() - started > _SLOW_START_S:
            on_slow()
            told = True
        attempt += 1
        # Each probe its own id: decisions are de-duplicated in KV_DECISIONS by request id.
        probe = json.dumps({"request_id": f"demo-probe-{attempt}", "local_hashes": [], "block_size": 16}).encode()
        try:
            await nc.request(DECIDE_SUBJECT, probe, timeout=2)
            return
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.1)


async def _wait_store_caught_up(nc, settings: Settings, timeout: float = 60) -> bool:
    """Until the store's checkpoints reach the ends of KV_EVENTS and KV_DECISIONS, and its sweeper has written
    the verdicts those events settled (False on timeout): the summary then reads verdicts, judging none."""
    from kvledger.store.commands import store_progress

    js = nc.jetstream()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        ends = {
            name: (await js.stream_info(name)).state.last_seq
            for name in (settings.stream.events_stream, settings.stream.decisions_stream)
        }
        done, verdicts_due = await asyncio.to_thread(store_progress, settings.db.url)
        if all(done.get(name, 0) >= end for name, end in ends.items()) and not (
            settings.store.quality_horizons_ms and verdicts_due
        ):
            return True
        await asyncio.sleep(0.2)
    return False


def _revision_argument(default: str) -> Callable[[argparse.ArgumentParser], None]:
    def add(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("revision", nargs="?", default=default, help=f"target revision (default {default})")

    return add


def _db_upgrade(args: argparse.Namespace, loaded: LoadedSettings) -> int:
    from kvledger.store.commands import db_upgrade

    return db_upgrade(loaded.settings, args.revision)


def _db_downgrade(args: argparse.Namespace, loaded: LoadedSettings) -> int:
    from kvledger.store.commands import db_downgrade

    return db_downgrade(loaded.settings, args.revision)


def _db_current(args: argparse.Namespace, loaded: LoadedSettings) -> int:
    from kvledger.store.commands import db_current

    return db_current(loaded.settings)


def _json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _audit_inventory_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--worker", required=True, help="worker name: PUBLISHER or PUBLISHER/DP_RANK")
    parser.add_argument("--tier", choices=("device", "host", "disk", "external"), help="one tier (default: all)")
    when = parser.add_mutually_exclusive_group()
    when.add_argument("--at-seq", type=int, metavar="SEQ", help="as of this KV_EVENTS stream seq (default: now)")
    when.add_argument("--at-time", metavar="TIME", help="as of this time (unix seconds or ISO 8601, UTC if no zone)")
    _json_flag(parser)


def _audit_inventory(args: argparse.Namespace, loaded: LoadedSettings) -> int:
    from kvledger.store.commands import audit_inventory

    return audit_inventory(loaded.settings, args.worker, args.tier, args.at_seq, args.at_time, args.json)


def _audit_block_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("hash", help="engine or sequence hash: unsigned decimal, signed decimal or 0x hex")
    _json_flag(parser)


def _audit_block(args: argparse.Namespace, loaded: LoadedSettings) -> int:
    from kvledger.store.commands import audit_block

    return audit_block(loaded.settings, args.hash, args.json)


def _audit_decision_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("request_id", help="the decision's request_id")
    _json_flag(parser)


def _audit_decision(args: argparse.Namespace, loaded: LoadedSettings) -> int:
    from kvledger.store.commands import audit_decision

    return audit_decision(loaded.settings, args.request_id, args.json)


def _audit_gaps_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--worker", help="only this worker (PUBLISHER or PUBLISHER/DP_RANK)")
    _json_flag(parser)


def _audit_gaps(args: argparse.Namespace, loaded: LoadedSettings) -> int:
    from kvledger.store.commands import audit_gaps

    return audit_gaps(loaded.settings, args.worker, args.json)


def _audit_dead_letters_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--limit", type=int, default=100, help="newest N (default 100)")
    _json_flag(parser)


def _audit_dead_letters(args: argparse.Namespace, loaded: LoadedSettings) -> int:
    from kvledger.store.commands import audit_dead_letters

    return audit_dead_letters(loaded.settings, args.limit, args.json)


def _audit_workers(args: argparse.Namespace, loaded: LoadedSettings) -> int:
    from kvledger.store.commands import audit_workers

    return audit_workers(loaded.settings, args.json)


def _audit_stream_losses_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", action="store_true",
                        help="also list the batches that exist only in SQL (their stream message lost for good)")
    _json_flag(parser)


def _audit_stream_losses(args: argparse.Namespace, loaded: LoadedSettings) -> int:
    from kvledger.store.commands import audit_stream_losses

    return audit_stream_losses(loaded.settings, args.batches, args.json)


def _audit_quality_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--horizon-ms", type=float, default=500.0, metavar="MS",
                        help="judge each decision this long after it, in stream time (default 500)")
    parser.add_argument("--by", choices=("worker", "tier", "reason", "hour", "settings"), action="append",
                        help="only these groupings (repeatable; default: all four)")
    parser.add_argument("--decisions", action="store_true", help="one row per decision instead of the rates")
    judged = parser.add_mutually_exclusive_group()
    judged.add_argument("--shadow", dest="judged", action="store_const", const="shadow", default="live",
                        help="the would-be hints of shadow decisions (decide.shadow), per settings, worker and tier")
    judged.add_argument("--inflight", dest="judged", action="store_const", const="inflight",
                        help="in-flight credit per target: confirmed, lost credit with and without it")
    parser.add_argument("--ceiling", action="store_true",
                        help="also the prefix hit rate and TTFT saving of kvledger's routing, round-robin and an "
                             "oracle on the same recorded requests and fleet capacity (docs/audit.md, \"Ceiling\")")
    _json_flag(parser)


def _audit_quality(args: argparse.Namespace, loaded: LoadedSettings) -> int:
    from kvledger.store.commands import audit_quality

    return audit_quality(loaded.settings, args.horizon_ms, args.by, args.decisions, args.json, args.judged,
                         ceiling=args.ceiling)


@attrs.frozen
class Command:
    """A subcommand: its words (`("config", "show")`), what it does, and its own arguments."""

    words: tuple[str, ...]
    run: Callable[[argparse.Namespace, LoadedSettings], int]
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None


# Every subcommand is registered here and nowhere else. A stage command imports its package
# inside its function (`from ingest.bridge import ...`), so `kvledger config show` never does.
COMMANDS: tuple[Command, ...] = (
    Command(("up",), _up, "run ingest, store and decide with an embedded NATS and SQLite", _up_arguments),
    Command(("demo",), _demo, "up plus simulated engines replaying a workload, then a summary", _demo_arguments),
    Command(("ingest",), _ingest, "bridge engine KV events from ZMQ into JetStream", _ingest_arguments),
    Command(("store",), _store, "project the event, decision and dead-letter streams into SQL", _store_arguments),
    Command(("decide",), _decide, "answer reuse decisions over NATS and HTTP", _decide_arguments),
    Command(("trtllm-forward",), trtllm_forward.run, "publish a TensorRT-LLM LLM's KV events as ZMQ", trtllm_forward.arguments),
    Command(("db", "upgrade"), _db_upgrade, "apply database migrations", _revision_argument("head")),
    Command(("db", "downgrade"), _db_downgrade, "undo database migrations", _revision_argument("-1")),
    Command(("db", "current"), _db_current, "show the database schema revision"),
    Command(("audit", "inventory"), _audit_inventory, "a worker's inventory now, as of a seq or a time",
            _audit_inventory_arguments),
    Command(("audit", "block"), _audit_block, "the history of one block", _audit_block_arguments),
    Command(("audit", "decision"), _audit_decision, "what a decision saw", _audit_decision_arguments),
    Command(("audit", "gaps"), _audit_gaps, "gaps and uncertain periods per worker", _audit_gaps_arguments),
    Command(("audit", "dead-letters"), _audit_dead_letters, "records that could not be used",
            _audit_dead_letters_arguments),
    Command(("audit", "workers"), _audit_workers, "every worker and where its stream stands", _json_flag),
    Command(("audit", "stream-losses"), _audit_stream_losses, "where a stream lost acknowledged messages, and what "
            "exists only in SQL", _audit_stream_losses_arguments),
    Command(("audit", "quality"), _audit_quality, "whether decisions were still true at a horizon: stale hints, "
            "lost credit", _audit_quality_arguments),
    Command(("replay",), replay.run, "answer recorded decision requests again under other reuse settings, judged at "
            "a horizon", replay.arguments),
    Command(
        ("config", "show"),
        _config_show,
        "print the effective settings and their sources",
        _config_show_arguments,
    ),
)

_GROUP_HELP: Mapping[str, str] = {
    "config": "inspect settings",
    "db": "manage the audit database schema",
    "audit": "query the audit database",
}


# -------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser, built from COMMANDS."""
    parser = argparse.ArgumentParser(
        prog="kvledger",
        description="Durable, auditable KV-cache event ledger and reuse decisions.",
        parents=[_global_options(None)],
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {kvledger.__version__}")
    shared = _global_options(argparse.SUPPRESS)

    # command-word prefix -> its parser, and -> its subparsers action (created on first use)
    levels: dict[tuple[str, ...], argparse.ArgumentParser] = {(): parser}
    actions: dict[tuple[str, ...], argparse._SubParsersAction] = {}

    def subparsers_of(prefix: tuple[str, ...]) -> argparse._SubParsersAction:
        if prefix not in actions:
            actions[prefix] = levels[prefix].add_subparsers(title="commands", metavar="COMMAND")
        return actions[prefix]

    for command in COMMANDS:
        for depth, word in enumerate(command.words):
            prefix, here = command.words[:depth], command.words[: depth + 1]
            if here in levels:
                continue
            is_leaf = here == command.words
            help_text = command.help if is_leaf else _GROUP_HELP.get(word, "")
            sub = subparsers_of(prefix).add_parser(word, help=help_text, description=help_text, parents=[shared])
            levels[here] = sub
            if is_leaf:
                if command.add_arguments is not None:
                    command.add_arguments(sub)
                sub.set_defaults(_command=command)
            else:
                sub.set_defaults(_group=sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `kvledger` with `argv` (default: sys.argv[1:]) and return the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version and usage errors
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)

    command: Command | None = getattr(args, "_command", None)
    if command is None:
        (getattr(args, "_group", None) or parser).print_help(sys.stderr)
        return 2
    try:
        loaded = load_settings(args.config, overrides=_overrides(args))
        return command.run(args, loaded)
    except SettingsError as exc:
        print(f"kvledger: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader (`kvledger config show | head`) left; keep the interpreter's final
        # flush from raising again, as the Python docs on SIGPIPE recommend.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as exc:
        # A refused NATS login is a configuration problem: say so in one line, not a traceback.
        from kvledger.runtime.nats_options import auth_failure, is_auth_error

        if not is_auth_error(exc):
            raise
        print(f"kvledger: {auth_failure(loaded.settings.nats, exc)}", file=sys.stderr)
        return REFUSED


if __name__ == "__main__":
    raise SystemExit(main())
