"""ingest's publishing connection follows a NATS cluster: the servers given and announced, the last one last."""

from __future__ import annotations

from kvledger.ingest.publish_connection import ServerPool


def test_the_pool_adds_what_the_cluster_announces_and_tries_the_server_left_last() -> None:
    pool = ServerPool("nats://127.0.0.1:4001, nats://127.0.0.1:4002")
    assert pool.candidates() == ["nats://127.0.0.1:4001", "nats://127.0.0.1:4002"]
    pool.connected("nats://127.0.0.1:4001", ["127.0.0.1:4002", "127.0.0.1:4003"])
    assert pool.urls == ["nats://127.0.0.1:4001", "nats://127.0.0.1:4002", "nats://127.0.0.1:4003"]
    assert pool.candidates() == ["nats://127.0.0.1:4002", "nats://127.0.0.1:4003", "nats://127.0.0.1:4001"]
    pool.connected("nats://127.0.0.1:4003", ["127.0.0.1:4001", "127.0.0.1:4002"])
    assert pool.candidates()[-1] == "nats://127.0.0.1:4003" and len(pool.urls) == 3


def test_announced_servers_keep_the_scheme_and_credentials_given() -> None:
    pool = ServerPool("tls://ingest:secret@10.0.0.1:4222")
    pool.connected("tls://ingest:secret@10.0.0.1:4222", ["10.0.0.2:4222", "10.0.0.1:4222"])
    assert pool.urls == ["tls://ingest:secret@10.0.0.1:4222", "tls://ingest:secret@10.0.0.2:4222"]
    bare = ServerPool("127.0.0.1")
    bare.connected("127.0.0.1", ["127.0.0.1:4222", "127.0.0.1:5222"])
    assert bare.urls == ["127.0.0.1", "nats://127.0.0.1:5222"]
