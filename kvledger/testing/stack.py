"""`KvledgerStack`: NATS, decide and (optionally) PostgreSQL with store, in containers for a test.

The containers share a Docker network of their own and publish their ports on the host,
each on a port Docker chooses. decide's HTTP API takes a bearer token generated for the
stack; NATS runs without users (a throwaway server on a random port for the test's
duration). Readiness is each service's own signal: nats-server's "Server is ready",
PostgreSQL accepting a connection, `db upgrade` exiting 0, store's and decide's /readyz.
"""

from __future__ import annotations

import json
import secrets
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from http.client import HTTPException
from typing import Any, Self

import nats
import psycopg

from kvledger.core.events import EventBatch
from kvledger.core.settings import Settings
from kvledger.runtime.streams import ensure_stream, events_stream, publish_batches

# Each image from its variable (as docker/compose.yml takes them), else the official one.
IMAGE_VARIABLES = {"kvledger": ("KVLEDGER_IMAGE", "kvledger:latest"), "nats": ("KVLEDGER_NATS_IMAGE", "nats:2.15"),
                   "postgres": ("KVLEDGER_POSTGRES_IMAGE", "postgres:15")}
POLL_INTERVAL_S = 0.2
PROBE_BLOCK_SIZE = 16


def default_image(service: str, variables: Mapping[str, str]) -> str:
    variable, official = IMAGE_VARIABLES[service]
    return variables.get(variable, "").strip() or official


class StackNotReady(RuntimeError):
    """A container of the stack did not become ready; the message carries its log tail."""


