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

from kvledger.events import WorkerId, validate_publisher
from kvledger.hashing import local_block_hashes, sequence_hashes
from kvledger.runtime.http import Request, Response, Route

from decide.compact import lookup_rows
from decide.index import NATIVE_DEVICE, NATIVE_DISK, NATIVE_HOST, InventoryIndex
from decide.rows import dense_planes

JSON = "application/json"
DEFAULT_GROUP = "default"
U32 = Annotated[int, msgspec.Meta(ge=0, le=0xFFFFFFFF)]
U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgspec reads no integer past 2**64 - 1
I64 = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]
_U64_MASK = (1 << 64) - 1


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
    additional_salt: str | None = None  # accepted by Dynamo, not used
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


class QueryByHashRequest(msgspec.Struct, frozen=True):
    block_hashes: list[I64]  # local (content) hashes; Dynamo reads them as i64, values ≥ 2**63 negative
    model_name: str
    routing_group: str = DEFAULT_GROUP
    tenant_id: str = DEFAULT_GROUP
    cache_salt: str | None = None  # refused: the hashes carry their salt already


class InstanceMatch(msgspec.Struct, frozen=True):
    """One instance's prefix in tokens; `cpu` and `disk` count the tiers before them too (Mooncake RFC #1403)."""

    longest_matched: int
    gpu: int
    dp: dict[str, int]  # rank -> its device prefix
    cpu: int
    disk: int


class ScoreResponse(msgspec.Struct, frozen=True):
    scores: dict[str, dict[str, int]]  # instance -> rank -> device prefix, ranks with one only
    frequencies: list[int]
    instances: dict[str, InstanceMatch]


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


_DECODERS = {kind: msgspec.json.Decoder(kind) for kind in (RegisterRequest, UnregisterRequest, QueryRequest, QueryByHashRequest)}
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

    def unregister(self, request: UnregisterRequest) -> None:
        instance = request.instance_id
        held = self.instances.get(instance)
        if held is None:
            raise _error(404, f"instance {instance} not found")
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

    def workers(self, index: InventoryIndex, model_name: str | None, routing_group: str | None) -> list[WorkerInfo]:
        listed = []
        for instance, held in self.instances.items():
            model, group = held.partition
            if model_name is not None and model != model_name or routing_group is not None and group != routing_group:
                continue
            # A rank is active once kvledger's index has seen its publisher's events, pending until then.
            listeners = {
                str(rank): ListenerInfo(listener.endpoint,
                                        "active" if index.slot(WorkerId(held.publisher, rank)) is not None else "pending")
                for rank, listener in held.ranks.items()
            }
            status = "pending" if any(item.status == "pending" for item in listeners.values()) else "active"
            listed.append(WorkerInfo(
                instance, "zmq", status, model, group, self.block_sizes[held.partition],
                {rank: item.endpoint for rank, item in listeners.items()}, listeners,
            ))
        return listed


# --- the answers -----------------------------------------------------------------------------------


def tier_prefixes(index: InventoryIndex, local_hashes: list[int]) -> dict[WorkerId, tuple[int, int, int]]:
    """Each worker's contiguous native prefix of the request, in blocks, on device; device or host; any of the three.

    Read from the index's rows (what every backend ranks from): the request's sequence hashes
    probed in one compiled call, their rows as bitmask planes, a running AND per tier set.
    Workers with no block of the prefix on any tier are left out.
    """
    if not local_hashes or not index.workers:
        return {}
    sequences = np.array(sequence_hashes(local_hashes), dtype=np.uint64)
    rows = lookup_rows(index.table_keys, index.table_rows, index.table_bits, sequences).astype(np.int64)
    planes = dense_planes(index.holders, index.spilled, rows, index.words)  # blocks × classes × words
    gpu = planes[:, NATIVE_DEVICE]
    cpu = gpu | planes[:, NATIVE_HOST]
    disk = cpu | planes[:, NATIVE_DISK]
    prefix = [_prefix_blocks(held) for held in (gpu, cpu, disk)]
    found = {}
    for slot in np.flatnonzero(prefix[2][: len(index.workers)]).tolist():
        found[index.workers[slot]] = (int(prefix[0][slot]), int(prefix[1][slot]), int(prefix[2][slot]))
    return found


