"""Sequence rules (docs/core.md, canonical record), on the tracker alone: replay supplied by a plain in-memory buffer."""

from __future__ import annotations

from kvledger.core.events import Gap, GapReason
from kvledger.ingest.sequence import SequenceTracker


class EngineBuffer:
    """What an engine's replay socket would answer: its last `size` batches from a seq on."""

    def __init__(self, size: int = 100) -> None:
        self.size = size
        self.batches: list[tuple[int, bytes]] = []
        self.asked: list[int] = []

    def add(self, seq: int, payload: bytes | None = None) -> tuple[int, bytes]:
        payload = payload if payload is not None else f"batch-{seq}".encode()
        self.batches = (self.batches + [(seq, payload)])[-self.size:]
        return seq, payload

    async def fetch(self, start: int) -> list[tuple[int, bytes]]:
        self.asked.append(start)
        return [(s, p) for s, p in self.batches if s >= start]


def seqs(emits) -> list[tuple[int, int]]:
    return [(e.epoch, e.seq) for e in emits]


async def test_in_order_batches_publish_without_replay() -> None:
    engine = EngineBuffer()
    tracker = SequenceTracker(0, 0, engine.fetch)
    out = []
    for seq in range(3):
        out += await tracker.on_live(*engine.add(seq))
    assert seqs(out) == [(0, 0), (0, 1), (0, 2)] and all(e.gaps == () for e in out)
    assert engine.asked == []


async def test_a_gap_inside_the_replay_buffer_is_repaired_without_a_gap_event() -> None:
    engine = EngineBuffer()
    tracker = SequenceTracker(0, 0, engine.fetch)
    await tracker.on_live(*engine.add(0))
    engine.add(1), engine.add(2)  # lost on the SUB socket
    out = await tracker.on_live(*engine.add(3))
    assert seqs(out) == [(0, 1), (0, 2), (0, 3)]
    assert all(e.gaps == () for e in out)
    assert engine.asked == [1]


async def test_a_gap_beyond_the_replay_buffer_emits_replay_incomplete_and_keeps_what_replay_had() -> None:
    engine = EngineBuffer(size=3)
    tracker = SequenceTracker(0, 0, engine.fetch)
    await tracker.on_live(*engine.add(0))
    for seq in range(1, 8):
        engine.add(seq)  # the buffer keeps 5, 6, 7
    out = await tracker.on_live(*engine.add(8))  # buffer now 6, 7, 8
    assert seqs(out) == [(0, 6), (0, 7), (0, 8)]
    assert out[0].gaps == (Gap(1, 6, GapReason.REPLAY_INCOMPLETE),)
    assert out[1].gaps == () and out[2].gaps == ()


async def test_without_a_replay_socket_a_gap_is_missed() -> None:
    tracker = SequenceTracker(0, 0, None)
    await tracker.on_live(0, b"a")
    out = await tracker.on_live(4, b"e")
    assert seqs(out) == [(0, 4)] and out[0].gaps == (Gap(1, 4, GapReason.MISSED),)


async def test_an_engine_restart_bumps_the_epoch_with_a_publisher_restart_gap() -> None:
    engine = EngineBuffer()
    tracker = SequenceTracker(3, 0, engine.fetch)
    for seq in range(5):
        await tracker.on_live(*engine.add(seq))
    engine.batches = []  # the restarted engine's buffer starts empty
    out = await tracker.on_live(*engine.add(0, b"new-life"))
    assert seqs(out) == [(4, 0)]
    assert out[0].gaps == (Gap(5, 0, GapReason.PUBLISHER_RESTART),)
    assert tracker.counters.restarts == 1


async def test_a_restart_noticed_late_replays_the_new_epoch_from_zero() -> None:
    engine = EngineBuffer()
    tracker = SequenceTracker(0, 10, engine.fetch)  # resumed: JetStream held up to seq 9
    engine.batches = []
    engine.add(0, b"n0"), engine.add(1, b"n1")  # sent before we noticed
    out = await tracker.on_live(*engine.add(2, b"n2"))
    assert seqs(out) == [(1, 0), (1, 1), (1, 2)]
    assert out[0].gaps == (Gap(10, 2, GapReason.PUBLISHER_RESTART),)


async def test_replay_overlapping_the_sub_socket_is_dropped_as_duplicate() -> None:
    engine = EngineBuffer()
    tracker = SequenceTracker(0, 0, engine.fetch)
    for seq in range(4):
        engine.add(seq)
    assert seqs(await tracker.catch_up()) == [(0, 0), (0, 1), (0, 2), (0, 3)]
    for seq in range(4):  # the same batches, now arriving on the SUB socket
        assert await tracker.on_live(seq, f"batch-{seq}".encode()) == []
    assert tracker.counters.duplicates == 4
    assert seqs(await tracker.on_live(*engine.add(4))) == [(0, 4)]


async def test_catch_up_from_a_resume_point_and_an_idle_probe_finds_a_lost_tail() -> None:
    engine = EngineBuffer()
    for seq in range(6):
        engine.add(seq)
    tracker = SequenceTracker(2, 4, engine.fetch)  # JetStream already has up to seq 3
    assert seqs(await tracker.catch_up()) == [(2, 4), (2, 5)]
    engine.add(6)  # the last message, lost on SUB: nothing after it reveals the gap
    assert seqs(await tracker.catch_up()) == [(2, 6)]
    assert await tracker.catch_up() == []


async def test_the_first_replay_of_a_new_engine_starting_mid_buffer_is_incomplete() -> None:
    engine = EngineBuffer(size=2)
    for seq in range(5):
        engine.add(seq)  # the engine kept 3 and 4 only
    out = await SequenceTracker(0, 0, engine.fetch).catch_up()
    assert seqs(out) == [(0, 3), (0, 4)]
    assert out[0].gaps == (Gap(0, 3, GapReason.REPLAY_INCOMPLETE),)



def test_recent_digests_keep_the_last_limit_seqs_and_only_seqs_emitted() -> None:
    from kvledger.ingest.sequence import RecentDigests

    recent = RecentDigests(8)
    for seq in [0, 1, 2, 3, 4, 9, 10, 11, 12, 13]:  # 5..8 never emitted, as after a gap
        recent.put(seq, 1000 + seq)
    # 9..13 took the slots of 1..5; 0 keeps its slot (8 never came); 6 and 7 were never emitted.
    assert [recent.get(seq) for seq in range(16)] == [1000] + [None] * 8 + [1009, 1010, 1011, 1012, 1013, None, None]
    recent.put(21, 2**64 - 1)  # digests are u64
    assert recent.get(21) == 2**64 - 1 and recent.get(13) is None
    recent.clear()
    assert recent.get(0) is None and recent.get(21) is None
