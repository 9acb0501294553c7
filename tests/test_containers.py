"""The container lane, part one: the service fixtures' testcontainers path for real.

Every test here gets NATS and PostgreSQL from containers (tests/services.py's
ContainerNatsServer and ContainerPostgresServer), whatever else this machine has, and the
fault tests below kill them with `docker kill` (SIGKILL) and start them again on the same
ports and data. The tests are the suite's own, imported from their modules, so the
container path is held to the same assertions as the local binaries. Images:
KVLEDGER_NATS_IMAGE and KVLEDGER_POSTGRES_IMAGE (official by default; CI builds stand-ins
with docker/build-ci-images.sh).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

import services
from conftest import _service_or_skip
from services import PostgresService, Source

# The suite's tests, run here again against containers.
from test_services import (  # noqa: F401
    test_jetstream_message_survives_sigkill_of_nats_server,
    test_postgres_row_survives_sigkill_of_postgres,
)
from test_store_faults import test_kill_9_of_postgres_under_the_projector_recovers_by_itself  # noqa: F401

pytestmark = [pytest.mark.container, pytest.mark.service]


@pytest.fixture(scope="module")
def nats_source() -> Source:
    """NATS from a container for every test of this module (overrides conftest's discovery)."""
    return _service_or_skip(lambda: services.container_source("NATS server", services.nats_image(os.environ)))


@pytest.fixture(scope="module")
def postgres_cluster() -> Iterator[PostgresService]:
    """PostgreSQL from a container for every test of this module (overrides conftest's discovery)."""
    source = _service_or_skip(lambda: services.container_source("PostgreSQL", services.postgres_image(os.environ)))
    with services.start_postgres(source) as server:
        yield server


def test_the_services_here_run_in_containers(nats_server, postgres_server) -> None:
    assert isinstance(nats_server, services.ContainerNatsServer)
    assert isinstance(postgres_server, services.ContainerPostgresServer)
