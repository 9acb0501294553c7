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
import json
import math
import sys
from pathlib import Path

from collections.abc import Sequence

import numpy as np

from kvledger.core.events import WorkerId
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
    from kvledger.store.whatif_reference import read_window, report_of, stays_of, workers_of

    window = read_window(connection, horizon_s=horizon_s, from_ts=from_ts, to_ts=to_ts, horizons_in_sql=False)
    judged = []
    if window.decisions:  # an empty window loads no kernel and reads no stay
        from kvledger.decide.ranking.whatif import StayTimeline

        stays = stays_of(connection, window.first_seq, window.last_seq)
        timeline = StayTimeline.of_stays(workers_of(connection), stays.placements, stays.placement,
                                         stays.sequence_hash, stays.stored_seq, stays.removed_seq,
                                         stays.conflict_since)
        judged = _answered(window.decisions, settings, placed, timeline, lambda decision: decision.horizon_seq)
    return report_of((from_ts, to_ts), horizon_s, "sql", window.decisions, judged, window.unreplayable, settings)


async def replay_stream(js, streams, settings: Sequence[tuple[str, ReuseSettings]], *, horizon_s: float,
                        from_ts: float = -math.inf, to_ts: float = math.inf, placed: bool = False,
                        timeout_s: float = 300.0):
    """`store.whatif_reference.replay_stream`'s report, KV_EVENTS folded by decide's own index, answered by its kernels."""
    from kvledger.store.whatif_reference import read_streams, report_of

    decisions, unreplayable, batches = await read_streams(js, streams, horizon_s=horizon_s, from_ts=from_ts,
                                                          to_ts=to_ts, timeout_s=timeout_s)
    judged = []
    if decisions:
        from kvledger.decide.ranking.whatif import FoldTimeline

        judged = _answered(decisions, settings, placed, FoldTimeline(batches), lambda decision: decision.horizon_seq)
    return report_of((from_ts, to_ts), horizon_s, "stream", decisions, judged, unreplayable, settings)


def _answered(decisions: Sequence, settings: Sequence[tuple[str, ReuseSettings]], placed: bool, timeline,
              horizon_of) -> list:
    """Each decision's recorded outcome and its replayed ones (store.whatif_reference.Outcome), judged at its horizon."""
    from kvledger.decide.ranking.ranked import REASONS
    from kvledger.decide.ranking.whatif import FALLBACK, NAMED, Requests, recorded_outcomes
    from kvledger.core.events import Tier
    from kvledger.store.whatif_reference import Outcome

    targets, fallbacks = [], []
    for decision in decisions:
        request = decision.request
        if placed and request.target is None and request.fallback is not None:
            targets.append(request.fallback)
            fallbacks.append(None)
        else:
            targets.append(request.target)
            fallbacks.append(request.fallback if request.target is None else None)
    requests = Requests.of([decision.request.local_hashes for decision in decisions],
                           [decision.request.block_size for decision in decisions],
                           [decision.inventory_seq for decision in decisions], targets, fallbacks)
    horizons = np.array([-1 if (seq := horizon_of(decision)) is None else seq for decision in decisions],
                        dtype=np.int64)
    recorded_targets = [WorkerId.parse(decision.target) if decision.target else None for decision in decisions]
    recorded = ([decision.source for decision in decisions], [decision.tier for decision in decisions],
                [decision.baseline_blocks for decision in decisions],
                [decision.prefix_blocks for decision in decisions], recorded_targets,
                [decision.target_prefix_blocks for decision in decisions])
    values = [value for _, value in settings]
    if hasattr(timeline, "slot"):
        answers, judged = timeline.answer(requests, values, horizons, recorded_outcomes(timeline.slot, *recorded))
    else:
        answers, judged = timeline.answer(requests, values, horizons, recorded)
    workers = timeline.workers
    names = [worker.name for worker in workers]
    tiers = (Tier.DEVICE, Tier.HOST, Tier.DISK)
    verdict = (None, False, True)  # by judged code + 1
    stale, lost = (judged.stale + 1).tolist(), (judged.lost + 1).tolist()
    outcomes: list[list] = [[] for _ in decisions]
    for setting in range(len(values)):
        columns = zip(answers.target[setting].tolist(), answers.target_how[setting].tolist(),
                      answers.reason[setting].tolist(), answers.source[setting].tolist(),
                      answers.tier[setting].tolist(), answers.prefix[setting].tolist(),
                      answers.transfer[setting].tolist(), answers.saving[setting].tolist(),
                      stale[setting + 1], lost[setting + 1])
        for position, (target, how, reason, source, tier, prefix, transfer, saving, is_stale, is_lost) in \
                enumerate(columns):
            if target >= 0:
                target_name = names[target]
            elif how == NAMED:
                target_name = targets[position].name
            elif how == FALLBACK:
                target_name = fallbacks[position].name
            else:
                target_name = None
            chosen = source >= 0
            outcomes[position].append(Outcome(
                target_name, REASONS[reason], workers[source] if chosen else None, tiers[tier] if chosen else None,
                prefix, transfer, saving, verdict[is_stale], verdict[is_lost]))
    return [
        (Outcome(decision.target, decision.reason, decision.source, decision.tier, decision.prefix_blocks or 0,
                 decision.transfer_blocks or 0, decision.saving_ms or 0.0, verdict[is_stale], verdict[is_lost]),
         replayed)
        for decision, replayed, is_stale, is_lost in zip(decisions, outcomes, stale[0], lost[0])
    ]
