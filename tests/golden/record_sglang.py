"""Re-record the SGLang 0.5.23 golden frames in tests/golden/sglang_*.json.

Why: the wire tests must decode what SGLang really sends, not what we think it sends. So the frames
come out of SGLang's own publisher: this script opens the 0.5.23 wheel as a zip and executes only
`sglang/srt/disaggregation/kv_events.py` (stand-ins replace the two sglang modules it imports; msgspec,
pyzmq and pydantic are the real ones). Each batch is built from that module's `KVEventBatch`,
`BlockStored`, `BlockRemoved` and `AllBlocksCleared`, published through its `ZmqEventPublisher` (made
by its `EventPublisherFactory`, as the scheduler does), and recorded as the multipart frames a real
pyzmq SUB socket receives. The replay ROUTER is then asked for seq 0 onward and must return the same
frames; an incomplete live capture (slow joiner) is retried on fresh ports.

What goes into the events is ported from the same wheel: page hashes from mem_cache/utils.py and
mem_cache/cpp_utils/hash_binding.cpp (SHA-256 chains over little-endian u32 token ids), namespacing,
parent links and coalescing from mem_cache/events.py:KVCacheEventRecorder, node splits from
mem_cache/radix_cache.py. Batch timestamps are fixed, so re-recording is byte-for-byte deterministic.

Run:  python tests/golden/record_sglang.py [--wheel PATH]
      (without --wheel it runs `pip download --no-deps sglang==0.5.23` into a temporary directory)
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import socket
import subprocess
import sys
import tempfile
import time
import types
import uuid
import zipfile
from pathlib import Path

import zmq

VERSION = "0.5.23"
HERE = Path(__file__).resolve().parent
T0 = 1767225600.0  # batch ts (SGLang sends time.time()): T0 + 0.5 s per batch
CPU = "CPU_PINNED"  # kv_events.StorageMedium.CPU; the device tier is "GPU"
TOPIC = "kv-events"  # --kv-events-config topic (KVEventsConfig's default is ""), as in the vLLM fixtures


# --- kv_events.py out of the wheel -------------------------------------------------------------

def fetch_wheel(path: str | None, tmp: str) -> Path:
    if path:
        return Path(path)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                    f"sglang=={VERSION}", "-d", tmp], check=True)
    return next(Path(tmp).glob("sglang-*.whl"))


@dataclasses.dataclass(frozen=True)
class NetworkAddress:
    """Stand-in for sglang/srt/utils/network.py:NetworkAddress (parse, is_ipv6, to_tcp)."""

    host: str
    port: int
    is_ipv6 = property(lambda self: ":" in self.host)

    def to_tcp(self) -> str:
        return f"tcp://[{self.host}]:{self.port}" if self.is_ipv6 else f"tcp://{self.host}:{self.port}"

    @staticmethod
    def parse(addr: str) -> NetworkAddress:
        host, _, port = addr[1:].partition("]:") if addr.startswith("[") else addr.rpartition(":")
        if not host or not port.isdigit() or int(port) > 65535 or (":" in host and addr[0] != "["):
            raise ValueError(f"bad address {addr!r}")
        return NetworkAddress(host, int(port))


def load_kv_events(wheel: Path) -> types.ModuleType:
    """Execute the wheel's kv_events.py, fresh, as sglang.srt.disaggregation.kv_events."""
    parallel = types.SimpleNamespace(pp_rank=0, attn_tp_rank=0, attn_cp_rank=0, dp_rank=None, attn_dp_size=1,
                                     attn_dp_rank=0)  # runtime_context.py:get_parallel() on a single GPU
    stubs = {"sglang": {}, "sglang.srt": {}, "sglang.srt.utils": {}, "sglang.srt.disaggregation": {},
             "sglang.srt.runtime_context": {"get_parallel": lambda: parallel},
             "sglang.srt.utils.network": {"NetworkAddress": NetworkAddress}}
    for name, attrs in stubs.items():
        sys.modules[name] = module = types.ModuleType(name)
        module.__path__ = []
        module.__dict__.update(attrs)
    name, member = "sglang.srt.disaggregation.kv_events", "sglang/srt/disaggregation/kv_events.py"
    sys.modules[name] = module = types.ModuleType(name)
    module.__file__ = f"{wheel}!/{member}"
    exec(compile(zipfile.ZipFile(wheel).read(member), module.__file__, "exec"), module.__dict__)
    return module


