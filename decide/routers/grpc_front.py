"""decide's gRPC front: SGLang's KVIndexer and llm-d's IndexerService over the index (docs/routers.md).

Started by `DecideService` when `decide.grpc_listen` is set, on the service's own event
loop, so every answer reads the index between two applied batches. Requests arrive as
bytes and are parsed here, so that everything a router's own server would refuse before
its handler runs — a message past the size limit, bytes that are no protobuf message — is
refused with that server's status code and message and counted in
`kvledger_decide_grpc_refusals`, like every refusal of the handlers themselves.
A refusal never reaches the index, and a failure inside a handler is answered INTERNAL.
"""

from __future__ import annotations

import asyncio
import logging
import tomllib
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

import attrs
import grpc
import grpc.aio
from google.protobuf.message import DecodeError, Message

from kvledger.decide.inventory.index import InventoryIndex
from kvledger.decide.metrics import DecideMetrics
from kvledger.decide.routers.llmd_scores import DEFAULT_WEIGHTS, SERVICE as LLMD_SERVICE, LlmdModel, pod_scores, scores_response
from kvledger.decide.routers.protos import indexer_pb2, kv_indexer_pb2
from kvledger.decide.routers.sglang_indexer import APPLY_REFUSAL, SERVICE as SGLANG_SERVICE, Refused, SglangIndexer
from kvledger.decide.startup import StartupError

log = logging.getLogger("kvledger.decide.grpc")

Answer = Callable[[Message], Awaitable[Message] | Message]


# --- what the operator tells the front: workers' addresses, llm-d's models ---------------------


@attrs.frozen
class RouterSettings:
    """The `decide.grpc_routers` file: `[sglang.workers]` names → router-facing URLs;
    `[llmd.models."<model>"]` tokenizer, block_size and `pods`; `[llmd.weights]` tier → weight."""

    sglang_addresses: Mapping[str, str] = attrs.field(factory=dict)
    llmd_models: Mapping[str, LlmdModel] = attrs.field(factory=dict)
    llmd_weights: Mapping[str, float] = DEFAULT_WEIGHTS


def load_router_settings(path: str | None) -> RouterSettings:
    """The file's settings (tokenizers loaded), or a StartupError naming what is wrong."""
    if path is None:
        return RouterSettings()
    try:
        document = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise StartupError(f"decide.grpc_routers: cannot read {path}: {error}") from None
    try:
        sglang = document.get("sglang", {})
        addresses = {str(name): _text(url, f"sglang.workers.{name}") for name, url in sglang.get("workers", {}).items()}
        llmd = document.get("llmd", {})
        weights = {str(tier): float(weight) for tier, weight in llmd.get("weights", DEFAULT_WEIGHTS).items()}
        models = {str(name): _model(name, spec) for name, spec in llmd.get("models", {}).items()}
    except (AttributeError, TypeError, ValueError) as error:
        raise StartupError(f"decide.grpc_routers: {path}: {error}") from None
    return RouterSettings(addresses, models, weights)


def _text(value: object, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where} must be a non-empty string, got {value!r}")
    return value


def _model(name: str, spec: Mapping[str, object]) -> LlmdModel:
    from tokenizers import Tokenizer  # only a front serving llm-d needs it

    where = f"llmd.models.{name!r}"
    tokenizer_file = _text(spec.get("tokenizer"), f"{where}.tokenizer")
    block_size = spec.get("block_size")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"{where}.block_size must be a positive integer, got {block_size!r}")
    pods = {str(worker): _text(pod, f"{where}.pods.{worker}") for worker, pod in spec.get("pods", {}).items()}
    try:
        tokenizer = Tokenizer.from_file(tokenizer_file)
    except Exception as error:  # tokenizers raises its own exception type for a missing or bad file
        raise ValueError(f"{where}.tokenizer: cannot load {tokenizer_file}: {error}") from None
    return LlmdModel(tokenizer, block_size, pods)


# --- the routers' own refusals before a handler runs ---------------------------------------------


def _too_large(service: str, size: int, limit: int) -> Refused:
    if service == SGLANG_SERVICE:  # tonic's decoder
        return Refused(grpc.StatusCode.OUT_OF_RANGE,
                       f"Error, decoded message length too large: found {size} bytes, the limit is: {limit} bytes",
                       "message_too_large")
    return Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,  # grpc-go's
                   f"grpc: received message larger than max ({size} vs. {limit})", "message_too_large")


def _undecodable(service: str, error: Exception) -> Refused:
    if service == SGLANG_SERVICE:  # prost's DecodeError, as tonic answers it
        return Refused(grpc.StatusCode.INTERNAL, f"failed to decode Protobuf message: {error}", "malformed")
    return Refused(grpc.StatusCode.INTERNAL, f"grpc: error unmarshalling request: {error}", "malformed")


# --- the front ----------------------------------------------------------------------------------


