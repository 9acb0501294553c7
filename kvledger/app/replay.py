"""`kvledger replay`: the recorded decision requests answered again under other reuse settings (store/whatif_reference.py).

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
import contextlib
import json
import math
import sys
from pathlib import Path

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import attrs

from kvledger.core.settings import LoadedSettings, ReuseSettings, SettingsError, reuse_settings_from

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
    parser.add_argument("--ceiling", action="store_true",
                        help="also the window's ceiling from SQL (store/ceiling.py): the prefix hit rate and TTFT "
                             "saving an oracle, round-robin and kvledger's routing reached on the same requests")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace, loaded: LoadedSettings) -> int:
    from kvledger.store import database
    from kvledger.store.commands import _parse_time, print_table
    from kvledger.store.whatif_reference import ReplayRefused

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
    ceiling_rows, ceiling_refused = None, None
    if getattr(args, "ceiling", False):
        ceiling_rows, ceiling_refused = _ceiling(settings, from_ts, to_ts)
    if args.json:
        print(json.dumps({
            "source": report.source, **({"sql_refused": refusal} if refusal else {}), "horizon_ms": args.horizon_ms,
            "replayed": report.replayed, "unreplayable": report.unreplayable, "truncated": report.truncated,
            "rows": rows,
            **({"changes": {tally.name: tally.changes for tally in report.settings}} if args.decisions else {}),
            **({"ceiling": ceiling_rows} if ceiling_rows is not None else {}),
            **({"ceiling_refused": ceiling_refused} if ceiling_refused is not None else {}),
        }, indent=2))
        return 1 if ceiling_refused is not None else 0
    where = "from SQL over the recorded timeline" if report.source == "sql" else \
        f"from {settings.stream.decisions_stream} over {settings.stream.events_stream} folded" + \
        (f" (SQL no longer holds the window: {refusal})" if refusal else "")
    print(f"replayed {report.replayed} recorded requests{' as placed' if args.placed else ''} {where}, judged at "
          f"{args.horizon_ms:g} ms" + (f"; {report.unreplayable} decisions unreplayable: recorded without their request "
                                       "(decide.record_requests = false)"
                                       if report.unreplayable else "")
          + (f"; {report.truncated} longer than 16 384 blocks answered on their first blocks" if report.truncated else ""))
    print_table(rows, COLUMNS)
    if args.decisions:
        for tally in report.settings:
            print(f"\n{tally.name}: {tally.changed} decisions change")
            print_table(tally.changes, ("request_id", "recorded", "replayed"))
    if ceiling_rows is not None:
        from kvledger.store.commands import _CEILING_COLUMNS

        print("\nceiling of the same window (store/ceiling.py; docs/audit.md, \"Ceiling\"): "
              "the configured [reuse] settings, capacity as held")
        print_table(ceiling_rows, _CEILING_COLUMNS)
    if ceiling_refused is not None:
        print(f"kvledger replay --ceiling: {ceiling_refused}", file=sys.stderr)
        return 1
    return 0


def _ceiling(settings, from_ts: float, to_ts: float) -> tuple[list[dict] | None, str | None]:
    """The window's ceiling rows (oracle, round_robin, achieved) from SQL, or why SQL cannot give them."""
    from kvledger.store import database
    from kvledger.store.ceiling import ceiling
    from kvledger.store.whatif_reference import ReplayRefused

    engine = database.create_engine(settings.db.url)
    try:
        database.require_current(engine, settings.db.url)
        with engine.connect() as connection:
            return ceiling(connection, settings.reuse, from_ts=from_ts, to_ts=to_ts).rows(), None
    except (database.SchemaError, ReplayRefused) as error:
        return None, str(error)
    finally:
        engine.dispose()


async def _from_streams(settings, sweep: list, options: dict):
    """The replay from KV_DECISIONS and KV_EVENTS, over one connection opened for it."""
    import nats

    from kvledger.runtime.nats_options import connect_options

    async with await nats.connect(**connect_options(settings.nats, name="kvledger-replay")) as nc:
        return await replay_stream(nc.jetstream(), settings.stream, sweep, **options)


