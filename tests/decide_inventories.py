"""Hypothesis strategies for decide's tests: inventories built from canonical batches, and requests.

Blocks come from a few shared token paths, so workers overlap the way a fleet serving
common prompts does; engine hashes are spread over the whole u64 range (≥ 2^63 included).
"""

from __future__ import annotations

import xxhash
from hypothesis import strategies as st

from kvledger.core.events import Cleared, EventBatch, Gap, GapReason, Provenance, Removed, Stored, Tier, WorkerId
from kvledger.core.reuse import ReuseRequest
from kvledger.core.settings import ReuseSettings
from builders import BLOCK_SIZE, local_hashes

# Token paths as block ids; shared beginnings make shared prefixes.
PATHS = (
    (1, 2, 3, 4, 5, 6, 7, 8),
    (1, 2, 3, 9, 10, 11),
    (1, 2, 12, 13),
    (14, 15, 16, 17, 18),
    (14, 19),
)
WORKERS = tuple(WorkerId(publisher, rank) for publisher in ("alpha", "beta", "gamma", "delta") for rank in (0, 1))
TIERS = (Tier.DEVICE, Tier.DEVICE, Tier.HOST, Tier.DISK, Tier.EXTERNAL)


def engine_hash(path: tuple[int, ...], upto: int, salt: int = 0) -> int:
    """An engine's block hash for path[:upto + 1]; the top bit is set for about half of them."""
    return xxhash.xxh3_64_intdigest(repr((path[: upto + 1], salt)).encode())


# KV-cache groups of a hybrid model: (group_idx, declared kind). Most events are group 0
# with no kind (a plain model); the rest exercise kvledger.core.residency's rule.
GROUPS = ((0, None),) * 6 + ((0, "full_attention"), (1, "sliding_window"), (1, None), (2, "full_attention"), (3, "mamba"))
OWNERSHIPS = (None,) * 5 + ("kvcr",)


@st.composite
def events_for(draw: st.DrawFn) -> object:
    kind = draw(st.sampled_from(("stored",) * 10 + ("removed",) * 2 + ("cleared", "gap")))
    path = draw(st.sampled_from(PATHS))
    tier = draw(st.sampled_from(TIERS))
    group, spec_kind = draw(st.sampled_from(GROUPS))
    ownership = draw(st.sampled_from(OWNERSHIPS))
    # A salted engine hash models an engine whose topology disagrees with another announcer.
    salt = draw(st.sampled_from((0,) * 7 + (1,)))
    if kind == "stored":
        # Mostly whole chains from the root, sometimes a continuation under a parent.
        start = draw(st.sampled_from((0, 0, 0, draw(st.integers(0, len(path) - 1)))))
        end = draw(st.integers(start + 1, len(path)))
        parent = engine_hash(path, start - 1, salt) if start > 0 else None
        ids = list(path[start:end])
        # Sometimes without tokens, as an offload placeholder: hashes from the engine-hash map.
        local = () if draw(st.sampled_from((False,) * 5 + (True,))) else local_hashes(ids)
        return Stored(tier, tuple(engine_hash(path, i, salt) for i in range(start, end)), parent, BLOCK_SIZE,
                      local, None, None, group, ownership, spec_kind)
    if kind == "removed":
        start = draw(st.integers(0, len(path) - 1))
        end = draw(st.integers(start + 1, len(path)))
        return Removed(tier, tuple(engine_hash(path, i, salt) for i in range(start, end)), group, ownership)
    if kind == "cleared":
        return Cleared(draw(st.sampled_from((None, None, Tier.DEVICE, Tier.HOST))))
    return Gap(1, 5, draw(st.sampled_from(tuple(GapReason))))


@st.composite
def batches(draw: st.DrawFn, workers: tuple[WorkerId, ...] = WORKERS, max_batches: int = 40) -> list[tuple[EventBatch, int]]:
    """A stream of canonical batches, numbered like JetStream numbers KV_EVENTS."""
    chosen = draw(st.lists(st.sampled_from(workers), min_size=1, max_size=6, unique=True))
    stream: list[tuple[EventBatch, int]] = []
    engine_seq: dict[tuple[WorkerId, Provenance], int] = {}
    for stream_seq in range(1, draw(st.integers(0, max_batches)) + 1):
        worker = draw(st.sampled_from(chosen))
        provenance = draw(st.sampled_from((Provenance.NATIVE, Provenance.NATIVE, Provenance.RETAINED)))
        key = (worker, provenance)
        engine_seq[key] = engine_seq.get(key, -1) + 1
        events = tuple(draw(st.lists(events_for(), min_size=1, max_size=3)))
        stream.append((EventBatch(worker, 0, engine_seq[key], 1.0, 2.0, provenance, events), stream_seq))
    return stream


@st.composite
def requests(draw: st.DrawFn, request_id: str = "r") -> ReuseRequest:
    path = draw(st.sampled_from(PATHS))
    length = draw(st.integers(0, len(path)))
    ids = list(path[:length]) + draw(st.lists(st.integers(20, 24), max_size=2))
    target = draw(st.one_of(st.none(), st.sampled_from(WORKERS), st.just(WorkerId("stranger"))))
    block_size = draw(st.sampled_from((BLOCK_SIZE, 16, 512)))
    return ReuseRequest(request_id, local_hashes(ids), block_size, target)


_WEIGHTS = st.sampled_from((0.0, 0.1, 0.25, 0.3, 0.75, 1.0, 1.7))


