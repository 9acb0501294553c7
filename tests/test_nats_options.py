"""The options every service connects to NATS with, against real nats-servers."""

from __future__ import annotations

import asyncio

import nats
import pytest

import services
from kvledger.core.settings import NatsSettings
from kvledger.runtime.nats_options import connect_options

pytestmark = pytest.mark.service


async def test_a_frozen_server_is_left_for_another_within_the_ping_budget(nats_source) -> None:
    # A server whose host vanished (a killed container, a machine off the network) can leave
    # its clients' connections open with nothing behind them; a frozen process is the same
    # from the client's side. The services' pings notice it and move to another server;
    # nats-py's defaults (two pings 120 s apart) would not for minutes.
    with services.start_nats(nats_source) as first, services.start_nats(nats_source) as second:
        settings = NatsSettings(url=f"{first.url},{second.url}", ping_interval_s=0.5, max_outstanding_pings=2)
        moved = asyncio.Event()

        async def reconnected() -> None:
            moved.set()

        ours = await nats.connect(**connect_options(settings, name="kvledger-test"), dont_randomize=True,
                                  reconnected_cb=reconnected)
        defaults = await nats.connect([first.url, second.url], dont_randomize=True)
        try:
            assert ours.connected_url.port == defaults.connected_url.port == first.port
            first.freeze()
            try:
                loop = asyncio.get_running_loop()
                frozen_at = loop.time()
                await asyncio.wait_for(moved.wait(), 10)
                noticed_s = loop.time() - frozen_at
                # (max_outstanding_pings + 1) intervals, then a connection to the other server
                assert noticed_s < 0.5 * 3 + 1.5, noticed_s
                assert ours.connected_url.port == second.port
                await ours.flush(timeout=2)  # and it is served there
                # a client on nats-py's defaults still takes the frozen server for alive
                assert defaults.is_connected and defaults.connected_url.port == first.port
            finally:
                first.thaw()
        finally:
            await ours.close()
            await defaults.close()
