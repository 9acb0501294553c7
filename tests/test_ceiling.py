"""The ceiling (kvledger/core/ceiling.py, store/ceiling.py): MIN against brute force, the oracle against every
routing brute force can try, round-robin against the demo's own caches, and the SQL reading on the scripted
decision workload whose truth is known (tests/quality_workload.py), on SQLite and PostgreSQL."""

from __future__ import annotations

import functools
import itertools
import random
import subprocess
import sys
from collections import OrderedDict

import numpy as np
import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvledger.core.ceiling import Policy, Requests, belady_hits, ceiling, oracle, round_robin
from kvledger.core.hashing import local_block_hashes, sequence_hashes
from kvledger.core.settings import ReuseSettings
from kvledger.sim.workload import EngineCache, block_tokens, synthetic_requests

REUSE = ReuseSettings()  # 50 µs a token


def _chains(paths: list[list[int]]) -> list[list[int]]:
    """Requests as paths of small local ids, chained as kvledger chains them: equal prefixes, equal hashes."""
    return [sequence_hashes(path) for path in paths]


# --- MIN -------------------------------------------------------------------------------------


def _brute_force_hits(stream: tuple[int, ...], capacity: int, start: frozenset[int]) -> int:
    """The most hits of one cache of `capacity` over every choice: on each miss, bypass, or insert and evict
    any block."""

    @functools.lru_cache(maxsize=None)
    def best(t: int, cache: frozenset[int]) -> int:
        if t == len(stream):
            return 0
        block = stream[t]
        if block in cache:
            return 1 + best(t + 1, cache)
        options = [best(t + 1, cache)]
        if len(cache) < capacity:
            options.append(best(t + 1, cache | {block}))
        else:
            options.extend(best(t + 1, (cache - {victim}) | {block}) for victim in cache)
        return max(options)

    return best(0, start)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.integers(1, 5), max_size=11), st.integers(0, 4), st.sets(st.integers(1, 7), max_size=4))
def test_min_reaches_exactly_the_best_of_every_eviction_choice(stream, capacity, start) -> None:
    start = frozenset(sorted(start)[:capacity])
    hits = belady_hits(np.array(stream, dtype=np.uint64), capacity, start)
    assert int(hits.sum()) == _brute_force_hits(tuple(stream), capacity, start)


def test_min_by_hand() -> None:
    # x y x with one slot: keeping x for its reuse is the only hit to be had; y is bypassed.
    assert belady_hits(np.array([1, 2, 1], dtype=np.uint64), 1).tolist() == [False, False, True]
    # a b c a b c with two slots: MIN keeps the one used soonest, 2 hits (LRU would have none).
    assert int(belady_hits(np.array([1, 2, 3, 1, 2, 3], dtype=np.uint64), 2).sum()) == 2
    # A block held at the start and used first is a hit; one never used takes no room.
    assert belady_hits(np.array([7, 8, 7], dtype=np.uint64), 1, [9, 7]).tolist() == [True, False, True]
    assert belady_hits(np.array([], dtype=np.uint64), 3).tolist() == []


def test_the_three_figures_by_hand() -> None:
    # A = a1 a2 a3, B = a1 a2 b3, then A again; two workers of two blocks.
    a, b = _chains([[1, 2, 3], [1, 2, 4]])
    requests = Requests.of([a, b, a], 16)
    result = ceiling(requests, [2, 2], [0, 2, 2], REUSE)
    # Oracle, 4 pooled blocks: A's three kept for A again; B's a1 a2 hit, its b3 bypassed; A hits 3.
    assert (result.oracle.hit_blocks, result.oracle.request_blocks, result.oracle.requests) == (5, 9, 3)
    # Round-robin: A then A on worker 0 (two blocks: a1 is evicted, so no prefix); B alone on worker 1.
    assert result.round_robin.hit_blocks == 0
    assert result.achieved.hit_blocks == 4
    assert result.oracle.prefix_hit_rate == pytest.approx(5 / 9)
    assert result.oracle.ttft_saving_ms == pytest.approx(5 * 16 * 50 / 1000)  # 0.8 ms a block
    assert result.achieved.ttft_saving_ms == pytest.approx(4 * 0.8)
    assert [row["policy"] for row in result.rows()] == ["oracle", "round_robin", "achieved"]
    assert result.capacity_blocks == 4


