"""What TensorRT-LLM really produces, both ways, replayed through kvledger.

`tests/golden/trtllm/*.json` come out of TensorRT-LLM's own code (`record_trtllm.py`):
`zmq_*` are frames its ZMQ publisher sent; `pull_*` are what `get_kv_cache_events()` returned,
poll by poll, which kvledger's forwarder (`kvledger/engines/trtllm_forwarder.py`) publishes. Each carries
the engine's own account of what it holds at the end; the fold, SQL and decide must agree.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvledger.decide.serving.service import DecideService
from engines import engine_endpoints, wait_until
from kvledger.core.decision_codec import request_from_json
from kvledger.core.events import EventBatch, Gap, GapReason, Provenance, Tier, WorkerId
from kvledger.core.fold import InventoryFold
from kvledger.engines.trtllm_forwarder import LEVEL_MEDIUM, TrtllmEventMapper, TrtllmForwarder, encode_batch, forward_kv_events
from kvledger.ingest.bridge import Bridge
from kvledger.ingest.endpoints import StreamSource
from kvledger.ingest.wire import Engine, decode_payload
from kvledger.sim.engine import SimulatedEngine
from pipeline import pipeline_settings
from kvledger.store import database
from kvledger.store.service import StoreService
from test_e2e import REUSE_ON
from test_golden_engines import _checkpoint, _sql_inventory, _sql_scalar, decide_equals_reference, request_body

GOLDEN = Path(__file__).parent / "golden" / "trtllm"
PULL = sorted(GOLDEN.glob("pull_*.json"))
ZMQ = sorted(GOLDEN.glob("zmq_*.json"))
U64 = 1 << 64


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def publisher_of(path: Path) -> str:
    return "trtllm-" + path.stem.replace("_", "-")


class FakeLLM:
    """What the forwarder polls: `get_kv_cache_events_async` yields one recorded poll's events per call."""

    def __init__(self, polls: list[list[dict]]) -> None:
        self.polls = list(polls)
        self.drained = asyncio.Event()

    async def get_kv_cache_events_async(self, timeout: float):
        if not self.polls:
            self.drained.set()
            await asyncio.sleep(min(timeout, 0.01))
            return
        for event in self.polls.pop(0):
            yield event


def frames_of(path: Path) -> tuple[list[tuple[int, int, bytes]], TrtllmEventMapper | None]:
    """(rank, seq, payload) of every batch, as the engine (zmq) or the forwarder (pull) numbers them."""
    doc = load(path)
    if doc["api"] == "zmq":
        return [(0, frame["seq"], bytes.fromhex(frame["payload"])) for frame in doc["frames"]], None
    mapper, out, seqs = TrtllmEventMapper(doc["block_size"]), [], {}
    for poll in doc["polls"]:
        for batch in mapper.map(poll):
            seq = seqs.get(batch.rank, 0) + batch.lost_before
            seqs[batch.rank] = seq + 1
            out.append((batch.rank, seq, encode_batch(0.0, batch.events, batch.rank)))
    return out, mapper


def truth_held(path: Path, mapper: TrtllmEventMapper | None) -> dict[int, set]:
    """Per rank: (tier, group, ownership, engine hash) of every block the engine says it holds."""
    doc, held = load(path), {}
    for row in doc["truth"]["held"]:
        if mapper is None:
            rank, medium, group = 0, row["medium"], row["group_idx"]
        else:
            rank, medium, group = row["attention_dp_rank"], LEVEL_MEDIUM[row["cache_level"]], mapper.group_of(row["window_size"])[0]
        tier = {"GPU": "device", "CPU": "host", "DISK": "disk"}[medium]
        held.setdefault(rank, set()).add((tier, group, None, row["block_hash"] % U64))
    return held


def folded(path: Path) -> tuple[InventoryFold, TrtllmEventMapper | None]:
    fold, last = InventoryFold(), {}
    frames, mapper = frames_of(path)
    for stream_seq, (rank, seq, payload) in enumerate(frames, 1):
        decoded = decode_payload(payload, engine=Engine.TRTLLM)
        assert decoded.rejected == ()
        events = decoded.events
        if seq > last.get(rank, -1) + 1:  # what ingest adds when replay cannot fill a hole
            events = (Gap(last.get(rank, -1) + 1, seq, GapReason.REPLAY_INCOMPLETE), *events)
        last[rank] = seq
        fold.apply(EventBatch(WorkerId(publisher_of(path), rank), 0, seq, 0.0, 0.0, Provenance.NATIVE, events), stream_seq)
    return fold, mapper


