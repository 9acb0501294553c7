"""Re-record the TensorRT-LLM golden fixtures in tests/golden/trtllm/*.json.

Why: kvledger must read what TensorRT-LLM really produces, not what we think it produces. Its
release on the package index is a stub, so this script executes TensorRT-LLM's own modules out
of a source snapshot, each at the commit named in SOURCES (the stored copies read for this
recording came from those commits), with tiny stand-ins for what they import (the logger, the
env reader, a config class; torch, TensorRT, MPI and the C++ bindings are never imported):

- the pull API (`LLM.get_kv_cache_events()`): events come out of KVCacheManagerV2's Python event
  manager (`runtime/kv_cache_manager_v2/_events.py`: `on_blocks_stored`, `on_block_removed`,
  `on_block_updated`, `enqueue_created_event`, `flush_iteration_events`, `get_latest_events`, with
  its own v1-compatible block hashing, window sizes per life cycle and attention-DP gathering),
  and each is turned into the dict users receive by `KVCacheEventSerializer` (the class alone is
  executed out of `_utils.py`; the rest of that module needs torch, TensorRT and MPI). Each
  fixture keeps what every poll returned (`polls`), for the forwarder to replay;
- the ZMQ publisher (opt-in, KVCacheManagerV2): `_torch/pyexecutor/kv_cache_events.py`'s
  `StreamingKVCacheEventManager` is driven through its V2 hooks and publishes through its own
  `ZmqEventPublisher` (made by `create_event_publisher`); the frames a real pyzmq SUB socket
  receives are recorded, and its replay ROUTER must return the same ones.

What drives the hooks is a stand-in for the V2 radix tree: a block is an object with `key`
(SHA-256 over the parent's key and the block's tokens, as the radix tree chains its keys),
`tokens`, `prev` (the parent block, or a root with `ordinal == -1`) and `storage` (one page
reference per life cycle: `cache_level`, `priority`, `num_tokens_in_block`). Batch timestamps are
fixed (the publisher reads `time.time()`), so re-recording is byte-for-byte deterministic.

One adjustment, applied only when needed: at the commits below the serializer's
`_event_diff_to_json` raises on `None`, and V2's `on_block_updated` sends a cache-level move with
`priority=None`; the recorder then serializes that missing diff as `null` (what a newer
serializer must do for V2's moves) and says so on stdout.

Run:  python tests/golden/record_trtllm.py --source PATH   (a TensorRT-LLM checkout at those files)
      python tests/golden/record_trtllm.py --git-dir PATH  (a clone: each file read at its commit)
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import json
import logging
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import zmq

HERE = Path(__file__).resolve().parent / "trtllm"
T0 = 1767225600.0  # fixed batch timestamps: +0.25 s per batch
BS = 16  # tokens_per_block
TOPIC = "kv-events"
FULL_WINDOW, SWA_WINDOW = 4096, 128

# Each file as read, at the commit it was read at (github.com/NVIDIA/TensorRT-LLM).
SOURCES = {
    "tensorrt_llm/_torch/pyexecutor/kv_cache_events.py": "44004b3864a76c01690e02cedd10678b598233dd",
    "tensorrt_llm/runtime/kv_cache_hash.py": "991de58c52acf039626cabc30e7c4f4106d222fd",
    "tensorrt_llm/runtime/kv_cache_manager_v2/_events.py": "826999ef0152954c267bc84457d04db0ef6330ea",
    "tensorrt_llm/runtime/kv_cache_manager_v2/_common.py": "0fccc5b97dd7b23c438e740b3bf4dcde607266c4",
    "tensorrt_llm/_utils.py": "ed53795b33fc139493f762a1c6c53f691cf52d38",
}


# --- loading TensorRT-LLM's modules out of the snapshot -----------------------------------------

def read_sources(args) -> dict[str, str]:
    if args.git_dir:
        return {path: subprocess.run(["git", "--git-dir", args.git_dir, "show", f"{commit}:{path}"], check=True,
                                     capture_output=True, text=True).stdout for path, commit in SOURCES.items()}
    return {path: (Path(args.source) / path).read_text() for path in SOURCES}


@dataclasses.dataclass
class KVEventsConfig:
    """Stand-in for llmapi/llm_args.py:KVEventsConfig (the fields create_event_publisher reads)."""

    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""


def _module(name: str, **attrs) -> types.ModuleType:
    module = sys.modules[name] = types.ModuleType(name)
    module.__path__ = []
    module.__dict__.update(attrs)
    return module


def _exec(name: str, path: str, text: str) -> types.ModuleType:
    module = _module(name)
    module.__file__ = path
    if "." in name:
        module.__package__ = name.rpartition(".")[0]
    exec(compile(text, path, "exec"), module.__dict__)
    return module


def load_trtllm(sources: dict[str, str]) -> types.SimpleNamespace:
    """Execute the five files, fresh, under their own module names."""
    for name in [n for n in sys.modules if n == "tensorrt_llm" or n.startswith("tensorrt_llm.")]:
        del sys.modules[name]
    _module("tensorrt_llm")
    _module("tensorrt_llm.envs", get_env=lambda name: 0)
    _module("tensorrt_llm.logger", logger=logging.getLogger("tensorrt_llm"))
    _module("tensorrt_llm.llmapi")
    _module("tensorrt_llm.llmapi.llm_args", KVEventsConfig=KVEventsConfig)
    _module("tensorrt_llm.runtime")
    _module("tensorrt_llm.runtime.kv_cache_manager_v2")
    # kv_cache_events.py names these two in annotations only (postponed by `from __future__ import annotations`).
    _module("tensorrt_llm.runtime.kv_cache_manager_v2._event_manager", KVCacheEvent=object, KVCacheEventDiff=object)
    path = "tensorrt_llm/runtime/kv_cache_hash.py"
    _exec("tensorrt_llm.runtime.kv_cache_hash", path, sources[path])
    for name in ("_common", "_events"):
        path = f"tensorrt_llm/runtime/kv_cache_manager_v2/{name}.py"
        _exec(f"tensorrt_llm.runtime.kv_cache_manager_v2.{name}", path, sources[path])
    path = "tensorrt_llm/_torch/pyexecutor/kv_cache_events.py"
    streaming = _exec("tensorrt_llm._torch.pyexecutor.kv_cache_events", path, sources[path])
    # Only the serializer class of _utils.py: the module imports torch, TensorRT and MPI at import.
    tree = ast.parse(sources["tensorrt_llm/_utils.py"])
    [cls] = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "KVCacheEventSerializer"]
    namespace: dict = {}
    exec(compile(ast.Module([cls], []), "tensorrt_llm/_utils.py", "exec"), namespace)
    return types.SimpleNamespace(events=sys.modules["tensorrt_llm.runtime.kv_cache_manager_v2._events"],
                                 streaming=streaming, serializer=namespace["KVCacheEventSerializer"],
                                 serializer_globals=namespace)


def serializer_for(trt) -> type:
    """The serializer, with a None-tolerant diff only if it raises on V2's priority-less moves."""
    cls = trt.serializer
    try:
        cls._event_diff_to_json(None)
    except AttributeError:
        print("note: this KVCacheEventSerializer cannot serialize a cache-level move without a priority diff "
              "(V2 on_block_updated sends priority=None); serializing that diff as null")
        original = cls._event_diff_to_json

        class Tolerant(cls):
            @staticmethod
            def _event_diff_to_json(data):
                return None if data is None else original(data)
        Tolerant.__name__ = cls.__name__
        trt.serializer_globals[cls.__name__] = Tolerant  # its methods name the class through the module globals
        return Tolerant
    return cls


