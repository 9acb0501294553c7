"""Re-record the vLLM 0.33.0 golden frames in tests/golden/vllm_*.json.

Why: the wire tests must decode what vLLM really sends, not what we think it sends. So the frames
here come out of vLLM's own publisher: this script opens the 0.33.0 wheel as a zip, executes only
`vllm/distributed/kv_events.py` (tiny stand-ins replace the vllm modules it imports; msgspec and
pyzmq are the real ones), builds each batch from that module's own `KVEventBatch`/`BlockStored`/
`BlockRemoved`/`AllBlocksCleared`, publishes it through its `ZmqEventPublisher` (made by its
`EventPublisherFactory`), and records the frames `[topic, seq (8 bytes BE), payload]` a real pyzmq
SUB socket receives. The replay ROUTER is asked for seq 0 onward too; both must agree exactly.

What vLLM puts in each event is ported from the same wheel, call site by call site (every scenario
names its code path). Block hashes are vLLM's default: the `sha256` (pickle) chain of
`v1/core/kv_cache_utils.py:hash_block_tokens` from the default NONE_HASH seed, as ints by
`maybe_convert_block_hash` (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1: the low 64 bits, unsigned);
extra keys follow `generate_block_hash_extra_keys` / `to_event_extra_keys`. Tokens are seeded and
batch timestamps fixed (vLLM sends time.time()), so re-recording is byte-for-byte deterministic.

Run:  python tests/golden/record_vllm.py [--wheel PATH]
(without --wheel it runs `pip download --no-deps vllm==0.33.0` into a temporary directory).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import ipaddress
import json
import logging
import os
import pickle
import random
import socket
import subprocess
import sys
import tempfile
import time
import types
import zipfile
from pathlib import Path
from urllib.parse import urlsplit

import zmq

VERSION = "0.33.0"
HERE = Path(__file__).resolve().parent
T0 = 1767225600.0  # fixed batch timestamps; +0.25 s per batch
BS = 16  # block_size of every KV cache group here
TOPIC = "kv-events"  # as in the README's --kv-events-config


# --- loading kv_events.py out of the wheel -----------------------------------------------------

def fetch_wheel(path: str | None) -> Path:
    if path:
        return Path(path)
    tmp = Path(tempfile.mkdtemp(prefix="vllm-wheel-"))
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                    f"vllm=={VERSION}", "-d", str(tmp)], check=True)
    return next(tmp.glob("vllm-*.whl"))


@dataclasses.dataclass
class KVEventsConfig:
    """Stand-in for vllm/config/kv_events.py:KVEventsConfig: the same fields, defaults, post-init."""

    enable_kv_cache_events: bool = False
    publisher: str = None  # type: ignore[assignment]
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self):
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"


# vllm/utils/network_utils.py: is_valid_ipv6_address and get_tcp_uri verbatim; split_zmq_path with its
# checks but urllib instead of urllib3; get_ip without interface probing (only `tcp://*:0` uses it).
def is_valid_ipv6_address(address: str) -> bool:
    try:
        ipaddress.IPv6Address(address)
        return True
    except ValueError:
        return False


def get_tcp_uri(ip: str, port: int) -> str:
    return f"tcp://[{ip}]:{port}" if is_valid_ipv6_address(ip) else f"tcp://{ip}:{port}"


def split_zmq_path(path: str) -> tuple[str, str, str]:
    parsed = urlsplit(path)
    host, port = parsed.hostname or "", "" if parsed.port is None else str(parsed.port)
    tcp = parsed.scheme == "tcp"
    if not parsed.scheme or (tcp and not all((host, port))) or (not tcp and port):
        raise ValueError(f"Invalid zmq path: {path}")
    return parsed.scheme, host, port


def get_ip() -> str:
    return os.environ.get("VLLM_HOST_IP") or "127.0.0.1"


def load_kv_events(wheel: Path) -> types.ModuleType:
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        assert f"\nVersion: {VERSION}\n" in zf.read(meta).decode(), f"{wheel} is not vLLM {VERSION}"
        source = zf.read("vllm/distributed/kv_events.py").decode()
    stand_ins = {
        "vllm.config.kv_events": {"KVEventsConfig": KVEventsConfig},
        "vllm.logger": {"init_logger": logging.getLogger},
        "vllm.utils.network_utils": {"get_ip": get_ip, "get_tcp_uri": get_tcp_uri,
                                     "is_valid_ipv6_address": is_valid_ipv6_address,
                                     "split_zmq_path": split_zmq_path},
        "vllm.v1.core.kv_cache_utils": {"ExternalBlockHash": bytes | int},  # kv_cache_utils.py:57
        "vllm.distributed": {},
    }
    for name, attrs in stand_ins.items():
        parts = name.split(".")
        for i in range(1, len(parts)):
            sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
        sys.modules[name] = types.ModuleType(name)
        sys.modules[name].__dict__.update(attrs)
    kv = sys.modules["vllm.distributed.kv_events"] = types.ModuleType("vllm.distributed.kv_events")
    kv.__file__ = f"{wheel}/vllm/distributed/kv_events.py"
    exec(compile(source, kv.__file__, "exec"), kv.__dict__)
    return kv


# --- what vLLM puts in the events (ported from the wheel) --------------------------------------

def sha256(obj) -> bytes:  # vllm/utils/hashing.py:sha256, the default prefix_caching_hash_algo
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


NONE_HASH = sha256("vllm-none-hash")  # kv_cache_utils.init_none_hash with DEFAULT_NONE_HASH_SEED


def ext(block_hash: bytes) -> int:  # kv_cache_utils.maybe_convert_block_hash
    return int.from_bytes(block_hash, byteorder="big") & ((1 << 64) - 1)


def to_event_extra_keys(extra_keys):  # kv_cache_utils.to_event_extra_keys, verbatim
    if not extra_keys:
        return None
    event_keys = [None if keys is None else tuple(key[1:] if key[0] == "mm" else key[1] for key in keys)
                  for keys in extra_keys]
    return event_keys or None


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(128_000) for _ in range(n)]


@dataclasses.dataclass
class Req:
    """What block hashes and BlockStored read from a v1/request.py:Request."""

    name: str
    token_ids: list[int]
    lora: tuple[str, int, str] | None = None  # LoRARequest(lora_name, lora_int_id, lora_path)
    cache_salt: str | None = None
    mm: tuple[tuple[str, int, int], ...] = ()  # MultiModalFeatureSpec (identifier, offset, length)
    lookahead: int = 0  # vllm_config.num_hash_lookahead_tokens

    def keys(self, start: int, end: int) -> tuple | None:
        """generate_block_hash_extra_keys: LoRA, then mm inputs, then the salt (block 0 only). Its
        cursor walk over sorted, disjoint mm features selects exactly the overlapping ones."""
        keys = [("lora", self.lora[0], self.lora[2])] if self.lora else []
        keys += [("mm", ident, off - start) for ident, off, n in self.mm if off < end and start < off + n]
        keys += [("cache_salt", self.cache_salt)] if start == 0 and self.cache_salt else []
        return tuple(keys) or None

    def event_keys(self, i: int) -> tuple | None:  # BlockPool._generate_event_extra_keys
        return self.keys(i * BS, (i + 1) * BS + self.lookahead)

    @property
    def hashes(self) -> list[bytes]:
        """get_request_block_hasher: full blocks only; lookahead extra keys are (E, *next tokens)."""
        out, parent = [], None
        for i in range((len(self.token_ids) - self.lookahead) // BS):
            extra = self.keys(i * BS, (i + 1) * BS)
            if self.lookahead:
                extra = (self.event_keys(i), *self.token_ids[(i + 1) * BS:(i + 1) * BS + self.lookahead])
            parent = sha256((parent or NONE_HASH, tuple(self.block(i)), extra))  # hash_block_tokens
            out.append(parent)
        return out

    def parent(self, i: int) -> int | None:
        return ext(self.hashes[i - 1]) if i else None

    def block(self, i: int) -> list[int]:
        return self.token_ids[i * BS:(i + 1) * BS]

    @property
    def lora_fields(self) -> dict:
        name, adapter_id, _ = self.lora or (None, None, None)
        return {"lora_id": adapter_id, "lora_name": name}


def jsonable(value):
    return [jsonable(v) for v in value] if isinstance(value, (list, tuple)) else value


class Engine:
    """Builds the batches one scheduler step at a time and keeps the truth: what is held where.
    Stores and removals are counted per (medium, group, ownership, hash); a row goes at zero."""

    def __init__(self, kv, groups=(("full_attention", None),)):
        self.kv, self.groups = kv, groups  # KVCacheManager.kv_cache_event_metadata, per group
        self.batches: list[list] = [[]]
        self.held: dict[tuple, list] = {}  # key -> [row, count]
        self.requests: list[dict] = []

    def step(self):
        self.batches.append([])

    def emit(self, event):
        self.batches[-1].append(event)

    def hold(self, medium, group, ownership, h, token_ids=(), parent=None, extra=None):
        if (key := (medium, group, ownership, h)) in self.held:
            self.held[key][1] += 1
        else:
            self.held[key] = [{"medium": medium, "group_idx": group, "ownership": ownership, "block_hash": h,
                               "token_ids": list(token_ids), "parent_block_hash": parent,
                               "extra_keys": jsonable(extra)}, 1]

    def release(self, medium, group, ownership, h):
        entry = self.held[key := (medium, group, ownership, h)]
        entry[1] -= 1
        if not entry[1]:
            del self.held[key]

    def request(self, *reqs: Req):
        for r in reqs:
            n = len(r.hashes)
            self.requests.append({
                "name": r.name, "token_ids": r.token_ids[:n * BS], "block_size": BS,
                "lora_name": r.lora_fields["lora_name"], "cache_salt": r.cache_salt,
                "extra_keys": jsonable(to_event_extra_keys([r.event_keys(i) for i in range(n)])),
                "block_hashes": [ext(h) for h in r.hashes]})

    def gpu_store(self, r: Req, first: int, last: int, group=0, null=()):
        """block_pool.py:BlockPool.cache_full_blocks(num_cached_blocks=first, num_full_blocks=last) ->
        _build_block_stored_event, then KVCacheManager.take_events sets kind and window. Null blocks
        are left out of block_hashes, extra_keys and lookahead_token_ids, not out of token_ids."""
        kept = [i for i in range(first, last) if i not in null]
        event = self.kv.BlockStored(
            block_hashes=[ext(r.hashes[i]) for i in kept], parent_block_hash=r.parent(first),
            token_ids=r.token_ids[first * BS:last * BS], block_size=BS, medium=self.kv.MEDIUM_GPU,
            extra_keys=to_event_extra_keys([r.event_keys(i) for i in kept]), group_idx=group, session_id=None,
            lookahead_token_ids=[r.token_ids[(i + 1) * BS:(i + 1) * BS + r.lookahead] for i in kept]
            if r.lookahead else None, **r.lora_fields)
        event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window = self.groups[group]
        self.emit(event)
        for i, keys in zip(kept, event.extra_keys or [None] * len(kept)):
            self.hold("GPU", group, None, ext(r.hashes[i]), r.block(i), r.parent(i), keys)

    def gpu_evict(self, r: Req, i: int, group=0):
        """BlockPool._maybe_evict_cached_block -> _emit_block_removed_events: one event per hash."""
        h = ext(r.hashes[i])
        self.emit(self.kv.BlockRemoved(block_hashes=[h], medium=self.kv.MEDIUM_GPU, group_idx=group))
        self.release("GPU", group, None, h)

    def reset_prefix_cache(self):
        """BlockPool.reset_prefix_cache: a bare AllBlocksCleared; the pool's (GPU) blocks go."""
        self.emit(self.kv.AllBlocksCleared())
        for key in [k for k in self.held if k[0] == "GPU"]:
            del self.held[key]

    def placeholders(self, r: Req, blocks, medium="CPU", locality=None, ownership=None, group=0):
        """offloading/events.py:OffloadingEventsTracker._placeholder_stored, one per OffloadKey
        (blocks_per_chunk 1, so the key's hash is the GPU block's)."""
        for i in blocks:
            self.emit(self.kv.BlockStored(
                block_hashes=[ext(r.hashes[i])], parent_block_hash=None, token_ids=[], lora_id=None,
                block_size=0, medium=medium, lora_name=None, group_idx=group, kv_cache_spec_kind=None,
                kv_cache_spec_sliding_window=None, locality=locality, ownership=ownership))
            self.hold(medium, group, ownership, ext(r.hashes[i]))

    def chunk(self, r: Req, chunk: int, per_chunk: int, medium="CPU", group=0):
        """OffloadingEventsTracker._build_event_metadata + _take_stored_event (self-describing)."""
        blocks = range(chunk * per_chunk, (chunk + 1) * per_chunk)
        kind, window = self.groups[group]
        self.emit(self.kv.BlockStored(
            block_hashes=[ext(r.hashes[i]) for i in blocks], parent_block_hash=r.parent(blocks[0]),
            token_ids=r.token_ids[blocks[0] * BS:(blocks[-1] + 1) * BS], block_size=BS, medium=medium,
            extra_keys=to_event_extra_keys(None), group_idx=group, kv_cache_spec_kind=kind,
            kv_cache_spec_sliding_window=window, locality=None, ownership=None, **r.lora_fields))
        for i in blocks:
            self.hold(medium, group, None, ext(r.hashes[i]), r.block(i), r.parent(i))

    def offload_remove(self, r: Req, blocks, medium="CPU", locality=None, ownership=None, group=0):
        """OffloadingEventsTracker._take_removed_event: one BlockRemoved per group, all its hashes."""
        hashes = [ext(r.hashes[i]) for i in blocks]
        self.emit(self.kv.BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group,
                                       locality=locality, ownership=ownership))
        for h in hashes:
            self.release(medium, group, ownership, h)

    def mooncake(self, r: Req, i: int, with_tokens=True, group=0):
        """mooncake/store/worker.py:KVCacheStoreSendingThread._handle_request's BlockStored."""
        token_ids = r.block(i) if with_tokens else []
        self.emit(self.kv.BlockStored(
            block_hashes=[ext(r.hashes[i])], parent_block_hash=r.parent(i), token_ids=token_ids,
            block_size=BS, lora_id=None, medium="cpu", lora_name=None, group_idx=group))
        self.hold("cpu", group, None, ext(r.hashes[i]), token_ids, r.parent(i))


