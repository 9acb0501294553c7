"""Smoke tests for the test services themselves: real nats-server, real PostgreSQL, real SQLite."""

from __future__ import annotations

import socket
import uuid
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import nats
import psycopg
import pytest
import sqlalchemy as sa

import services
from services import ExternalNatsServer, ExternalPostgresServer, NatsService, PostgresService, ServiceNotControllable
from services import ServiceUnavailable, Source


def _refuses_connections(url: str) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=1):
            return False
    except OSError:
        return True


def _stream_name() -> str:
    # Unique per test, so an external server shared between runs never mixes their messages.
    return f"SMOKE_{uuid.uuid4().hex[:8].upper()}"


@pytest.mark.service
async def test_jetstream_drops_a_republished_msg_id(nats_server: NatsService) -> None:
    stream = _stream_name()
    async with await nats.connect(nats_server.url) as client:
        jetstream = client.jetstream()
        await jetstream.add_stream(name=stream, subjects=[f"{stream}.>"], duplicate_window=120)
        try:
            headers = {"Nats-Msg-Id": "engine-a:0:1:42"}
            first = await jetstream.publish(f"{stream}.batch", b"batch 42", headers=headers)
            second = await jetstream.publish(f"{stream}.batch", b"batch 42", headers=headers)

            assert first.duplicate is not True
            assert second.duplicate is True
            assert second.seq == first.seq
            assert (await jetstream.stream_info(stream)).state.messages == 1
        finally:
            await jetstream.delete_stream(stream)


@pytest.mark.service
async def test_jetstream_message_survives_sigkill_of_nats_server(nats_server: NatsService) -> None:
    stream = _stream_name()
    async with await nats.connect(nats_server.url) as client:
        jetstream = client.jetstream()
        await jetstream.add_stream(name=stream, subjects=[f"{stream}.>"])  # file storage is the default
        ack = await jetstream.publish(f"{stream}.batch", b"kept across a crash")

    nats_server.kill()
    assert _refuses_connections(nats_server.url)
    nats_server.restart()

    async with await nats.connect(nats_server.url) as client:
        jetstream = client.jetstream()
        message = await jetstream.get_msg(stream, seq=ack.seq)
        assert message.data == b"kept across a crash"
        assert (await jetstream.stream_info(stream)).state.messages == 1


@pytest.mark.service
def test_postgres_row_survives_sigkill_of_postgres(postgres_server: PostgresService, postgres_url: str) -> None:
    engine = sa.create_engine(postgres_url)
    try:
        with engine.begin() as connection:
            connection.execute(sa.text("CREATE TABLE ledger (seq bigint PRIMARY KEY, note text NOT NULL)"))
            connection.execute(sa.text("INSERT INTO ledger VALUES (7, 'committed before the crash')"))
        engine.dispose()  # pooled connections would not survive the kill anyway

        postgres_server.kill()
        with pytest.raises(psycopg.OperationalError):
            psycopg.connect(services.libpq_url(postgres_url), connect_timeout=2).close()
        postgres_server.restart()

        with engine.connect() as connection:
            rows = connection.execute(sa.text("SELECT seq, note FROM ledger")).all()
        assert [tuple(row) for row in rows] == [(7, "committed before the crash")]
    finally:
        engine.dispose()


@pytest.mark.service
def test_each_test_gets_an_empty_postgres_database(postgres_url: str) -> None:
    engine = sa.create_engine(postgres_url)
    try:
        with engine.connect() as connection:
            tables = connection.execute(
                sa.text("SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public'")
            ).scalar_one()
        assert tables == 0
    finally:
        engine.dispose()


def test_sqlite_url_names_a_usable_file(sqlite_url: str, tmp_path: Path) -> None:
    engine = sa.create_engine(sqlite_url)
    try:
        with engine.begin() as connection:
            connection.execute(sa.text("CREATE TABLE ledger (seq INTEGER PRIMARY KEY, note TEXT)"))
            connection.execute(sa.text("INSERT INTO ledger VALUES (1, 'on disk')"))
        with engine.connect() as connection:
            assert connection.execute(sa.text("SELECT note FROM ledger")).scalar_one() == "on disk"
    finally:
        engine.dispose()
    assert (tmp_path / "ledger.db").is_file()