# --- the V2 radix tree, as the event hooks see it ----------------------------------------------

@dataclasses.dataclass
class Page:
    cache_level: int = 0
    priority: int = 35
    num_tokens_in_block: int = BS


class Root:
    ordinal = -1
    lora_task_id = None


class Block:
    def __init__(self, prev, tokens, ordinal, life_cycles=1):
        self.prev, self.tokens, self.ordinal = prev, list(tokens), ordinal
        parent_key = getattr(prev, "key", b"")
        raw = b"".join(t if isinstance(t, bytes) else t.to_bytes(4, "little") for t in self.tokens)
        self.key = hashlib.sha256(parent_key + raw).digest()
        self.pages = [Page(num_tokens_in_block=len(self.tokens)) for _ in range(life_cycles)]
        self.storage = [(lambda page=page: page) for page in self.pages]


def chain(tokens, life_cycles=1, root=None) -> list[Block]:
    root = root or Root()
    blocks, prev = [], root
    for ordinal, start in enumerate(range(0, len(tokens), BS)):
        prev = Block(prev, tokens[start:start + BS], ordinal, life_cycles)
        blocks.append(prev)
    return blocks


def tokens(seed: int, count: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 151_000 + 1 for i in range(count)]


# --- the pull API: KVCacheEventManager (V2) + KVCacheEventSerializer ---------------------------

