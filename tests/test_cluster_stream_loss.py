"""A three-node JetStream cluster (R3 streams) whose nodes lose or garble acknowledged messages (issue 31).

JetStream acknowledges before it fsyncs, and a disk can lose or garble what it wrote. The
faults, on local nats-server processes (tests/cluster.py): (a) one node restored from an old
copy of its store folder, then made KV_EVENTS's leader; (b) all three restored from one
instant's copies, a coordinated power loss, with the engines still buffering what was lost
and with engines that no longer do; (c) a truncated and (d) a bit-flipped message block of
KV_EVENTS on one node, which is then made leader. Simulated engines → ingest → KV_EVENTS →
store + decide (all in this process) run through each fault, with traffic before, between
and after. After recovery every batch an engine still buffers is once in KV_EVENTS and once
in SQL, SQL holds what the engines hold, no worker is uncertain, there is no gap, and decide
answers as the reference model does on the engines' truth. Where no engine buffers what was
lost, KV_EVENTS says so with a Gap(stream_lost) per worker, SQL keeps the batches it had and
the audit lists them, and a store reading the stream afresh marks every worker uncertain.

Where the cluster itself repairs a node from its peers, the stream keeps every acknowledged
message byte for byte at its seq and no stage may claim a loss; where it does not, the stages
must have noticed. A copy of a paused node's store folder is what was on disk at that instant;
a real crash loses what the kernel had not written back, which need not be a clean earlier
state of every file; a FUSE layer that drops unsynced writes would model that more faithfully.

Databases: the coordinated power loss, where store opens a generation and SQL alone keeps
batches, runs on SQLite and PostgreSQL; (a), (c) and (d), where nats-server 2.15 repairs the
node from its peers and store only sees its consumer fail over, run on SQLite alone, which
keeps the file near 90 s on two cores (each test 5-16 s).
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, defaultdict
from pathlib import Path

import attrs
import nats.errors
import nats.js.errors
import pytest

from cluster import (
    LocalNatsCluster,
    copy_stores,
    flip_bytes,
    message_blocks,
    put_back_stores,
    restart_together,
    restored_messages,
    stream_state,
    truncate_block,
)
from engines import read_batches, read_stream, wait_until
from kvledger.core.events import GapReason
from kvledger.sim.fleet import SimulatedFleet
from kvledger.sim.workload import DEMO_BLOCK_SIZE, synthetic_requests
from pipeline import Pipeline, pipeline_settings, truth_inventory
from kvledger.store import audit, database
from test_e2e import REUSE_ON, assert_decide_matches_reference, batches_sent, serve_round_robin
from test_e2e_stream_loss import _assert_truth, _every_engine_batch, _sql_identities

pytestmark = pytest.mark.service

WORKERS = 3
PART = 60  # requests served per phase: some 60 engine batches
STREAM = "KV_EVENTS"
HEAL_S = 30.0
LEADER_S = 12.0  # how long a restored or repaired node is given to become KV_EVENTS's leader
PROBE = {"request_id": "probe", "local_hashes": [], "block_size": DEMO_BLOCK_SIZE}
R3_REUSE_ON = {"stream.replicas": 3, **REUSE_ON}


@attrs.frozen
class Healing:
    """What the stages noticed and did about the fault, and how long it took them."""

    repaired: float  # batches ingest published again from the engines' replay buffers
    lost: float  # batches no engine buffered any more (published as Gap stream_lost)
    store_losses: float  # times store found KV_EVENTS no longer holding what SQL committed
    decide_regressions: float  # times decide found KV_EVENTS gone back past what it had applied
    healed_s: float  # from the nodes' return (the last part of the traffic served meanwhile) to every
    # buffered batch once in SQL and in KV_EVENTS

    @property
    def noticed(self) -> bool:
        return bool(self.repaired or self.lost or self.store_losses or self.decide_regressions)


class Fault:
    """A fault in two steps: `on_disk` after the first part of the traffic (what the disk will keep),
    `strike` after the second (the crash or the bad disk, and the nodes back)."""

    def __init__(self, cluster: LocalNatsCluster, tmp_path: Path) -> None:
        self.cluster = cluster
        self.tmp_path = tmp_path
        self.started = time.monotonic()
        self.led: bool | None = None  # whether the damaged node came to lead KV_EVENTS, where asked
        self.restored: dict[str, int] = {}  # KV_EVENTS messages each node struck found in its store on restart

    def say(self, line: str) -> None:
        print(f"{time.monotonic() - self.started:5.1f}s {line}")

    def states(self) -> str:
        """KV_EVENTS as each node holds it: `first-last (messages)`."""
        parts = []
        for name in self.cluster.nodes:
            state = stream_state(self.cluster, name, STREAM)
            held = "-" if state is None else f"{state['first_seq']}-{state['last_seq']} ({state['messages']})"
            parts.append(f"{name} {held}")
        return ", ".join(parts)

    async def follower(self) -> str:
        """A node leading neither KV_EVENTS nor the meta group, so that making it leader is a real move."""
        leader = await self.cluster.stream_leader(STREAM)
        return next(name for name in self.cluster.nodes if name not in (leader, self.cluster.meta_leader()))

    async def make_leader(self, name: str) -> None:
        """Ask for `name` to lead KV_EVENTS; `led` says whether the cluster let it."""
        try:
            await self.cluster.move_stream_leader(STREAM, name, timeout_s=LEADER_S)
        except (TimeoutError, RuntimeError) as refused:
            self.led = False
            self.say(f"{name} not made KV_EVENTS's leader: {refused}")
        else:
            self.led = True
            self.say(f"{name} leads KV_EVENTS: {self.states()}")

    def note_restored(self, names) -> None:
        """What each restarted node found of KV_EVENTS in its store (its log says), before any catching up."""
        self.restored = {name: restored_messages(self.cluster, name, STREAM)[-1] for name in names}

    async def on_disk(self) -> None:
        pass

    async def strike(self) -> None:
        raise NotImplementedError


class RestoredNode(Fault):
    """(a) One follower's store folder put back to an older copy after a SIGKILL; then it is made leader."""

    async def on_disk(self) -> None:
        self.victim = await self.follower()
        self.copies = copy_stores(self.cluster, [self.victim], self.tmp_path / "on-disk")
        self.say(f"{self.victim}'s store copied: {self.states()}")

    async def strike(self) -> None:
        put_back_stores(self.cluster, self.copies)
        await self.cluster.restart_async(self.victim)
        self.note_restored([self.victim])
        self.say(f"{self.victim} killed, its old store put back, restarted with {self.restored}: {self.states()}")
        await self.make_leader(self.victim)