# --- the replay at decide's speed ---------------------------------------------------------
#
# store/whatif_reference.py reads the window and tallies the report; decide/ranking/whatif.py folds the timeline into decide's
# rows and answers with decide's kernels; here one is handed to the other (the stages never import each other).
# store/whatif_reference.py's own `replay` and `replay_stream`, the reference model one request at a time, stay the
# reference the tests compare these with, to the last float.


def replay(connection, settings: Sequence[tuple[str, ReuseSettings]], *, horizon_s: float,
           from_ts: float = -math.inf, to_ts: float = math.inf, placed: bool = False):
    """`store.whatif_reference.replay`'s report, from SQL, answered by decide's kernels in a batch per inventory seq."""
    from kvledger.store.whatif_reference import read_columns

    table = None
    with _stays_read_beside(connection, from_ts, to_ts) as prefetched:
        window = read_columns(connection, horizon_s=horizon_s, from_ts=from_ts, to_ts=to_ts)
        if prefetched is not None and len(window.decisions):  # made while the stays are still being read
            from kvledger.decide.ranking.whatif import RequestTable

            table = RequestTable.of(window.decisions.local, window.decisions.offsets)
    timeline = None
    if len(window.decisions):  # an empty window loads no kernel and reads no stay
        covers, timeline = prefetched.result() if prefetched is not None else (None, None)
        if timeline is None or covers < window.last_seq:  # none read beside, or events projected since
            timeline = _timeline(connection, window.first_seq, window.last_seq)
    return _report((from_ts, to_ts), horizon_s, "sql", window.decisions, settings, placed, timeline,
                   window.unreplayable, table)


@contextlib.contextmanager
def _stays_read_beside(connection, from_ts: float, to_ts: float):
    """The ledger's timeline (`decide.ranking.whatif.StayTimeline` of every stay SQL holds), read and built on a
    connection of its own in a thread while the caller reads the window: SQLite builds the stays' texts without
    the GIL, PostgreSQL's server lays them out in a process of its own, and the stays matched to their removals
    (`store.whatif_reference.stays_of`) and made the timeline's columns while the window's rows are still being
    read, not after. Yields a future of (covers, timeline): every stay stored at or before `covers` (the events
    projected before they were read) is in it; or None where the database is SQLite in memory (this
    connection's alone), or where the window ends in the ledger's first half (the stays stored up to the
    window's end are then read alone, once it is known).

    The timeline holds stays the window does not need (ended before its first inventory seq, stored after its
    last seq, workers first seen after it): they are held at no seq the window answers or judges at, so the
    answers are those of the window's own stays."""
    import sqlalchemy as sa

    engine = connection.engine
    if engine.url.database in (None, "", ":memory:") or connection.execute(sa.text(
            "SELECT 1 FROM decisions WHERE decided_ts >= :from_ts AND decided_ts < :to_ts LIMIT 1"),
            {"from_ts": max(from_ts, -1e18), "to_ts": min(to_ts, 1e18)}).first() is None:  # an empty window: no stay
        yield None
        return
    first_ts, last_ts = connection.exec_driver_sql("SELECT MIN(decided_ts), MAX(decided_ts) FROM decisions").one()
    if to_ts < (first_ts + last_ts) / 2:
        yield None
        return

    def read():
        from kvledger.store.whatif_reference import stay_tables

        with engine.connect() as own:
            covered = own.exec_driver_sql("SELECT MAX(stream_seq) FROM event_log").scalar() or 0
            return covered, _timeline(own, 0, covered, stay_tables(own))

    with ThreadPoolExecutor(1, thread_name_prefix="replay-stays") as pool:
        yield pool.submit(read)


def _timeline(connection, first_seq: int, last_seq: int, tables=None):
    """decide's `StayTimeline` of the stays open at some seq of [first_seq, last_seq]
    (`store.whatif_reference.stays_of`, from its `StayTables` where they were read before)."""
    from kvledger.decide.ranking.whatif import StayTimeline
    from kvledger.store.whatif_reference import stays_of, workers_of

    stays = stays_of(connection, first_seq, last_seq, tables)
    return StayTimeline.of_stays(workers_of(connection), stays.placements, stays.placement, stays.sequence_hash,
                                 stays.stored_seq, stays.removed_seq, stays.conflict_since)


