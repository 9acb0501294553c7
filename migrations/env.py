"""Alembic environment for kvledger, configured in code by `store.schema` (no alembic.ini).

The caller passes an open SQLAlchemy connection in `config.attributes["connection"]`, so
migrations run on the same engine (and the same SQLite file lock) as the caller.
"""

from alembic import context

from kvledger.store.tables import metadata

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("kvledger migrations run through `kvledger db upgrade`, which passes a connection")

# SQLite cannot ALTER most things in place; batch mode rebuilds tables when a version needs it.
context.configure(
    connection=connection,
    target_metadata=metadata,
    render_as_batch=connection.dialect.name == "sqlite",
    transaction_per_migration=True,
)
with context.begin_transaction():
    context.run_migrations()
