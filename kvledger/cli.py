"""The `kvledger` command: one small function per subcommand, all registered in COMMANDS.

Stage packages (`ingest`, `store`, `decide`) are imported inside the subcommand that runs
them, never at module import, so the core and `config show` work without their
dependencies (and DESIGN's import rule stays true).
"""

import argparse
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence

import attrs

import kvledger
from kvledger.settings import (
    LoadedSettings,
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
        help="tcp://HOST:PORT[,replay=tcp://HOST:PORT][,provenance=retained][,dp_ranks=N] (repeatable)",
    )
    parser.add_argument(
        "--publisher", action="append", default=[], metavar="NAME",
        help="publisher name for the endpoint in the same position (repeatable)",
    )


def _ingest(args: argparse.Namespace, loaded: LoadedSettings) -> int:
    """Bridge engine KV events from ZMQ into JetStream until stopped."""
    from ingest.service import run

    return run(loaded.settings, args.publisher)


def _decide_arguments(parser: argparse.ArgumentParser) -> None:
    add_setting_flag(parser, "--backend", key="decide.backend", choices=("auto", "cpu", "cuda"),
                     help="ranking backend (auto = cuda when a GPU answers)")
    add_setting_flag(parser, "--http-port", key="decide.http_port", type=int, metavar="PORT",
                     help="port of the HTTP front, metrics and health")


def _decide(args: argparse.Namespace, loaded: LoadedSettings) -> int:
    """Run the reuse decision service (imported here: DESIGN's import rule)."""
    from decide.service import run

    return run(loaded.settings)


def _store(args: argparse.Namespace, loaded: LoadedSettings) -> int:
    """Project KV_EVENTS, KV_DECISIONS and KV_DEAD_LETTERS into SQL until stopped."""
    from store.commands import run_store

    return run_store(loaded.settings)


def _revision_argument(default: str) -> Callable[[argparse.ArgumentParser], None]:
    def add(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("revision", nargs="?", default=default, help=f"target revision (default {default})")

    return add


def _db_upgrade(args: argparse.Namespace, loaded: LoadedSettings) -> int:
    from store.commands import db_upgrade

    return db_upgrade(loaded.settings, args.revision)


def _db_downgrade(args: argparse.Namespace, loaded: LoadedSettings) -> int:
    from store.commands import db_downgrade

    return db_downgrade(loaded.settings, args.revision)


def _db_current(args: argparse.Namespace, loaded: LoadedSettings) -> int:
    from store.commands import db_current

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
    from store.commands import audit_inventory

    return audit_inventory(loaded.settings, args.worker, args.tier, args.at_seq, args.at_time, args.json)


def _audit_block_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("hash", help="engine or sequence hash: unsigned decimal, signed decimal or 0x hex")
    _json_flag(parser)


def _audit_block(args: argparse.Namespace, loaded: LoadedSettings) -> int:
    from store.commands import audit_block

    return audit_block(loaded.settings, args.hash, args.json)


def _audit_decision_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("request_id", help="the decision's request_id")
    _json_flag(parser)


def _audit_decision(args: argparse.Namespace, loaded: LoadedSettings) -> int:
    from store.commands import audit_decision

    return audit_decision(loaded.settings, args.request_id, args.json)


def _audit_gaps_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--worker", help="only this worker (PUBLISHER or PUBLISHER/DP_RANK)")
    _json_flag(parser)


def _audit_gaps(args: argparse.Namespace, loaded: LoadedSettings) -> int:
    from store.commands import audit_gaps

    return audit_gaps(loaded.settings, args.worker, args.json)


def _audit_dead_letters_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--limit", type=int, default=100, help="newest N (default 100)")
    _json_flag(parser)


def _audit_dead_letters(args: argparse.Namespace, loaded: LoadedSettings) -> int:
    from store.commands import audit_dead_letters

    return audit_dead_letters(loaded.settings, args.limit, args.json)


def _audit_workers(args: argparse.Namespace, loaded: LoadedSettings) -> int:
    from store.commands import audit_workers

    return audit_workers(loaded.settings, args.json)


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
    Command(("ingest",), _ingest, "bridge engine KV events from ZMQ into JetStream", _ingest_arguments),
    Command(("store",), _store, "project the event, decision and dead-letter streams into SQL"),
    Command(("decide",), _decide, "answer reuse decisions over NATS and HTTP", _decide_arguments),
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


if __name__ == "__main__":
    raise SystemExit(main())