class GrpcFront:
    """The gRPC server; `async with GrpcFront(...)`, or `start()` and `close()` from the service's own."""

    def __init__(self, index: Callable[[], InventoryIndex], metrics: DecideMetrics, listen: str, *,
                 routers: RouterSettings = RouterSettings(), max_message_bytes: int = 4 * 1024 * 1024) -> None:
        self._index = index
        self.listen = listen
        self.routers = routers
        self.max_message_bytes = max_message_bytes
        self.sglang = SglangIndexer(dict(routers.sglang_addresses))
        self.refusals = metrics.counter("kvledger_decide_grpc_refusals",
                                        "gRPC requests refused, by service, method, status code and reason.",
                                        ["service", "method", "code", "reason"])
        self.requests = metrics.counter("kvledger_decide_grpc_requests", "gRPC requests answered, by service and method.",
                                        ["service", "method"])
        self._server: grpc.aio.Server | None = None
        self.port: int | None = None

    async def start(self) -> None:
        # grpc's own limit sits well above ours, so what lies between is refused here, counted.
        core_limit = max(2 * self.max_message_bytes, self.max_message_bytes + (1 << 20))
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", core_limit)])
        sglang = {
            "ApplyExternalKvBatch": self._unary(SGLANG_SERVICE, "ApplyExternalKvBatch",
                                                kv_indexer_pb2.ApplyExternalKvBatchRequest, self._apply),
            "MatchExternalKv": self._unary(SGLANG_SERVICE, "MatchExternalKv", kv_indexer_pb2.MatchExternalKvRequest,
                                           lambda request: self.sglang.match(self._index(), request)),
            "MatchExternalKvPrefix": self._unary(SGLANG_SERVICE, "MatchExternalKvPrefix",
                                                 kv_indexer_pb2.MatchExternalKvPrefixRequest,
                                                 lambda request: self.sglang.match_prefix(self._index(), request)),
            "GetExternalKvHitCounts": self._unary(SGLANG_SERVICE, "GetExternalKvHitCounts",
                                                  kv_indexer_pb2.GetExternalKvHitCountsRequest,
                                                  lambda request: self.sglang.hit_counts_of(self._index(), request)),
        }
        llmd = {"GetPodScores": self._unary(LLMD_SERVICE, "GetPodScores", indexer_pb2.GetPodScoresRequest,
                                            self._pod_scores)}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SGLANG_SERVICE, sglang),
                                         grpc.method_handlers_generic_handler(LLMD_SERVICE, llmd)))
        for service, methods in ((SGLANG_SERVICE, sglang), (LLMD_SERVICE, llmd)):  # at 0 from the start, for rate()
            for method in methods:
                for refusal in (_undecodable(service, ValueError()), _too_large(service, 0, 0)):
                    self.refusals.labels(service, method, refusal.code.name, refusal.reason)
        try:
            self.port = server.add_insecure_port(self.listen)
        except RuntimeError as error:  # grpcio raises where older releases returned 0
            raise StartupError(f"decide.grpc_listen: cannot listen on {self.listen!r}: {error}") from None
        if not self.port:
            raise StartupError(f"decide.grpc_listen: cannot listen on {self.listen!r}")
        await server.start()
        self._server = server
        log.info("decide: gRPC front on %s (SGLang KVIndexer, llm-d IndexerService)", self.listen)

    async def close(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=1.0)  # requests in progress are answered first
            self._server = None

    async def __aenter__(self) -> GrpcFront:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _unary(self, service: str, method: str, kind: type[Message], answer: Answer) -> grpc.RpcMethodHandler:
        async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
            try:
                if len(raw) > self.max_message_bytes:
                    raise _too_large(service, len(raw), self.max_message_bytes)
                try:
                    request = kind.FromString(raw)
                except (DecodeError, ValueError) as error:
                    raise _undecodable(service, error) from None
                response = answer(request)
                if asyncio.iscoroutine(response):
                    response = await response
            except Refused as refusal:
                self.refusals.labels(service, method, refusal.code.name, refusal.reason).inc()
                await context.abort(refusal.code, refusal.message)
            except Exception as failure:
                log.exception("decide: gRPC %s/%s failed", service, method)
                self.refusals.labels(service, method, grpc.StatusCode.INTERNAL.name, "internal").inc()
                await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(failure).__name__}: {failure}")
            self.requests.labels(service, method).inc()
            return response.SerializeToString()

        return grpc.unary_unary_rpc_method_handler(handle)

    def _apply(self, request: kv_indexer_pb2.ApplyExternalKvBatchRequest) -> Message:
        raise APPLY_REFUSAL

    async def _pod_scores(self, request: indexer_pb2.GetPodScoresRequest) -> indexer_pb2.GetPodScoresResponse:
        model = self.routers.llmd_models.get(request.model_name)
        if model is None:
            # llm-d salts its block keys with the model name: a model it holds nothing for scores nobody.
            self.refusals.labels(LLMD_SERVICE, "GetPodScores", grpc.StatusCode.OK.name, "unknown_model").inc()
            return indexer_pb2.GetPodScoresResponse()
        # Tokenizing a long prompt takes a while; the tokenizer releases the GIL, the loop goes on.
        tokens = await asyncio.to_thread(model.tokens, request.prompt)
        scores = pod_scores(self._index(), model, tokens, list(request.pod_identifiers), self.routers.llmd_weights)
        return scores_response(scores)
