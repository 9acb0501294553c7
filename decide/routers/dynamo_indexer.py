"""Dynamo's standalone KV indexer API (`python -m dynamo.indexer`), answered from decide's index.

A router that queries Dynamo's indexer over HTTP can point at decide instead: the same
paths, request bodies, answers, status codes and error bodies as the indexer in
`ai-dynamo-runtime` 1.6 (`lib/kv-router/src/services/indexer/server.rs`), behind decide's
bearer token and body limits (docs/decide.md, "Dynamo's indexer API").

Dynamo's workers are integer instance ids, each rank registered with the ZMQ endpoint the
indexer then subscribes to. decide subscribes to nothing (ingest does), so a registration
binds the id to a kvledger publisher: the body's `publisher` (kvledger's one addition,
which Dynamo ignores) or else the id in decimal, so `kvledger ingest --publisher 7` is
what `--workers 7=tcp://...` is to Dynamo. Rank r of the id is WorkerId(publisher, r).

The answers are per-tier prefixes of kvledger's native inventory, in tokens: `gpu` the
device prefix, `cpu` the prefix held on device or host, `disk` on device, host or disk.
These queries are reads of the index, not decisions: nothing is recorded in KV_DECISIONS.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Annotated
from urllib.parse import parse_qsl

import attrs
import msgspec
import numpy as np

from kvledger.core.events import Tier, WorkerId, validate_publisher
from kvledger.core.hashing import block_seed, local_block_hashes
from kvledger.runtime.http import Request, Response, Route

from kvledger.decide.inventory.blocks import native_blocks
from kvledger.decide.inventory.index import InventoryIndex
from kvledger.decide.inventory.token_hashes import MAX_BLOCK_TOKENS
from kvledger.decide.inventory.view import IndexReader
from kvledger.decide.routers.dynamo_answers import block_scores, json_token_ids, token_scores

JSON = "application/json"
DEFAULT_GROUP = "default"
U32 = Annotated[int, msgspec.Meta(ge=0, le=0xFFFFFFFF)]
U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgspec reads no integer past 2**64 - 1
I64 = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]
_U64_MASK = (1 << 64) - 1
_PLAIN_SEED = np.uint64(block_seed(None))


# --- the wire: one schema per body, as Dynamo's serde structs read and write them -----------------


class RegisterRequest(msgspec.Struct, frozen=True):
    instance_id: U64
    endpoint: str
    model_name: str
    block_size: U32
    routing_group: str = DEFAULT_GROUP
    tenant_id: str = DEFAULT_GROUP  # the older name of routing_group; Dynamo reads and ignores it
    dp_rank: U32 | None = None
    replay_endpoint: str | None = None
    # Mooncake RFC #1403's per-tenant salt, under either spelling: Dynamo accepts it and mixes
    # it into no hash (engines salt their own blocks), so it is accepted and unused here too.
    additional_salt: str | None = None
    additionalsalt: str | None = None
    publisher: str | None = None  # kvledger's: whose events these are (default: the id in decimal)


class UnregisterRequest(msgspec.Struct, frozen=True):
    instance_id: U64
    model_name: str
    routing_group: str | None = None
    tenant_id: str | None = None
    dp_rank: U32 | None = None


class QueryRequest(msgspec.Struct, frozen=True):
    token_ids: list[U32]
    model_name: str
    routing_group: str = DEFAULT_GROUP
    tenant_id: str = DEFAULT_GROUP
    lora_name: str | None = None
    cache_salt: str | None = None  # enters the first block, as Dynamo's cache namespace does


class _QueryText(QueryRequest, frozen=True):
    """`QueryRequest` with its token ids kept as their JSON text, read in compiled code (`json_token_ids`):
    msgspec's list of ints and its copy to u32 cost a query more than the index's walk. A body whose ids
    that reading does not take is decoded again as `QueryRequest`, for msgspec's own refusal."""

    token_ids: msgspec.Raw


