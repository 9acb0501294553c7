"""How a stage runs as a process: one log format, and one map from what stopped it to its exit code.

Exit codes, the same for every stage (and for `kvledger` itself, docs/settings.md):
- 0: stopped by SIGINT or SIGTERM, cleanly;
- 2: refused to run as configured (a bad setting or endpoint, a database schema it does not
  know, a stream that exists with other settings, credentials the server refuses): the
  operator must change something, and restarting as is cannot help;
- 1: could not run for now (e.g. no NATS server answered in time): a restart may succeed.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable

from kvledger.runtime.nats_options import NatsAuthError

LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
REFUSED = 2
FAILED = 1


def configure_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(level=level, format=LOG_FORMAT)


def run_stage(
    name: str,
    serve: Callable[[], Awaitable[None]],
    *,
    refusals: tuple[type[BaseException], ...] = (),
    failures: tuple[type[BaseException], ...] = (),
) -> int:
    """Run `serve()` until it returns; say in one line on stderr why it could not, and return the exit code.

    `refusals` are the stage's own configuration errors (beside a stream conflict and a
    refused login, which every stage meets); `failures` the ones a restart may cure.
    """
    # (here: nats-py's import is a fifth of a second that the commands without a stage do not pay)
    from kvledger.runtime.streams import StreamConflictError

    configure_logging()
    try:
        asyncio.run(serve())
    except (StreamConflictError, NatsAuthError, *refusals) as error:
        print(f"kvledger {name}: {error}", file=sys.stderr)
        return REFUSED
    except failures as error:
        print(f"kvledger {name}: {error}", file=sys.stderr)
        return FAILED
    return 0