# --- publishing through vLLM's ZmqEventPublisher and capturing with a SUB socket ---------------

def recv_until(sock, done, timeout=5.0):
    frames, deadline = [], time.monotonic() + timeout
    while not done(frames) and sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
        frames.append(sock.recv_multipart())
    return frames


def capture(kv, eng: Engine, attempts=5):
    batches, ctx = [b for b in eng.batches if b], zmq.Context.instance()
    for _ in range(attempts):
        sub, dealer = ctx.socket(zmq.SUB), ctx.socket(zmq.DEALER)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.bind("tcp://127.0.0.1:0")  # an endpoint without '*' makes vLLM's PUB connect (_is_bind_endpoint)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            replay = f"tcp://127.0.0.1:{s.getsockname()[1]}"  # the ROUTER always binds
        monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        publisher = kv.EventPublisherFactory.create(KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=sub.getsockopt_string(zmq.LAST_ENDPOINT),
            replay_endpoint=replay, topic=TOPIC), data_parallel_rank=0)
        try:
            monitor.poll(5000)  # the PUB has connected and handshaken ...
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.poll(300)  # ... and the SUB, touched, has attached the pipe and sent its subscription
            for n, events in enumerate(batches):
                publisher.publish(kv.KVEventBatch(ts=T0 + 0.25 * n, events=events))
            live = recv_until(sub, lambda f: len(f) == len(batches))
            dealer.connect(replay)
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            replayed = recv_until(dealer, lambda f: bool(f) and f[-1][2] == kv.ZmqEventPublisher.END_SEQ)
        finally:
            publisher.shutdown()
            sub.close(linger=0)
            dealer.close(linger=0)
        seqs = [int.from_bytes(f[1], "big") for f in live]
        if seqs == list(range(len(batches))) and [f[1:] for f in replayed[:-1]] == live:
            assert all(len(f) == 3 and len(f[1]) == 8 for f in live)
            return [{"topic": t.hex(), "seq": s, "payload": p.hex()} for (t, _, p), s in zip(live, seqs)]
    raise RuntimeError(f"no complete capture of {len(batches)} batches in {attempts} attempts")