class PullEngine:
    """One LLM: V2 event managers per attention-DP rank, polled as get_kv_cache_events() does."""

    def __init__(self, trt, *, ranks=1, max_entries=1000, windows=None):
        self.trt, self.serializer = trt, serializer_for(trt)
        manager = trt.events.KVCacheEventManager
        if ranks == 1:
            self.managers = [manager(max_entries, default_window_size=FULL_WINDOW)]
        else:
            gathered: dict[int, list] = {}

            def gather_for(rank):
                def gather(local):  # the attention-DP all-gather, in one process: every rank's events, in rank order
                    gathered[rank] = local
                    return [gathered[r] for r in range(ranks)] if len(gathered) == ranks else [local]
                return gather
            self._gathered = gathered
            self.managers = [manager(max_entries, attention_dp_rank=r, attention_dp_size=ranks,
                                     attention_dp_gather_fn=gather_for(r), default_window_size=FULL_WINDOW)
                             for r in range(ranks)]
        for m in self.managers:
            if windows:
                m.set_life_cycle_window_sizes(windows)
        self.polls: list[list[dict]] = []
        self.held: dict[tuple, dict] = {}
        self.requests: list[dict] = []

    def iteration(self) -> None:
        """End of a scheduler step: every rank flushes (rank 0 last, so it gathers everyone's events)."""
        if len(self.managers) > 1:
            self._gathered.clear()
            for m in reversed(self.managers):
                m.flush()
            for m in self.managers[1:]:
                m._exchange_attention_dp_events()
            self.managers[0]._exchange_attention_dp_events()
        else:
            self.managers[0].flush_iteration_events()

    def poll(self) -> None:
        """LLM.get_kv_cache_events(): rank 0's queue, serialized."""
        self.polls.append(self.serializer.serialize(self.managers[0].get_latest_events(timeout_ms=0)))

    def hold(self, blocks, level=0, window=FULL_WINDOW, rank=0):
        m = self.managers[rank]
        for b in blocks:
            if len(b.tokens) == BS:  # a partial block is no cache block
                self.held[(rank, window, m._block_hash(b))] = {
                    "attention_dp_rank": rank, "window_size": window, "cache_level": level, "block_hash": m._block_hash(b)}

    def drop(self, blocks, window=FULL_WINDOW, rank=0):
        m = self.managers[rank]
        for b in blocks:
            self.held.pop((rank, window, m._block_hash(b)), None)

    def request(self, name, blocks, rank=0, extra_keys=None):
        full = [b for b in blocks if len(b.tokens) == BS]
        m = self.managers[rank]
        self.requests.append({
            "name": name, "attention_dp_rank": rank, "token_ids": [t if isinstance(t, int) else 0 for b in full for t in b.tokens],
            "block_size": BS, "lora_name": None, "cache_salt": None, "extra_keys": extra_keys,
            "block_hashes": [m._block_hash(b) for b in full]})


def pull_plain(trt):
    """One window (full attention, 4096). enqueue_created_event first (num_blocks_per_cache_level [GPU, host]);
    A's 40 tokens are stored as 2 full blocks and a partial third (8 tokens: V2's radix tree keeps partial
    blocks, and the event manager announces them); B shares A's first block and stores one of its own; then
    A's partial block and its block 1 are evicted (one coalesced removed event). Hashes are the manager's
    v1-compatible 64-bit block keys."""
    e = PullEngine(trt)
    m = e.managers[0]
    m.enqueue_created_event([64, 32])
    e.iteration(), e.poll()
    a = chain(tokens(1, 40))
    m.on_blocks_stored(a), e.hold(a)
    e.iteration()
    b = [a[0], Block(a[0], tokens(2, 16), 1)]
    m.on_blocks_stored(b[1:]), e.hold(b[1:])
    e.iteration(), e.poll()
    m.on_block_removed(a[2]), m.on_block_removed(a[1]), e.drop(a[1:])
    e.iteration(), e.poll()
    e.request("A", a), e.request("B", b)
    return e


