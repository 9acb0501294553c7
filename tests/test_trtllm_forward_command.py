"""`kvledger trtllm-forward` as a process: it polls the LLM its --llm factory builds and publishes what
TensorRT-LLM's serializer returned as vLLM-format ZMQ, replayable, and stops cleanly on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import zmq

from engines import engine_endpoints
from kvledger.engines.trtllm_forwarder import TrtllmEventMapper
from kvledger.ingest.wire import Engine, decode_payload, split_replay_frames

HERE = Path(__file__).parent
FIXTURE = HERE / "golden" / "trtllm" / "pull_host_tier.json"


def test_the_command_publishes_the_llms_events_and_replays_them() -> None:
    pub, replay = engine_endpoints()
    doc = json.loads(FIXTURE.read_text())
    mapper = TrtllmEventMapper(doc["block_size"])
    expected = [list(batch.events) for poll in doc["polls"] for batch in mapper.map(poll)]
    env = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "TRTLLM_FAKE_FIXTURE": FIXTURE.name}
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub)  # before the forwarder binds: ZMQ retries, and nothing it sends is missed
    process = subprocess.Popen(
        [sys.executable, "-m", "kvledger.app.cli", "trtllm-forward", "--llm", "trtllm_fake_llm:build",
         "--endpoint", pub, "--replay", replay, "--block-size", str(doc["block_size"])],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    dealer = context.socket(zmq.DEALER)
    try:
        deadline, received = time.monotonic() + 20, []
        while len(received) < len(expected) and time.monotonic() < deadline:
            if sub.poll(200):
                received.append(sub.recv_multipart())
        # A SUB may join after the first batches went out: the replay socket has them all.
        dealer.connect(replay)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replies = []
        while dealer.poll(5000):
            reply = split_replay_frames(dealer.recv_multipart())
            if reply.seq is None:
                break
            replies.append(reply)
        assert [reply.seq for reply in replies] == list(range(len(expected)))
        for reply, events in zip(replies, expected):
            assert msgspec.msgpack.decode(reply.payload)[1] == events
            assert decode_payload(reply.payload, engine=Engine.TRTLLM).rejected == ()
        assert [frame[1:] for frame in received] == [
            [r.seq.to_bytes(8, "big"), r.payload] for r in replies[len(replies) - len(received):]]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0, process.stdout.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        sub.close(linger=0)
        dealer.close(linger=0)
