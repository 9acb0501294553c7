"""Fault tests: kill -9 of the projector mid-run, and of PostgreSQL under it.

The projector runs as its own process (`kvledger store`), the way it runs in production;
after each fault the database must be identical (row counts and a content digest) to a
clean run's.
"""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest

from services import free_ports
from store_harness import StoreProcess, checkpoint, content_digest, poll, project, publish, recorded_stream, store_settings

pytestmark = pytest.mark.service

STREAM_BATCHES = 6000
# Small transactions, so a kill lands between or inside one of many.
TRANSACTION_MESSAGES = 8


def projector_process(nats_url: str, db_url: str, log_path: Path, http_port: int = 0) -> StoreProcess:
    """`kvledger store` as a child process, projecting TRANSACTION_MESSAGES messages per transaction."""
    return StoreProcess(nats_url, db_url, log_path, environment={
        "KVLEDGER_STORE_BATCH_SIZE": str(TRANSACTION_MESSAGES), "KVLEDGER_STORE_HTTP_PORT": str(http_port)})


def _writers_of(url: str) -> list[int]:
    """Live `python -m kvledger.store.writer` processes writing to `url`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            arguments = (entry / "cmdline").read_bytes().split(b"\0")
            state = next(line for line in (entry / "status").read_text().splitlines() if line.startswith("State:"))
        except (OSError, StopIteration):
            continue
        if b"kvledger.store.writer" in arguments and url.encode() in arguments and "zombie" not in state:
            found.append(int(entry.name))
    return found


def _past(url: str, seq: int, process: StoreProcess):
    def condition() -> bool:
        if not process.alive():
            raise AssertionError(f"projector exited with {process.process.returncode}:\n{process.log()}")
        return checkpoint(url) >= seq

    return condition


async def test_kill_9_of_the_projector_mid_run_loses_and_duplicates_nothing(nats_server, db_pair, tmp_path) -> None:
    faulty, clean = db_pair
    stream = recorded_stream(seed=11, batches=STREAM_BATCHES)
    last = await publish(nats_server.url, stream)
    await project(store_settings(nats_server.url, clean, batch_size=TRANSACTION_MESSAGES * 16), last)

    first = projector_process(nats_server.url, faulty, tmp_path / "projector-1.log")
    try:
        await poll(_past(faulty, last // 4, first), "a quarter of the stream")
        assert _writers_of(faulty), "the projector's SQL writer child should be running"
    finally:
        first.kill()
    # The SQL writer child dies with the projector (it would otherwise finish a transaction).
    await poll(lambda: not _writers_of(faulty), "the writer process to die with the projector")
    at_kill = checkpoint(faulty)
    assert 0 < at_kill < last, "the projector finished before it could be killed; make the stream longer"

    second = projector_process(nats_server.url, faulty, tmp_path / "projector-2.log")
    try:
        await poll(_past(faulty, last, second), "the whole stream after the restart")
    finally:
        assert second.terminate() == 0, second.log()
    assert "fold rebuilt from SQL at stream seq" in second.log()
    assert content_digest(faulty) == content_digest(clean)


@pytest.mark.parametrize("db_pair", ["postgres"], indirect=True)
async def test_kill_9_of_postgres_under_the_projector_recovers_by_itself(
    nats_server, postgres_server, db_pair, tmp_path
) -> None:
    faulty, clean = db_pair
    stream = recorded_stream(seed=13, batches=STREAM_BATCHES)
    last = await publish(nats_server.url, stream)
    await project(store_settings(nats_server.url, clean, batch_size=TRANSACTION_MESSAGES * 16), last)

    (port,) = free_ports(1)
    projector = projector_process(nats_server.url, faulty, tmp_path / "projector.log", http_port=port)

    def database_errors() -> float:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
                text = response.read().decode()
        except OSError:
            return 0.0
        for line in text.splitlines():
            if line.startswith("kvledger_store_database_errors_total "):
                return float(line.split()[1])
        return 0.0

    try:
        await poll(_past(faulty, last // 4, projector), "a quarter of the stream")
        postgres_server.kill()
        # The projector must notice the outage (and survive it) before the server returns.
        await poll(lambda: projector.alive() and database_errors() > 0, "the projector to see the outage")
        postgres_server.restart()
        await poll(_past(faulty, last, projector), "the whole stream after the database returned")
    finally:
        postgres_server.ensure_running()
        returncode = projector.terminate()
    assert returncode == 0, projector.log()
    assert content_digest(faulty) == content_digest(clean)