def pull_host_tier(trt):
    """Host offload (cache levels 0 GPU, 1 host): A's 2 blocks and C's 1 are stored on GPU; A's block 1 and
    C move to host (on_block_updated 0 -> 1: an `updated` event with a cache_level diff), A's block 0 goes to
    host and comes back (1 -> 0), then C is evicted from host. At the end A's block 0 is on GPU, block 1 on
    host."""
    e = PullEngine(trt)
    m = e.managers[0]
    m.enqueue_created_event([64, 32])
    a, c = chain(tokens(3, 32)), chain(tokens(4, 16))
    m.on_blocks_stored(a), m.on_blocks_stored(c), e.hold(a), e.hold(c)
    e.iteration(), e.poll()
    for block in (a[1], c[0]):
        block.pages[0].cache_level = 1
        m.on_block_updated(block, 0, 0, 1)
    e.hold(a[1:], 1), e.hold(c, 1)
    e.iteration(), e.poll()
    m.on_block_updated(a[0], 0, 0, 1), m.on_block_updated(a[0], 0, 1, 0)
    m.on_block_removed(c[0]), e.drop(c)
    e.iteration(), e.poll()
    e.request("A", a), e.request("C", c)
    return e


def pull_windows(trt):
    """Variable sliding-window attention: life cycle 0 has window 4096 (full attention), life cycle 1 window
    128. A's 3 blocks have pages in both, so each store is announced once per window (two stored events,
    window_size 4096 and 128); the 128 window then evicts A's block 0 (on_block_removed with life_cycle 1),
    which the full-attention window keeps."""
    e = PullEngine(trt, windows={0: FULL_WINDOW, 1: SWA_WINDOW})
    m = e.managers[0]
    m.enqueue_created_event([64, 32], FULL_WINDOW), m.enqueue_created_event([64, 32], SWA_WINDOW)
    a = chain(tokens(5, 48), life_cycles=2)
    m.on_blocks_stored(a), e.hold(a), e.hold(a, window=SWA_WINDOW)
    e.iteration(), e.poll()
    m.on_block_removed(a[0], life_cycle=1), e.drop(a[:1], window=SWA_WINDOW)
    e.iteration(), e.poll()
    e.request("A", a)
    return e


IMAGE = hashlib.sha256(b"image-A").digest()


def pull_multimodal(trt):
    """A multimodal prompt: 4 text tokens, then 24 tokens of one image, whose tokens V2 keys by the image's
    digest (TokenIdExt bytes), then 4 text tokens. The manager announces an image token as token_id 0 and
    token_extra_id = the digest's first 8 bytes (little-endian); blocks with such tokens are not
    v1-hashable, so their block hash is the radix key's first 8 bytes, as are their children's. The same
    text with another image is stored too."""
    e = PullEngine(trt)
    m = e.managers[0]
    text = tokens(6, 8)
    other = hashlib.sha256(b"image-B").digest()
    a = chain(text[:4] + [IMAGE] * 24 + text[4:])
    b = chain(text[:4] + [other] * 24 + text[4:])
    m.on_blocks_stored(a), m.on_blocks_stored(b), e.hold(a), e.hold(b)
    e.iteration(), e.poll()

    def keys(digest):  # what a router passes per block: the image as TensorRT-LLM announces it (see docs/ingest.md)
        ident = f"{int.from_bytes(digest[:8], 'little'):016x}".ljust(64, "0")
        return [[[ident, 4]], [[ident, -12]]]  # [identifier, where the image starts relative to the block]
    e.request("image_a", a, extra_keys=keys(IMAGE)), e.request("image_b", b, extra_keys=keys(other))
    return e


def pull_attention_dp(trt):
    """Attention DP with 2 ranks: each rank's manager has its own event ids; flush_iteration_events gathers
    both ranks' events onto rank 0 (the injected gather function), so get_kv_cache_events() on rank 0
    returns rank 0's and rank 1's events, each carrying attention_dp_rank."""
    e = PullEngine(trt, ranks=2)
    a, b = chain(tokens(7, 32)), chain(tokens(8, 32))
    e.managers[0].on_blocks_stored(a), e.hold(a, rank=0)
    e.managers[1].on_blocks_stored(b), e.hold(b, rank=1)
    e.iteration(), e.poll()
    e.managers[1].on_block_removed(b[1]), e.drop(b[1:], rank=1)
    e.iteration(), e.poll()
    e.request("A", a, rank=0), e.request("B", b, rank=1)
    return e


