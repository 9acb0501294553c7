"""How an audit command reads SQLite: with SQLite's own page cache, not the projector's large one."""

from __future__ import annotations

from kvledger.core.settings import load_settings
from kvledger.store import database
from kvledger.store.commands import _audit


def test_an_audit_reads_sqlite_with_the_default_page_cache_while_the_store_keeps_its_large_one(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    with database.opened(url) as engine:
        database.upgrade(engine)
        with engine.connect() as writer:
            projector_cache = writer.exec_driver_sql("PRAGMA cache_size").scalar_one()
    engine, _audit_view, connection = _audit(load_settings(None, environ={}, overrides={"db.url": url}).settings)
    try:
        assert connection.exec_driver_sql("PRAGMA cache_size").scalar_one() == database.SQLITE_READ_CACHE
        assert projector_cache < database.SQLITE_READ_CACHE  # (negative: KiB) the store's is larger
    finally:
        connection.close()
        engine.dispose()