def render(doc: dict) -> str:
    """JSON with one frame, held row or request per line (the layout of the SGLang fixtures)."""
    def rows(items, pad):
        return "[\n" + ",\n".join(pad + json.dumps(i) for i in items) + "\n" + pad[:-1] + "]" if items else "[]"
    parts = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in doc.items() if k not in ("frames", "truth")]
    parts.append(' "frames": ' + rows(doc["frames"], "  "))
    truth = doc["truth"]
    parts.append(' "truth": {\n  "held": ' + rows(truth["held"], "   ") + ',\n  "requests": '
                 + rows(truth["requests"], "   ") + "\n }")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def write(kv, feature: str, eng: Engine, description: str) -> Path:
    held = sorted((row for row, _ in eng.held.values()),
                  key=lambda r: (r["medium"], r["group_idx"], r["ownership"] or "", r["block_hash"]))
    doc = {"engine": "vllm", "engine_version": VERSION, "feature": feature,
           "description": " ".join(description.split()), "block_size": BS,
           "frames": capture(kv, eng), "truth": {"held": held, "requests": eng.requests}}
    path = HERE / f"vllm_{feature}.json"
    text = render(doc)
    assert json.loads(text) == doc
    path.write_text(text)
    return path


# --- scenarios (each returns the engine and its description) ----------------------------------

