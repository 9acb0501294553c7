"""Endpoint specs: `tcp://HOST:PORT[,replay=tcp://HOST:PORT][,provenance=retained][,dp_ranks=N][,publisher=NAME][,engine=vllm|sglang|trtllm]`."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from kvledger.core.events import Provenance, WorkerId, validate_publisher
from kvledger.ingest.wire import Engine


def with_port_offset(endpoint: str, offset: int) -> str:
    """`tcp://host:5557` + 2 → `tcp://host:5559` (how dp ranks find their sockets)."""
    if offset == 0:
        return endpoint
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + offset}"


class EndpointError(ValueError):
    """An endpoint spec that cannot be used; the message quotes it."""


@attrs.frozen
class EndpointSpec:
    publisher: str
    pub_url: str
    replay_url: str | None = None
    provenance: Provenance = Provenance.NATIVE
    dp_ranks: int = 1
    engine: Engine = Engine.VLLM


@attrs.frozen
class StreamSource:
    """One engine stream ingest follows: a worker's rank, where it publishes and replays."""

    worker: WorkerId
    pub_url: str
    replay_url: str | None
    provenance: Provenance
    engine: Engine = Engine.VLLM  # what a clear means differs by engine (docs/ingest.md)


def _check_url(url: str, spec: str) -> str:
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("tcp", "ipc", "inproc") or not rest:
        raise EndpointError(f"endpoint {spec!r}: {url!r} is not a ZMQ address like tcp://HOST:PORT")
    if scheme == "tcp":
        port = rest.rpartition(":")[2]
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise EndpointError(f"endpoint {spec!r}: {url!r} needs a TCP port")
    return url


def parse_endpoint(spec: str, publisher: str | None = None) -> EndpointSpec:
    """Parse one `--endpoint` value; `publisher` is the paired `--publisher` (or the spec's own)."""
    url, *options = [part.strip() for part in spec.split(",")]
    values: dict[str, str] = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or key not in ("replay", "provenance", "dp_ranks", "publisher", "engine"):
            raise EndpointError(
                f"endpoint {spec!r}: unknown option {option!r} (replay=, provenance=, dp_ranks=, publisher=, engine=)"
            )
        values[key] = value
    name = values.get("publisher", publisher)
    if name is None:
        raise EndpointError(f"endpoint {spec!r}: no publisher name (add --publisher NAME or publisher=NAME)")
    try:
        validate_publisher(name)
    except ValueError as error:
        raise EndpointError(f"endpoint {spec!r}: {error}") from None
    try:
        provenance = Provenance(values.get("provenance", "native"))
    except ValueError:
        raise EndpointError(f"endpoint {spec!r}: provenance must be native or retained") from None
    ranks = values.get("dp_ranks", "1")
    if not ranks.isdigit() or int(ranks) < 1:
        raise EndpointError(f"endpoint {spec!r}: dp_ranks must be a positive integer")
    pub_url = _check_url(url, spec)
    replay = _check_url(values["replay"], spec) if values.get("replay") else None
    if int(ranks) > 1:
        if not all(address.startswith("tcp://") for address in (pub_url, replay) if address):
            raise EndpointError(f"endpoint {spec!r}: dp_ranks > 1 needs tcp:// addresses (rank r uses port + r)")
        if replay:
            _check_rank_ports(pub_url, replay, int(ranks), spec)
    try:
        engine = Engine(values.get("engine", "vllm").lower())
    except ValueError:
        choices = ", ".join(engine.value for engine in Engine)
        raise EndpointError(f"endpoint {spec!r}: engine must be one of {choices}") from None
    return EndpointSpec(name, pub_url, replay, provenance, int(ranks), engine)


def _check_rank_ports(pub_url: str, replay_url: str, ranks: int, spec: str) -> None:
    """Rank r uses port + r for both sockets, so the two port ranges must not overlap on one host."""
    pub_host, _, pub_port = pub_url.rpartition(":")
    replay_host, _, replay_port = replay_url.rpartition(":")
    if pub_host == replay_host and abs(int(pub_port) - int(replay_port)) < ranks:
        raise EndpointError(
            f"endpoint {spec!r}: with dp_ranks={ranks}, ranks use ports {pub_port}+r and {replay_port}+r, which overlap; "
            f"put the replay port at least {ranks} away from the publish port"
        )


def parse_endpoints(specs: Sequence[str], publishers: Sequence[str], default_publisher: str | None = None) -> list[EndpointSpec]:
    """Pair each endpoint with its `--publisher` in order; a spec's own `publisher=` wins."""
    parsed = []
    for index, spec in enumerate(specs):
        name = publishers[index] if index < len(publishers) else default_publisher
        parsed.append(parse_endpoint(spec, name))
    seen: set[tuple[str, Provenance]] = set()
    for endpoint in parsed:
        key = (endpoint.publisher, endpoint.provenance)
        if key in seen:
            raise EndpointError(f"publisher {endpoint.publisher!r} has two {endpoint.provenance.value} endpoints")
        seen.add(key)
    return parsed


def stream_sources(endpoints: Sequence[EndpointSpec]) -> list[StreamSource]:
    """Expand data-parallel ranks: rank r publishes on the base port + r, replays on replay port + r."""
    return [
        StreamSource(
            WorkerId(endpoint.publisher, rank),
            with_port_offset(endpoint.pub_url, rank),
            with_port_offset(endpoint.replay_url, rank) if endpoint.replay_url else None,
            endpoint.provenance,
            endpoint.engine,
        )
        for endpoint in endpoints
        for rank in range(endpoint.dp_ranks)
    ]
