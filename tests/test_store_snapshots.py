"""Snapshots are written to KV_SNAPSHOTS with a manifest row, and only the newest few are kept."""

from __future__ import annotations

import nats
import sqlalchemy as sa

from builders import Stream, stored
from kvledger.core.events import WorkerId
from kvledger.core.fold import InventoryFold
from kvledger.core.settings import StoreSettings
from kvledger.core.snapshot import decode_snapshot
from kvledger.runtime.streams import SNAPSHOTS_BUCKET, snapshot_seq
from kvledger.store import database
from kvledger.store.snapshots import SnapshotWriter


async def test_only_the_newest_snapshots_are_kept_in_the_bucket_and_the_manifest(nats_server, sqlite_url) -> None:
    with database.opened(sqlite_url) as engine:
        database.upgrade(engine)
    engine = sa.create_engine(sqlite_url)
    nc = await nats.connect(nats_server.url)
    try:
        writer = SnapshotWriter(nc.jetstream(), engine, StoreSettings(snapshot_keep=3))
        fold, stream = InventoryFold(), Stream()
        for block in range(5):
            fold.apply(*stream.batch(WorkerId("w"), stored([block + 1], parent=block or None)))
            await writer.write(fold)
        bucket = await nc.jetstream().object_store(SNAPSHOTS_BUCKET)
        kept = sorted(snapshot_seq(info.name) for info in await bucket.list(ignore_deletes=True))
        assert kept == [3, 4, 5]
        with engine.connect() as connection:
            manifest = connection.execute(sa.text("SELECT inventory_seq FROM snapshots ORDER BY inventory_seq")).scalars().all()
        assert manifest == [3, 4, 5]
        newest = decode_snapshot((await bucket.get("inventory-00000000000000000005")).data)
        assert [r.engine_hash for r in newest.iter_records()] == [1, 2, 3, 4, 5]
    finally:
        await nc.close()
        engine.dispose()