class PowerLoss(Fault):
    """(b) All three store folders put back to one instant's copies after all three were SIGKILLed."""

    async def on_disk(self) -> None:
        self.copies = copy_stores(self.cluster, self.cluster.nodes, self.tmp_path / "on-disk")
        self.say(f"every store copied: {self.states()}")

    async def strike(self) -> None:
        put_back_stores(self.cluster, self.copies)
        await restart_together(self.cluster, self.cluster.nodes)
        self.note_restored(self.cluster.nodes)
        self.say(f"every node killed, its old store put back, restarted with {self.restored}: {self.states()}")


class BadBlock(Fault):
    """(c), (d) One follower killed, its KV_EVENTS message block cut to half or 16 bytes flipped in
    its middle, restarted; then it is made leader."""

    def __init__(self, cluster: LocalNatsCluster, tmp_path: Path, damage: str) -> None:
        super().__init__(cluster, tmp_path)
        self.damage = damage

    async def strike(self) -> None:
        self.victim = await self.follower()
        self.cluster.kill(self.victim)
        blocks = message_blocks(self.cluster, self.victim, STREAM)
        block, size = blocks[-1], blocks[-1].stat().st_size
        if self.damage == "truncated":
            what = f"cut to {truncate_block(block)} of {size} bytes"
        else:
            what = f"16 bytes flipped at {flip_bytes(block)} of {size}"
        await self.cluster.restart_async(self.victim)
        self.note_restored([self.victim])
        self.say(f"{self.victim} killed, {block.name} (of {len(blocks)}) {what}, restarted with {self.restored}: "
                 f"{self.states()}")
        await self.make_leader(self.victim)


# --- what survived ------------------------------------------------------------------------------


async def _messages(cluster: LocalNatsCluster) -> dict[int, bytes] | None:
    """KV_EVENTS's messages by stream seq; None while the cluster cannot answer (e.g. electing a leader)."""
    try:
        return {seq: data for seq, _, data in await read_stream(cluster.url_list, STREAM, connect_timeout=2)}
    except (nats.errors.Error, nats.js.errors.Error, TimeoutError):
        return None


async def _stream_identities(cluster: LocalNatsCluster) -> Counter | None:
    try:
        batches = await read_batches(cluster.url_list, connect_timeout=2)
    except (nats.errors.Error, nats.js.errors.Error, TimeoutError):
        return None
    return Counter((b.worker.publisher, b.worker.dp_rank, b.provenance.value, b.epoch, b.seq) for b in batches)