@st.composite
def reuse_settings(draw: st.DrawFn) -> ReuseSettings:
    """Settings over the interesting range; the lookup budget is huge so it never stops a scan."""
    return ReuseSettings(
        enable_decode_to_prefill_reuse=draw(st.booleans()),
        enable_decode_to_prefill_gpu_reuse=draw(st.booleans()),
        minimum_transfer_prefix_blocks=draw(st.integers(0, 3)),
        minimum_estimated_ttft_saving_ms=draw(st.sampled_from((0.0, 0.1, 5.0))),
        transfer_source_prefill_token_us=draw(st.sampled_from((0.0, 1.3, 50.0, 1000.0))),
        transfer_source_estimated_block_us=draw(st.sampled_from((0.0, 400.0, 3333.3))),
        transfer_source_gpu_estimated_block_us=draw(st.sampled_from((0.0, 40.0, 77.7))),
        transfer_source_lookup_budget_ms=1e12,
        device_credit_weight=draw(_WEIGHTS),
        host_credit_weight=draw(_WEIGHTS),
        disk_credit_weight=draw(_WEIGHTS),
    )


# --- plain workers: what nearly every engine sends, held in decide.compact's arrays --------

PLAIN_TIERS = (Tier.DEVICE, Tier.DEVICE, Tier.HOST, Tier.DISK)


@st.composite
def plain_events_for(draw: st.DrawFn, spec_kind: str | None, mixed: bool, offloadable: list[tuple[int, ...]]) -> object:
    """Native group-0 events without ownership; `mixed`, now and then one beyond the plain case (which promotes).

    `offloadable` collects the stored chains' engine hashes, which later placeholders (stores
    without tokens, as an offloading connector sends them) name.
    """
    kinds = ("stored",) * 8 + ("placeholder",) * 2 + ("removed",) * 4 + ("cleared", "gap") + (("beyond",) if mixed else ())
    kind = draw(st.sampled_from(kinds))
    path = draw(st.sampled_from(PATHS))
    tier = draw(st.sampled_from(PLAIN_TIERS))
    # A salted engine hash re-parents a block the worker may hold on another tier.
    salt = draw(st.sampled_from((0,) * 7 + (1,))) if mixed else 0
    if kind == "placeholder" and offloadable:
        chain = draw(st.sampled_from(offloadable))
        start = draw(st.integers(0, len(chain) - 1))
        return Stored(draw(st.sampled_from((Tier.HOST, Tier.DISK))), chain[start:], None, BLOCK_SIZE, (), None, None,
                      0, None, spec_kind)
    if kind in ("stored", "placeholder"):
        start = draw(st.sampled_from((0, 0, draw(st.integers(0, len(path) - 1)))))
        end = draw(st.integers(start + 1, len(path)))
        # An unknown parent now and then: a new chain under a parent nobody holds.
        parent = engine_hash(path, start - 1, salt) if start > 0 else draw(st.sampled_from((None,) * 9 + (7,)))
        engines = tuple(engine_hash(path, i, salt) for i in range(start, end))
        offloadable.append(engines)
        return Stored(tier, engines, parent, BLOCK_SIZE, local_hashes(list(path[start:end])), None, None, 0, None,
                      spec_kind)
    if kind == "removed":
        start = draw(st.integers(0, len(path) - 1))
        end = draw(st.integers(start + 1, len(path)))
        return Removed(tier, tuple(engine_hash(path, i, salt) for i in range(start, end)))
    if kind == "cleared":
        return Cleared(draw(st.sampled_from((None, Tier.DEVICE, Tier.HOST, Tier.EXTERNAL))))
    if kind == "gap":
        return Gap(1, 5, draw(st.sampled_from(tuple(GapReason))))
    return draw(events_for())


@st.composite
def plain_batches(draw: st.DrawFn, workers: tuple[WorkerId, ...] = WORKERS[:4], max_batches: int = 40,
                  ) -> list[tuple[EventBatch, int]]:
    """Native batches in engine order, with restarts (a new epoch), holes and repeats; in a mixed
    stream (a third of them) also retained batches and events beyond the plain case."""
    chosen = draw(st.lists(st.sampled_from(workers), min_size=1, max_size=4, unique=True))
    mixed = draw(st.sampled_from((False, False, True)))
    spec_kind = draw(st.sampled_from((None, None, "full_attention")))
    offloadable: dict[WorkerId, list[tuple[int, ...]]] = {worker: [] for worker in chosen}
    stream: list[tuple[EventBatch, int]] = []
    position: dict[tuple[WorkerId, Provenance], tuple[int, int]] = {}
    for stream_seq in range(1, draw(st.integers(0, max_batches)) + 1):
        worker = draw(st.sampled_from(chosen))
        provenance = draw(st.sampled_from((Provenance.NATIVE,) * 7 + (Provenance.RETAINED,))) if mixed else Provenance.NATIVE
        epoch, seq = position.get((worker, provenance), (0, -1))
        step = draw(st.sampled_from(("next",) * 16 + ("hole", "repeat", "restart")))
        if step == "hole":
            seq += 2
        elif step == "restart":
            epoch, seq = epoch + 1, 0
        elif step == "next" or seq < 0:
            seq += 1
        position[(worker, provenance)] = (epoch, seq)
        events = tuple(draw(st.lists(plain_events_for(spec_kind, mixed, offloadable[worker]), min_size=1, max_size=3)))
        stream.append((EventBatch(worker, epoch, seq, 1.0, 2.0, provenance, events), stream_seq))
    return stream