class QueryByHashRequest(msgspec.Struct, frozen=True):
    block_hashes: list[I64]  # local (content) hashes; Dynamo reads them as i64, values ≥ 2**63 negative
    model_name: str
    routing_group: str = DEFAULT_GROUP
    tenant_id: str = DEFAULT_GROUP
    cache_salt: str | None = None  # refused: the hashes carry their salt already


class ListenerInfo(msgspec.Struct, frozen=True):
    endpoint: str
    status: str


class WorkerInfo(msgspec.Struct, frozen=True):
    instance_id: int
    source: str
    status: str
    model_name: str
    routing_group: str
    block_size: int
    endpoints: dict[str, str]
    listeners: dict[str, ListenerInfo]


# Dynamo's dump (`GET /dump`): per partition "model:routing_group", its block size and one stored event per block,
# as a peer indexer started with `--peers` replays them (the 1.6.1 wheel's recovery reads exactly this).
class DumpBlock(msgspec.Struct, frozen=True):
    block_hash: int  # the engine's hash
    tokens_hash: int  # the local (content) hash
    mm_extra_info: None = None


class DumpStored(msgspec.Struct, frozen=True):
    parent_hash: int | None
    start_position: None
    blocks: list[DumpBlock]


class DumpData(msgspec.Struct, frozen=True):
    stored: DumpStored


class DumpKvEvent(msgspec.Struct, frozen=True):
    event_id: int
    data: DumpData
    dp_rank: int


class DumpEvent(msgspec.Struct, frozen=True):
    worker_id: int
    storage_tier: str
    residency_domain: str
    event: DumpKvEvent


class DumpPartition(msgspec.Struct, frozen=True):
    block_size: int
    events: list[DumpEvent]


_STORAGE_TIERS = {Tier.DEVICE: "device", Tier.HOST: "host_pinned", Tier.DISK: "disk"}  # Dynamo's names

_DECODERS = {kind: msgspec.json.Decoder(kind)
             for kind in (RegisterRequest, UnregisterRequest, QueryRequest, _QueryText, QueryByHashRequest)}
_encode = msgspec.json.Encoder().encode
_OK = {"status": "ok"}


class Refusal(Exception):
    """A request answered with an error, as Dynamo answers it."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status)
        self.response = response


def _error(status: int, message: str) -> Refusal:
    return Refusal(Response(status, _encode({"error": message}), JSON))


def decode_body(request: Request, kind: type):
    """The body as `kind`, or the refusal axum's `Json` extractor gives (415, 400 or 422, plain text)."""
    media_type = request.media_type
    if media_type != JSON and not (media_type.startswith("application/") and media_type.endswith("+json")):
        raise Refusal(Response.text(415, "Expected request with `Content-Type: application/json`"))
    try:
        return _DECODERS[kind].decode(request.body)
    except msgspec.ValidationError as error:
        raise Refusal(Response.text(422, f"Failed to deserialize the JSON body into the target type: {error}")) from None
    except msgspec.DecodeError as error:
        raise Refusal(Response.text(400, f"Failed to parse the request body as JSON: {error}")) from None


def check_zmq_endpoint(endpoint: str) -> str | None:
    """Why Dynamo would refuse this endpoint (its `validate_zmq_endpoint`), None when it would not."""
    scheme, sep, address = endpoint.partition("://")
    if not sep:
        return f"invalid ZMQ endpoint `{endpoint}`: missing scheme"
    if scheme in ("ipc", "inproc"):
        return None
    if scheme != "tcp":
        return f"invalid ZMQ endpoint `{endpoint}`: unsupported scheme `{scheme}`"
    host, colon, port = address.rpartition(":")
    if not colon:
        return f"invalid ZMQ endpoint `{endpoint}`: missing TCP port"
    if not host:
        return f"invalid ZMQ endpoint `{endpoint}`: missing TCP host"
    if host.startswith("[") and not host.endswith("]"):
        return f"invalid ZMQ endpoint `{endpoint}`: missing closing `]`"
    if not host.startswith("[") and ":" in host:
        return f"invalid ZMQ endpoint `{endpoint}`: missing TCP port"
    if not port.isdigit() or int(port) > 0xFFFF:
        return f"invalid ZMQ endpoint `{endpoint}`: invalid TCP port: {port!r}"
    return None


