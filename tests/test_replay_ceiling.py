"""`kvledger replay --ceiling`: the window's ceiling (store/ceiling.py) beside the replay's report.

On the scripted workload of tests/quality_workload.py (three decisions, recorded on SQLite): the
ceiling the command prints, as a table and under "ceiling" in --json, is `store.ceiling.ceiling`'s
for the same window and the configured [reuse] settings, one row per policy (oracle,
round_robin, achieved); an empty window gives its rows with no request; without --ceiling the
JSON has no "ceiling".
"""

from __future__ import annotations

import json

import pytest

from kvledger.app.cli import main as kvledger
from kvledger.core.settings import ReuseSettings
from kvledger.store import database
from kvledger.store.ceiling import ceiling
from kvledger.store.commands import _parse_time
from test_replay import _record_workload

pytestmark = pytest.mark.service


async def test_the_ceiling_is_printed_beside_the_replay(nats_server, sqlite_url, tmp_path, capsys) -> None:
    with database.opened(sqlite_url) as engine:
        database.upgrade(engine)
    await _record_workload(nats_server.url, sqlite_url)
    on = tmp_path / "on.toml"
    on.write_text("[reuse]\nenable_decode_to_prefill_reuse = true\nenable_decode_to_prefill_gpu_reuse = true\n")
    with database.opened(sqlite_url) as engine, engine.connect() as connection:
        expected = ceiling(connection, ReuseSettings()).rows()
        empty = ceiling(connection, ReuseSettings(),
                        from_ts=_parse_time("2000-01-01"), to_ts=_parse_time("2000-01-02")).rows()
    assert [row["policy"] for row in expected] == ["oracle", "round_robin", "achieved"]
    assert all(row["requests"] == 3 for row in expected)

    capsys.readouterr()
    assert kvledger(["replay", "--db", sqlite_url, "--settings", str(on), "--ceiling", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["replayed"] == 3 and printed["ceiling"] == expected

    assert kvledger(["replay", "--db", sqlite_url, "--settings", str(on), "--json"]) == 0
    assert "ceiling" not in json.loads(capsys.readouterr().out)

    assert kvledger(["replay", "--db", sqlite_url, "--settings", str(on), "--ceiling"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("ceiling of the same window"):].splitlines()
    assert table[1].split()[:4] == ["policy", "requests", "request_blocks", "hit_blocks"]
    assert [line.split()[0] for line in table[2:5]] == ["oracle", "round_robin", "achieved"]
    assert table[2].split()[1:4] == [str(expected[0]["requests"]), str(expected[0]["request_blocks"]),
                                     str(expected[0]["hit_blocks"])]

    assert kvledger(["replay", "--db", sqlite_url, "--settings", str(on), "--ceiling", "--json",
                     "--from", "2000-01-01", "--to", "2000-01-02"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["replayed"] == 0 and printed["ceiling"] == empty