class KvledgerStack:
    """`with KvledgerStack() as stack:` NATS and decide (and with `postgres=True`, PostgreSQL,
    its migrations and store) running, ready, and removed afterwards.

    `nats_url`, `decide_url` (HTTP front) with `decide_token`, `sql_url` (with PostgreSQL),
    and `publish_batches` to put engine batches on KV_EVENTS as ingest would.
    """

    def __init__(
        self, image: str | None = None, *, postgres: bool = False, nats_image: str | None = None,
        postgres_image: str | None = None, ready_timeout_s: float = 120.0, environ: Mapping[str, str] = {},
    ) -> None:
        """Images not given come from `environ`'s KVLEDGER_IMAGE, KVLEDGER_NATS_IMAGE and KVLEDGER_POSTGRES_IMAGE
        (pass `os.environ` to let the environment choose), else kvledger:latest (build it from
        docker/Dockerfile), nats:2.15 and postgres:15. Like every part of kvledger but its settings,
        this module reads no environment of its own accord."""
        self.image = image or default_image("kvledger", environ)
        self.nats_image = nats_image or default_image("nats", environ)
        self.postgres_image = (postgres_image or default_image("postgres", environ)) if postgres else None
        self.ready_timeout_s = ready_timeout_s
        self.decide_token = secrets.token_urlsafe(24)
        self.nats_url = ""
        self.decide_url = ""
        self.sql_url: str | None = None
        self._postgres_password = secrets.token_hex(16)
        self._network: Any = None
        self._containers: list[Any] = []

    # --- lifetime ------------------------------------------------------------------------

    def start(self) -> Self:
        """Start every container in dependency order; return once each is ready."""
        from testcontainers.core.network import Network

        try:
            self._network = Network().create()
            nats_container = self._run_nats()
            self.nats_url = f"nats://{self._host(nats_container)}:{nats_container.get_exposed_port(4222)}"
            if self.postgres_image is not None:
                self._run_postgres()
                self._run_store()
            decide = self._run_kvledger(
                "decide", ["decide", "--nats", "nats://nats:4222"], 9103,
                {"KVLEDGER_DECIDE_HTTP_TOKEN": self.decide_token},
            )
            self.decide_url = f"http://{self._host(decide)}:{decide.get_exposed_port(9103)}"
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Remove every container and the network, newest first."""
        while self._containers:
            container = self._containers.pop()
            try:
                container.stop()
            except Exception:  # already gone: nothing left to remove
                pass
        if self._network is not None:
            self._network.remove()
            self._network = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # --- what a test does with it ---------------------------------------------------------

    async def publish_batches(self, batches: Iterable[EventBatch]) -> int:
        """Publish engine batches to KV_EVENTS as ingest does (record bytes, de-duplication id);
        creates the stream if decide has not yet. Returns the last stream seq, which decide's
        answers report as `inventory_seq` once it has applied them."""
        connection = await nats.connect(self.nats_url)
        try:
            js = connection.jetstream()
            await ensure_stream(js, events_stream(Settings().stream))
            return await publish_batches(js, batches)
        finally:
            await connection.close()

    def await_decide_at(self, inventory_seq: int, timeout_s: float = 30.0) -> None:
        """Return once decide's answers reflect the stream up to `inventory_seq` (what
        `publish_batches` returned), so a test's next question sees those batches."""
        body = json.dumps({"request_id": "kvledger-testing-probe", "local_hashes": [],
                           "block_size": PROBE_BLOCK_SIZE}).encode()
        request = urllib.request.Request(
            f"{self.decide_url}/v1/decide", data=body, method="POST",
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.decide_token}"})
        deadline = time.monotonic() + timeout_s
        seen = None
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(request, timeout=5) as response:
                    seen = json.load(response).get("inventory_seq")
            except (OSError, urllib.error.URLError, HTTPException, ValueError):
                seen = None
            if seen is not None and seen >= inventory_seq:
                return
            time.sleep(POLL_INTERVAL_S)
        raise StackNotReady(f"decide not at inventory_seq {inventory_seq} after {timeout_s:.0f} s (last seen: {seen})")

    # --- containers -----------------------------------------------------------------------

    def _container(self, image: str) -> Any:
        from testcontainers.core.container import DockerContainer

        return DockerContainer(image).with_network(self._network)

    def _started(self, container: Any) -> Any:
        self._containers.append(container)
        container.start()
        return container

    def _run_nats(self) -> Any:
        from testcontainers.core.wait_strategies import LogMessageWaitStrategy

        container = (
            self._container(self.nats_image)
            .with_command("-js -sd /data -m 8222")
            .with_network_aliases("nats")
            .with_exposed_ports(4222, 8222)
            .waiting_for(LogMessageWaitStrategy("Server is ready").with_startup_timeout(int(self.ready_timeout_s)))
        )
        return self._started(container)

    def _run_postgres(self) -> None:
        container = (
            self._container(self.postgres_image)
            .with_env("POSTGRES_USER", "kvledger")
            .with_env("POSTGRES_PASSWORD", self._postgres_password)
            .with_env("POSTGRES_DB", "kvledger")
            .with_network_aliases("postgres")
            .with_exposed_ports(5432)
        )
        self._started(container)
        host, port = self._host(container), container.get_exposed_port(5432)
        self.sql_url = f"postgresql+psycopg://kvledger:{self._postgres_password}@{host}:{port}/kvledger"
        libpq = f"postgresql://kvledger:{self._postgres_password}@{host}:{port}/kvledger"
        # Over TCP only the final server answers, not the one the image runs while initialising.
        self._await(container, "PostgreSQL", lambda: _accepts_connections(libpq))

    def _run_store(self) -> None:
        inside = f"postgresql+psycopg://kvledger:{self._postgres_password}@postgres:5432/kvledger"
        migrate = self._started(self._container(self.image).with_command(["db", "upgrade", "--db", inside]))
        status = migrate.get_wrapped_container().wait(timeout=int(self.ready_timeout_s))["StatusCode"]
        if status != 0:
            raise StackNotReady(f"kvledger db upgrade exited {status}:\n{_log_tail(migrate)}")
        self._run_kvledger("store", ["store", "--nats", "nats://nats:4222", "--db", inside], 9102, {})

    def _run_kvledger(self, name: str, command: list[str], port: int, environment: dict[str, str]) -> Any:
        container = self._container(self.image).with_command(command).with_exposed_ports(port)
        for key, value in environment.items():
            container = container.with_env(key, value)
        self._started(container)
        url = f"http://{self._host(container)}:{container.get_exposed_port(port)}/readyz"
        self._await(container, name, lambda: _http_ok(url))
        return container

    def _await(self, container: Any, what: str, ready: Callable[[], bool]) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while not ready():
            wrapped = container.get_wrapped_container()
            wrapped.reload()
            if wrapped.status == "exited" or time.monotonic() > deadline:
                state = "exited" if wrapped.status == "exited" else f"not ready after {self.ready_timeout_s:.0f} s"
                raise StackNotReady(f"{what} {state}; log tail:\n{_log_tail(container)}")
            time.sleep(POLL_INTERVAL_S)

    @staticmethod
    def _host(container: Any) -> str:
        return container.get_container_host_ip()


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError, HTTPException):
        return False


def _accepts_connections(url: str) -> bool:
    try:
        with psycopg.connect(url, connect_timeout=2) as connection:
            connection.execute("SELECT 1")
        return True
    except psycopg.Error:
        return False


def _log_tail(container: Any, lines: int = 30) -> str:
    stdout, stderr = container.get_logs()
    return "\n".join((stdout + stderr).decode(errors="replace").splitlines()[-lines:])


__all__ = ["KvledgerStack", "StackNotReady"]