def lost_blocks(path: Path) -> set:
    """Blocks whose store event the engine dropped before anyone polled it (pull_event_gap's B)."""
    doc = load(path)
    announced = {block["block_hash"] for poll in doc.get("polls", []) for event in poll
                 if event["data"]["type"] == "stored" for block in event["data"]["blocks"]}
    return {row["block_hash"] % U64 for row in doc["truth"]["held"] if "polls" in doc and row["block_hash"] not in announced}


@pytest.mark.parametrize("path", PULL + ZMQ, ids=lambda path: path.stem)
def test_the_fold_holds_what_the_engine_says_it_holds(path: Path) -> None:
    fold, mapper = folded(path)
    expected = truth_held(path, mapper)
    lost = lost_blocks(path)
    for rank, rows in expected.items():
        worker = WorkerId(publisher_of(path), rank)
        held = {(r.tier.value, r.group_idx, r.ownership, r.engine_hash)
                for r in fold.iter_worker_records(worker) if r.provenance is Provenance.NATIVE}
        assert held == {row for row in rows if row[3] not in lost}
        # Only a lost event makes a worker uncertain: the forwarder's seq hole turns into a Gap.
        assert fold.is_uncertain(worker) == bool(lost)
    assert fold.counters["unresolved_store"] == 0 and fold.counters["unknown_parent"] == 0


def test_the_forwarder_maps_every_trtllm_feature() -> None:
    """What each fixture exercises, so a re-recording that loses a feature fails here."""
    _, plain = folded(GOLDEN / "pull_plain.json")
    assert plain.counters["partial_blocks"] == 1  # A's third block: 8 of 16 tokens, nor is its removal sent
    _, gap = folded(GOLDEN / "pull_event_gap.json")
    assert gap.counters["event_id_gaps"] == 1 and gap.counters["lost_events"] == 1
    fold, _ = folded(GOLDEN / "pull_host_tier.json")
    worker = WorkerId(publisher_of(GOLDEN / "pull_host_tier.json"))
    assert {r.tier for r in fold.iter_worker_records(worker)} == {Tier.DEVICE, Tier.HOST}
    fold, windows = folded(GOLDEN / "pull_windows.json")
    assert windows.group_of(4096) == (0, "full_attention", None) and windows.group_of(128) == (1, "sliding_window", 128)
    fold, _ = folded(GOLDEN / "pull_attention_dp.json")
    assert {w.dp_rank for w in fold.workers()} == {0, 1}


@pytest.mark.parametrize("path", PULL + ZMQ, ids=lambda path: path.stem)
def test_a_request_hashes_exactly_as_the_engine_blocks_it_stored(path: Path) -> None:
    fold, _ = folded(path)
    hashed = {}
    for request in load(path)["truth"]["requests"]:
        worker = WorkerId(publisher_of(path), request.get("attention_dp_rank", 0))
        by_hash = {r.engine_hash: r for r in fold.records(worker, Provenance.NATIVE, Tier.DEVICE)}
        by_hash.update({r.engine_hash: r for r in fold.records(worker, Provenance.NATIVE, Tier.HOST)})
        parsed = request_from_json(request_body({"feature": ""}, request, request["name"]))
        expected = [by_hash[h % U64].sequence_hash for h in request["block_hashes"] if h % U64 in by_hash]
        assert parsed.sequence_hashes[: len(expected)] == expected, request["name"]
        still_held = {row["block_hash"] % U64 for row in load(path)["truth"]["held"]} - lost_blocks(path)
        assert len(expected) == len([h for h in request["block_hashes"] if h % U64 in still_held]), request["name"]
        hashed[request["name"]] = set(parsed.sequence_hashes)
    if path.stem == "pull_multimodal":  # the same text around another image shares no block
        assert not hashed["image_a"] & hashed["image_b"]


# --- through the real pipeline ----------------------------------------------------------