# --- what SGLang puts in the events ----------------------------------------------------------------

def page_hashes(node: Node, prior_hex: str | None, page: int) -> list[str]:
    """utils.get_hash_str -> hash_binding.cpp:pages_hashes. Page digest = SHA-256(previous digest || token
    ids as LE u32); a bigram page hashes its (t[j], t[j+1]) pairs, flattened."""
    prior, raw, out = bytes.fromhex(prior_hex) if prior_hex else b"", node.raw, []
    for start in range(0, len(node), page):
        end = min(start + page, len(node))
        words = [w for j in range(start, end) for w in (raw[j], raw[j + 1])] if node.bigram else raw[start:end]
        assert all(0 <= w < 2**32 for w in words)  # wider ids would take hash_wide_page
        prior = hashlib.sha256(prior + b"".join(w.to_bytes(4, "little") for w in words)).digest()
        out.append(prior.hex())
    return out


def storage_namespace_seed(extra_key: str | None, cache_salt: str | None) -> str | None:  # utils.py
    if extra_key is None and cache_salt is None:
        return None
    digest = hashlib.sha256(b"sglang-cache-namespace-v1")
    for part in (extra_key, cache_salt):
        data = None if part is None else part.encode()
        digest.update(b"\x00" if data is None else b"\x01" + len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()


def hash_str_to_int64(hash_str: str) -> int:  # utils.py: first 16 hex digits as a signed int64
    return int.from_bytes(bytes.fromhex(hash_str[:16]), "big", signed=True)


class Node:
    """radix_cache.py:TreeNode as events see it: raw key tokens (a bigram key holds N+1 tokens for N
    bigrams), the request namespace, and the lazily computed page hashes."""

    def __init__(self, parent, raw, extra_key=None, cache_salt=None, bigram=False):
        self.parent, self.raw, self.extra_key, self.cache_salt, self.bigram = parent, list(raw), extra_key, cache_salt, bigram
        self.hash_value = None if parent is not None else []
        self.event_hash_value = None

    def __len__(self) -> int:
        return max(0, len(self.raw) - 1) if self.bigram else len(self.raw)


class Recorder:
    """Port of events.py:KVCacheEventRecorder over the wheel's event classes, plus the scenario's own
    bookkeeping of what each tier holds (truth.held)."""

    def __init__(self, kv, page: int, dynamo_format: bool, lora_names: dict[str, str]):
        self.kv, self.page, self.dynamo, self.lora_names = kv, page, dynamo_format, lora_names
        self.queue, self.held = [], {}

    def event_hashes(self, node) -> list[str]:  # events._node_event_hash_values
        if node.hash_value is None:  # utils.compute_node_hash_values
            p = node.parent
            prior = p.hash_value[-1] if p is not None and p.hash_value and len(p) > 0 else None
            node.hash_value = page_hashes(node, prior or storage_namespace_seed(node.extra_key, node.cache_salt), self.page)
        if node.extra_key is None and node.cache_salt is None:
            return node.hash_value
        missing, cur = [], node  # utils.compute_node_event_hash_values: legacy salt seed, no extra_key
        while cur is not None and len(cur) > 0 and cur.event_hash_value is None:
            missing.append(cur)
            cur = cur.parent
        if cur is not None and cur.event_hash_value:
            prior = cur.event_hash_value[-1]
        elif node.cache_salt is not None:
            prior = hashlib.sha256(b"sglang-cache-salt-v1\0" + node.cache_salt.encode()).hexdigest()
        else:
            prior = None
        for m in reversed(missing):
            m.event_hash_value = page_hashes(m, prior, self.page)
            prior = m.event_hash_value[-1] if m.event_hash_value else prior
        return node.event_hash_value

    def seed(self, node):  # events._namespace_seed
        if self.dynamo:
            return self.kv.kv_event_namespace_seed(extra_key=node.extra_key, cache_salt=node.cache_salt)
        lora = node.extra_key if self.lora_names.get(node.extra_key) is not None else None
        return self.kv.kv_event_namespace_seed(extra_key=lora, cache_salt=None)

    def block_hashes(self, node) -> list[int]:
        seed = self.seed(node)
        return [self.kv.namespaced_block_hash(hash_str_to_int64(h), namespace_seed=seed) for h in self.event_hashes(node)]

    def parent_block_hash(self, node) -> int | None:  # events._parent_block_hash
        parent = node.parent
        if parent is None or parent.parent is None:
            return None
        values = parent.hash_value if node.extra_key is None and node.cache_salt is None else parent.event_hash_value
        if not values:
            return None
        return self.kv.namespaced_block_hash(hash_str_to_int64(values[-1]), namespace_seed=self.seed(node))

    def enqueue(self, event) -> None:  # events.enqueue: merge into a compatible queue tail
        tail, kv = self.queue[-1] if self.queue else None, self.kv
        if isinstance(tail, kv.BlockRemoved) and isinstance(event, kv.BlockRemoved) and tail.medium == event.medium:
            tail.block_hashes.extend(event.block_hashes)
            return
        if isinstance(tail, kv.BlockStored) and isinstance(event, kv.BlockStored):
            same = ("medium", "lora_id", "block_size", "cache_salt", "session_id", "lora_name")
            if all(getattr(tail, f) == getattr(event, f) for f in same) and tail.block_hashes \
                    and event.parent_block_hash == tail.block_hashes[-1]:
                tail.block_hashes.extend(event.block_hashes)
                tail.token_ids.extend(event.token_ids)
                return
        self.queue.append(event)

    def record_store(self, node, medium, session_id=None) -> None:  # one BlockStored per page, then enqueue
        parent, lora_name = self.parent_block_hash(node), self.lora_names.get(node.extra_key)
        for i, block_hash in enumerate(self.block_hashes(node)):
            start, end = i * self.page, min((i + 1) * self.page, len(node))
            flat = node.raw[start:end + node.bigram]
            tokens = [(flat[j], flat[j + 1]) for j in range(end - start)] if node.bigram else list(flat)
            self.enqueue(self.kv.BlockStored(
                block_hashes=[block_hash], parent_block_hash=parent, token_ids=tokens, block_size=len(tokens),
                lora_id=None, medium=medium, cache_salt=node.cache_salt, session_id=session_id, lora_name=lora_name))
            self.held[(medium.value, block_hash)] = {
                "medium": medium.value, "group_idx": 0, "ownership": None, "block_hash": block_hash,
                "token_ids": flat, "parent_block_hash": parent, "extra_keys": None}
            parent = block_hash

    def record_remove(self, node, medium) -> None:  # one BlockRemoved per node, then enqueue
        hashes = self.block_hashes(node)
        for block_hash in hashes:
            del self.held[(medium.value, block_hash)]
        if hashes:
            self.enqueue(self.kv.BlockRemoved(block_hashes=hashes, medium=medium))

    def record_all_cleared(self) -> None:
        self.held.clear()
        self.enqueue(self.kv.AllBlocksCleared())


class Engine:
    """One scheduler with a fresh tree cache; step() is SchedulerKvEventsPublisher.publish_kv_events."""

    def __init__(self, kv, *, page=16, bigram=False, config=None, lora_names=None, dp=(1, 0)):
        self.kv, self.page, self.bigram, self.dp, self.config = kv, page, bigram, dp, config or {}
        dynamo = kv.KVEventsConfig(**self.config).format == "dynamo"
        self.rec = Recorder(kv, page, dynamo, lora_names or {})
        self.root = Node(None, [], bigram=bigram)
        self.batches, self.requests = [], []
        self.rec.record_all_cleared()  # UnifiedRadixCache.__init__ -> reset() -> _reset_full()
        self.step()

    def store(self, parent, raw, *, extra_key=None, cache_salt=None, session_id=None) -> Node:
        node = Node(parent, raw, extra_key, cache_salt, self.bigram)  # a new radix node, on GPU
        self.rec.record_store(node, self.kv.StorageMedium.GPU, session_id)
        return node

    def restore(self, node, medium) -> None:  # an existing node gets a copy on `medium`
        self.rec.record_store(node, self.kv.StorageMedium(medium))

    def remove(self, node, medium="GPU") -> None:
        self.rec.record_remove(node, self.kv.StorageMedium(medium))

    def split(self, child, pages) -> Node:
        """radix_cache._split_node + utils.split_node_hash_value at a page boundary: no event."""
        k = pages * self.page
        new = Node(child.parent, child.raw[:k + self.bigram], child.extra_key, child.cache_salt, self.bigram)
        child.raw, child.parent = child.raw[k:], new
        for attr in ("hash_value", "event_hash_value"):
            if (value := getattr(child, attr)) is not None:
                setattr(new, attr, value[:pages])
                setattr(child, attr, value[pages:])
        return new

    def step(self) -> None:
        events, self.rec.queue = self.rec.queue, []
        if events:
            self.batches.append(self.kv.KVEventBatch(ts=T0 + 0.5 * len(self.batches), events=events))

    def requests_for(self, **paths) -> Engine:
        """truth.requests: each named request's stored tokens (its radix path) and its blocks' hashes."""
        for name, path in paths.items():
            tokens = [t for i, node in enumerate(path) for t in (node.raw[1:] if i and self.bigram else node.raw)]
            self.requests.append({
                "name": name, "token_ids": tokens, "block_size": self.page,
                "lora_name": self.rec.lora_names.get(path[-1].extra_key), "cache_salt": path[-1].cache_salt,
                "extra_keys": None, "block_hashes": [h for node in path for h in self.rec.block_hashes(node)]})
        return self


# --- publishing through SGLang's ZmqEventPublisher, capturing with a SUB socket ---------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def recv_until(sock, done, timeout=5.0) -> list[list[bytes]]:
    frames, deadline = [], time.monotonic() + timeout
    while not done(frames) and sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
        frames.append(sock.recv_multipart())
    return frames


def capture(kv, eng: Engine, attempts=5) -> list[dict]:
    n, rank = len(eng.batches), kv.select_kv_publisher_dp_rank(eng.dp[0], eng.dp[1], None)
    ctx = zmq.Context.instance()
    for _ in range(attempts):
        pub_port, replay_port = free_port(), free_port()
        config = {"publisher": "zmq", "bind": True, "topic": TOPIC, **eng.config,  # the publisher adds the rank
                  "endpoint": f"tcp://127.0.0.1:{pub_port - rank}", "replay_endpoint": f"tcp://127.0.0.1:{replay_port - rank}"}
        publisher = kv.EventPublisherFactory.create(json.dumps(config), rank)
        sub, dealer = ctx.socket(zmq.SUB), ctx.socket(zmq.DEALER)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
            sub.connect(f"tcp://127.0.0.1:{pub_port}")
            monitor.poll(5000)  # connected and handshaken ...
            sub.disable_monitor()
            monitor.close(linger=0)
            time.sleep(0.3)  # ... and the subscription has reached the PUB socket
            for batch in eng.batches:
                publisher.publish(batch)
            live = recv_until(sub, lambda f: len(f) == n)
            dealer.connect(f"tcp://127.0.0.1:{replay_port}")
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])  # replay from seq 0
            replayed = recv_until(dealer, lambda f: bool(f) and f[-1][2] == kv.ZmqEventPublisher.END_SEQ)
        finally:
            publisher.shutdown()
            sub.close(linger=0)
            dealer.close(linger=0)
        seqs = [int.from_bytes(f[1], "big") for f in live]
        if seqs == list(range(n)) and [f[1:] for f in replayed[:-1]] == live:
            assert all(len(f) == 3 and len(f[1]) == 8 for f in live)
            return [{"topic": t.hex(), "seq": s, "payload": p.hex()} for (t, _, p), s in zip(live, seqs)]
    raise RuntimeError(f"no complete capture of {n} batches in {attempts} attempts")