FULL, SWA, MAMBA = ("full_attention", None), ("sliding_window", 32), ("mamba", None)  # KVCacheSpecKind


def plain(kv):
    e, a = Engine(kv), Req("A", tokens(1, 64))
    b = Req("B", a.token_ids[:32] + tokens(2, 16))
    e.gpu_store(a, 0, 2), e.step()  # chunked prefill: 32 tokens, then 32 more
    e.gpu_store(a, 2, 4), e.step()
    e.gpu_store(b, 2, 3), e.step()  # B hits A's first 2 blocks (no event) and stores its third
    e.gpu_evict(a, 3)
    e.request(a, b)
    return e, """One full-attention group: A's 64 tokens are cached in two prefill chunks (the second
    chained under A's block 1), B shares A's first 32 tokens and stores one block under block 1, then
    the pool reuses A's last block. Code: v1/core/block_pool.py:BlockPool.cache_full_blocks ->
    _build_block_stored_event (kind set by v1/core/kv_cache_manager.py:KVCacheManager.take_events);
    BlockPool.get_new_blocks -> _maybe_evict_cached_block -> _emit_block_removed_events."""


def hybrid_sliding_window(kv):
    e, a = Engine(kv, (FULL, SWA)), Req("A", tokens(3, 96))
    e.gpu_store(a, 0, 4, group=0), e.gpu_store(a, 0, 4, group=1), e.step()
    e.gpu_evict(a, 0, group=1), e.gpu_evict(a, 1, group=1), e.step()
    e.gpu_store(a, 4, 6, group=0), e.gpu_store(a, 4, 6, group=1)
    e.request(a)
    return e, """Hybrid model, one BlockPool: group 0 full attention, group 1 sliding window (32). A's
    prefill stores the same 4 hashes once per group; SlidingWindowManager.remove_skipped_blocks frees
    group 1's blocks 0-1 (no event) and a later allocation evicts them (BlockRemoved, group_idx 1); then
    blocks 4-5 are stored in both groups. Code: v1/core/kv_cache_coordinator.py:KVCacheCoordinator.cache_blocks
    -> v1/core/block_pool.py:BlockPool.cache_full_blocks; BlockPool.get_new_blocks ->
    _maybe_evict_cached_block."""