async def _healed(pipeline: Pipeline, fleet: SimulatedFleet, cluster: LocalNatsCluster) -> int:
    """Wait until every batch an engine buffers is once in SQL and once in KV_EVENTS; KV_EVENTS's last seq."""
    expected = _every_engine_batch(fleet)
    await wait_until(lambda: _sql_identities(pipeline) == expected, HEAL_S, "every engine batch once in SQL")

    async def stream_complete() -> bool:
        return await _stream_identities(cluster) == expected

    await wait_until(stream_complete, HEAL_S, "every engine batch once in KV_EVENTS")
    return await pipeline.events_last_seq()


async def _decide_matches_reference(pipeline: Pipeline, fleet: SimulatedFleet, requests: list, last: int) -> None:
    async def answering() -> bool:
        # An error answer is a retry: decide gives no answer it cannot record, and KV_DECISIONS
        # may still be electing a leader after its node came back.
        return (await pipeline.ask(PROBE)).get("inventory_seq", -1) >= last

    await wait_until(answering, HEAL_S, f"decide answering at inventory_seq {last}")
    await assert_decide_matches_reference(pipeline, fleet, requests, last)


def _healing(pipeline: Pipeline, healed_s: float) -> Healing:
    return Healing(
        repaired=pipeline.bridge.metrics.stream_repaired.value,
        lost=pipeline.bridge.metrics.stream_lost.value,
        store_losses=pipeline.store.metrics.stream_losses.labels(STREAM).value,
        decide_regressions=pipeline.decide.metrics.stream_regressions.value,
        healed_s=healed_s,
    )


def _stream_losses(db_url: str) -> tuple[list[dict], list[dict]]:
    """audit stream-losses (KV_EVENTS's) and audit only-in-sql."""
    with database.opened(db_url) as engine, engine.connect() as connection:
        ledger = audit.Audit(connection)
        return [loss for loss in ledger.stream_losses() if loss["stream"] == STREAM], ledger.only_in_sql()


def _alike(cluster: LocalNatsCluster) -> bool:
    states = [stream_state(cluster, name, STREAM) for name in cluster.nodes]
    return None not in states and len({(s["first_seq"], s["last_seq"], s["messages"]) for s in states}) == 1


def _kept(before: dict[int, bytes], after: dict[int, bytes]) -> bool:
    """Whether the stream still holds every message it had acknowledged, byte for byte at its seq."""
    return all(after.get(seq) == data for seq, data in before.items())


async def _acknowledged_after_the_copy(fault: Fault, pipeline: Pipeline, fleet: SimulatedFleet, requests: list) -> None:
    """The first part served and projected, the copy `on_disk` taken, the second part served and in SQL."""
    await serve_round_robin(fleet, requests[:PART])
    await pipeline.settled(batches_sent(fleet))
    await fault.on_disk()
    await serve_round_robin(fleet, requests[PART : 2 * PART], start=PART)
    await wait_until(lambda: sum(_sql_identities(pipeline).values()) == batches_sent(fleet), HEAL_S,
                     "the acknowledged part in SQL")