def pull_event_gap(trt):
    """A bounded event buffer (event_buffer_max_size 2) that nobody polled in time: three stores in one
    step, and _publish_events_locked drops the oldest, so the poll returns event ids 2 and 3 after 0 --
    event 1 (B's store) is lost. The engine holds A, B and C; what forwarded the events cannot know B."""
    e = PullEngine(trt, max_entries=2)
    m = e.managers[0]
    m.enqueue_created_event([64, 32])
    e.iteration(), e.poll()
    a, b, c = chain(tokens(9, 16)), chain(tokens(10, 16)), chain(tokens(11, 16))
    for blocks in (b, a, c):
        m.on_blocks_stored(blocks), e.hold(blocks)
    e.iteration(), e.poll()
    e.request("A", a), e.request("B", b), e.request("C", c)
    return e


PULL_SCENARIOS = [pull_plain, pull_host_tier, pull_windows, pull_multimodal, pull_attention_dp, pull_event_gap]


# --- the ZMQ publisher: StreamingKVCacheEventManager + ZmqEventPublisher -----------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def recv_until(sock, done, timeout=5.0):
    frames, deadline = [], time.monotonic() + timeout
    while not done(frames) and sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
        frames.append(sock.recv_multipart())
    return frames


class FixedClock:
    """The publisher module's `time`: time() gives T0 + 0.25 s per batch; sleep is the real one."""

    def __init__(self):
        self.batches = 0
        self.sleep = time.sleep

    def time(self):
        self.batches += 1
        return T0 + 0.25 * (self.batches - 1)


def zmq_capture(trt, drive, rank, attempts=5):
    streaming = trt.streaming
    ctx = zmq.Context.instance()
    for _ in range(attempts):
        pub_port, replay_port = free_port(), free_port()
        config = KVEventsConfig(endpoint=f"tcp://127.0.0.1:{pub_port - rank}",
                                replay_endpoint=f"tcp://127.0.0.1:{replay_port - rank}", topic=TOPIC)
        streaming.time = FixedClock()
        manager = streaming.StreamingKVCacheEventManager(
            config, data_parallel_rank=rank, block_size=BS, max_window_size=FULL_WINDOW)
        manager.set_layer_group_window_sizes({0: FULL_WINDOW, 1: SWA_WINDOW})
        manager.start()
        sub, dealer = ctx.socket(zmq.SUB), ctx.socket(zmq.DEALER)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
            sub.connect(f"tcp://127.0.0.1:{pub_port}")
            monitor.poll(5000)
            sub.disable_monitor()
            monitor.close(linger=0)
            time.sleep(0.3)  # the subscription has reached the PUB socket
            result = drive(manager)
            n = manager.enqueued_batches
            live = recv_until(sub, lambda f: len(f) == n)
            dealer.connect(f"tcp://127.0.0.1:{replay_port}")
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            replayed = recv_until(dealer, lambda f: bool(f) and f[-1][2] == streaming.ZmqEventPublisher.END_SEQ)
        finally:
            manager.shutdown()
            sub.close(linger=0)
            dealer.close(linger=0)
        seqs = [int.from_bytes(f[1], "big") for f in live]
        if seqs == list(range(n)) and [f[1:] for f in replayed[:-1]] == live:
            frames = [{"topic": t.hex(), "seq": s, "payload": p.hex()} for (t, _, p), s in zip(live, seqs)]
            return frames, result
    raise RuntimeError(f"no complete capture in {attempts} attempts")


def wire_hash(trt, block) -> int:
    return trt.streaming._kv_event_wire_hash_from_radix_key(block.key)


def zmq_requests(trt, named) -> list[dict]:
    return [{"name": name, "token_ids": [t for b in blocks for t in b.tokens], "block_size": BS, "lora_name": None,
             "cache_salt": None, "extra_keys": None, "block_hashes": [wire_hash(trt, b) for b in blocks]}
            for name, blocks in named]


