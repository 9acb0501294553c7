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
    Command(
        ("config", "show"),
        _config_show,
        "print the effective settings and their sources",
        _config_show_arguments,
    ),
)

_GROUP_HELP: Mapping[str, str] = {
    "config": "inspect settings",
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