async def lose_and_heal(fault: Fault, db_url: str, seed: int) -> tuple[Healing, bool]:
    """Traffic, `on_disk`, traffic (acknowledged and projected), `strike`, traffic; then assert that it
    healed: each buffered batch once in KV_EVENTS and SQL, SQL equals the engines, no worker uncertain,
    no gap, decide equals the reference model. Returns what healed and whether the cluster kept every
    acknowledged message itself."""
    cluster = fault.cluster
    requests = list(itertools.islice(synthetic_requests(10_000, seed=seed), 3 * PART))
    async with SimulatedFleet(WORKERS, gpu_blocks=48, cpu_blocks=96) as fleet:
        settings = pipeline_settings(cluster.urls, db_url, **R3_REUSE_ON)
        async with Pipeline(settings, fleet) as pipeline:
            await _acknowledged_after_the_copy(fault, pipeline, fleet, requests)
            acknowledged = await wait_until(lambda: _messages(cluster), HEAL_S, "KV_EVENTS read")
            assert len(acknowledged) == batches_sent(fleet)
            await fault.strike()
            assert fault.restored and max(fault.restored.values()) < len(acknowledged), (
                f"the struck nodes came back without the newest acknowledged messages: {fault.restored}")
            back = time.monotonic()
            await serve_round_robin(fleet, requests[2 * PART :], start=2 * PART)
            last = await _healed(pipeline, fleet, cluster)
            healing = _healing(pipeline, time.monotonic() - back)
            kept = _kept(acknowledged, await wait_until(lambda: _messages(cluster), HEAL_S, "KV_EVENTS read"))
            # Whether or not it was let lead, the struck node ends holding what its peers hold.
            await wait_until(lambda: _alike(cluster), HEAL_S, f"every node holding the same KV_EVENTS: {fault.states()}")
            outcome = "nothing lost" if kept else "acknowledged messages lost"
            fault.say(f"healed, {outcome}: {healing}; {fault.states()}")
            _assert_truth(pipeline, fleet)
            await _decide_matches_reference(pipeline, fleet, requests[-12:], last)
    losses, only_in_sql = _stream_losses(db_url)
    assert only_in_sql == [], "every batch the stream lost was published again and projected"
    if kept:
        # The cluster repaired the node from its peers: no stage may claim a loss.
        assert not healing.noticed and losses == [], healing
    else:
        # Never a silent heal: what was lost was published again by ingest, and store saw it. decide checks
        # the message it applied last: before ingest put the lost batches back it finds it gone and
        # rebuilds; after, the stream holds that very message at that seq again (ingest publishes the lost
        # batches, same Msg-Ids, before anything newer), so decide's index is what the stream holds and
        # there is nothing to rebuild; which comes first is a race (seen once in CI: decide's check came
        # second). `_decide_matches_reference` above shows decide right either way; with content that
        # changed (a Gap, beyond the engines' buffers) decide must rebuild, and that test asserts it.
        assert healing.store_losses > 0, healing
        assert len(losses) == healing.store_losses
        # Every batch acknowledged and lost was published again, none more.
        assert healing.repaired + healing.lost == len(acknowledged) - max(fault.restored.values()), healing
    return healing, kept


# --- the tests -------------------------------------------------------------------------------


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
async def test_a_node_restored_from_an_old_copy_and_then_made_leader_loses_nothing(
    nats_cluster, db_url, tmp_path
) -> None:
    """(a) nats-server 2.15.1: the follower comes back with the old copy's 60 of 120 messages
    ("Stream state outdated … will rebuild") and catches up from the leader, by the time it
    reports healthy or within a second or two; a stepdown asked while it is still behind elects
    another node, and the next one makes it leader. The stream keeps every acknowledged message
    byte for byte; no stage sees a loss. Were it to lead while behind, the stages would heal it
    (checked in lose_and_heal either way)."""
    fault = RestoredNode(nats_cluster, tmp_path)
    healing, kept = await lose_and_heal(fault, db_url, seed=31)
    print(f"{fault.victim} led: {fault.led}; the cluster kept every acknowledged message: {kept}")


async def test_a_coordinated_power_loss_of_every_node_is_healed_from_the_engines(
    nats_cluster, db_url, tmp_path
) -> None:
    """(b) nats-server 2.15.1: every node comes back with the copy's 60 messages and nothing newer, the
    cluster elects a leader, and new publishes would take the lost seqs 61-120. ingest finds the
    shortfall (on its reconnection, else before its next write) and publishes the 60 lost batches again from the engines' buffers
    before anything newer; store finds the stream no longer holding what SQL committed and reads it
    again as a new generation; decide finds its last applied message gone and rebuilds, unless ingest
    has already put it back at its seq (then decide's index is the stream's, and is checked against the
    reference model)."""
    healing, kept = await lose_and_heal(PowerLoss(nats_cluster, tmp_path), db_url, seed=32)
    assert not kept, "a coordinated power loss loses the acknowledged tail"
    assert healing.lost == 0, "the engines still buffered every lost batch"