@pytest.mark.service
async def test_every_trtllm_stream_through_ingest_store_and_decide(nats_server, db_url) -> None:
    settings = pipeline_settings(nats_server.url, db_url, **REUSE_ON)
    with database.opened(db_url) as engine:
        database.upgrade(engine)
    sources, closers, feeders, expected_batches = [], [], [], 0
    for path in ZMQ:
        pub, replay = engine_endpoints()
        topic = bytes.fromhex(load(path)["frames"][0]["topic"])
        engine = await SimulatedEngine(pub, replay, topic=topic).__aenter__()
        closers.append(engine.close)
        sources.append(StreamSource(WorkerId(publisher_of(path)), engine.pub_endpoint, engine.replay_endpoint,
                                    Provenance.NATIVE, Engine.TRTLLM))
        feeders.append((path, engine))
    for path in PULL:
        ranks = 1 + max(row["attention_dp_rank"] for row in load(path)["truth"]["held"])
        pub, replay = engine_endpoints(ranks)
        forwarder = await TrtllmForwarder(pub, replay, block_size=load(path)["block_size"],
                                          attention_dp_size=ranks).__aenter__()
        closers.append(forwarder.close)
        for rank in range(ranks):
            pub_url, replay_url = forwarder.endpoints(rank)
            sources.append(StreamSource(WorkerId(publisher_of(path), rank), pub_url, replay_url, Provenance.NATIVE, Engine.TRTLLM))
        feeders.append((path, forwarder))
    store_stop = asyncio.Event()
    try:
        async with Bridge(settings, sources) as bridge:
            await bridge.wait_ready(timeout=30)
            for path, feeder in feeders:
                if isinstance(feeder, SimulatedEngine):
                    for frame in load(path)["frames"]:
                        assert await feeder.publish_payload(bytes.fromhex(frame["payload"])) == frame["seq"]
                    expected_batches += len(load(path)["frames"])
                else:  # the forwarder polls a fake LLM yielding what TensorRT-LLM's serializer returned
                    llm, stop = FakeLLM(load(path)["polls"]), asyncio.Event()
                    task = asyncio.create_task(forward_kv_events(llm, feeder, stop=stop, poll_timeout_s=0.05))
                    await asyncio.wait_for(llm.drained.wait(), 10)
                    stop.set()
                    await task
                    expected_batches += feeder.batches_published
            store = StoreService(settings)
            store_task = asyncio.create_task(store.run(store_stop))
            await wait_until(lambda: _checkpoint(db_url) >= expected_batches, 60, f"store checkpoint at {expected_batches}")
            held = _sql_inventory(db_url)
            for path in PULL + ZMQ:
                _, mapper = folded(path)
                truth = set().union(*truth_held(path, mapper).values())
                lost = lost_blocks(path)
                assert held.get(publisher_of(path), set()) == {row for row in truth if row[3] not in lost}, path.stem
            uncertain = _sql_scalar(db_url, "SELECT COUNT(DISTINCT publisher) FROM uncertain_periods")
            assert uncertain == 1  # pull_event_gap alone: its lost event is a Gap, the worker uncertain
            assert _sql_scalar(db_url, "SELECT COUNT(*) FROM dead_letters") == 0
            async with DecideService(settings) as service:
                await _decide_equals_reference(settings, expected_batches)
            store_stop.set()
            await store_task
    finally:
        store_stop.set()
        for close in closers:
            await close()


async def _decide_equals_reference(settings, total: int) -> None:
    reference = InventoryFold()
    for path in PULL + ZMQ:
        fold, _ = folded(path)
        for worker in fold.workers():
            reference.adopt_worker(fold.worker_state(worker))

    def bodies() -> Iterator[dict]:
        for path in PULL + ZMQ:
            for number, request in enumerate(load(path)["truth"]["requests"]):
                name = WorkerId(publisher_of(path), request.get("attention_dp_rank", 0)).name
                for target in (None, name):
                    body = request_body({"feature": ""}, request, f"{path.stem}-{number}-{target}")
                    body["target"] = target
                    yield body

    # The reference fold's uncertainty comes from the hole, as ingest's Gap makes it.
    await decide_equals_reference(settings, reference, bodies(), total)