def null_blocks(kv):
    e, a = Engine(kv, (FULL, MAMBA)), Req("A", tokens(4, 112))
    e.gpu_store(a, 0, 4, group=0), e.gpu_store(a, 0, 4, group=1, null={0, 1, 2}), e.step()
    e.gpu_store(a, 4, 7, group=0), e.gpu_store(a, 4, 7, group=1, null={4, 5})
    e.request(a)
    return e, """Hybrid model: group 0 full attention, group 1 Mamba in 'align' mode, whose block table
    is null except the block holding each prefill chunk's final state (chunks of 64 and 48 tokens).
    cache_full_blocks leaves null blocks out of block_hashes and extra_keys but not out of token_ids,
    which spans every block from num_cached_blocks to num_full_blocks, and parent_block_hash is the hash
    of block num_cached_blocks-1, null or not. So group 1 sends [h3] with parent null and 64 token_ids
    (h3's are token_ids[48:64]), then [h6] with parent h3 (not h6's parent h5, never stored in group 1)
    and 48 token_ids (h6's are the last 16). Here the kept block ends its range; with interior gaps
    (prefill checkpoints, a block_mask) the event does not say which positions were kept. Code:
    v1/core/single_type_kv_cache_manager.py:MambaManager.cache_blocks -> v1/core/block_pool.py:
    BlockPool.cache_full_blocks (its blk.is_null / block_mask skips)."""


