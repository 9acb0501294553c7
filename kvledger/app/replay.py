"""`kvledger replay`: the recorded decision requests answered again under other reuse settings (store/replay.py).

Reads SQL (`db.url`): the window's requests from `decision_requests` and the timeline from
`block_residency`; or the streams (`nats.url`): the requests from KV_DECISIONS records and the
timeline by folding KV_EVENTS (`--source`; auto: SQL while it holds the window, else the
streams). Prints one row for the recorded decisions and one per settings file: the
decisions that change, the estimated TTFT saved, the transfer volume, and the stale-hint and
lost-credit rates at the horizon, judged as `kvledger audit quality` judges.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path

from kvledger.settings import LoadedSettings, SettingsError, reuse_settings_from

COLUMNS = ("settings", "digest", "decisions", "changed", "hints", "estimated_ttft_saved_ms", "blocks_moved",
           "tokens_moved", "judged_hints", "stale_hints", "stale_hint_rate", "fresh_ttft_saved_ms", "credited",
           "lost_credit", "lost_credit_rate", "pending")


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--from", dest="from_time", metavar="TIME",
                        help="first decision time (unix seconds or ISO 8601, UTC if no zone; default: the first)")
    parser.add_argument("--to", dest="to_time", metavar="TIME", help="end of the window, exclusive (default: none)")
    parser.add_argument("--settings", action="append", required=True, metavar="FILE",
                        help="a TOML file whose [reuse] keys are laid over the configured ones (repeat for a sweep)")
    parser.add_argument("--horizon-ms", type=float, default=500.0, metavar="MS",
                        help="judge each decision this long after it, in stream time (default 500)")
    parser.add_argument("--placed", action="store_true",
                        help="answer a request naming no target for its fallback (where it was placed), as shadow "
                             "decisions do; default: as it was asked")
    parser.add_argument("--source", choices=("auto", "sql", "stream"), default="auto",
                        help="where the requests and the timeline come from: SQL (db.url), the KV_DECISIONS and "
                             "KV_EVENTS streams (nats.url), or auto: SQL while it holds the window, else the streams")
    parser.add_argument("--decisions", action="store_true", help="also list every decision that changes, per settings")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace, loaded: LoadedSettings) -> int:
    from store import database
    from store.commands import _parse_time, print_table
    from store.replay import ReplayRefused, replay

    settings = loaded.settings
    sweep = []
    for path in args.settings:
        if not Path(path).is_file():
            print(f"kvledger replay: settings file {path} not found", file=sys.stderr)
            return 2
        try:
            sweep.append((path, reuse_settings_from(path, settings.reuse)))
        except SettingsError as error:
            print(f"kvledger replay: {path}: {error}", file=sys.stderr)
            return 2
    try:
        from_ts = _parse_time(args.from_time) if args.from_time else -math.inf
        to_ts = _parse_time(args.to_time) if args.to_time else math.inf
    except ValueError as error:
        print(f"kvledger replay: --from/--to: {error}", file=sys.stderr)
        return 2
    options = {"horizon_s": args.horizon_ms / 1000, "from_ts": from_ts, "to_ts": to_ts, "placed": args.placed}
    report, refusal = None, None
    if args.source in ("auto", "sql"):
        engine = database.create_engine(settings.db.url)
        try:
            database.require_current(engine, settings.db.url)
            with engine.connect() as connection:
                report = replay(connection, sweep, **options)
        except database.SchemaError as error:
            print(f"kvledger replay: {error}", file=sys.stderr)
            return 2
        except ReplayRefused as error:
            if args.source == "sql":
                print(f"kvledger replay: {error}", file=sys.stderr)
                return 2
            refusal = str(error)
        finally:
            engine.dispose()
    if report is None:
        import nats.errors

        try:
            report = asyncio.run(_from_streams(settings, sweep, options))
        except (ReplayRefused, nats.errors.Error, OSError, TimeoutError) as error:
            print(f"kvledger replay: {f'SQL: {refusal}; streams: ' if refusal else ''}{error or type(error).__name__}",
                  file=sys.stderr)
            return 2
    rows = [report.recorded.row(), *(tally.row() for tally in report.settings)]
    if args.json:
        print(json.dumps({
            "source": report.source, **({"sql_refused": refusal} if refusal else {}), "horizon_ms": args.horizon_ms,
            "replayed": report.replayed, "unreplayable": report.unreplayable, "truncated": report.truncated,
            "rows": rows,
            **({"changes": {tally.name: tally.changes for tally in report.settings}} if args.decisions else {}),
        }, indent=2))
        return 0
    where = "from SQL over the recorded timeline" if report.source == "sql" else \
        f"from {settings.stream.decisions_stream} over {settings.stream.events_stream} folded" + \
        (f" (SQL no longer holds the window: {refusal})" if refusal else "")
    print(f"replayed {report.replayed} recorded requests{' as placed' if args.placed else ''} {where}, judged at "
          f"{args.horizon_ms:g} ms" + (f"; {report.unreplayable} decisions without a recorded request left out"
                                       if report.unreplayable else "")
          + (f"; {report.truncated} longer than 16 384 blocks answered on their first blocks" if report.truncated else ""))
    print_table(rows, COLUMNS)
    if args.decisions:
        for tally in report.settings:
            print(f"\n{tally.name}: {tally.changed} decisions change")
            print_table(tally.changes, ("request_id", "recorded", "replayed"))
    return 0


async def _from_streams(settings, sweep: list, options: dict):
    """The replay from KV_DECISIONS and KV_EVENTS, over one connection opened for it."""
    import nats

    from kvledger.runtime.nats_options import connect_options
    from store.replay import replay_stream

    async with await nats.connect(**connect_options(settings.nats, name="kvledger-replay")) as nc:
        return await replay_stream(nc.jetstream(), settings.stream, sweep, **options)
