"""The commands a newcomer meets first: `kvledger demo` and `kvledger up`, as real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from services import free_ports


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLEDGER_")}
    env.update(extra)
    return env


def test_the_demo_runs_end_to_end_and_prints_a_summary(tmp_path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvledger.cli", "demo", "--duration", "4", "--workers", "2"],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    for line in ("batches bridged (in SQL)", "decisions recorded", "prefix hit rate with kvledger",
                 "prefix hit rate round-robin", "kvledger audit workers --db sqlite:///.kvledger/demo/ledger.db"):
        assert line in out
    assert (tmp_path / ".kvledger" / "demo" / "ledger.db").is_file()
    workers = subprocess.run(
        [sys.executable, "-m", "kvledger.cli", "audit", "workers", "--db", "sqlite:///.kvledger/demo/ledger.db"],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=60,
    )
    assert workers.returncode == 0 and "sim-0" in workers.stdout and "sim-1" in workers.stdout


def test_up_runs_every_stage_stops_cleanly_on_sigterm_and_resumes(nats_server, tmp_path) -> None:
    ingest_port, store_port, decide_port = free_ports(3)
    env = clean_env(KVLEDGER_INGEST_HTTP_PORT=str(ingest_port), KVLEDGER_STORE_HTTP_PORT=str(store_port),
                    KVLEDGER_DECIDE_HTTP_PORT=str(decide_port))
    args = [sys.executable, "-m", "kvledger.cli", "up", "--nats", nats_server.url]
    for round_ in range(2):
        process = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        log = []
        deadline = time.monotonic() + 60
        for line in process.stdout:
            log.append(line)
            if "decide: ready at inventory_seq" in line or time.monotonic() > deadline:
                break
        process.send_signal(signal.SIGTERM)
        rest, _ = process.communicate(timeout=60)
        output = "".join(log) + rest
        assert process.returncode == 0, output[-3000:]
        assert "decide: ready at inventory_seq" in output
        assert (tmp_path / ".kvledger" / "ledger.db").is_file()
        if round_ == 1:
            assert "fold rebuilt from SQL" in output  # the second run resumed from the same database
