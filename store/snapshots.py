"""Inventory snapshots into the JetStream object store `KV_SNAPSHOTS`, with a manifest row in SQL.

decide warm-starts from the newest one and replays KV_EVENTS after its `inventory_seq`.
Only snapshots of committed state are written: the fold is snapshotted right after its
transaction commits, never between a fold and its write.
"""

from __future__ import annotations

import asyncio
import logging
import time

import sqlalchemy as sa
from nats.js import JetStreamContext
from nats.js.api import StorageType
from nats.js.errors import BucketNotFoundError, NotFoundError

from kvledger.core.fold import InventoryFold
from kvledger.core.settings import StoreSettings
from kvledger.core.snapshot import StreamPosition, encode_snapshot
from kvledger.runtime.streams import SNAPSHOTS_BUCKET, snapshot_object_name, snapshot_seq
from kvledger.store import tables

log = logging.getLogger("kvledger.store")


class SnapshotWriter:
    """Decides when a snapshot is due (every N messages or T seconds) and writes it."""

    def __init__(self, js: JetStreamContext, engine: sa.Engine, settings: StoreSettings, *, replicas: int = 1) -> None:
        self.js = js
        self.replicas = replicas  # as the streams: on a cluster the snapshots survive a node
        self.engine = engine
        self.every_events = settings.snapshot_every_events
        self.every_s = settings.snapshot_every_s
        self.keep = settings.snapshot_keep
        self.messages_since = 0
        self.last_time = time.monotonic()
        self.last_seq = 0
        self._store = None

    def count(self, messages: int) -> None:
        self.messages_since += messages

    def due(self, inventory_seq: int) -> bool:
        if inventory_seq <= self.last_seq:
            return False
        return self.messages_since >= self.every_events or time.monotonic() - self.last_time >= self.every_s

    async def _bucket(self):
        if self._store is None:
            try:
                self._store = await self.js.object_store(SNAPSHOTS_BUCKET)
            except (BucketNotFoundError, NotFoundError):
                self._store = await self.js.create_object_store(SNAPSHOTS_BUCKET, storage=StorageType.FILE, replicas=self.replicas)
        return self._store

    async def write(self, fold: InventoryFold, position: StreamPosition | None = None) -> str:
        """Snapshot `fold`; `position` is the KV_EVENTS message it ends with, which decide checks before trusting it."""
        seq = fold.inventory_seq
        started = time.perf_counter()
        # Encoding a large inventory takes a while: off the event loop (the fold does not
        # change meanwhile, the projector awaits this write).
        data, blocks = await asyncio.to_thread(lambda: (encode_snapshot(fold, position), sum(1 for _ in fold.iter_records())))
        store = await self._bucket()
        name = snapshot_object_name(seq)
        await store.put(name, data)
        row = {
            "inventory_seq": seq, "bucket": SNAPSHOTS_BUCKET, "object_name": name, "size_bytes": len(data),
            "blocks": blocks, "workers": len(fold.workers()), "created_ts": time.time(),
        }  # fmt: skip
        await asyncio.to_thread(self._record, row)
        self.messages_since, self.last_time, self.last_seq = 0, time.monotonic(), seq
        log.info("snapshot %s: %d blocks, %d bytes, %.2fs", name, blocks, len(data), time.perf_counter() - started)
        await self._prune(store)
        return name

    def _record(self, row: dict) -> None:
        with self.engine.begin() as connection:
            connection.execute(sa.delete(tables.snapshots).where(tables.snapshots.c.inventory_seq == row["inventory_seq"]))
            connection.execute(tables.snapshots.insert(), row)

    async def _prune(self, store) -> None:
        try:
            objects = await store.list(ignore_deletes=True)
        except NotFoundError:
            return
        seqs = sorted(seq for info in objects if (seq := snapshot_seq(info.name)) is not None)
        old = seqs[: -self.keep] if self.keep > 0 else []
        for seq in old:
            await store.delete(snapshot_object_name(seq))
        if old:
            await asyncio.to_thread(self._forget, old)

    def _forget(self, seqs: list[int]) -> None:
        with self.engine.begin() as connection:
            connection.execute(sa.delete(tables.snapshots).where(tables.snapshots.c.inventory_seq.in_(seqs)))
