"""The container lane, part four: `kvledger.testing.KvledgerStack` as a router team uses it.

The example in docs/operations.md ("kvledger in your integration tests") is run as written,
against the image of this checkout (KVLEDGER_IMAGE=kvledger:test); a second test brings
PostgreSQL and store up too and reads the published batch back from SQL.
"""

from __future__ import annotations

import asyncio
import os
import re
import time

import pytest
import sqlalchemy as sa

import services
from conftest import _service_or_skip
from images import IMAGE, REPO, kvledger_image
from kvledger.core.events import EventBatch, Provenance, Stored, Tier, WorkerId
from kvledger.testing import KvledgerStack

pytestmark = [pytest.mark.container, pytest.mark.service]

EXAMPLE_HEADING = "## kvledger in your integration tests"


@pytest.fixture(autouse=True)
def stack_images(monkeypatch) -> None:
    _service_or_skip(lambda: services.container_source("kvledger stack", IMAGE))
    kvledger_image()
    monkeypatch.setenv("KVLEDGER_IMAGE", IMAGE)


def documented_example() -> str:
    text = (REPO / "docs" / "operations.md").read_text(encoding="utf-8")
    section = text[text.index(EXAMPLE_HEADING):]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def test_the_documented_example_runs() -> None:
    example = documented_example()
    assert len(example.splitlines()) <= 20, "the example should stay short"
    namespace: dict = {}
    exec(compile(example, "docs/operations.md", "exec"), namespace)
    tests = [function for name, function in namespace.items() if name.startswith("test_")]
    assert tests, "the example defines no test"
    for test in tests:
        test()


def test_with_postgres_store_projects_what_was_published() -> None:
    stored = Stored(Tier.HOST, block_hashes=(21, 22), parent_hash=None, block_size=16, local_hashes=(5, 6))
    batch = EventBatch(WorkerId("sglang-b"), epoch=0, seq=0, engine_ts=time.time(), ingest_ts=time.time(),
                       provenance=Provenance.NATIVE, events=(stored,))
    with KvledgerStack(postgres=True, environ=os.environ) as stack:
        assert stack.sql_url is not None
        asyncio.run(stack.publish_batches([batch]))
        engine = sa.create_engine(stack.sql_url)
        try:
            deadline = time.monotonic() + 60
            rows: list = []
            while time.monotonic() < deadline and len(rows) < 2:
                with engine.connect() as connection:
                    rows = connection.execute(sa.text(
                        "SELECT publisher, tier, engine_hash FROM block_residency WHERE removed_seq IS NULL "
                        "ORDER BY engine_hash")).all()
                time.sleep(0.2)
        finally:
            engine.dispose()
    assert [tuple(row) for row in rows] == [("sglang-b", "host", 21), ("sglang-b", "host", 22)]