def write(kv, feature: str, eng: Engine, description: str) -> Path:
    held = sorted(eng.rec.held.values(), key=lambda r: (r["medium"], r["group_idx"], r["ownership"] or "", r["block_hash"]))
    doc = {"engine": "sglang", "engine_version": VERSION, "feature": feature, "description": " ".join(description.split()),
           "block_size": eng.page, "frames": capture(kv, eng), "truth": {"held": held, "requests": eng.requests}}

    def rows(items, pad):  # one frame, held row or request per line
        return "[\n" + ",\n".join(pad + json.dumps(i) for i in items) + "\n" + pad[:-1] + "]" if items else "[]"
    text = "{\n" + ",\n".join([f" {json.dumps(k)}: {json.dumps(v)}" for k, v in list(doc.items())[:5]] + [
        ' "frames": ' + rows(doc["frames"], "  "),
        ' "truth": {\n  "held": ' + rows(held, "   ") + ',\n  "requests": ' + rows(eng.requests, "   ") + "\n }"]) + "\n}\n"
    assert json.loads(text) == doc and text.count('"frames"') == 1
    path = HERE / f"sglang_{feature}.json"
    path.write_text(text)
    return path


# --- scenarios: one fresh engine each, batch by batch; the docstring is the description ----------

def seq(start, count):
    return list(range(start, start + count))


