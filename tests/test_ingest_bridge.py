"""ingest end to end over real ZMQ sockets and a real nats-server with JetStream."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest
import zmq
import zmq.asyncio

from services import free_ports
from engines import engine_endpoints, http_get, one_block, read_batches, read_stream, settings_for, wait_until
from kvledger.core.events import Gap, GapReason, Provenance, Stored, Tier, WorkerId, decode_dead_letter
from kvledger.ingest.bridge import Bridge
from kvledger.ingest.endpoints import StreamSource
from kvledger.ingest.replay_client import ReplayClient
from kvledger.ingest.subscriber import EngineSubscriber
from kvledger.sim.engine import SimulatedEngine
from kvledger.sim.vllm import VllmAllBlocksCleared, VllmBlockRemoved


def source(worker: WorkerId, engine: SimulatedEngine) -> StreamSource:
    return StreamSource(worker, engine.pub_endpoint, engine.replay_endpoint, Provenance.NATIVE)


def gaps_of(batches) -> list[Gap]:
    return [event for batch in batches for event in batch.events if isinstance(event, Gap)]


async def test_one_shot_events_after_readiness_reach_the_stream_with_their_tiers(nats_server) -> None:
    pub, replay = engine_endpoints()
    async with SimulatedEngine(pub, replay) as engine:
        async with Bridge(settings_for(nats_server.url), [source(WorkerId("vllm-a"), engine)]) as bridge:
            await bridge.wait_ready(timeout=10)
            await engine.publish([one_block(1, "GPU")])
            await engine.publish([one_block(2, "CPU")])
            batches = await wait_until(lambda: _two(read_batches(nats_server.url)), 5.0, "both one-shot batches")
    tiers = [event.tier for batch in batches for event in batch.events if isinstance(event, Stored)]
    assert tiers == [Tier.DEVICE, Tier.HOST]
    assert [b.seq for b in batches] == [0, 1] and all(b.epoch == 0 for b in batches)
    assert gaps_of(batches) == []


async def _two(coroutine):
    batches = await coroutine
    return batches if len(batches) >= 2 else None


async def _received_within(sock: zmq.asyncio.Socket, timeout_s: float) -> list[bytes] | None:
    return await sock.recv_multipart() if await sock.poll(timeout_s * 1000) else None


async def test_a_late_subscriber_loses_one_shot_events_unless_it_awaits_the_handshake() -> None:
    context = zmq.asyncio.Context()
    pub_endpoint, replay_endpoint = engine_endpoints()
    try:
        async with SimulatedEngine(pub_endpoint, replay_endpoint, context=context) as engine:
            # A subscriber that is late (still joining when the engine sends): ZMQ PUB sends
            # only to subscriptions it already holds, so the one-shot event is gone for good.
            await engine.publish([one_block(1)])
            hasty = context.socket(zmq.SUB)
            hasty.setsockopt(zmq.SUBSCRIBE, b"")
            hasty.connect(engine.pub_endpoint)
            assert await _received_within(hasty, 0.5) is None, "the one-shot event should have been lost"
            hasty.close(linger=0)
            # With ingest's barrier: the handshake completed, then one round trip to the
            # engine (the catch-up replay), by which time the engine holds our subscription.
            async with EngineSubscriber(engine.pub_endpoint, context) as patient:
                await asyncio.wait_for(patient.connected.wait(), 5)
                assert [seq for seq, _ in await ReplayClient(engine.replay_endpoint, context).fetch(0)] == [0]
                await engine.publish([one_block(2)])
                frames = await patient.recv(5.0)
            assert frames is not None and int.from_bytes(frames[1], "big") == 1
    finally:
        context.destroy(linger=0)


async def test_batches_sent_before_ingest_started_are_replayed_from_seq_zero(nats_server) -> None:
    pub, replay = engine_endpoints()
    async with SimulatedEngine(pub, replay) as engine:
        for block in range(5):
            await engine.publish([one_block(block)])  # nobody listens yet
        async with Bridge(settings_for(nats_server.url), [source(WorkerId("early"), engine)]) as bridge:
            await bridge.wait_ready(timeout=10)
            await bridge.publisher.flush(10)
    batches = await read_batches(nats_server.url)
    assert [b.seq for b in batches] == [0, 1, 2, 3, 4]
    assert gaps_of(batches) == []


async def test_a_gap_inside_the_replay_buffer_is_repaired_without_a_gap(nats_server) -> None:
    pub, replay = engine_endpoints()
    async with SimulatedEngine(pub, replay) as engine:
        async with Bridge(settings_for(nats_server.url), [source(WorkerId("w"), engine)]) as bridge:
            await bridge.wait_ready(timeout=10)
            await engine.publish([one_block(0)])
            for block in range(1, 4):
                await engine.publish([one_block(block)], send=False)  # lost on the wire
            await engine.publish([one_block(4)])
            await wait_until(lambda: _count(nats_server.url, 5), 10, "5 batches")
            await bridge.publisher.flush(10)
            assert bridge.streams[0].tracker.counters.replays >= 1
    batches = await read_batches(nats_server.url)
    assert [b.seq for b in batches] == [0, 1, 2, 3, 4]
    assert gaps_of(batches) == []


async def _count(url: str, n: int):
    return len(await read_stream(url)) >= n


async def test_a_gap_beyond_the_replay_buffer_is_one_replay_incomplete_gap_plus_what_replay_had(nats_server) -> None:
    pub, replay = engine_endpoints()
    async with SimulatedEngine(pub, replay, buffer_steps=3) as engine:
        async with Bridge(settings_for(nats_server.url), [source(WorkerId("w"), engine)]) as bridge:
            await bridge.wait_ready(timeout=10)
            await engine.publish([one_block(0)])
            for block in range(1, 8):
                await engine.publish([one_block(block)], send=False)
            await engine.publish([one_block(8)])  # the engine now buffers 6, 7, 8
            await wait_until(lambda: _count(nats_server.url, 4), 10, "4 batches")
            await bridge.publisher.flush(10)
    batches = await read_batches(nats_server.url)
    assert [b.seq for b in batches] == [0, 6, 7, 8]
    assert gaps_of(batches) == [Gap(1, 6, GapReason.REPLAY_INCOMPLETE)]
    assert isinstance(batches[1].events[0], Gap)


async def test_an_engine_restart_bumps_the_epoch_with_one_publisher_restart_gap(nats_server) -> None:
    pub, replay = engine_endpoints()
    async with SimulatedEngine(pub, replay) as engine:
        async with Bridge(settings_for(nats_server.url), [source(WorkerId("w"), engine)]) as bridge:
            await bridge.wait_ready(timeout=10)
            for block in range(3):
                await engine.publish([one_block(block)])
            await wait_until(lambda: _count(nats_server.url, 3), 10, "3 batches")
            engine.restart()
            await engine.publish([one_block(100)])
            await engine.publish([VllmBlockRemoved((100,)), VllmAllBlocksCleared()])
            await wait_until(lambda: _count(nats_server.url, 5), 10, "5 batches")
            await bridge.publisher.flush(10)
    batches = await read_batches(nats_server.url)
    assert [(b.epoch, b.seq) for b in batches] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    assert gaps_of(batches) == [Gap(3, 0, GapReason.PUBLISHER_RESTART)]
    assert batches[3].events[0] == Gap(3, 0, GapReason.PUBLISHER_RESTART)
    assert batches[3].msg_id == "w:0:1:0"


async def test_kill_9_of_nats_server_mid_stream_loses_and_duplicates_nothing(nats_server) -> None:
    total, kill_at, restart_at = 20_000, 5_000, 9_000
    pub, replay = engine_endpoints()
    async with SimulatedEngine(pub, replay, buffer_steps=total) as engine:
        settings = settings_for(nats_server.url, **{"ingest.max_buffered_batches": 2000})
        async with Bridge(settings, [source(WorkerId("steady"), engine)]) as bridge:
            await bridge.wait_ready(timeout=10)
            for seq in range(total):
                if seq == kill_at:
                    nats_server.kill()
                if seq == restart_at:
                    await asyncio.to_thread(nats_server.restart)
                await engine.publish([one_block(seq)])
                if seq % 500 == 0:
                    await asyncio.sleep(0)  # let ingest read while the engine runs
            await wait_until(lambda: _count(nats_server.url, total), 90, f"{total} batches")
            await bridge.publisher.flush(30)
            assert bridge.publisher.counters.reconnects >= 1
    batches = await read_batches(nats_server.url)
    assert [b.seq for b in batches] == list(range(total)), "every batch exactly once, in engine order"
    assert gaps_of(batches) == []


async def test_many_publishers_with_dp_ranks_and_one_sending_garbage(nats_server) -> None:
    engines: list[SimulatedEngine] = []
    sources: list[StreamSource] = []
    names = [f"engine-{i:02d}" for i in range(16)]
    ranks = {"engine-03": 2, "engine-07": 3}
    try:
        for name in names:
            pub, replay = engine_endpoints(ranks.get(name, 1))
            for rank in range(ranks.get(name, 1)):
                engine = await SimulatedEngine(pub, replay, dp_rank=rank).__aenter__()
                engines.append(engine)
                sources.append(source(WorkerId(name, rank), engine))
        async with Bridge(settings_for(nats_server.url), sources) as bridge:
            await bridge.wait_ready(timeout=20)
            garbage = next(e for e, s in zip(engines, sources) if s.worker.publisher == "engine-05")
            for round_ in range(5):
                for engine, src in zip(engines, sources):
                    if engine is garbage:
                        await engine.publish_payload(b"\xc1 not msgpack at all")
                        await engine.send_frames([b"only-one-frame"])
                    else:
                        await engine.publish([one_block(round_ * 1000 + src.worker.dp_rank)])
            expected = 5 * len(sources)  # garbage batches still hold their seq (as a Gap)
            await wait_until(lambda: _count(nats_server.url, expected), 20, f"{expected} batches")
            await bridge.publisher.flush(10)
            assert bridge.is_ready()
            assert (await http_get(bridge.http_port, "/readyz"))[0] == 200
            status, metrics = await http_get(bridge.http_port, "/metrics")
    finally:
        for engine in engines:
            await engine.close()
    batches = await read_batches(nats_server.url)
    per_worker: dict[WorkerId, list[int]] = {}
    for batch in batches:
        per_worker.setdefault(batch.worker, []).append(batch.seq)
    assert len(per_worker) == 16 + 1 + 2
    assert all(seqs == [0, 1, 2, 3, 4] for seqs in per_worker.values())
    clean = [b for b in batches if b.worker.publisher != "engine-05"]
    assert all(isinstance(e, Stored) for b in clean for e in b.events)
    dirty = [b for b in batches if b.worker.publisher == "engine-05"]
    assert all(b.events == (Gap(b.seq, b.seq + 1, GapReason.MISSED),) for b in dirty)
    assert status == 200
    assert 'kvledger_ingest_dead_letters_total{publisher="engine-05"} 10.0' in metrics
    assert f"kvledger_ingest_batches_out_total {expected + 10}.0" in metrics  # batches and dead letters
    assert 'kvledger_ingest_gaps_total{reason="missed"} 5.0' in metrics
    assert "kvledger_ingest_ready_streams 19.0" in metrics
    letters = [decode_dead_letter(data) for _, _, data in await read_stream(nats_server.url, "KV_DEAD_LETTERS")]
    assert {letter.publisher for letter in letters} == {"engine-05"}
    reasons = sorted(letter.reason.split(":")[0] for letter in letters)
    assert reasons.count("payload is not msgpack") == 5
    assert reasons.count("expected 3 frames [topic, seq, payload], got 1") == 5
    assert all(letter.frames for letter in letters)


class IngestProcess:
    """`kvledger ingest` as a real process, so it can be SIGKILLed."""

    def __init__(self, nats_url: str, engine: SimulatedEngine, publisher: str) -> None:
        [self.http_port] = free_ports(1)
        self._args = [
            sys.executable, "-m", "kvledger.app.cli", "ingest", "--nats", nats_url,
            "--endpoint", f"{engine.pub_endpoint},replay={engine.replay_endpoint}", "--publisher", publisher,
        ]
        self._env = {k: v for k, v in os.environ.items() if not k.startswith("KVLEDGER_")}
        self._env["KVLEDGER_INGEST_HTTP_PORT"] = str(self.http_port)
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(self._args, env=self._env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    async def ready(self) -> None:
        await wait_until(lambda: self._answers("/readyz"), 20, "ingest /readyz")

    async def started(self) -> None:
        """The health endpoint answers: the bridge has started, its streams have only just begun."""
        await wait_until(lambda: self._answers("/healthz"), 20, "ingest /healthz")

    async def _answers(self, path: str) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"ingest exited: {self.process.stderr.read().decode()[-2000:]}")
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.http_port)
        except OSError:
            return False
        writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
        status = (await reader.readline()).decode()
        writer.close()
        return " 200 " in status

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.kill()  # a hung shutdown must fail the test, not outlive it
            raise AssertionError(f"ingest did not exit within 20 s of SIGTERM: {self.process.stderr.read().decode()[-2000:]}")


async def test_kill_9_of_ingest_resumes_from_jetstream_and_replay(nats_server) -> None:
    pub, replay = engine_endpoints()
    async with SimulatedEngine(pub, replay, buffer_steps=50_000) as engine:
        ingest = IngestProcess(nats_server.url, engine, "crashy")
        ingest.start()
        await ingest.ready()
        for seq in range(3000):
            if seq == 1500:
                ingest.kill()  # whatever it had not yet published is lost with it
            await engine.publish([one_block(seq)])
            if seq % 100 == 0:
                await asyncio.sleep(0.001)
        ingest.start()
        await ingest.ready()
        for seq in range(3000, 4000):
            await engine.publish([one_block(seq)])
        await wait_until(lambda: _count(nats_server.url, 4000), 60, "4000 batches")
        assert ingest.stop() == 0
    batches = await read_batches(nats_server.url)
    assert [b.seq for b in batches] == list(range(4000)), "nothing lost, nothing duplicated, in order"
    assert {b.epoch for b in batches} == {0}
    assert gaps_of(batches) == []


async def test_a_lost_last_message_is_found_by_the_idle_replay_probe(nats_server) -> None:
    pub, replay = engine_endpoints()
    async with SimulatedEngine(pub, replay) as engine:
        async with Bridge(settings_for(nats_server.url), [source(WorkerId("w"), engine)]) as bridge:
            await bridge.wait_ready(timeout=10)
            await engine.publish([one_block(1)])
            await engine.publish([one_block(2)], send=False)  # nothing after it reveals the loss
            await wait_until(lambda: _count(nats_server.url, 2), 10, "the lost tail batch")
            await bridge.publisher.flush(10)
    batches = await read_batches(nats_server.url)
    assert [b.seq for b in batches] == [0, 1] and gaps_of(batches) == []


async def test_readiness_is_observable_before_and_after(nats_server) -> None:
    pub, replay = engine_endpoints()
    async with SimulatedEngine(pub, replay) as engine:
        silent = SimulatedEngine("tcp://127.0.0.1:1", None)  # never started: nothing to connect to
        sources = [source(WorkerId("up"), engine), StreamSource(WorkerId("down"), silent.pub_endpoint, None, Provenance.NATIVE)]
        async with Bridge(settings_for(nats_server.url), sources) as bridge:
            await bridge.streams[0].ready.wait()
            assert not bridge.is_ready()
            assert (await http_get(bridge.http_port, "/readyz"))[0] == 503
            assert (await http_get(bridge.http_port, "/healthz"))[0] == 200
            with pytest.raises(TimeoutError):
                await bridge.wait_ready(timeout=0.5)


@pytest.mark.parametrize("host", ["0.0.0.0", "127.0.0.1"])
async def test_the_health_endpoint_listens_on_the_configured_address(nats_server, host) -> None:
    pub, replay = engine_endpoints()
    async with SimulatedEngine(pub, replay) as engine:
        settings = settings_for(nats_server.url, **{"ingest.http_host": host})
        async with Bridge(settings, [source(WorkerId("bound"), engine)]) as bridge:
            assert bridge._http.address[0] == host
            assert (await http_get(bridge.http_port, "/healthz"))[0] == 200


async def test_a_batch_too_big_for_nats_is_dead_lettered_not_retried_forever(nats_server) -> None:
    from kvledger.sim.vllm import VllmBlockStored

    pub, replay = engine_endpoints()
    huge = VllmBlockStored(tuple(range(2**63, 2**63 + 70_000)), None, tuple(range(70_000)), 1, "GPU")  # > 1 MiB as a record
    async with SimulatedEngine(pub, replay) as engine:
        async with Bridge(settings_for(nats_server.url), [source(WorkerId("big"), engine)]) as bridge:
            await bridge.wait_ready(timeout=10)
            await engine.publish([huge])
            await engine.publish([one_block(1)])
            await wait_until(lambda: _count(nats_server.url, 2), 20, "both batches")
            await bridge.publisher.flush(10)
    batches = await read_batches(nats_server.url)
    assert [b.seq for b in batches] == [0, 1]
    assert batches[0].events == (Gap(0, 1, GapReason.MISSED),)
    assert isinstance(batches[1].events[0], Stored)
    [letter] = [decode_dead_letter(data) for _, _, data in await read_stream(nats_server.url, "KV_DEAD_LETTERS")]
    assert "exceeds the NATS max_payload" in letter.reason
    assert sum(len(frame) for frame in letter.frames) <= 256 * 1024


async def _answer_replays_with_garbage(router: zmq.asyncio.Socket) -> None:
    """A replay socket that answers every request with one badly framed reply and no end marker."""
    while True:
        identity, *_ = await router.recv_multipart()
        await router.send_multipart([identity, b"", b"not a replay reply"])


async def test_replay_and_latency_counters_are_on_metrics(nats_server) -> None:
    context = zmq.asyncio.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:0")
    broken_replay = router.getsockopt_string(zmq.LAST_ENDPOINT)
    answering = asyncio.create_task(_answer_replays_with_garbage(router))
    pub, replay = engine_endpoints()
    other_pub, _ = engine_endpoints()
    try:
        async with SimulatedEngine(pub, replay) as engine, SimulatedEngine(other_pub, None) as other:
            for block in range(3):
                await engine.publish([one_block(block)])  # before ingest: replayed at start
            sources = [
                source(WorkerId("replayed"), engine),
                StreamSource(WorkerId("garbled"), other.pub_endpoint, broken_replay, Provenance.NATIVE),
            ]
            settings = settings_for(nats_server.url, **{"ingest.replay_timeout_s": 0.3})
            async with Bridge(settings, sources) as bridge:
                await bridge.wait_ready(timeout=10)
                await bridge.publisher.flush(10)
                status, metrics = await http_get(bridge.http_port, "/metrics")
    finally:
        answering.cancel()
        router.close(linger=0)
        context.destroy(linger=0)
    assert status == 200
    values = {
        line.split(" ")[0]: float(line.split(" ")[1]) for line in metrics.splitlines() if line and not line.startswith("#")
    }
    assert values["kvledger_ingest_replayed_batches_total"] == 3.0
    assert values["kvledger_ingest_replays_incomplete_total"] >= 1.0  # the garbled replay never ended
    assert values["kvledger_ingest_replay_malformed_replies_total"] >= 1.0
    assert values["kvledger_ingest_publish_latency_seconds_count"] == 3.0
    assert values['kvledger_ingest_publish_latency_seconds_bucket{le="+Inf"}'] == 3.0
    assert values["kvledger_ingest_engine_to_ack_seconds_count"] == 3.0
    assert values["kvledger_ingest_engine_to_ack_seconds_sum"] > 0.0