def offload_placeholder(kv):
    e, a, b = Engine(kv), Req("A", tokens(5, 48)), Req("B", tokens(6, 32))
    e.gpu_store(a, 0, 3), e.step()
    e.gpu_store(b, 0, 2), e.placeholders(a, [0, 1, 2]), e.step()  # GPU events first, then the connector's
    e.gpu_evict(a, 2), e.gpu_evict(a, 1), e.gpu_evict(a, 0), e.step()  # freed in reverse: tail first
    e.offload_remove(a, [1])
    e.request(a, b)
    return e, """OffloadingConnector, default (placeholder) events, blocks_per_chunk 1: A's 3 GPU blocks are
    offloaded and announced one BlockStored per block (medium 'CPU', parent null, token_ids [],
    block_size 0, no kind) in the same batch as B's fresh GPU store (GPU events first); the GPU pool
    then evicts A's blocks (the CPU copies stay) and the CPU tier evicts A's block 1. Code:
    v1/core/sched/scheduler.py:Scheduler.update_from_output; distributed/kv_transfer/kv_connector/v1/
    offloading/events.py:OffloadingEventsTracker._placeholder_stored / _take_removed_event, from
    v1/kv_offload/cpu/manager.py:CPUOffloadingManager.complete_store / prepare_store."""


def offload_self_describing(kv):
    e, a = Engine(kv), Req("A", tokens(7, 64))
    b = Req("B", a.token_ids[:48] + tokens(8, 16))
    e.gpu_store(a, 0, 4), e.step()
    e.gpu_store(b, 3, 4), e.chunk(a, 0, 2), e.chunk(a, 1, 2), e.step()  # B hits A's first 3 GPU blocks
    e.chunk(b, 1, 2), e.step()  # B's chunk 0 is A's, already on CPU; its chunk 1 is [h2, B's h3]
    e.offload_remove(a, [2, 3])  # evicting A's chunk 1 fans out to both of its hashes
    e.request(a, b)
    return e, """OffloadingConnector with self_describing_kv_events, blocks_per_chunk 2: each offloaded
    chunk is one BlockStored with its 2 hashes, 32 token_ids, block_size 16, kind, medium 'CPU' and no
    extra_keys. A and B share 48 tokens, so both their chunk 1s hold h2: stored twice on CPU, it stays
    held after A's chunk 1 is evicted (BlockRemoved [h2, A's h3]); consumers must reference-count. Code:
    distributed/kv_transfer/kv_connector/v1/offloading/events.py:OffloadingEventsTracker.
    _build_event_metadata / _take_stored_event / _take_removed_event."""


def mooncake_store(kv):
    e, a = Engine(kv), Req("A", tokens(9, 48))
    e.gpu_store(a, 0, 3), e.step()
    e.mooncake(a, 0), e.mooncake(a, 1), e.step()
    e.mooncake(a, 2, with_tokens=False)
    e.request(a)
    return e, """MooncakeStoreConnector: after A's 3 GPU blocks the store worker sends one BlockStored per
    block put into Mooncake (medium lowercase 'cpu', block_size 16, parent = the previous block, no
    LoRA, no kind), with the block's token_ids when the job's token window covers it, else [] (the third:
    a save resumed behind that window); it never sends removals. Code: distributed/kv_transfer/
    kv_connector/v1/mooncake/store/worker.py:KVCacheStoreSendingThread._handle_request."""


