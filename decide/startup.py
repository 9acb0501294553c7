"""What decide needs before it can answer: settled subscriptions, and how long the process
has been starting (the snapshot it starts from: `decide.serving.stream_check.trusted_snapshot`)."""

from __future__ import annotations

import os

import nats


class StartupError(RuntimeError):
    """decide cannot start as configured; the message says what to change."""


async def settle_subscriptions(nc: nats.NATS) -> None:
    """Return once the server has every subscription `nc` has made so far.

    One `flush()` is not enough: nats-py (2.16) writes its PING straight to the socket
    while SUBs wait in its pending buffer for the flusher task, so the PONG can come back
    before the server has seen them, and a request sent at once gets "no responders" (about
    1 start in 15 on a busy machine). The flusher runs while the first PING is answered,
    so the second PING follows the SUBs.
    """
    await nc.flush()
    await nc.flush()


def seconds_since_process_start() -> float | None:
    """Seconds since the kernel started this process (Linux /proc), or None where that is unknown.

    Read from the kernel rather than from a timestamp taken at import, so the interpreter's
    own start and every import before decide count towards the cold start.
    """
    try:
        with open("/proc/self/stat", "rb") as stat_file:
            stat = stat_file.read()
        with open("/proc/uptime", "rb") as uptime_file:
            uptime_s = float(uptime_file.read().split()[0])
        # The command name (field 2) may hold spaces and parentheses; fields after its
        # closing parenthesis start at field 3, so starttime (field 22) is the 20th.
        started_ticks = int(stat[stat.rindex(b")") + 2:].split()[19])
        return max(uptime_s - started_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return None