async def replay_stream(js, streams, settings: Sequence[tuple[str, ReuseSettings]], *, horizon_s: float,
                        from_ts: float = -math.inf, to_ts: float = math.inf, placed: bool = False,
                        timeout_s: float = 300.0):
    """`store.whatif_reference.replay_stream`'s report, KV_EVENTS folded by decide's own index, answered by its kernels."""
    from kvledger.store.whatif_reference import RecordedColumns, read_streams

    decisions, unreplayable, batches = await read_streams(js, streams, horizon_s=horizon_s, from_ts=from_ts,
                                                          to_ts=to_ts, timeout_s=timeout_s)
    timeline = None
    if decisions:
        from kvledger.decide.ranking.whatif import FoldTimeline

        timeline = FoldTimeline(batches)
    return _report((from_ts, to_ts), horizon_s, "stream", RecordedColumns.of_recorded(decisions), settings, placed,
                   timeline, unreplayable)


def _report(bounds: tuple[float, float], horizon_s: float, source: str, window, settings, placed: bool, timeline,
            unreplayable: int, table=None):
    """The report of the window's decisions answered again on `timeline` (None: the window is empty)."""
    from kvledger.store.whatif_reference import report_of_columns

    if timeline is None:
        recorded, replayed = window.recorded, [window.recorded] * len(settings)
    else:
        recorded, replayed = answered(window, settings, placed, timeline, table)
    return report_of_columns(bounds, horizon_s, source, window, recorded, replayed, unreplayable, settings)


def answered(window, settings: Sequence[tuple[str, ReuseSettings]], placed: bool, timeline, table=None) -> tuple:
    """The recorded outcomes and each settings' replayed ones (`store.whatif_reference.OutcomeColumns`), every
    decision of `window` (`RecordedColumns`) answered at its inventory seq and judged at its horizon seq (on a
    `StayTimeline`, with the requests' `decide.ranking.whatif.RequestTable` where it was made before)."""
    import numpy as np  # here, not at the top: every `kvledger` command builds its parser from this module

    from kvledger.decide.ranking.ranked import REASONS
    from kvledger.decide.ranking.whatif import FALLBACK, NAMED, Requests, recorded_outcomes
    from kvledger.store.whatif_reference import NO_CODE, OutcomeColumns

    targets, fallbacks = window.requested_target, window.fallback
    if placed:  # a request naming no target is answered for where it was placed
        targets = np.where(targets == NO_CODE, fallbacks, targets)
    fallbacks = np.where(targets == NO_CODE, fallbacks, NO_CODE)  # asked again only where nothing was named
    workers = window.workers
    requests = Requests(window.local, window.offsets, window.block_size, window.inventory_seq, tuple(workers.values),
                        targets, fallbacks)
    mine = window.recorded
    recorded = (tuple(workers.values), mine.source, mine.tier, window.baseline, mine.prefix, window.target_worker,
                window.target_prefix)
    values = [value for _, value in settings]
    if hasattr(timeline, "slot"):
        answers, judged = timeline.answer(requests, values, window.horizon_seq,
                                          recorded_outcomes(timeline.slot, *recorded), table)
    else:
        answers, judged = timeline.answer(requests, values, window.horizon_seq, recorded)
    worker_of_slot = np.append(workers.of(timeline.workers), NO_CODE)  # slot -1 reads NO_CODE
    name_of_worker = np.append(window.names.of([worker.name for worker in workers.values]), NO_CODE)
    reason_of = window.reasons.of(REASONS)
    outcomes = []
    for setting in range(len(values)):
        target, how, source = answers.target[setting], answers.target_how[setting], answers.source[setting]
        name = name_of_worker[worker_of_slot[target]]
        name = np.where((target < 0) & (how == NAMED), name_of_worker[targets], name)
        name = np.where((target < 0) & (how == FALLBACK), name_of_worker[fallbacks], name)
        chosen = source >= 0
        outcomes.append(OutcomeColumns(
            name, reason_of[answers.reason[setting]], worker_of_slot[source],
            np.where(chosen, answers.tier[setting], NO_CODE), answers.prefix[setting], answers.transfer[setting],
            answers.saving[setting], judged.stale[setting + 1], judged.lost[setting + 1]))
    return attrs.evolve(mine, stale=judged.stale[0], lost=judged.lost[0]), outcomes