def plain(kv):
    """Page size 16 (--page-size 16). Seq 0 is the lone AllBlocksCleared every fresh engine publishes first
    (UnifiedRadixCache.__init__ -> reset -> _reset_full). A 53-token request caches its 3 whole pages as one
    coalesced BlockStored; B shares A's first 2 pages (node split, no event) and stores 2 pages whose
    parent_block_hash is A's page 2; C is unrelated; LRU eviction then removes A's third page. Code:
    unified_tree_core.py:_add_new_node / _delete_unbacked_device_leaf -> events.py:KVCacheEventRecorder
    .record_store / .record_remove / .enqueue."""
    e = Engine(kv)
    a = e.store(e.root, seq(1000, 48))
    e.step()
    a12 = e.split(a, 2)
    b, c = e.store(a12, seq(2000, 32)), e.store(e.root, seq(3000, 16))
    e.step()
    e.remove(a)
    e.step()
    return e.requests_for(A=[a12, a], B=[a12, b], C=[c])


def bigram_pages(kv):
    """EAGLE speculative decoding (is_eagle): radix keys are bigram views, so token_ids is a list of
    [t[j], t[j+1]] pairs, 16 pairs per page (block_size 16). truth token_ids are the flat tokens t: N+1
    tokens give N pairs, pair j = (t[j], t[j+1]); a page of pairs covers 17 tokens and the next page starts
    at its last one. Page hash = SHA-256(previous page digest || the 32 pair ids as LE u32). A (33 tokens,
    2 pages), B = A + 16 tokens (1 more page, parent = A's page 2), C (17 tokens), then B's page is evicted.
    Code: radix_cache.py:RadixKey(is_bigram) -> events.py:record_store ("bigram pages expose tuples"),
    cpp_utils/hash_binding.cpp:fill_bigram_page."""
    e = Engine(kv, bigram=True)
    a = e.store(e.root, seq(7000, 33))
    e.step()
    b, c = e.store(a, seq(7032, 17)), e.store(e.root, seq(7200, 17))
    e.step()
    e.remove(b)
    e.step()
    return e.requests_for(A=[a], B=[a, b], C=[c])