# --- discovery and the skip-or-fail decision: pure logic, no services needed --------------


def _no_docker() -> bool:
    return False


def _docker_must_not_be_asked() -> bool:
    raise AssertionError("Docker was probed although an explicit URL was given")


def _choose(
    environ: dict[str, str], docker_answers: Callable[[], bool] = _no_docker, local_binary: str | None = None
) -> Source:
    return services.choose_source(
        "NATS server",
        url_variable=services.NATS_URL_VARIABLE,
        environ=environ,
        docker_answers=docker_answers,
        image=services.NATS_IMAGE,
        local_binary=local_binary,
        local_looked_for="no nats-server binary in /nowhere or on PATH",
    )


def test_discovery_prefers_url_then_docker_then_local_binary() -> None:
    url_given = {services.NATS_URL_VARIABLE: "nats://nats.example:4222"}
    assert _choose(url_given, _docker_must_not_be_asked, "/bin/nats-server") == Source(
        "external", "nats://nats.example:4222"
    )
    assert _choose({}, lambda: True, "/bin/nats-server") == Source("container", services.NATS_IMAGE)
    assert _choose({}, _no_docker, "/bin/nats-server") == Source("local", "/bin/nats-server")


def test_missing_service_reason_names_everything_looked_for(tmp_path: Path) -> None:
    bogus_binary = services.find_nats_server(scripts_dir=str(tmp_path), search_path=str(tmp_path))
    assert bogus_binary is None
    assert services.find_postgres_bin_dir(search_path=str(tmp_path), debian_glob=str(tmp_path / "*" / "bin")) is None

    with pytest.raises(ServiceUnavailable) as missing:
        _choose({}, _no_docker, bogus_binary)

    reason = str(missing.value)
    assert services.NATS_URL_VARIABLE in reason
    assert "Docker" in reason
    assert "nats-server" in reason


def _fake_executable(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)


def test_binaries_are_found_where_the_wheel_and_debian_put_them(tmp_path: Path) -> None:
    _fake_executable(tmp_path / "venv-bin" / "nats-server")
    assert services.find_nats_server(scripts_dir=str(tmp_path / "venv-bin"), search_path="") == str(
        tmp_path / "venv-bin" / "nats-server"
    )
    for version in ("9.6", "13", "16"):
        for tool in ("initdb", "postgres"):
            _fake_executable(tmp_path / "postgresql" / version / "bin" / tool)
    newest = services.find_postgres_bin_dir(search_path="", debian_glob=str(tmp_path / "postgresql" / "*" / "bin"))
    assert newest == str(tmp_path / "postgresql" / "16" / "bin")


def test_missing_service_skips_by_default() -> None:
    with pytest.raises(pytest.skip.Exception, match="no NATS server"):
        services.missing_service("no NATS server for tests", {})
    with pytest.raises(pytest.skip.Exception):
        services.missing_service("no NATS server for tests", {services.REQUIRE_SERVICES_VARIABLE: "0"})


def test_required_services_turn_a_skip_into_a_failure() -> None:
    with pytest.raises(pytest.fail.Exception, match="no NATS server for tests"):
        services.missing_service("no NATS server for tests", {services.REQUIRE_SERVICES_VARIABLE: "1"})


def test_a_server_that_cannot_start_reports_its_log_and_leaves_nothing_behind() -> None:
    server = services.LocalNatsServer("/bin/false")
    with pytest.raises(services.ServiceStartError, match="exited with status 1"):
        server.start()
    assert not server.root.exists()


def test_external_servers_refuse_kill_and_restart() -> None:
    nats_server = ExternalNatsServer("nats://nats.example:4222")
    postgres_server = ExternalPostgresServer("postgresql://postgres:secret@db.example:5432/postgres")
    for action in (nats_server.kill, nats_server.restart, postgres_server.kill, postgres_server.restart):
        with pytest.raises(ServiceNotControllable, match="kill/restart need a managed server"):
            action()
    assert postgres_server.database_url("t1") == "postgresql+psycopg://postgres:secret@db.example:5432/t1"