async def test_a_coordinated_power_loss_beyond_the_engines_buffers_is_an_explicit_gap(
    nats_cluster, db_url, tmp_path
) -> None:
    """(b) with engines that no longer buffer what the cluster lost: a Gap(stream_lost) per worker in
    KV_EVENTS, SQL keeps the batches it had (and holds the truth), the audit lists them as only in
    SQL, and a store and decide that read the stream afresh report every worker uncertain."""
    cluster = nats_cluster
    fault = PowerLoss(cluster, tmp_path)
    requests = list(itertools.islice(synthetic_requests(10_000, seed=34), 3 * PART))
    async with SimulatedFleet(WORKERS, gpu_blocks=48, cpu_blocks=96) as fleet:
        settings = pipeline_settings(cluster.urls, db_url, **R3_REUSE_ON)
        async with Pipeline(settings, fleet) as pipeline:
            await _acknowledged_after_the_copy(fault, pipeline, fleet, requests)
            acknowledged = batches_sent(fleet)
            for worker in fleet.workers:
                # The engines move on: each keeps only its last batch, and the next one it sends evicts that too.
                worker.engine.shrink_replay_buffer(1)
            await fault.strike()
            await serve_round_robin(fleet, requests[2 * PART :], start=2 * PART)
            expected = _every_engine_batch(fleet)
            await wait_until(lambda: _sql_identities(pipeline) == expected, HEAL_S, "every engine batch once in SQL")
            # SQL committed the lost batches before the loss: it keeps them, and holds the truth.
            assert pipeline.sql_inventory() == truth_inventory(fleet)

            async def stream_lost_gaps() -> list | None:
                try:
                    batches = await read_batches(cluster.url_list, connect_timeout=2)
                except (nats.errors.Error, nats.js.errors.Error, TimeoutError):
                    return None
                gaps = [b for b in batches
                        if any(getattr(e, "reason", None) is GapReason.STREAM_LOST for e in b.events)]
                return gaps if {b.worker.publisher for b in gaps} == publishers else None

            publishers = {w.worker.publisher for w in fleet.workers}
            gaps = await wait_until(stream_lost_gaps, HEAL_S, "a Gap(stream_lost) per worker in KV_EVENTS")
            # A worker may have more than one (a lost run the engine's buffer splits: a gap before the
            # batch it still had, another at the run's end), but no engine seq is said lost twice.
            lost_ranges = defaultdict(list)
            for batch in gaps:
                for event in batch.events:
                    if getattr(event, "reason", None) is GapReason.STREAM_LOST:
                        lost_ranges[batch.worker.publisher, batch.epoch].append((event.expected_seq, event.received_seq))
            for ranges in lost_ranges.values():
                ranges.sort()
                assert all(end <= start for (_, end), (start, _) in zip(ranges, ranges[1:])), lost_ranges
            # decide finds the stream gone back on its own check, which a busy machine may run after the gaps.
            await wait_until(lambda: pipeline.decide.metrics.stream_regressions.value > 0, HEAL_S,
                             "decide finding KV_EVENTS gone back")
            healing = _healing(pipeline, 0.0)
            fault.say(f"gaps published: {healing}")
            assert healing.lost > 0 and healing.store_losses > 0 and healing.decide_regressions > 0, healing
            # Every lost batch is accounted for: published again (while an engine still had it) or a gap.
            assert healing.repaired + healing.lost == acknowledged - max(fault.restored.values()), healing
        losses, only_in_sql = _stream_losses(db_url)
        assert len(losses) == healing.store_losses
        assert {row["publisher"] for row in only_in_sql} == {w.worker.publisher for w in fleet.workers}, (
            "the batches no engine could give again exist only in SQL, and the audit says so")
        # A store and a decide that had not projected them read the stream as it is now: every
        # worker uncertain for that reason, never silently whole.
        fresh = pipeline_settings(cluster.urls, f"sqlite:///{tmp_path / 'replayed.db'}", **R3_REUSE_ON)
        async with Pipeline(fresh, fleet) as replay:
            await wait_until(lambda: replay.sql("SELECT COUNT(DISTINCT publisher) FROM uncertain_periods "
                                                "WHERE reason = 'stream_lost'")[0][0] == WORKERS,
                             HEAL_S, "every worker uncertain in a store that reads the stream afresh")
            last = await replay.events_last_seq()

            async def answered_at_last() -> dict | None:
                answer = await replay.ask(PROBE)
                return answer if answer.get("inventory_seq", -1) >= last else None

            answer = await wait_until(answered_at_last, HEAL_S, "a fresh decide caught up with KV_EVENTS")
            assert sorted(answer["uncertain_workers"]) == sorted(w.worker.name for w in fleet.workers)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("damage", ["truncated", "bit-flipped"])
async def test_a_damaged_message_block_on_one_node_then_made_leader_loses_nothing(
    nats_cluster, db_url, tmp_path, damage
) -> None:
    """(c), (d) nats-server 2.15.1: on restart the follower recovers KV_EVENTS's messages up to the
    damage and drops the rest (74 of 120 here: a cut block ends mid-message, and a flipped byte fails
    that message's checksum, so both stop at the same message); its Raft log still holds the rest,
    so it is current again by the time it reports healthy or just after, and it leads at the first
    stepdown. No garbled message is served (the stream keeps every acknowledged message byte for
    byte); no stage sees a loss. Were it to lead short, the stages would heal it (checked in
    lose_and_heal either way)."""
    fault = BadBlock(nats_cluster, tmp_path, damage)
    healing, kept = await lose_and_heal(fault, db_url, seed=33)
    print(f"{fault.victim} led: {fault.led}; the cluster kept every acknowledged message: {kept}")