def test_an_empty_window_has_no_rate() -> None:
    result = ceiling(Requests.of([], 16), [], [], REUSE)
    assert (result.oracle.requests, result.oracle.hit_blocks, result.oracle.prefix_hit_rate) == (0, 0, None)
    with pytest.raises(ValueError, match="no worker"):
        ceiling(Requests.of([[1]], 16), [], [0], REUSE)


def test_a_truncated_request_counts_its_unrecorded_tail_as_missed() -> None:
    (a,) = _chains([[1, 2]])
    requests = Requests.of([a, a], 16, blocks=[2, 40])
    figure = oracle(requests, 10, REUSE)
    assert (figure.request_blocks, figure.hit_blocks) == (42, 2)


def test_block_sizes_are_costed_per_request() -> None:
    a, b = _chains([[1], [2]])
    requests = Requests.of([a, a, b, b], [16, 32, 16, 64])
    figure = oracle(requests, 2, REUSE)
    assert figure.hit_blocks == 2
    assert figure.ttft_saving_ms == pytest.approx((32 + 64) * 50 / 1000)


# --- the oracle bounds every routing -----------------------------------------------------------


def _best_routing(requests: list[list[int]], capacities: list[int]) -> int:
    """The most prefix hits any routing reaches over per-worker caches, by brute force: each request on any
    worker, which then keeps any subset of what it held and the request's blocks within its capacity, and
    (as if every transfer were free) hits the longest prefix held anywhere in the fleet."""

    @functools.lru_cache(maxsize=None)
    def best(t: int, states: tuple[frozenset[int], ...]) -> int:
        if t == len(requests):
            return 0
        request = requests[t]
        anywhere = frozenset().union(*states)
        hit = _prefix(request, anywhere)
        result = 0
        for worker, capacity in enumerate(capacities):
            pool = sorted(states[worker] | set(request))
            for size in range(min(capacity, len(pool)) + 1):
                for kept in itertools.combinations(pool, size):
                    after = states[:worker] + (frozenset(kept),) + states[worker + 1:]
                    result = max(result, best(t + 1, after))
        return hit + result

    return best(0, tuple(frozenset() for _ in capacities))


_paths = st.lists(st.lists(st.integers(1, 2), min_size=1, max_size=3), max_size=4)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_paths, st.lists(st.integers(0, 2), min_size=1, max_size=2))
def test_the_oracle_is_at_least_any_routing_brute_force_can_find(paths, capacities) -> None:
    requests = _chains(paths)
    figure = oracle(Requests.of(requests, 16), sum(capacities), REUSE)
    assert figure.hit_blocks >= _best_routing(requests, capacities)


def _prefix(request: list[int], held) -> int:
    return next((k for k, block in enumerate(request) if block not in held), len(request))


def _routed_by_prefix(requests: list[list[int]], capacities: list[int]) -> list[int]:
    """A kvledger-like router: each request to the worker holding its longest prefix (ties: the least
    loaded so far, then the first), each worker an LRU; the prefix each request found there."""
    caches = [OrderedDict() for _ in capacities]
    served = [0] * len(capacities)
    found = []
    for request in requests:
        prefixes = [_prefix(request, cache) for cache in caches]
        worker = max(range(len(caches)), key=lambda w: (prefixes[w], -served[w], -w))
        served[worker] += 1
        found.append(prefixes[worker])
        cache = caches[worker]
        for block in request:
            cache[block] = None
            cache.move_to_end(block)
        while len(cache) > capacities[worker]:
            cache.popitem(last=False)
    return found


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.integers(1, 4), min_size=1, max_size=8), max_size=40),
       st.lists(st.integers(0, 12), min_size=1, max_size=4))
def test_the_oracle_is_above_round_robin_and_a_prefix_router(paths, capacities) -> None:
    requests = _chains(paths)
    found = _routed_by_prefix(requests, capacities)
    result = ceiling(Requests.of(requests, 16), capacities, found, REUSE)
    assert result.achieved.hit_blocks == sum(found)
    assert result.oracle.hit_blocks >= result.round_robin.hit_blocks
    assert result.oracle.hit_blocks >= result.achieved.hit_blocks
    assert result.oracle.ttft_saving_ms >= result.round_robin.ttft_saving_ms