def _prefix_blocks(held: np.ndarray) -> np.ndarray:
    """Per worker slot, how many leading blocks it holds (`held`: blocks × words of worker bits)."""
    running = np.bitwise_and.accumulate(held, axis=0)
    bits = np.unpackbits(running.astype("<u8").view(np.uint8), axis=1, bitorder="little")
    return bits.sum(axis=0, dtype=np.int64)


def score_response(registry: DynamoRegistry, index: InventoryIndex, partition: tuple[str, str],
                   local_hashes: list[int]) -> ScoreResponse:
    """Dynamo's answer for one partition: its instances' prefixes in tokens."""
    block_size = registry.block_sizes[partition]
    by_worker = tier_prefixes(index, local_hashes)
    scores: dict[str, dict[str, int]] = {}
    instances: dict[str, InstanceMatch] = {}
    for instance, held in registry.instances.items():
        if held.partition != partition:
            continue
        ranks = {rank: by_worker[WorkerId(held.publisher, rank)] for rank in held.ranks
                 if WorkerId(held.publisher, rank) in by_worker}
        if not ranks:
            continue
        name = str(instance)
        device = {str(rank): blocks[0] * block_size for rank, blocks in ranks.items()}
        if any(device.values()):
            scores[name] = {rank: tokens for rank, tokens in device.items() if tokens}
        gpu, cpu, disk = (max(blocks[tier] for blocks in ranks.values()) * block_size for tier in range(3))
        instances[name] = InstanceMatch(max(gpu, cpu, disk), gpu, device, cpu, disk)
    return ScoreResponse(scores, [], instances)


# --- the routes ------------------------------------------------------------------------------------


class DynamoIndexerApi:
    """The HTTP routes of Dynamo's indexer over decide's index (`index()`: the one decide answers from now)."""

    def __init__(self, index: Callable[[], InventoryIndex]) -> None:
        self._index = index
        self.registry = DynamoRegistry()

    def routes(self, *, max_request_bytes: int, max_query_bytes: int) -> dict[tuple[str, str], Route]:
        """Every path under decide's bearer token except /health, as /healthz; a query takes up to `max_query_bytes`."""

        def route(handler: Callable[[Request], Response], limit: int = max_request_bytes) -> Route:
            async def answer(request: Request) -> Response:
                try:
                    return handler(request)
                except Refusal as refusal:
                    return refusal.response
            return Route(answer, limit, needs_token=True)

        async def health(_: Request) -> Response:
            return Response(200, b"")

        return {
            ("POST", "/register"): route(self.register),
            ("POST", "/unregister"): route(self.unregister),
            ("GET", "/workers"): route(self.workers),
            ("POST", "/query"): route(self.query, max_query_bytes),
            ("POST", "/query_by_hash"): route(self.query_by_hash, max_query_bytes),
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

    def query(self, request: Request) -> Response:
        body = decode_body(request, QueryRequest)
        partition = self._partition(body.model_name, body.routing_group)
        local = local_block_hashes(body.token_ids, self.registry.block_sizes[partition],
                                   lora_name=body.lora_name, cache_salt=body.cache_salt)
        return Response(200, _encode(score_response(self.registry, self._index(), partition, local)), JSON)

    def query_by_hash(self, request: Request) -> Response:
        body = decode_body(request, QueryByHashRequest)
        if body.cache_salt is not None:
            raise _error(400, "cache_salt is not accepted by /query_by_hash; "
                              "block_hashes must already include the intended cache salt")
        partition = self._partition(body.model_name, body.routing_group)
        local = [value & _U64_MASK for value in body.block_hashes]
        return Response(200, _encode(score_response(self.registry, self._index(), partition, local)), JSON)

    def _partition(self, model_name: str, routing_group: str) -> tuple[str, str]:
        partition = (model_name, routing_group)
        if partition not in self.registry.block_sizes:
            raise _error(404, f"no indexer for model={model_name} routing_group={routing_group}")
        return partition
