"""Credentials: the pipeline works against a nats-server that requires a login, a wrong
password fails with a clear message, and secrets never reach logs or `config show`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engines import engine_endpoints, one_block, read_batches, wait_until
from kvledger.core.events import Provenance, WorkerId
from kvledger.core.settings import load_settings
from kvledger.ingest.bridge import Bridge
from kvledger.ingest.endpoints import StreamSource
from kvledger.runtime.embedded import EmbeddedNats
from kvledger.runtime.nats_options import NatsAuthError
from kvledger.sim.engine import SimulatedEngine

SECRET = "hunter2-s3cr3t"


@pytest.fixture
def locked_nats(tmp_path):
    with EmbeddedNats(tmp_path / "nats", extra_args=("--user", "alice", "--pass", SECRET)) as server:
        yield server


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLEDGER_")}
    env.update(extra)
    return env


async def test_the_pipeline_runs_against_a_server_that_requires_a_login(locked_nats, tmp_path) -> None:
    from kvledger.decide.serving.service import DecideService
    from kvledger.store import database
    from kvledger.store.service import StoreService
    import asyncio

    db_url = f"sqlite:///{tmp_path / 'ledger.db'}"
    settings = load_settings(environ={}, overrides={
        "nats.url": locked_nats.url, "nats.user": "alice", "nats.password": SECRET, "db.url": db_url,
        "ingest.http_port": 0, "store.http_port": 0, "decide.http_port": 0,
    }).settings
    with database.opened(db_url) as engine:
        database.upgrade(engine)
    pub, replay = engine_endpoints()
    async with SimulatedEngine(pub, replay) as engine:
        source = StreamSource(WorkerId("locked"), engine.pub_endpoint, engine.replay_endpoint, Provenance.NATIVE)
        async with Bridge(settings, [source]) as bridge:
            await bridge.wait_ready(timeout=10)
            await engine.publish([one_block(1)])
            await wait_until(lambda: _one(read_batches(locked_nats.url, user="alice", password=SECRET)), 10, "the batch in KV_EVENTS")
        stop = asyncio.Event()
        store = asyncio.create_task(StoreService(settings).run(stop))
        async with DecideService(settings) as decide:
            await decide.wait_ready(10)

            def projected() -> bool:
                with database.opened(db_url) as engine, engine.connect() as connection:
                    return connection.exec_driver_sql("SELECT COUNT(*) FROM block_residency").scalar() == 1

            await wait_until(projected, 20, "the block in SQL")
            assert decide.index.inventory_seq == 1
        stop.set()
        await store


async def test_a_wrong_password_fails_with_a_clear_message(locked_nats) -> None:
    settings = load_settings(environ={}, overrides={
        "nats.url": locked_nats.url, "nats.user": "alice", "nats.password": "wrong-password", "ingest.http_port": 0,
    }).settings
    pub, replay = engine_endpoints()
    with pytest.raises(NatsAuthError, match="refused the login .*Authorization Violation.*nats.user/nats.password") as caught:
        async with Bridge(settings, [StreamSource(WorkerId("w"), pub, replay, Provenance.NATIVE)]):
            pass
    assert "wrong-password" not in str(caught.value)


@pytest.mark.parametrize("command", ["ingest", "decide", "store"])
def test_each_service_refuses_a_wrong_password_in_one_line_without_the_secret(locked_nats, tmp_path, command) -> None:
    args = [sys.executable, "-m", "kvledger.app.cli", command, "--nats", locked_nats.url, "--db", f"sqlite:///{tmp_path / 'x.db'}"]
    if command == "ingest":
        args += ["--endpoint", "tcp://127.0.0.1:5999", "--publisher", "w"]
    if command == "store":
        subprocess.run([sys.executable, "-m", "kvledger.app.cli", "db", "upgrade", "--db", f"sqlite:///{tmp_path / 'x.db'}"],
                       check=True, capture_output=True, env=clean_env())
    env = clean_env(KVLEDGER_NATS_USER="alice", KVLEDGER_NATS_PASSWORD=SECRET + "-typo",
                    KVLEDGER_INGEST_HTTP_PORT="0", KVLEDGER_STORE_HTTP_PORT="0", KVLEDGER_DECIDE_HTTP_PORT="0")
    result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "refused the login" in result.stderr and "Authorization Violation" in result.stderr
    assert SECRET not in result.stdout + result.stderr


def test_secrets_never_appear_in_config_show_or_logs_of_a_working_service(locked_nats, tmp_path) -> None:
    env = clean_env(KVLEDGER_NATS_USER="alice", KVLEDGER_NATS_PASSWORD=SECRET, KVLEDGER_NATS_TOKEN="tok-" + SECRET,
                    KVLEDGER_DECIDE_HTTP_TOKEN="http-" + SECRET)
    shown = subprocess.run([sys.executable, "-m", "kvledger.app.cli", "config", "show"], env=env, capture_output=True, text=True)
    assert shown.returncode == 0 and "***" in shown.stdout
    assert SECRET not in shown.stdout + shown.stderr
    # a URL with embedded credentials is shown without them in the service's own log lines
    url = locked_nats.url.replace("nats://", f"nats://alice:{SECRET}@")
    env = clean_env(KVLEDGER_DECIDE_HTTP_PORT="0", KVLEDGER_DECIDE_HTTP_TOKEN="http-" + SECRET)
    process = subprocess.Popen([sys.executable, "-m", "kvledger.app.cli", "decide", "--nats", url], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in process.stdout:
        lines.append(line)
        if "ready at inventory_seq" in line:
            break
    process.terminate()
    lines.extend(process.stdout.readlines())
    process.wait(20)
    output = "".join(lines)
    assert "ready at inventory_seq" in output
    assert SECRET not in output


async def _one(coroutine) -> bool:
    return len(await coroutine) == 1


def _make_certificates(folder) -> dict[str, str]:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate (openssl)."""
    import shutil

    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make test certificates")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=kvledger-test-ca")
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, extra in (("server", ["-extfile", "san.ext"]), ("client", [])):
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", *extra)
    return {name: str(folder / name) for name in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


async def test_the_pipeline_runs_over_tls_with_a_client_certificate(tmp_path) -> None:
    import nats
    import nats.errors

    certs = _make_certificates(tmp_path)
    tls_args = ("--tls", "--tlscert", certs["server.pem"], "--tlskey", certs["server.key"],
                "--tlsverify", "--tlscacert", certs["ca.pem"])
    with EmbeddedNats(tmp_path / "nats", extra_args=tls_args) as server:
        url = server.url.replace("nats://", "tls://")
        settings = load_settings(environ={}, overrides={
            "nats.url": url, "nats.tls_ca": certs["ca.pem"], "nats.tls_cert": certs["client.pem"],
            "nats.tls_key": certs["client.key"], "ingest.http_port": 0,
        }).settings
        pub, replay = engine_endpoints()
        async with SimulatedEngine(pub, replay) as engine:
            source = StreamSource(WorkerId("tls"), engine.pub_endpoint, engine.replay_endpoint, Provenance.NATIVE)
            async with Bridge(settings, [source]) as bridge:
                await bridge.wait_ready(timeout=10)
                await engine.publish([one_block(1)])
                from kvledger.runtime.nats_options import connect_options

                options = connect_options(settings.nats, name="test-reader")
                servers = options.pop("servers")

                async def landed() -> bool:
                    nc = await nats.connect(servers, **options)
                    try:
                        return (await nc.jetstream().stream_info("KV_EVENTS")).state.messages == 1
                    finally:
                        await nc.close()

                await wait_until(landed, 10, "the batch in KV_EVENTS over TLS")
        # and without the client certificate the server refuses us
        no_cert = load_settings(environ={}, overrides={"nats.url": url, "nats.tls_ca": certs["ca.pem"]}).settings
        options = connect_options(no_cert.nats, name="no-cert")
        with pytest.raises((OSError, nats.errors.Error)):  # the server drops the TLS connection
            nc = await nats.connect(options.pop("servers"), **options, allow_reconnect=False)
            await nc.close()
