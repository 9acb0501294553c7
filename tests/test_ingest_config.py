"""Endpoint specs, NATS connection options, and refusing a conflicting stream."""

from __future__ import annotations

import nats
import pytest
from nats.js.api import StorageType, StreamConfig

from engines import settings_for
from kvledger.core.events import Provenance, WorkerId
from kvledger.core.settings import NatsSettings
from kvledger.ingest.endpoints import EndpointError, EndpointSpec, parse_endpoint, parse_endpoints, stream_sources
from kvledger.ingest.publisher import JetStreamPublisher, StreamConflictError
from kvledger.ingest.wire import Engine
from kvledger.runtime.nats_options import connect_options, describe_server
from kvledger.runtime.streams import events_stream


def test_endpoint_specs_with_every_option() -> None:
    spec = parse_endpoint("tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5657,provenance=retained,dp_ranks=2", "vllm-a")
    assert spec == EndpointSpec("vllm-a", "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5657", Provenance.RETAINED, 2)
    sources = stream_sources([spec])
    assert [(s.worker, s.pub_url, s.replay_url) for s in sources] == [
        (WorkerId("vllm-a", 0), "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5657"),
        (WorkerId("vllm-a", 1), "tcp://10.0.0.5:5558", "tcp://10.0.0.5:5658"),
    ]
    assert parse_endpoint("tcp://h:1,publisher=own", "flag").publisher == "own"


def test_an_endpoint_names_its_engine_which_decides_what_a_clear_covers() -> None:
    assert parse_endpoint("tcp://h:1", "a").engine is Engine.VLLM
    spec = parse_endpoint("tcp://h:1,engine=SGLang,dp_ranks=2", "a")
    assert spec.engine is Engine.SGLANG and {s.engine for s in stream_sources([spec])} == {Engine.SGLANG}
    with pytest.raises(EndpointError, match="engine must be one of vllm, sglang, trtllm"):
        parse_endpoint("tcp://h:1,engine=tgi", "a")


@pytest.mark.parametrize(
    ("spec", "publisher", "message"),
    [
        ("tcp://h:1", None, "no publisher name"),
        ("tcp://h:1", "bad.name", "character '.'"),
        ("http://h:1", "a", "not a ZMQ address"),
        ("tcp://h", "a", "needs a TCP port"),
        ("tcp://h:1,replay=tcp://h", "a", "needs a TCP port"),
        ("tcp://h:1,colour=red", "a", "unknown option 'colour=red'"),
        ("tcp://h:1,provenance=maybe", "a", "provenance must be native or retained"),
        ("tcp://h:1,dp_ranks=0", "a", "dp_ranks must be a positive integer"),
        ("tcp://h:5557,replay=tcp://h:5558,dp_ranks=4", "a", "which overlap"),
        ("tcp://h:abc,dp_ranks=2", "a", "needs a TCP port"),
        ("ipc:///tmp/engine,dp_ranks=2", "a", "dp_ranks > 1 needs tcp://"),
    ],
)
def test_bad_endpoint_specs_are_refused_with_the_spec_quoted(spec: str, publisher: str | None, message: str) -> None:
    with pytest.raises(EndpointError, match=message):
        parse_endpoint(spec, publisher)


def test_endpoints_pair_with_publishers_in_order_and_names_must_not_repeat() -> None:
    parsed = parse_endpoints(["tcp://h:1", "tcp://h:2", "tcp://h:3,provenance=retained"], ["a", "b", "a"])
    assert [(e.publisher, e.provenance) for e in parsed] == [("a", Provenance.NATIVE), ("b", Provenance.NATIVE), ("a", Provenance.RETAINED)]
    with pytest.raises(EndpointError, match="publisher 'a' has two native endpoints"):
        parse_endpoints(["tcp://h:1", "tcp://h:2"], ["a", "a"])


def test_connect_options_carry_credentials_and_tls_but_descriptions_hide_them(tmp_path) -> None:
    settings = NatsSettings(url="nats://alice:s3cret@h:4222,nats://h2:4222", user="u", password="p", token=None)
    options = connect_options(settings, name="x")
    assert options["servers"] == ["nats://alice:s3cret@h:4222", "nats://h2:4222"]
    assert (options["user"], options["password"]) == ("u", "p")
    assert "tls" not in options
    assert describe_server(settings) == "nats://h:4222,nats://h2:4222"
    assert connect_options(NatsSettings(token="t"), name="x")["token"] == "t"
    assert connect_options(NatsSettings(creds_file="/x.creds"), name="x")["user_credentials"] == "/x.creds"
    assert "tls" in connect_options(NatsSettings(url="tls://h:4222"), name="x")


async def test_an_existing_stream_with_other_settings_is_a_clear_startup_error(nats_server) -> None:
    nc = await nats.connect(nats_server.url)
    await nc.jetstream().add_stream(StreamConfig(name="KV_EVENTS", subjects=["kv.ev.>"], storage=StorageType.MEMORY, duplicate_window=120))
    await nc.close()
    settings = settings_for(nats_server.url)
    async with JetStreamPublisher(settings.nats, [events_stream(settings.stream)]) as publisher:
        with pytest.raises(StreamConflictError, match="stream KV_EVENTS exists with different settings .*storage"):
            await publisher.wait_connected(timeout=10)


async def test_the_stream_is_created_with_the_configured_limits(nats_server) -> None:
    settings = settings_for(nats_server.url, **{"stream.max_age_s": 3600.0, "stream.max_bytes": 10_000_000, "stream.duplicate_window_s": 300.0})
    async with JetStreamPublisher(settings.nats, [events_stream(settings.stream)]) as publisher:
        await publisher.wait_connected(timeout=10)
    nc = await nats.connect(nats_server.url)
    config = (await nc.jetstream().stream_info("KV_EVENTS")).config
    await nc.close()
    assert (config.max_age, config.max_bytes, config.duplicate_window, config.storage) == (3600.0, 10_000_000, 300.0, StorageType.FILE)
    # and a second start with the same settings is fine
    async with JetStreamPublisher(settings.nats, [events_stream(settings.stream)]) as publisher:
        await publisher.wait_connected(timeout=10)