def extra_keys(kv):
    e, t = Engine(kv), tokens(10, 33)
    img_a, img_b = hashlib.sha256(b"image-A").hexdigest(), hashlib.sha256(b"image-B").hexdigest()
    for r in [Req("plain", t[:32]), Req("salt_a", t[:32], cache_salt="tenant-a"),
              Req("salt_b", t[:32], cache_salt="tenant-b"), Req("image_a", t[:32], mm=((img_a, 4, 20),)),
              Req("image_b", t[:32], mm=((img_b, 4, 20),)),
              Req("lora", t[:32], lora=("adapter-1", 1, "/adapters/adapter-1")),
              Req("lookahead", t[:33], lookahead=1)]:
        e.gpu_store(r, 0, 2), e.request(r), e.step()
    return e, """The same 32 tokens stored by 7 requests; extra_keys has one untagged entry per block: plain
    nulls; the cache_salt on block 0 only; an image (tokens 4..23) as [mm identifier, offset from the
    block start] in each block it overlaps (block 1: -12); the LoRA name in every block (lora_name and
    lora_id set). Hashes use the tagged keys, so all differ. The last request is what an engine with
    EAGLE lookahead hashing (num_hash_lookahead_tokens 1) sends: each hash also covers the next token,
    carried in lookahead_token_ids. Code: v1/core/kv_cache_utils.py:generate_block_hash_extra_keys /
    to_event_extra_keys / get_request_block_hasher; v1/core/block_pool.py:BlockPool.cache_full_blocks."""


def clear_scope(kv):
    e, a, b = Engine(kv), Req("A", tokens(11, 48)), Req("B", tokens(12, 16))
    e.gpu_store(a, 0, 3), e.step()
    e.placeholders(a, [0, 1, 2]), e.step()
    e.reset_prefix_cache(), e.step()
    e.gpu_store(b, 0, 1)
    e.request(a, b)
    return e, """A's 3 blocks are on GPU and offloaded to CPU (placeholders); /reset_prefix_cache makes the
    GPU BlockPool send a bare AllBlocksCleared and the CPU copies stay (the connector is reset only with
    reset_connector=True, and CPUOffloadingManager.reset_cache sends nothing); then B is stored on GPU.
    Code: v1/core/sched/scheduler.py:Scheduler.reset_prefix_cache -> v1/core/kv_cache_coordinator.py:
    KVCacheCoordinator.reset_prefix_cache -> v1/core/block_pool.py:BlockPool.reset_prefix_cache."""


def two_ownerships(kv):
    e, a = Engine(kv), Req("A", tokens(13, 32))
    e.gpu_store(a, 0, 2), e.step()
    e.placeholders(a, [0, 1]), e.step()  # primary CPU tier
    e.placeholders(a, [0, 1], medium="STORAGE", locality="LOCAL")  # FS secondary tier
    e.placeholders(a, [0, 1], medium="STORAGE", ownership="kvcr")  # KVCR secondary tier (G3)
    e.step()
    e.offload_remove(a, [0], medium="STORAGE", ownership="kvcr")
    e.request(a)
    return e, """Tiering: a CPU primary tier plus two STORAGE secondary tiers, FS (locality 'LOCAL',
    ownership null) and KVCR's G3 inventory (ownership 'kvcr', the only one vLLM sets), both report A's
    2 blocks; KVCR then removes block 0, which FS still holds (FS never sends removals). Code:
    v1/kv_offload/tiering/manager.py:TieringOffloadingManager.take_events; tiering/fs/manager.py:
    FileSystemTierManager.get_finished_jobs; tiering/kvcr/manager.py:KVCRSecondaryTierManager.
    _record_inventory; offloading/events.py:OffloadingEventsTracker._placeholder_stored."""


SCENARIOS = [plain, hybrid_sliding_window, null_blocks, offload_placeholder, offload_self_describing,
             mooncake_store, extra_keys, clear_scope, two_ownerships]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--wheel", help="path to vllm-0.33.0-*.whl (default: pip download it)")
    kv = load_kv_events(fetch_wheel(parser.parse_args().wheel))
    for scenario in SCENARIOS:
        eng, description = scenario(kv)
        assert scenario is not plain or any(h >= 1 << 63 for r in eng.requests for h in r["block_hashes"])
        print(write(kv, scenario.__name__, eng, description).relative_to(HERE.parents[1]))


if __name__ == "__main__":
    main()