LORA_NAME, LORA_PATH = "sql-lora", "/adapters/sql-lora"
LORA_ID = uuid.uuid5(uuid.NAMESPACE_URL, f"{LORA_NAME}\0{LORA_PATH}").hex  # lora_registry.py:LoRARef.lora_id
NAMESPACES = """The same 32 tokens stored unsalted, with cache_salt tenant-a (session_id session-1), with
    tenant-b, with LoRA adapter sql-lora (session-2) and with sql-lora + tenant-a; then session-3 extends the
    unsalted chain by a page. BlockStored carries cache_salt, session_id and lora_name, omitted when None;
    lora_id is always nil; there is no extra_keys field. A salted chain starts from prior
    SHA-256(b'sglang-cache-salt-v1\\0' + salt) (utils.py:compute_node_event_hash_values); a LoRA request's
    extra_key is its 32-hex lora_id (schedule_batch.py:Req), named via KvEventLoraNames
    (scheduler.py:_record_kv_event_lora_name)."""


def namespaces(kv, config=None):
    e = Engine(kv, config=config, lora_names={LORA_ID: LORA_NAME})
    t = seq(5000, 32)
    u = e.store(e.root, t)
    e.step()
    sa = e.store(e.root, t, cache_salt="tenant-a", session_id="session-1")
    sb = e.store(e.root, t, cache_salt="tenant-b")
    e.step()
    lo = e.store(e.root, t, extra_key=LORA_ID, session_id="session-2")
    ls = e.store(e.root, t, extra_key=LORA_ID, cache_salt="tenant-a")
    e.step()
    u3 = e.store(u, seq(5032, 16), session_id="session-3")
    e.step()
    return e.requests_for(unsalted=[u, u3], salt_a=[sa], salt_b=[sb], lora=[lo], lora_salt_a=[ls])


def salt_session_lora(kv):
    return namespaces(kv), NAMESPACES + """ Default format: only LoRA nodes are re-namespaced, by
    kv_events.py:namespaced_block_hash with kv_event_namespace_seed(extra_key=lora_id, cache_salt=None)."""


