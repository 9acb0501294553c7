"""bench/router_index.py at a tiny size: both indexers built from the same engines, compared, loaded at
two concurrencies, killed and restarted, decide alone and with an index reader answering (a smoke test that
the benchmark runs, not a measurement)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("dynamo.llm", reason="ai-dynamo-runtime is not installed")


@pytest.mark.parametrize("readers", [0, 1], ids=["decide alone", "an index reader"])
def test_router_index_runs_at_a_tiny_size(nats_source, readers: int) -> None:
    # nats_source: skipped (or failed, services required) where no nats-server is found; the script starts its own.
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "router_index.py"), "--workers", "2", "--prompts", "20", "--chain", "4",
         "--clients", "1,4", "--seconds", "0.3", "--rounds", "2", "--queries", "50", "--compared", "20", "--restart",
         "--readers", str(readers), "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "DYN_LOG": "error"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout)
    assert report["residencies"] == 2 * 20 * 4 and report["matched_tokens"] > 0
    for clients in ("1", "4"):
        figures = report["load"][clients]
        assert figures["kvledger"]["qps_median"] > 0 and figures["dynamo"]["qps_median"] > 0
        assert figures["ratio_qps"] > 0 and figures["kvledger"]["p99_ms"] >= figures["kvledger"]["p50_ms"]
    assert report["memory"]["kvledger"]["rss_bytes"] > 0 and report["memory"]["dynamo"]["rss_bytes"] > 0
    # kvledger comes back from KV_EVENTS with everything it answered before.
    assert report["restart"]["kvledger"]["kept"] == 1.0
