"""decide's index readers (decide/serving/readers.py): Dynamo's indexer API answered by other processes
from decide's index in shared memory, exactly as decide answers it, through churn, restarts and kill -9."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time

import aiohttp
import pytest

from kvledger.decide.serving.readers import READER_NAME, ask_decide, remove_stale_socket_folders
from kvledger.decide.serving.service import DecideService
from kvledger.decide.startup import StartupError
from kvledger.ingest.bridge import Bridge
from kvledger.runtime.http import Request
from engines import wait_until
from pipeline import pipeline_settings
from services import child_processes, free_ports, process_ended
from test_dynamo_indexer_dropin import SIM_MODEL, SIM_RANKS, BLOCK, SimWorker, sim_engines, sim_paths, sim_queries

TOKEN = "reader-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="index readers are Linux only")


async def ask(session: aiohttp.ClientSession, port: int, method: str, path: str, body: object = None,
              headers: dict[str, str] | None = None) -> tuple[int, object]:
    async with session.request(method, f"http://127.0.0.1:{port}{path}", json=body,
                               headers=AUTH if headers is None else headers) as response:
        text = await response.text()
        with contextlib.suppress(ValueError):
            return response.status, await response.json(content_type=None)
        return response.status, text


def reader_pids(parent: int) -> list[int]:
    return [pid for pid, (name, _) in child_processes(parent).items() if name == READER_NAME.decode()]


async def test_readers_answer_as_decide_through_churn_and_a_killed_reader(nats_server) -> None:
    rng = random.Random(7)
    engines, sources = await sim_engines()
    [readers_port] = free_ports(1)
    settings = pipeline_settings(nats_server.url, "sqlite://", **{
        "decide.http_token": TOKEN, "decide.backend": "cpu", "decide.index_readers": 2,
        "decide.index_readers_port": readers_port, "decide.http_host": "127.0.0.1"})
    try:
        async with Bridge(settings, sources) as bridge, DecideService(settings) as service, \
                aiohttp.ClientSession() as session:
            await bridge.wait_ready(timeout=30)
            await service.wait_ready(timeout=60)
            main = service.http_port

            async def readers_up() -> bool:
                with contextlib.suppress(aiohttp.ClientError):
                    return (await ask(session, readers_port, "GET", "/health"))[0] == 200
                return False

            await wait_until(readers_up, 60, "the index readers answering /health")
            # Registered through the readers: decide holds the registrations, both ports see them.
            for (instance, rank) in engines:
                status, _ = await ask(session, readers_port, "POST", "/register", {
                    "instance_id": instance, "endpoint": "tcp://127.0.0.1:1", "model_name": SIM_MODEL,
                    "block_size": BLOCK, "dp_rank": rank})
                assert status == 201
            assert service.dynamo.registry.instances.keys() == set(SIM_RANKS)
            assert await ask(session, readers_port, "GET", "/workers") == await ask(session, main, "GET", "/workers")

            # Churn: the engines publish while the readers are asked; every answer is whole and well-formed.
            paths = sim_paths(rng)
            queries = sim_queries(rng, paths)
            workers = {key: SimWorker(engine) for key, engine in engines.items()}
            answered = 0
            for _ in range(12):
                for worker in workers.values():
                    for _ in range(5):
                        await worker.step(rng, paths)
                for query in rng.sample(queries, 20):
                    status, answer = await ask(session, readers_port, "POST", "/query", query)
                    assert status == 200 and set(answer) == {"scores", "frequencies", "instances"}
                    answered += 1

            # Settled: every query answered alike by decide and by its readers.
            async def settled() -> bool:
                for query in queries:
                    if await ask(session, readers_port, "POST", "/query", query) != \
                            await ask(session, main, "POST", "/query", query):
                        return False
                return True

            await wait_until(settled, 30, "the readers answering every query as decide does")
            passed_on = service.metrics.reader_queries_passed_on.value
            held = 0
            for query in queries:
                on_reader = await ask(session, readers_port, "POST", "/query", query)
                assert on_reader == await ask(session, main, "POST", "/query", query)
                held += bool(on_reader[1]["instances"])
            assert held > len(queries) // 4, "the workload left too little to compare"
            assert service.metrics.reader_queries_passed_on.value == passed_on, "answered by decide, not the readers"
            # A query a reader passes on (decide busy writing) is answered by decide as on its own port.
            body = json.dumps(queries[0]).encode()
            passed = await asyncio.to_thread(ask_decide, service._internal_http_path, Request(  # blocking: decide
                "POST", "/query", {"content-type": "application/json", "authorization": f"Bearer {TOKEN}"}, body))
            assert (passed.status, json.loads(passed.body)) == await ask(session, main, "POST", "/query", queries[0])
            assert service.metrics.reader_queries_passed_on.value == passed_on + 1
            hashed = {"block_hashes": [1, 2, -3], "model_name": SIM_MODEL}
            assert await ask(session, readers_port, "POST", "/query_by_hash", hashed) == \
                await ask(session, main, "POST", "/query_by_hash", hashed)

            # Refusals as decide gives them: unknown model, no token, a malformed body.
            unknown = {"token_ids": [1] * BLOCK, "model_name": "no-such-model"}
            assert await ask(session, readers_port, "POST", "/query", unknown) == \
                await ask(session, main, "POST", "/query", unknown)
            assert (await ask(session, readers_port, "POST", "/query", queries[0], headers={}))[0] == 401
            async with session.post(f"http://127.0.0.1:{readers_port}/query", data=b"{not json",
                                    headers={**AUTH, "Content-Type": "application/json"}) as response:
                assert response.status == 400

            # Unregistered through a reader: gone from both.
            status, _ = await ask(session, readers_port, "POST", "/unregister",
                                  {"instance_id": 3, "model_name": SIM_MODEL})
            assert status == 200 and 3 not in service.dynamo.registry.instances
            for query in queries[:20]:
                assert await ask(session, readers_port, "POST", "/query", query) == \
                    await ask(session, main, "POST", "/query", query)

            # kill -9 of a reader: the other answers meanwhile, decide starts it again.
            victim = service.readers.processes[0]
            os.kill(victim.pid, signal.SIGKILL)
            await wait_until(lambda: service.metrics.reader_restarts.value >= 1, 10, "the reader started again")
            # (The reader started again is a new interpreter: it takes its name once its imports are done.)
            await wait_until(lambda: len(reader_pids(os.getpid())) == 2, 30, "two readers again")
            for query in queries[:20]:
                assert await ask(session, readers_port, "POST", "/query", query) == \
                    await ask(session, main, "POST", "/query", query)
            assert answered == 12 * 20
    finally:
        for engine in engines.values():
            await engine.__aexit__(None, None, None)


async def test_readers_end_with_a_killed_decide(nats_server) -> None:
    http_port, readers_port = free_ports(2)
    env = {key: value for key, value in os.environ.items() if not key.startswith("KVLEDGER_")}
    env.update({"KVLEDGER_DECIDE_HTTP_PORT": str(http_port), "KVLEDGER_DECIDE_INDEX_READERS": "2",
                "KVLEDGER_DECIDE_INDEX_READERS_PORT": str(readers_port), "KVLEDGER_DECIDE_BACKEND": "cpu",
                "KVLEDGER_DECIDE_HTTP_HOST": "127.0.0.1"})
    decide = subprocess.Popen([sys.executable, "-m", "kvledger.app.cli", "decide", "--nats", nats_server.url],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        async with aiohttp.ClientSession() as session:
            async def up() -> bool:
                with contextlib.suppress(aiohttp.ClientError):
                    return (await ask(session, readers_port, "GET", "/health", headers={}))[0] == 200
                return False

            await wait_until(up, 90, "decide's index readers answering")
            pids = reader_pids(decide.pid)
            assert len(pids) == 2
            decide.kill()
            decide.wait()

            def gone() -> bool:
                return all(process_ended(pid) for pid in pids)

            deadline = time.monotonic() + 10
            while not gone() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert gone(), "the index readers outlived decide"
            with pytest.raises(aiohttp.ClientConnectionError):
                await ask(session, readers_port, "GET", "/health", headers={})
    finally:
        if decide.poll() is None:
            decide.kill()
            decide.wait()


async def test_a_readers_port_equal_to_decides_own_is_refused(nats_server) -> None:
    [port] = free_ports(1)
    settings = pipeline_settings(nats_server.url, "sqlite://", **{
        "decide.backend": "cpu", "decide.index_readers": 1, "decide.index_readers_port": port, "decide.http_port": port})
    with pytest.raises(StartupError, match="decide.index_readers_port must differ from decide.http_port"):
        async with DecideService(settings):
            pass


def test_a_killed_decide_s_socket_folder_is_removed_by_the_next(tmp_path) -> None:
    """A decide killed by SIGKILL leaves its private socket folder; the next decide's start removes the folders
    of processes that no longer run, this user's only, and leaves the rest."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = tmp_path / f"kvledger-decide-{gone.pid}-abc"
    running = tmp_path / f"kvledger-decide-{os.getpid()}-def"
    other = tmp_path / "kvledger-decide-notapid"
    for folder in (stale, running, other):
        folder.mkdir()
        (folder / "index.sock").touch()
    assert remove_stale_socket_folders(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and running.exists() and other.exists()
