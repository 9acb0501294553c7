"""docker/compose.yml and compose.cluster.yml brought up for a test, as a user would run them.

Each stack gets fresh secrets, the images the environment names (official by default; CI's
stand-ins from docker/build-ci-images.sh), the kvledger image of this checkout
(images.kvledger_image) and an override that leaves every host port to Docker, so runs
never collide; `down` removes its containers and volumes.
"""

from __future__ import annotations

import contextlib
from http.client import HTTPException
import os
import secrets
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import sqlalchemy as sa

import services
from images import REPO, TAG, kvledger_image

SECRETS = ("KVLEDGER_NATS_INGEST_PASSWORD", "KVLEDGER_NATS_STORE_PASSWORD", "KVLEDGER_NATS_DECIDE_PASSWORD",
           "KVLEDGER_NATS_ROUTER_PASSWORD", "KVLEDGER_DECIDE_HTTP_TOKEN", "POSTGRES_PASSWORD")
READY_TIMEOUT_S = 180.0


def require_compose() -> None:
    """Raise ServiceUnavailable unless a Docker engine answers and the compose plugin runs."""
    services.container_source("compose stack", "docker compose")
    try:
        found = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        found = False
    if not found:
        raise services.ServiceUnavailable("a Docker engine answers but `docker compose` does not (install the compose plugin)")


class ComposeStack:
    """One compose project: its commands, published ports, logs, and SQL."""

    def __init__(self, compose_file: Path, project: str, environment: dict[str, str], override: Path) -> None:
        self.project = project
        self.environment = {**os.environ, **environment}
        self.files = ["-f", str(compose_file), "-f", str(override)]

    def compose(self, *arguments: str, timeout: float = 300) -> str:
        result = subprocess.run(["docker", "compose", "-p", self.project, *self.files, *arguments],
                                env=self.environment, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"docker compose {' '.join(arguments)} exited {result.returncode}:\n{result.stderr[-4000:]}")
        return result.stdout

    def port(self, service: str, container_port: int) -> int:
        """The host port Docker published `container_port` of `service` on (127.0.0.1)."""
        return int(self.compose("port", service, str(container_port)).strip().rsplit(":", 1)[1])

    def container(self, service: str) -> str:
        return self.compose("ps", "--quiet", service).strip()

    def service_log(self, service: str) -> str:
        return self.compose("logs", "--no-color", service)

    def logs(self) -> str:
        try:
            return self.compose("logs", "--no-color", "--tail", "30")
        except RuntimeError as failure:
            return str(failure)

    def await_ready(self, service: str, container_port: int) -> float:
        """Seconds until the service's /readyz answers 200 (from now).

        A stage that started before NATS could answer exits and is restarted by compose; while
        it restarts it has no published port (and may get another one), so the port is asked
        again on every try.
        """
        started = time.monotonic()
        while True:
            try:
                if http(f"http://127.0.0.1:{self.port(service, container_port)}/readyz")[0] == 200:
                    return time.monotonic() - started
            except RuntimeError:
                pass  # restarting: no port published right now
            if time.monotonic() - started > READY_TIMEOUT_S:
                raise AssertionError(f"{service} not ready after {READY_TIMEOUT_S:.0f} s:\n{self.logs()}")
            time.sleep(0.2)

    def sql_engine(self) -> sa.Engine:
        """An SQLAlchemy engine on the stack's PostgreSQL (published by the override)."""
        password = self.environment["POSTGRES_PASSWORD"]
        return sa.create_engine(
            f"postgresql+psycopg://kvledger:{password}@127.0.0.1:{self.port('postgres', 5432)}/kvledger")


@contextlib.contextmanager
def compose_stack(compose_file: Path, override_text: str, directory: Path, **environment: str) -> Iterator[ComposeStack]:
    """`docker compose up` of `compose_file` with `override_text` beside it; down (volumes too) afterwards."""
    kvledger_image()
    override = directory / "override.yml"
    override.write_text(override_text)
    values = {name: secrets.token_hex(16) for name in SECRETS}
    values |= {
        "KVLEDGER_TAG": TAG,
        "KVLEDGER_NATS_IMAGE": services.nats_image(os.environ),
        "KVLEDGER_POSTGRES_IMAGE": services.postgres_image(os.environ),
        **environment,
    }
    stack = ComposeStack(compose_file, f"kvledger-test-{secrets.token_hex(4)}", values, override)
    try:
        stack.compose("up", "--detach", "--no-build", "--quiet-pull")
        yield stack
    except BaseException:
        print(stack.logs())
        raise
    finally:
        stack.compose("down", "--volumes", "--remove-orphans", "--timeout", "10")


def http(url: str, body: bytes | None = None, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """Status and body of a GET (or a POST of `body`); 0 when nothing answers."""
    request = urllib.request.Request(url, data=body, headers=headers or {}, method="POST" if body else "GET")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as refused:
        return refused.code, refused.read()
    except (OSError, HTTPException):  # nothing, or something else than HTTP, answers
        return 0, b""


COMPOSE_FILE = REPO / "docker" / "compose.yml"
CLUSTER_COMPOSE_FILE = REPO / "docker" / "compose.cluster.yml"