# --- the registry: Dynamo instance ids bound to kvledger workers ----------------------------------


@attrs.frozen
class Listener:
    endpoint: str
    replay_endpoint: str | None


@attrs.define
class Registration:
    """One instance id: its routing partition, the publisher its events come under, its ranks."""

    partition: tuple[str, str]  # (model_name, routing_group)
    publisher: str
    ranks: dict[int, Listener] = attrs.Factory(dict)


class DynamoRegistry:
    """Dynamo's registrations and partitions (model, routing group → block size), by its rules."""

    def __init__(self) -> None:
        self.instances: dict[int, Registration] = {}
        self.block_sizes: dict[tuple[str, str], int] = {}
        self.version = 0  # bumped by every change, so what is derived from the registrations is made again

    def register(self, request: RegisterRequest) -> None:
        partition = (request.model_name, request.routing_group)
        instance, rank = request.instance_id, request.dp_rank or 0
        publisher = request.publisher if request.publisher is not None else str(instance)
        for endpoint, prefix in ((request.endpoint, ""), (request.replay_endpoint, "invalid replay endpoint")):
            problem = check_zmq_endpoint(endpoint) if endpoint is not None else None
            if problem:
                raise _error(400, f"{prefix} `{endpoint}`: {problem}" if prefix else problem)
        try:
            validate_publisher(publisher)
        except ValueError as error:
            raise _error(400, str(error)) from None
        if request.block_size == 0:
            raise _error(400, "block_size must be positive")  # Dynamo takes 0, then cannot hash a query
        held = self.instances.get(instance)
        if held is not None:
            if held.partition != partition:
                raise _error(409, f"instance {instance} is already registered for model={held.partition[0]} "
                                  f"routing_group={held.partition[1]}")
            if rank in held.ranks:
                raise _error(409, f"instance {instance} dp_rank {rank} already registered")
            if held.publisher != publisher:
                raise _error(409, f"instance {instance} is bound to publisher {held.publisher!r}")
        block_size = self.block_sizes.setdefault(partition, request.block_size)
        if block_size != request.block_size:
            raise _error(409, f"block_size mismatch for model={partition[0]} routing_group={partition[1]}: "
                              f"existing={block_size}, requested={request.block_size}")
        if held is None:
            held = self.instances[instance] = Registration(partition, publisher)
        held.ranks[rank] = Listener(request.endpoint, request.replay_endpoint)
        self.version += 1

    def unregister(self, request: UnregisterRequest) -> None:
        instance = request.instance_id
        held = self.instances.get(instance)
        if held is None:
            raise _error(404, f"instance {instance} not found")
        self.version += 1
        model, group = held.partition
        # Without a routing group Dynamo drops the instance from every group of the model, whatever dp_rank says.
        if model != request.model_name or (request.routing_group is not None and group != request.routing_group):
            raise _error(404, f"instance {instance} is registered for model={model} routing_group={group}")
        if request.routing_group is not None and request.dp_rank is not None:
            if request.dp_rank not in held.ranks:
                raise _error(404, f"instance {instance} dp_rank {request.dp_rank} not found")
            del held.ranks[request.dp_rank]
            if held.ranks:
                return
        del self.instances[instance]
        self._forget_if_empty(held.partition)

    def _forget_if_empty(self, partition: tuple[str, str]) -> None:
        if not any(held.partition == partition for held in self.instances.values()):
            self.block_sizes.pop(partition, None)

    def workers(self, index: IndexReader, model_name: str | None, routing_group: str | None) -> list[WorkerInfo]:
        listed = []
        for instance, held in self.instances.items():
            model, group = held.partition
            if model_name is not None and model != model_name or routing_group is not None and group != routing_group:
                continue
            # Dynamo marks a listener active once its ZMQ socket is set up (pending for that moment);
            # kvledger's listener is ingest, already following the engine, so every rank is active at once.
            listeners = {str(rank): ListenerInfo(listener.endpoint, "active") for rank, listener in held.ranks.items()}
            status = "active"
            listed.append(WorkerInfo(
                instance, "zmq", status, model, group, self.block_sizes[held.partition],
                {rank: item.endpoint for rank, item in listeners.items()}, listeners,
            ))
        return listed