def zmq_plain(trt):
    """KVCacheManagerV2 with kv_events_config publisher "zmq", rank 0. Life cycles 0 (window 4096) and 1
    (window 128): set_layer_group_window_sizes picks life cycle 0, so stores announced for life cycle 1 are
    ignored. A's 40 tokens: blocks 0-1 are full and coalesced into one BlockStored (medium GPU, hashes the
    radix keys' first 8 bytes as signed int64, no parent); its partial third block is suppressed. B stores
    one block under A's block 0. Then A's block 1 and the partial block are removed: only block 1 is
    announced (the partial one was never stored). Code: StreamingKVCacheEventManager.
    add_stored_block_event_from_block / add_stored_life_cycle_event_from_block / add_removed_event /
    flush_iteration_events -> ZmqEventPublisher.publish."""
    a = chain(tokens(12, 40), life_cycles=2)
    b1 = Block(a[0], tokens(13, 16), 1, life_cycles=2)

    def drive(manager):
        for block in a:
            manager.add_stored_block_event_from_block(block)
        manager.add_stored_life_cycle_event_from_block(a[0], 1)
        manager.flush_iteration_events()
        manager.add_stored_life_cycle_event_from_block(b1, 0)
        manager.flush_iteration_events()
        manager.add_removed_event([a[2].key, a[1].key])
        manager.flush_iteration_events()
    frames, _ = zmq_capture(trt, drive, 0)
    held = [{"medium": "GPU", "group_idx": 0, "ownership": None, "block_hash": wire_hash(trt, blk)} for blk in (a[0], b1)]
    return frames, held, zmq_requests(trt, [("A", a[:2]), ("B", [a[0], b1])])


def zmq_dp_rank(trt):
    """Attention DP rank 1: ZmqEventPublisher.offset_endpoint_port binds the configured ports + 1, the batch
    carries data_parallel_rank 1, the sequence counts from 0 on that rank."""
    a = chain(tokens(14, 32))

    def drive(manager):
        for block in a:
            manager.add_stored_block_event_from_block(block)
        manager.flush_iteration_events()
    frames, _ = zmq_capture(trt, drive, 1)
    held = [{"medium": "GPU", "group_idx": 0, "ownership": None, "block_hash": wire_hash(trt, blk)} for blk in a]
    return frames, held, zmq_requests(trt, [("A", a)])


ZMQ_SCENARIOS = [zmq_plain, zmq_dp_rank]


# --- writing -------------------------------------------------------------------------------------

def rows(items, pad):
    return "[\n" + ",\n".join(pad + json.dumps(i) for i in items) + "\n" + pad[:-1] + "]" if items else "[]"


def write(name: str, head: dict, body_key: str, body: list, held: list, requests: list) -> Path:
    doc = {**head, body_key: body, "truth": {"held": held, "requests": requests}}
    parts = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in head.items()]
    parts.append(f' "{body_key}": ' + rows(body, "  "))
    parts.append(' "truth": {\n  "held": ' + rows(held, "   ") + ',\n  "requests": ' + rows(requests, "   ") + "\n }")
    text = "{\n" + ",\n".join(parts) + "\n}\n"
    assert json.loads(text) == doc
    HERE.mkdir(exist_ok=True)
    path = HERE / f"{name}.json"
    path.write_text(text)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--source", help="a TensorRT-LLM source tree holding the files of SOURCES")
    group.add_argument("--git-dir", help="a TensorRT-LLM git directory: each file is read at its commit")
    logging.getLogger("tensorrt_llm").setLevel(logging.ERROR)
    sources = read_sources(parser.parse_args())
    for scenario in PULL_SCENARIOS:
        trt = load_trtllm(sources)
        e = scenario(trt)
        head = {"engine": "trtllm", "api": "get_kv_cache_events", "sources": SOURCES, "feature": scenario.__name__[5:],
                "description": " ".join(scenario.__doc__.split()), "block_size": BS}
        held = sorted(e.held.values(), key=lambda r: (r["attention_dp_rank"], r["window_size"], r["cache_level"], r["block_hash"]))
        print(write(scenario.__name__, head, "polls", e.polls, held, e.requests).relative_to(HERE.parents[2]))
    for scenario in ZMQ_SCENARIOS:
        trt = load_trtllm(sources)
        frames, held, requests = scenario(trt)
        head = {"engine": "trtllm", "api": "zmq", "sources": SOURCES, "feature": scenario.__name__[4:],
                "description": " ".join(scenario.__doc__.split()), "block_size": BS}
        held.sort(key=lambda r: r["block_hash"])
        print(write(scenario.__name__, head, "frames", frames, held, requests).relative_to(HERE.parents[2]))


if __name__ == "__main__":
    main()
