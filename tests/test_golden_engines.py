"""What the engines' own publisher classes really send, replayed through kvledger.

`tests/golden/*.json` are frames recorded from vLLM 0.33's and SGLang 0.5.23's publisher
classes (`record_vllm.py`, `record_sglang.py` re-record them from the wheels), one per
feature, each with the engine's own account of what it holds at the end. The fold, the
SQL inventory (SQLite and PostgreSQL) and decide's answers must all agree with it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import msgspec
import nats
import pytest
import sqlalchemy as sa

from kvledger.decide.serving.service import DecideService
from engines import engine_endpoints, wait_until
from kvledger.core.decision_codec import decision_to_json, request_from_json
from kvledger.core.events import EventBatch, Provenance, Tier, WorkerId
from kvledger.core.fold import InventoryFold
from kvledger.core.reuse import decide, overlap_of
from kvledger.ingest.bridge import Bridge
from kvledger.ingest.endpoints import StreamSource
from kvledger.ingest.wire import Engine, _tier, decode_payload
from kvledger.runtime.streams import DECIDE_SUBJECT
from kvledger.sim.engine import SimulatedEngine
from pipeline import pipeline_settings
from kvledger.store import database
from kvledger.store.fold_loader import load_fold
from kvledger.store.service import StoreService
from test_e2e import REUSE_ON

GOLDEN = Path(__file__).parent / "golden"
FIXTURES = sorted(GOLDEN.glob("*.json"))
U64 = 1 << 64


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def fixture_worker(fixture: dict) -> WorkerId:
    return WorkerId(f"{fixture['engine']}-{fixture['feature']}".replace("_", "-"))


def folded(fixture: dict) -> tuple[InventoryFold, list]:
    """Decode every recorded frame as ingest does and fold it; also what was rejected."""
    fold, rejected = InventoryFold(), []
    worker = fixture_worker(fixture)
    for stream_seq, frame in enumerate(fixture["frames"], 1):
        decoded = decode_payload(bytes.fromhex(frame["payload"]), engine=Engine(fixture["engine"]))
        rejected.extend(decoded.rejected)
        batch = EventBatch(worker, 0, frame["seq"], decoded.engine_ts, 0.0, Provenance.NATIVE, decoded.events)
        fold.apply(batch, stream_seq)
    return fold, rejected


def truth_held(fixture: dict) -> set[tuple[str, int, str | None, int]]:
    """(tier, group, ownership, engine hash) of every block the engine says it holds at the end."""
    return {
        (_tier(held["medium"]).value, held["group_idx"] or 0, held["ownership"], held["block_hash"] % U64)
        for held in fixture["truth"]["held"]
    }


def request_body(fixture: dict, request: dict, request_id: str) -> dict:
    """A decision request for one of the token sequences the engine stored, hashed as its blocks were."""
    body = {
        "request_id": request_id, "token_ids": request["token_ids"], "block_size": request["block_size"],
        "lora_name": request["lora_name"], "cache_salt": request["cache_salt"], "extra_keys": request["extra_keys"],
    }
    if request["name"] == "lookahead":
        # Each block's hash covers the next token too (vLLM's lookahead_token_ids); the
        # request carries that token and says so.
        body["token_ids"] = [*request["token_ids"], _lookahead_tail(fixture, request)]
        body["lookahead"] = 1
    elif fixture["feature"] == "bigram_pages":
        body["lookahead"] = 1  # SGLang's EAGLE pages: each covers one token past its end
    return body


def _lookahead_tail(fixture: dict, request: dict) -> int:
    for frame in fixture["frames"]:
        for event in msgspec.msgpack.decode(bytes.fromhex(frame["payload"]))[1]:
            if event.get("block_hashes") == request["block_hashes"] and event.get("lookahead_token_ids"):
                return event["lookahead_token_ids"][-1][-1]
    raise AssertionError(f"no lookahead tokens recorded for {request['name']}")


@pytest.mark.parametrize("path", FIXTURES, ids=lambda path: path.stem)
def test_the_fold_holds_exactly_what_the_engine_says_it_holds(path: Path) -> None:
    fixture = load(path)
    fold, rejected = folded(fixture)
    assert rejected == []
    worker = fixture_worker(fixture)
    held = {
        (record.tier.value, record.group_idx, record.ownership, record.engine_hash)
        for record in fold.iter_records() if record.provenance is Provenance.NATIVE
    }
    assert held == truth_held(fixture)
    assert not fold.is_uncertain(worker)
    assert fold.counters["unresolved_store"] == 0 and fold.counters["unknown_parent"] == 0


@pytest.mark.parametrize("path", [p for p in FIXTURES if load(p)["truth"]["requests"]], ids=lambda path: path.stem)
def test_a_request_hashes_exactly_as_the_engine_blocks_it_stored(path: Path) -> None:
    fixture = load(path)
    fold, _ = folded(fixture)
    worker = fixture_worker(fixture)
    by_engine_hash = {record.engine_hash: record for record in fold.records(worker, Provenance.NATIVE, Tier.DEVICE)}
    hashed = {}
    for request in fixture["truth"]["requests"]:
        body = request_body(fixture, request, request["name"])
        parsed = request_from_json(body)
        expected = [by_engine_hash[block % U64].sequence_hash for block in request["block_hashes"] if block % U64 in by_engine_hash]
        assert parsed.sequence_hashes[: len(expected)] == expected, request["name"]
        extra = [entry for entry in body["extra_keys"] or () if entry is not None]
        keys = (body["lora_name"], body["cache_salt"], json.dumps(extra), body.get("lookahead", 0))
        hashed[request["name"]] = (keys, set(parsed.sequence_hashes))
    # The same tokens under another salt, adapter, image or lookahead share no block:
    # salted never matches unsalted nor another salt; image A never matches image B.
    for name, (keys, hashes) in hashed.items():
        for other, (other_keys, other_hashes) in hashed.items():
            if other != name and other_keys != keys:
                assert not hashes & other_hashes, (name, other)


def test_a_sliding_window_groups_evictions_do_not_shorten_the_prefix() -> None:
    fixture = load(GOLDEN / "vllm_hybrid_sliding_window.json")
    fold, _ = folded(fixture)
    worker = fixture_worker(fixture)
    groups = {record.group_idx: record.spec_kind for record in fold.records(worker, Provenance.NATIVE, Tier.DEVICE)}
    assert groups == {0: "full_attention", 1: "sliding_window"}
    full = [held for held in fixture["truth"]["held"] if held["group_idx"] == 0]
    window = [held for held in fixture["truth"]["held"] if held["group_idx"] == 1]
    assert len(window) < len(full)  # the window group evicted blocks the full-attention group keeps
    for request in fixture["truth"]["requests"]:
        parsed = request_from_json(request_body(fixture, request, request["name"]))
        overlap = overlap_of(fold, worker, parsed.sequence_hashes)
        assert overlap.device == len(parsed.sequence_hashes), request["name"]


# --- through the real pipeline ----------------------------------------------------------


@pytest.mark.service
async def test_every_golden_stream_through_ingest_store_and_decide(nats_server, db_url) -> None:
    fixtures = [load(path) for path in FIXTURES]
    settings = pipeline_settings(nats_server.url, db_url, **REUSE_ON)
    with database.opened(db_url) as engine:
        database.upgrade(engine)
    engines = []
    for fixture in fixtures:
        pub, replay = engine_endpoints()
        topic = bytes.fromhex(fixture["frames"][0]["topic"])
        engines.append(await SimulatedEngine(pub, replay, topic=topic).__aenter__())
    sources = [
        StreamSource(fixture_worker(fixture), engine.pub_endpoint, engine.replay_endpoint, Provenance.NATIVE,
                     Engine(fixture["engine"]))
        for fixture, engine in zip(fixtures, engines)
    ]
    store_stop = asyncio.Event()
    try:
        async with Bridge(settings, sources) as bridge:
            await bridge.wait_ready(timeout=30)
            for fixture, engine in zip(fixtures, engines):
                for frame in fixture["frames"]:
                    assert await engine.publish_payload(bytes.fromhex(frame["payload"])) == frame["seq"]
            total = sum(len(fixture["frames"]) for fixture in fixtures)
            store = StoreService(settings)
            store_task = asyncio.create_task(store.run(store_stop))
            await wait_until(lambda: _checkpoint(db_url) >= total, 60, f"store checkpoint at {total}")
            held = _sql_inventory(db_url)
            for fixture in fixtures:
                assert held.get(fixture_worker(fixture).publisher, set()) == truth_held(fixture), fixture["feature"]
            assert _sql_scalar(db_url, "SELECT COUNT(*) FROM uncertain_periods") == 0
            assert _sql_scalar(db_url, "SELECT COUNT(*) FROM dead_letters") == 0
            # What a restarted store reads back is the fold itself: references, kinds and groups included.
            with database.opened(db_url) as engine:
                restored, _ = load_fold(engine)
            for fixture in fixtures:
                fold, _ = folded(fixture)
                worker = fixture_worker(fixture)
                assert list(restored.iter_worker_records(worker)) == [
                    msgspec.structs.replace(record, stream_seq=_stream_seq_of(restored, record)) for record in fold.iter_worker_records(worker)
                ]
                for provenance in Provenance:
                    assert restored.worker_state(worker).position(provenance).groups == (
                        fold.worker_state(worker).position(provenance).groups)
            async with DecideService(settings) as service:
                await _decide_equals_reference(service, settings, fixtures, total)
            store_stop.set()
            await store_task
    finally:
        store_stop.set()
        for engine in engines:
            await engine.close()


async def _decide_equals_reference(service: DecideService, settings, fixtures: list[dict], total: int) -> None:
    reference = InventoryFold()
    for fixture in fixtures:  # the same stream order ingest published in, per worker
        fold, _ = folded(fixture)
        for worker in fold.workers():
            reference.adopt_worker(fold.worker_state(worker))

    def bodies() -> Iterator[dict]:
        for fixture in fixtures:
            for number, request in enumerate(fixture["truth"]["requests"]):
                for target in (None, fixture_worker(fixture).name):
                    body = request_body(fixture, request, f"{fixture['feature']}-{number}-{target}")
                    body["target"] = target
                    yield body

    await decide_equals_reference(settings, reference, bodies(), total)


async def decide_equals_reference(settings, reference: InventoryFold, bodies: Iterable[dict], total: int) -> None:
    """Once decide stands at inventory_seq `total`, its answer to each request body is the reference fold's,
    the reference at the inventory_seq decide answered at."""
    nc = await nats.connect(settings.nats.url)
    try:
        async def ask(body: dict) -> dict:
            reply = await nc.request(DECIDE_SUBJECT, json.dumps(body).encode(), timeout=10)
            return json.loads(reply.data)

        async def caught_up() -> bool:
            return (await ask({"request_id": "probe", "local_hashes": [], "block_size": 16}))["inventory_seq"] >= total

        await wait_until(caught_up, 30, f"decide at inventory_seq {total}")
        for body in bodies:
            answer = await ask(body)
            reference.inventory_seq = answer["inventory_seq"]
            expected = decision_to_json(decide(reference, request_from_json(body), settings.reuse, backend=answer["backend"]))
            assert answer == expected, body["request_id"]
    finally:
        await nc.close()


def _stream_seq_of(fold: InventoryFold, record) -> int:
    """The KV_EVENTS seq the pipeline stored `record` at (the fixture's own fold numbers its frames from 1)."""
    [held] = [r for r in fold.records(record.worker, record.provenance, record.tier) if r.key == record.key]
    return held.stream_seq


def _checkpoint(db_url: str) -> int:
    return _sql_scalar(db_url, "SELECT COALESCE(MAX(stream_seq), 0) FROM checkpoints WHERE name = 'events'") or 0


def _sql_scalar(db_url: str, query: str):
    with database.opened(db_url) as engine, engine.connect() as connection:
        return connection.execute(sa.text(query)).scalar()


def _sql_inventory(db_url: str) -> dict[str, set[tuple[str, int, str | None, int]]]:
    """Open native rows per publisher, as (tier, group, ownership, engine hash), read through the audit view."""
    inventory: dict[str, set] = {}
    with database.opened(db_url) as engine, engine.connect() as connection:
        rows = connection.execute(sa.text(
            "SELECT publisher, tier, group_idx, ownership, engine_hash FROM current_inventory WHERE provenance = 'native'"
        ))
        for publisher, tier, group, ownership, engine_hash in rows:
            inventory.setdefault(publisher, set()).add((tier, group, ownership, int(engine_hash)))
    return inventory