# --- the answers -----------------------------------------------------------------------------------


@attrs.frozen
class PartitionPlan:
    """A partition's registered ranks as the index's worker slots: what a query of it reads."""

    block_size: int
    slots: np.ndarray  # per registered rank (that the index knows), its worker slot
    instance_ids: np.ndarray  # per registered rank, its instance id (u64); an instance's ranks together
    ranks: np.ndarray  # per registered rank, its dp rank

    def scores(self, index: IndexReader, local: np.ndarray) -> bytes:
        """Dynamo's answer for the request's local block hashes, as JSON (dynamo_answers.scores_json says what)."""
        return block_scores(local, self.block_size, index.table_keys, index.table_rows, index.table_bits,
                            index.holders, index.spilled, len(index.workers), self.slots, self.instance_ids,
                            self.ranks).tobytes()

    def token_scores(self, index: IndexReader, tokens: np.ndarray, seed: np.uint64) -> bytes:
        """The same for the request's token ids, hashed in the same compiled call."""
        return token_scores(tokens, seed, self.block_size, index.table_keys, index.table_rows, index.table_bits,
                            index.holders, index.spilled, len(index.workers), self.slots, self.instance_ids,
                            self.ranks).tobytes()


def compile_answer_kernels(index: IndexReader) -> None:
    """Compile (or load from the kernel cache) the kernels a query runs, for this index's arrays (a reader's
    read-only ones are specialisations of their own), so that no router's first query waits for them."""
    _, tokens = json_token_ids(np.frombuffer(b"[1]", dtype=np.uint8))
    plan = PartitionPlan(1, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.int64))
    plan.token_scores(index, tokens, _PLAIN_SEED)
    plan.scores(index, np.zeros(1, dtype=np.uint64))


def partition_plan(registry: DynamoRegistry, index: IndexReader, partition: tuple[str, str]) -> PartitionPlan:
    instance_ids, ranks, slots = [], [], []
    for instance, held in registry.instances.items():
        if held.partition != partition:
            continue
        for rank in held.ranks:
            slot = index.slot(WorkerId(held.publisher, rank))
            if slot is not None:
                instance_ids.append(instance)
                ranks.append(rank)
                slots.append(slot)
    return PartitionPlan(registry.block_sizes[partition], np.array(slots, dtype=np.int64),
                         np.array(instance_ids, dtype=np.uint64), np.array(ranks, dtype=np.int64))


# --- the routes ------------------------------------------------------------------------------------


