"""Opening the audit database and keeping its schema current (Alembic, configured in code)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import sqlalchemy as sa

from kvledger.runtime.resources import data_dir
from kvledger.store.transactions import SQLITE_CONNECT_ARGS, apply_sqlite_pragmas

# Alembic is imported where migrations are read or run, not here: store's writer process
# opens a connection with this module and starts a tenth of a second sooner without it.
if TYPE_CHECKING:
    from alembic.config import Config


class SchemaError(RuntimeError):
    """The database schema is not the one this kvledger needs; the message says what to run."""


# A reading connection's SQLite page cache, in SQLite's units (negative: KiB): SQLite's default.
SQLITE_READ_CACHE = -2000


def create_engine(url: str) -> sa.Engine:
    """An engine for `url`; SQLite files get WAL mode so audit readers never block the projector."""
    parsed = sa.make_url(url)
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database
        if database and database != ":memory:":
            Path(database).parent.mkdir(parents=True, exist_ok=True)
        engine = sa.create_engine(url, connect_args=dict(SQLITE_CONNECT_ARGS))

        @sa.event.listens_for(engine, "connect")
        def _pragmas(dbapi_connection, _record) -> None:
            apply_sqlite_pragmas(dbapi_connection)

        return engine
    if parsed.get_backend_name() == "postgresql" and parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")  # psycopg 3, not the psycopg2 default
    return sa.create_engine(parsed, pool_pre_ping=True)


def driver_connect_args(url: str) -> tuple[str, tuple, dict]:
    """(dialect, args, keyword args) with which `store.transactions.connect_driver` opens `url` as this
    module's engines do, for a process that imports no SQLAlchemy (store's writer)."""
    engine = create_engine(url)
    try:
        args, kwargs = engine.dialect.create_connect_args(engine.url)
    finally:
        engine.dispose()
    name = engine.dialect.name
    if name == "sqlite":
        return name, tuple(args), {**kwargs, **SQLITE_CONNECT_ARGS}
    if name == "postgresql":
        from psycopg.conninfo import make_conninfo

        kwargs.pop("context", None)  # SQLAlchemy's own type adapters: the writer passes plain values
        return name, (make_conninfo(*args, **kwargs),), {}
    raise ValueError(f"unsupported database {name!r}: use SQLite or PostgreSQL")


@contextlib.contextmanager
def opened(url: str) -> Iterator[sa.Engine]:
    engine = create_engine(url)
    try:
        yield engine
    finally:
        engine.dispose()


def _config(connection: sa.Connection) -> Config:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(data_dir("migrations")))
    config.attributes["connection"] = connection
    return config


def head_revision() -> str:
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    config = Config()
    config.set_main_option("script_location", str(data_dir("migrations")))
    return ScriptDirectory.from_config(config).get_current_head()


def current_revision(engine: sa.Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def upgrade(engine: sa.Engine, revision: str = "head") -> None:
    from alembic import command

    with engine.begin() as connection:
        command.upgrade(_config(connection), revision)


def downgrade(engine: sa.Engine, revision: str) -> None:
    from alembic import command

    with engine.begin() as connection:
        command.downgrade(_config(connection), revision)


def require_current(engine: sa.Engine, url: str) -> None:
    """Refuse to run on a schema older (or newer) than this kvledger's head."""
    current, head = current_revision(engine), head_revision()
    if current == head:
        return
    shown = sa.make_url(url).render_as_string(hide_password=True)
    if current is None:
        raise SchemaError(f"database {shown} has no kvledger schema; run `kvledger db upgrade --db {shown}`")
    from alembic.script import ScriptDirectory

    script = ScriptDirectory(str(data_dir("migrations")))
    known = {revision.revision for revision in script.walk_revisions()}
    if current not in known:
        raise SchemaError(
            f"database {shown} has schema revision {current}, newer than this kvledger knows (head {head}); "
            "upgrade kvledger"
        )
    raise SchemaError(
        f"database {shown} has schema revision {current}, this kvledger needs {head}; "
        f"run `kvledger db upgrade --db {shown}`"
    )
