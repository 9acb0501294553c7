"""The commands a newcomer meets first: `kvledger demo` and `kvledger up`, as real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from services import child_processes, free_ports, process_ended


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLEDGER_")}
    env.update(extra)
    return env


def test_the_demo_runs_end_to_end_and_prints_a_summary(tmp_path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvledger.app.cli", "demo", "--duration", "4", "--workers", "2"],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    for line in ("batches bridged (in SQL)", "decisions recorded", "prefix hit rate with kvledger",
                 "prefix hit rate round-robin", "stale-hint rate at 500 ms", "lost-credit rate at 500 ms",
                 "kvledger audit workers --db sqlite:///.kvledger/demo/ledger.db"):
        assert line in out
    assert (tmp_path / ".kvledger" / "demo" / "ledger.db").is_file()
    workers = subprocess.run(
        [sys.executable, "-m", "kvledger.app.cli", "audit", "workers", "--db", "sqlite:///.kvledger/demo/ledger.db"],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=60,
    )
    assert workers.returncode == 0 and "sim-0" in workers.stdout and "sim-1" in workers.stdout


def _publish_one_batch(nats_url: str) -> None:
    import asyncio

    import nats

    from builders import Stream, stored
    from kvledger.core.events import WorkerId, encode_batch

    async def publish() -> None:
        nc = await nats.connect(nats_url)
        batch, _ = Stream().batch(WorkerId("up-test"), stored([1, 2]))
        await nc.jetstream().publish(batch.subject, encode_batch(batch), headers={"Nats-Msg-Id": batch.msg_id})
        await nc.close()

    asyncio.run(publish())


def _checkpoint(db_path) -> int:
    import sqlite3

    with sqlite3.connect(db_path) as connection:
        row = connection.execute("SELECT MAX(stream_seq) FROM checkpoints WHERE stream = 'KV_EVENTS'").fetchone()
    return row[0] or 0


def test_up_runs_every_stage_stops_cleanly_on_sigterm_and_resumes(nats_server, tmp_path) -> None:
    ingest_port, store_port, decide_port = free_ports(3)
    env = clean_env(KVLEDGER_INGEST_HTTP_PORT=str(ingest_port), KVLEDGER_STORE_HTTP_PORT=str(store_port),
                    KVLEDGER_DECIDE_HTTP_PORT=str(decide_port))
    args = [sys.executable, "-m", "kvledger.app.cli", "up", "--nats", nats_server.url]
    database = tmp_path / ".kvledger" / "ledger.db"
    for round_ in range(2):
        process = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        log = []
        waiting_for = {"decide: ready at inventory_seq", "fold rebuilt from SQL"}
        for line in process.stdout:
            log.append(line)
            waiting_for = {marker for marker in waiting_for if marker not in line}
            if not waiting_for:
                break
        assert not waiting_for, "".join(log)[-3000:]
        if round_ == 0:
            _publish_one_batch(nats_server.url)
            deadline = time.monotonic() + 30
            while _checkpoint(database) < 1:
                assert time.monotonic() < deadline, "the store did not project the batch"
                time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        rest, _ = process.communicate(timeout=60)
        output = "".join(log) + rest
        assert process.returncode == 0, output[-3000:]
        if round_ == 1:
            # the second run resumed from the same database, where the first one stopped
            assert "fold rebuilt from SQL at stream seq 1" in output
            assert "decide: ready at inventory_seq 1" in output


def test_the_demo_with_reuse_places_round_robin_and_asks_for_transfers(tmp_path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvledger.app.cli", "demo", "--duration", "4", "--workers", "3", "--enable-reuse"],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "round-robin + kvledger reuse" in result.stdout
    chosen = next(line for line in result.stdout.splitlines() if "reuse candidates chosen" in line)
    assert int(chosen.split("│")[2].strip()) > 0, chosen


def test_a_killed_demo_leaves_no_nats_server_behind(tmp_path) -> None:
    """`kill -9` of `kvledger demo` (or `up`): its embedded nats-server ends too, instead of keeping the port and
    the store from the next start (the kernel's parent-death signal), and so do decide's index readers and the
    demo's store process (with its SQL writer)."""
    readers_port, decide_port = free_ports(2)
    env = clean_env(KVLEDGER_DECIDE_INDEX_READERS="2", KVLEDGER_DECIDE_INDEX_READERS_PORT=str(readers_port),
                    KVLEDGER_DECIDE_HTTP_PORT=str(decide_port))
    demo = subprocess.Popen([sys.executable, "-m", "kvledger.app.cli", "demo", "--duration", "120", "--workers", "2"],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            children = {pid: name for pid, (name, _) in child_processes(demo.pid).items()
                        if name in ("nats-server", "kvledger-reader", "kvledger-store")}
            stores = [pid for pid, name in children.items() if name == "kvledger-store"]
            writers = {pid: name for store in stores for pid, (name, _) in child_processes(store).items()}
            if list(children.values()).count("kvledger-reader") == 2 and writers:
                break
            assert demo.poll() is None and time.monotonic() < deadline, "the demo's readers and store did not start"
            time.sleep(0.1)
        assert sorted(children.values()) == ["kvledger-reader", "kvledger-reader", "kvledger-store", "nats-server"]
        children |= writers
    finally:
        demo.kill()
        demo.wait()
    deadline = time.monotonic() + 20
    while not all(process_ended(pid) for pid in children):
        assert time.monotonic() < deadline, {pid: children[pid] for pid in children if not process_ended(pid)}
        time.sleep(0.1)
