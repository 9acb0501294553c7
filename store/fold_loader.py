"""Reading the fold back from SQL after a restart, and the placements' ids; writing is store/transactions.py."""

from __future__ import annotations

import json

import sqlalchemy as sa

from kvledger.core.events import Provenance, Tier, WorkerId
from kvledger.core.fold import BlockRecord, InventoryFold, ProvenancePosition
from kvledger.store import tables
from kvledger.store.changes import PLACEMENT_COLUMNS, ResidencyIndex
from kvledger.store.sharding import SINGLE, Shard
from kvledger.store.tables import to_unsigned
from kvledger.store.transactions import EVENTS_CHECKPOINT, Recorder, recorder_for


class PlacementIds:
    """A placement's id, from SQL: found, or added in a transaction of its own the first time it is met.

    Called while folding, so once per placement and process (cached): a worker's tier, group and
    ownership. Only this projector adds its publishers' placements (store shards own disjoint
    publishers), so finding and adding need no lock; one added by a transaction that later fails
    is merely unused.
    """

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self._known: dict[tuple, int] = {}

    def __call__(self, values: tuple) -> int:
        found = self._known.get(values)
        if found is None:
            found = self._known[values] = self._find_or_add(values)
        return found

    def _find_or_add(self, values: tuple) -> int:
        p = tables.placements.c
        with self.engine.begin() as connection:
            found = connection.execute(sa.select(p.placement_id).where(
                *(p[name].is_not_distinct_from(value) for name, value in zip(PLACEMENT_COLUMNS, values))
            ).order_by(p.placement_id).limit(1)).scalar_one_or_none()
            if found is None:
                found = connection.execute(
                    tables.placements.insert().values(dict(zip(PLACEMENT_COLUMNS, values))).returning(p.placement_id)
                ).scalar_one()
        return found


def open_recorder(engine: sa.Engine, stream: str, checkpoint_name: str = EVENTS_CHECKPOINT) -> Recorder:
    """A recorder on a connection of `engine`'s own (store's writer process opens one through the driver alone)."""
    proxy = engine.raw_connection()
    connection = proxy.driver_connection
    # Detached: this connection lives and dies with the recorder, never back in the pool.
    proxy.detach()
    return recorder_for(engine.dialect.name, connection, stream, checkpoint_name, proxy.close)


# --- reading back -------------------------------------------------------------------


def read_checkpoint(connection: sa.Connection, name: str) -> int:
    seq = connection.execute(
        sa.select(tables.checkpoints.c.stream_seq).where(tables.checkpoints.c.name == name)
    ).scalar_one_or_none()
    return seq or 0


def last_ingest_ts(engine: sa.Engine) -> float | None:
    """Ingest time of the newest event SQL holds (None: none yet): where a fold rebuilt from SQL stands in stream time."""
    with engine.connect() as connection:
        return connection.execute(sa.select(sa.func.max(tables.workers.c.last_ingest_ts))).scalar_one()


def load_fold(engine: sa.Engine, shard: Shard = SINGLE) -> tuple[InventoryFold, ResidencyIndex]:
    """Rebuild the fold as it was at the shard's events checkpoint, from its open residency rows and workers.

    Records go back in (stored_seq, slot) order, the order the fold stored them, so
    topology ends as folding left it (the same rule as snapshot restore). Rows of other
    shards' publishers, in the same database, are left out.
    """
    fold = InventoryFold()
    index: ResidencyIndex = {}
    t = tables
    with engine.connect() as connection:
        row = connection.execute(
            sa.select(t.checkpoints.c.stream_seq, t.checkpoints.c.counters).where(t.checkpoints.c.name == shard.checkpoint_name)
        ).one_or_none()
        if row is None:
            return fold, index
        fold.inventory_seq = row.stream_seq
        fold.counters.update(json.loads(row.counters))
        # per worker: (positions, records in stored order, counters), for fold.restore_worker
        kept: dict[WorkerId, tuple[dict, list[BlockRecord], dict]] = {}
        for w in connection.execute(sa.select(t.workers)):
            if not shard.owns_publisher(w.publisher):
                continue
            groups = json.loads(w.kv_cache_groups)
            positions = {
                Provenance.NATIVE: ProvenancePosition(w.epoch, w.engine_seq, w.uncertain_since, groups.get("native", {})),
                Provenance.RETAINED: ProvenancePosition(
                    w.retained_epoch, w.retained_engine_seq, w.retained_uncertain_since, groups.get("retained", {}),
                ),
            }
            kept[WorkerId(w.publisher, w.dp_rank)] = (positions, [], json.loads(w.counters))
        s, p = t.block_stays.c, t.placements.c
        # The open stays, from the tables rather than the view: a stay no run of ends covers.
        rows = connection.execution_options(yield_per=50_000).execute(
            sa.select(
                s.stored_seq, s.slot, p.publisher, p.dp_rank, p.tier, p.provenance, s.engine_hash,
                s.sequence_hash, s.parent_hash, s.local_hash, s.conflict_since, p.group_idx, p.ownership,
                p.kv_cache_spec_kind, p.sliding_window, sa.func.coalesce(s.refs, 1), s.unresolved, s.placement_id,
            )
            .join_from(t.block_stays, t.placements, p.placement_id == s.placement_id)
            .where(~sa.exists().where(tables.run_covers_stay()))
            .order_by(s.stored_seq, s.slot)
        )
        tiers = {tier.value: tier for tier in Tier}
        provenances = {provenance.value: provenance for provenance in Provenance}
        workers: dict[tuple[str, int], WorkerId | None] = {}
        for (
            stored_seq, slot, publisher, dp_rank, tier_name, provenance_name, engine, sequence, parent, local, conflict,
            group, ownership, spec_kind, window, refs, unresolved, place,
        ) in rows:
            key = (publisher, dp_rank)
            if key in workers:
                worker = workers[key]
            else:  # None: another shard's publisher, whose rows share the database
                worker = workers[key] = WorkerId(publisher, dp_rank) if shard.owns_publisher(publisher) else None
            if worker is None:
                continue
            tier, provenance = tiers[tier_name], provenances[provenance_name]
            engine_hash = to_unsigned(engine)
            record = BlockRecord(
                worker, tier, provenance, engine_hash, to_unsigned(sequence),
                None if parent is None else to_unsigned(parent), to_unsigned(local), stored_seq, conflict is not None,
                group, ownership, spec_kind, window, refs, bool(unresolved),
            )  # fmt: skip
            kept[worker][1].append(record)
            index.setdefault((worker, provenance), {}).setdefault(tier, {})[record.key] = (stored_seq, slot, place)
    for worker, (positions, records, counters) in kept.items():
        fold.restore_worker(worker, positions, records, counters)
    return fold, index