class DynamoIndexerApi:
    """The HTTP routes of Dynamo's indexer over decide's index (`index()`: the one decide answers from now)."""

    def __init__(self, index: Callable[[], InventoryIndex]) -> None:
        self._index = index
        self.registry = DynamoRegistry()
        self._plans: dict[tuple[str, str], tuple[tuple, PartitionPlan]] = {}
        self.changed: Callable[[], None] = lambda: None  # told after every registration or its removal

    def routes(self, *, max_request_bytes: int, max_query_bytes: int) -> dict[tuple[str, str], Route]:
        """Every path under decide's bearer token except /health, as /healthz; a query takes up to `max_query_bytes`."""

        def route(handler: Callable[[Request], Response], limit: int = max_request_bytes, changes: bool = False) -> Route:
            def answer(request: Request) -> Response:
                try:
                    return handler(request)
                except Refusal as refusal:
                    return refusal.response
                finally:
                    if changes:
                        self.changed()
            return Route(answer, limit, needs_token=True)  # reads of the index never wait: answered inline

        def health(_: Request) -> Response:
            return Response(200, b"")

        return {
            ("POST", "/register"): route(self.register, changes=True),
            ("POST", "/unregister"): route(self.unregister, changes=True),
            ("GET", "/workers"): route(self.workers),
            ("POST", "/query"): route(self.query, max_query_bytes),
            ("POST", "/query_by_hash"): route(self.query_by_hash, max_query_bytes),
            ("GET", "/dump"): route(self.dump),
            ("GET", "/health"): Route(health),
        }

    def register(self, request: Request) -> Response:
        self.registry.register(decode_body(request, RegisterRequest))
        return Response(201, _encode(_OK), JSON)

    def unregister(self, request: Request) -> Response:
        self.registry.unregister(decode_body(request, UnregisterRequest))
        return Response(200, _encode(_OK), JSON)

    def workers(self, request: Request) -> Response:
        params: Mapping[str, str] = dict(parse_qsl(request.query))
        listed = self.registry.workers(self._index(), params.get("model_name"), params.get("routing_group"))
        return Response(200, _encode(listed), JSON)

    def dump(self, _: Request) -> Response:
        """Every registered rank's credited native blocks as Dynamo's dump: what a Dynamo indexer started with
        `--peers http://<decide>` recovers from (decide/inventory/blocks.py says which blocks, in which order)."""
        index = self._index()
        partitions = {}
        for partition, block_size in self.registry.block_sizes.items():
            events = []
            for instance, held in self.registry.instances.items():
                if held.partition != partition:
                    continue
                for rank in sorted(held.ranks):
                    for number, block in enumerate(native_blocks(index, WorkerId(held.publisher, rank))):
                        stored = DumpStored(block.parent_hash, None, [DumpBlock(block.engine_hash, block.local_hash)])
                        events.append(DumpEvent(instance, _STORAGE_TIERS[block.tier], "worker",
                                                DumpKvEvent(number, DumpData(stored), rank)))
            partitions[f"{partition[0]}:{partition[1]}"] = DumpPartition(block_size, events)
        return Response(200, _encode(partitions), JSON)

    def query(self, request: Request) -> Response:
        body = decode_body(request, _QueryText)
        read, tokens = json_token_ids(np.frombuffer(body.token_ids, dtype=np.uint8))
        if not read:  # not plain u32s: `QueryRequest` refuses it as Dynamo does, or reads what the fast path does not
            tokens = np.array(decode_body(request, QueryRequest).token_ids, dtype=np.uint32)
        index = self._index()
        plan = self._plan(body.model_name, body.routing_group, index)
        if body.cache_salt or plan.block_size > MAX_BLOCK_TOKENS:
            local = np.array(local_block_hashes(tokens.tolist(), plan.block_size, lora_name=body.lora_name,
                                                cache_salt=body.cache_salt), dtype=np.uint64)
            return Response(200, plan.scores(index, local), JSON)
        seed = _PLAIN_SEED if body.lora_name is None else np.uint64(block_seed(body.lora_name))
        return Response(200, plan.token_scores(index, tokens, seed), JSON)

    def query_by_hash(self, request: Request) -> Response:
        body = decode_body(request, QueryByHashRequest)
        if body.cache_salt is not None:
            raise _error(400, "cache_salt is not accepted by /query_by_hash; "
                              "block_hashes must already include the intended cache salt")
        index = self._index()
        plan = self._plan(body.model_name, body.routing_group, index)
        local = np.array(body.block_hashes, dtype=np.int64).view(np.uint64)  # Dynamo's `h as u64`
        return Response(200, plan.scores(index, local), JSON)

    def _plan(self, model_name: str, routing_group: str, index: IndexReader) -> PartitionPlan:
        """The partition's plan, made again when a registration changed, the index was replaced or gained a worker."""
        partition = (model_name, routing_group)
        if partition not in self.registry.block_sizes:
            raise _error(404, f"no indexer for model={model_name} routing_group={routing_group}")
        key = (self.registry.version, id(index), len(index.workers))
        cached = self._plans.get(partition)
        if cached is None or cached[0] != key:
            cached = self._plans[partition] = (key, partition_plan(self.registry, index, partition))
        return cached[1]