def test_the_oracle_bound_holds_on_the_demo_workload() -> None:
    workload = list(synthetic_requests(3000, seed=11))
    requests = [sequence_hashes([_local(block) for block in request.block_ids]) for request in workload]
    capacities = [64, 64, 64, 64]
    found = _routed_by_prefix(requests, capacities)
    result = ceiling(Requests.of(requests, 16), capacities, found, REUSE)
    assert result.oracle.hit_blocks >= result.achieved.hit_blocks > result.round_robin.hit_blocks > 0
    assert result.oracle.prefix_hit_rate < 1.0


# --- round-robin as the demo serves it ---------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _local(block_id: int) -> int:
    return local_block_hashes(block_tokens(block_id), 16)[0]


def test_round_robin_is_the_demo_s_round_robin_fleet() -> None:
    # The demo's baseline: request i served by shadow cache i mod W (kvledger/app/demo.py), here with no
    # CPU tier, so a worker's cache is one LRU of its GPU blocks.
    workload = list(synthetic_requests(1500, seed=3))
    shadow = [EngineCache(48, 0), EngineCache(48, 0), EngineCache(96, 0)]
    expected = sum(shadow[number % 3].serve(request.block_ids).hit_blocks for number, request in enumerate(workload))
    requests = [sequence_hashes([_local(block) for block in request.block_ids]) for request in workload]
    figure = round_robin(Requests.of(requests, 16), [48, 48, 96], REUSE)
    assert figure.policy is Policy.ROUND_ROBIN
    assert figure.hit_blocks == expected > 0


def _lru_reference(requests, capacities, start) -> int:
    caches = [OrderedDict.fromkeys(start[w] if w < len(start) else []) for w in range(len(capacities))]
    for cache, capacity in zip(caches, capacities):
        while len(cache) > capacity:
            cache.popitem(last=False)
    hits = 0
    for number, request in enumerate(requests):
        worker = number % len(capacities)
        cache = caches[worker]
        hits += _prefix(request, cache)
        for block in request:
            cache[block] = None
            cache.move_to_end(block)
        while len(cache) > capacities[worker]:
            cache.popitem(last=False)
    return hits


def test_round_robin_lru_against_a_plain_one_with_warm_starts() -> None:
    rng = random.Random(5)
    for _ in range(1500):
        workers = rng.randint(1, 3)
        capacities = [rng.randint(0, 5) for _ in range(workers)]
        requests = [list(dict.fromkeys(rng.randint(1, 8) for _ in range(rng.randint(0, 5))))
                    for _ in range(rng.randint(0, 8))]
        start = [list(dict.fromkeys(rng.randint(1, 10) for _ in range(rng.randint(0, 4)))) for _ in range(workers)]
        figure = round_robin(Requests.of(requests, 16), capacities, REUSE, start)
        assert figure.hit_blocks == _lru_reference(requests, capacities, start), (requests, capacities, start)


# --- from SQL ------------------------------------------------------------------------------------


def test_capacity_is_the_most_distinct_blocks_held_at_once() -> None:
    from kvledger.core.events import WorkerId
    from kvledger.store.ceiling import _OPEN, _Stays, held_at, most_held

    # (worker, hash, stored, slot, removed): worker 0 holds block 1 on device over [1, 5) and on host from
    # 3 (once, not twice), block 3 over [2, 5) and block 2 from 5, when block 3 goes: 2 at most.
    rows = [(0, 1, 1, 0, 5), (0, 1, 3, 0, _OPEN), (0, 3, 2, 0, 5), (0, 2, 5, 0, 8), (1, 9, 0, 0, 2), (1, 10, 1, 0, 3)]
    worker, hashes, stored, slot, removed = (np.array(column, dtype=np.int64) for column in zip(*rows))
    stays = _Stays(worker, hashes.view(np.uint64), stored, slot, removed, [WorkerId("a"), WorkerId("b")])
    assert most_held(stays, 1, 10).tolist() == [2, 2]
    assert most_held(stays, 2, 10).tolist() == [2, 1]  # b's blocks 9 and 10 overlap only at seq 1
    assert most_held(stays, 8, 10).tolist() == [1, 0]
    assert held_at(stays, 4) == [[3, 1], []]  # oldest first; block 1 as recent as its host copy
    assert held_at(stays, 1) == [[1], [9, 10]]


