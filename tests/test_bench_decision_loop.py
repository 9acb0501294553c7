"""bench/decision_loop.py at a tiny size: the fleet's ledger generated, projected with judging off and on,
audited and replayed, on SQLite (a smoke test that the benchmark runs, not a measurement)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DECISIONS = 300


def test_decision_loop_runs_at_a_tiny_size(nats_source) -> None:
    # nats_source: skipped (or failed, services required) where no nats-server is found; the script starts its own.
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "decision_loop.py"), "--decisions", str(DECISIONS), "--workers", "64",
         "--db", "sqlite", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout)
    [size] = report["sizes"]
    assert size["decisions"] == DECISIONS
    ledger = size["ledger"]
    assert ledger["workers"] == 64 and ledger["event_batches"] > 0 and ledger["block_events"] > 0
    assert ledger["horizon_ms"] >= 1
    figures = size["sqlite"]
    projection = figures["projection"]
    assert projection["judging_off_s"] > 0 and projection["judging_on_s"] > 0 and projection["bulk_load_s"] > 0
    assert projection["judging_off_cpu_s"] > 0 and projection["judging_on_cpu_s"] > 0 and projection["turns"] == 2
    # The kept projection by tenths of the ledger: ten spans (a tiny ledger passes most tenths at once).
    tenths = projection["tenths_s"]
    assert len(tenths) == 10 and min(tenths) >= 0 and sum(tenths) > 0
    assert 0 <= projection["judging_on_system_cpu_s"] <= projection["judging_on_cpu_s"]
    # Every decision judged once at the horizon (the closing batch settles the last ones), some of them hints.
    verdicts = figures["verdicts"]
    assert verdicts["verdicts"] == DECISIONS == verdicts["by_fold"] + verdicts["by_sql"]
    assert verdicts["hints"] > 0 and verdicts["credited"] > 0
    assert figures["size"]["decision_tables_bytes_per_decision"] > 0
    assert figures["audit"]["decisions_per_s"] > 0
    replay = figures["replay"]
    assert replay["replayed"] == DECISIONS and replay["unreplayable"] == 0
    assert replay["one_decisions_per_s"] > 0 and replay["four_decisions_per_s_per_setting"] > 0