def dynamo_format(kv):
    return namespaces(kv, {"format": "dynamo"}), NAMESPACES + """ --kv-events-config format "dynamo": every
    namespaced node's hashes and parent links go through namespaced_block_hash with
    kv_event_namespace_seed(extra_key, cache_salt), salt-only chains too; the wire shape is unchanged."""


def host_tier(kv):
    """HiCache (--enable-hierarchical-cache, write_through). Host events use medium 'CPU_PINNED'
    (StorageMedium.CPU), device events 'GPU'; a host store repeats the GPU store's hashes and parent. A (3
    pages) and B (2) are stored on GPU; write-through acks store both on CPU_PINNED
    (unified_tree_core.py:finish_write_through); device eviction demotes both, one coalesced GPU BlockRemoved
    (_demote); host eviction drops B from CPU_PINNED (_evict_host_leaf); A is loaded back to GPU
    (commit_load_back); A is extended by a page on GPU, which is then written through to host."""
    e = Engine(kv)
    a, b = e.store(e.root, seq(1000, 48)), e.store(e.root, seq(4000, 32))
    e.step()
    for node in (a, b):
        e.restore(node, CPU)
    e.step()
    for node in (a, b):
        e.remove(node)
    e.step()
    e.remove(b, CPU)
    e.step()
    e.restore(a, "GPU")
    e.step()
    a4 = e.store(a, seq(1048, 16))
    e.step()
    e.restore(a4, CPU)
    e.step()
    return e.requests_for(A=[a, a4], B=[b])


def clear(kv):
    """POST /flush_cache while GPU holds A (2 pages) and C (1 page) and CPU_PINNED holds A:
    scheduler.py:flush_cache -> UnifiedRadixCache.reset -> _reset_full rebuilds the tree, clears the host
    pool (cache_controller.mem_pool_host.clear()) and queues one AllBlocksCleared (no fields, no medium), so
    nothing survives on GPU or CPU_PINNED (L3 storage is kept, but SGLang publishes no L3 events). A is then
    stored again, with the same hashes as before."""
    e = Engine(kv)
    a, c = e.store(e.root, seq(1000, 32)), e.store(e.root, seq(3000, 16))
    e.step()
    e.restore(a, CPU)
    e.step()
    e.rec.record_all_cleared()
    e.step()
    a = e.store(e.root, seq(1000, 32))
    e.step()
    return e.requests_for(A=[a], C=[c])


def page_size_1(kv):
    """Page size 1, what many attention backends resolve --page-size to: every token is a block (block_size
    1) and a radix node's BlockStored carries one hash per token (events.py:enqueue coalescing). B shares A's
    first 5 tokens (split, no event); eviction then removes A's last 3."""
    e = Engine(kv, page=1)
    a = e.store(e.root, seq(9000, 8))
    e.step()
    a5 = e.split(a, 5)
    b = e.store(a5, [9100, 9101, 9102])
    e.step()
    e.remove(a)
    e.step()
    return e.requests_for(A=[a5, a], B=[a5, b])


def dp_rank(kv):
    """DP attention, rank 1 of 2: kv_events.py:select_kv_publisher_dp_rank gives 1, so the publisher binds
    the configured port + 1 (offset_endpoint_port) and puts attn_dp_rank=1 in every [ts, events,
    attn_dp_rank] batch."""
    e = Engine(kv, dp=(2, 1))
    a = e.store(e.root, seq(1000, 32))
    e.step()
    return e.requests_for(A=[a])


SCENARIOS = [plain, bigram_pages, salt_session_lora, host_tier, clear, dynamo_format, page_size_1, dp_rank]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel", help="path to sglang-0.5.23-*.whl (default: pip download it)")
    args = parser.parse_args()
    # ZmqEventPublisher.shutdown warns "Queue still has 1 items" when its thread left its loop before the
    # stop sentinel was queued: a harmless race in SGLang, every batch had been received.
    logging.getLogger("sglang.srt.disaggregation.kv_events").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="sglang-wheel-") as tmp:
        wheel = fetch_wheel(args.wheel, tmp)
        for scenario in SCENARIOS:
            kv = load_kv_events(wheel)
            result = scenario(kv)
            engine, description = result if isinstance(result, tuple) else (result, scenario.__doc__)
            print(write(kv, scenario.__name__, engine, description).relative_to(HERE.parent.parent))


if __name__ == "__main__":
    main()