@pytest.mark.service
async def test_the_ceiling_of_the_scripted_workload_from_sql(nats_server, db_url) -> None:
    """source/1 holds blocks 1-8, target 1-3, target2 1-2 when decide answers hint (1-12 to target),
    credit-only (1 2 3 40 41 to target) and hint2 (1-12 to target2): 29 request blocks.

    Oracle (13 pooled blocks, starting with 1-8): hint hits 8 and keeps 9-12 for hint2; credit-only hits
    1-3 and bypasses 40 41; hint2 hits all 12: 23. Round-robin (source/1, target, target2 in worker order):
    8 + 3 + 2 = 13. Achieved, each target's own prefix (reuse is off): 3 + 3 + 2 = 8."""
    from builders import BLOCK_SIZE
    from kvledger.store import database, tables
    from kvledger.store.ceiling import ceiling as sql_ceiling
    from test_decide_shadow import shadow_settings
    from test_replay import _record_workload

    await _record_workload(nats_server.url, db_url)
    reuse = shadow_settings(nats_server.url).reuse  # 1 ms a token
    with database.opened(db_url) as engine:
        with engine.begin() as connection:  # a decision recorded without its request (record_requests off)
            row = dict(connection.execute(sa.select(tables.decisions).limit(1)).mappings().one())
            row.update(stream_seq=row["stream_seq"] + 1000, request_id="unrecorded")
            connection.execute(tables.decisions.insert().values(**row))
        with engine.connect() as connection:
            report = sql_ceiling(connection, reuse)
            smaller = sql_ceiling(connection, reuse, capacities={"source/1": 1, "target": 1, "target2": 1})
            empty = sql_ceiling(connection, reuse, from_ts=0.0, to_ts=1.0)
    figures = report.figures
    assert report.capacities == {"source/1": 8, "target": 3, "target2": 2}
    assert (report.unreplayable, report.truncated, report.start_blocks) == (1, 0, 8)
    assert (figures.oracle.requests, figures.oracle.request_blocks) == (3, 29)
    assert (figures.oracle.hit_blocks, figures.round_robin.hit_blocks, figures.achieved.hit_blocks) == (23, 13, 8)
    assert figures.oracle.ttft_saving_ms == pytest.approx(23 * BLOCK_SIZE * 1.0)
    assert figures.achieved.prefix_hit_rate == pytest.approx(8 / 29)
    assert [row["policy"] for row in report.rows()] == ["oracle", "round_robin", "achieved"]
    assert all(row["unreplayable"] == 1 for row in report.rows())
    # Three pooled blocks, starting with the three used soonest (1-3): hint hits 3, credit-only 3, hint2 3.
    assert smaller.figures.oracle.hit_blocks == 9
    assert (empty.figures.oracle.requests, empty.unreplayable, empty.seqs) == (0, 0, None)
    # The demo makes the ceiling's kernels ready while its fleet serves (store.ceiling.warm_kernels): in a fresh
    # process, a ceiling from SQL then compiles or loads no kernel of its own.
    checked = subprocess.run([sys.executable, "-c", _NOTHING_COMPILED_AFTER_WARMING, db_url], capture_output=True,
                             text=True, timeout=600)
    assert checked.returncode == 0, checked.stderr[-3000:]
    assert checked.stdout.strip() == "compiled after warming: none"


_NOTHING_COMPILED_AFTER_WARMING = '''
import sys

import numba

from kvledger.core.settings import ReuseSettings
from kvledger.store import database
from kvledger.store.ceiling import ceiling, warm_kernels


def signatures():
    return {(name, attribute): set(map(str, value.signatures)) for name, module in list(sys.modules.items())
            if name.startswith("kvledger") for attribute, value in list(vars(module).items())
            if isinstance(value, numba.core.registry.CPUDispatcher)}


warm_kernels()
warmed = signatures()
with database.opened(sys.argv[1]) as engine, engine.connect() as connection:
    assert ceiling(connection, ReuseSettings()).figures.oracle.requests == 3
new = sorted(f"{name}.{attribute}" for (name, attribute), seen in signatures().items()
             if seen - warmed.get((name, attribute), set()))
print("compiled after warming:", ", ".join(new) or "none")
'''
