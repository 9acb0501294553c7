"""The scripted decision-quality workload whose truth is known, shared by the quality, shadow and replay tests.

The source holds 8 blocks (its engine hashes >= 2^63), `target` 3 and `target2` 2; three
requests ask (`hint` and `credit-only` to target, `hint2` to target2); 100 ms after the last
decision the source evicts its last three blocks and target2 its second, and 700 ms after it
another worker stores a block. Ingest times are written into the batches, so horizons fall
exactly where the script puts them.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

import attrs
import nats
import sqlalchemy as sa

from kvledger.core.events import WorkerId
from kvledger.runtime.streams import DECIDE_BATCH_SUBJECT, ensure_stream, events_stream
from builders import BLOCK_SIZE, Stream, local_hashes, publish, removed, stored
from kvledger.store import database
from engines import wait_until
from store_harness import RunningStore, checkpoint, store_settings

from kvledger.decide.serving.service import DecideService

SOURCE, TARGET, TARGET2, OTHER = WorkerId("source", 1), WorkerId("target"), WorkerId("target2"), WorkerId("other")
HIGH = 1 << 63  # the source's engine hashes are >= 2^63
DEADLINE_S = 20.0


def request(request_id: str, target: WorkerId, blocks: list[int]) -> dict:
    return {"request_id": request_id, "target": target.name, "block_size": BLOCK_SIZE,
            "local_hashes": [str(h) for h in local_hashes(blocks)]}


def at(batch_and_seq, ingest_ts: float):
    batch, seq = batch_and_seq
    return attrs.evolve(batch, ingest_ts=ingest_ts, engine_ts=ingest_ts), seq


def asked() -> list[dict]:
    """The three requests of one batch: two hints and one that finds nothing to transfer."""
    return [request("hint", TARGET, list(range(1, 13))), request("credit-only", TARGET, [1, 2, 3, 40, 41]),
            request("hint2", TARGET2, list(range(1, 13)))]


async def publish_holdings(js, stream_settings, stream: Stream) -> None:
    """KV_EVENTS made and the three workers' holdings published (seqs 1-3)."""
    await ensure_stream(js, events_stream(stream_settings))
    await publish(js, [
        at(stream.batch(SOURCE, stored(list(range(1, 9)), engine_offset=HIGH)), 1000.0),
        at(stream.batch(TARGET, stored([1, 2, 3])), 1000.0),
        at(stream.batch(TARGET2, stored([1, 2])), 1000.0),
    ])


async def evict_after_decisions(js, stream: Stream, running, db_url: str) -> tuple[float, float]:
    """The evictions 100 ms after the last decision in SQL, and the other worker's store 700 ms after
    it, published and projected (seqs 4-6). Returns (decided, evicted) ingest times."""
    with database.opened(db_url) as engine, engine.connect() as connection:
        decided = max(connection.execute(sa.text("SELECT decided_ts FROM decisions")).scalars())
    evicted = decided + 0.1
    await publish(js, [
        at(stream.batch(SOURCE, removed([6 + HIGH, 7 + HIGH, 8 + HIGH])), evicted),
        at(stream.batch(TARGET2, removed([2])), evicted),
        at(stream.batch(OTHER, stored([50])), decided + 0.7),
    ])
    await running.until(lambda: checkpoint(db_url) >= 6, "the evictions in SQL")
    return decided, evicted


@attrs.frozen
class Decided:
    """The workload once decide has answered the three requests; store and decide still run."""

    js: object
    stream: Stream
    running: RunningStore
    db_url: str
    answers: list[dict]

    async def evict(self) -> tuple[float, float]:
        return await evict_after_decisions(self.js, self.stream, self.running, self.db_url)


@contextlib.asynccontextmanager
async def decided_workload(nats_url: str, db_url: str, settings) -> AsyncIterator[Decided]:
    """The holdings published, store (500 ms horizon) and decide running, and decide's answers to `asked()`."""
    stream = Stream()
    async with await nats.connect(nats_url) as nc:
        js = nc.jetstream()
        await publish_holdings(js, settings.stream, stream)
        async with RunningStore(store_settings(nats_url, db_url, quality_horizon_s=0.5)) as running, \
                DecideService(settings) as decide:
            await decide.wait_ready(DEADLINE_S)
            await wait_until(lambda: decide.index.inventory_seq >= 3, DEADLINE_S, "decide at seq 3")
            reply = await nc.request(DECIDE_BATCH_SUBJECT, json.dumps(asked()).encode(), timeout=10)
            yield Decided(js, stream, running, db_url, json.loads(reply.data))
