"""Alembic environment: runs on the connection the store hands over (or the configured URL)."""

from alembic import context
from sqlalchemy import create_engine

from kernelmill.service.db.models import Base

config = context.config
target_metadata = Base.metadata


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is None:
        engine = create_engine(config.get_main_option("sqlalchemy.url"))
        with engine.begin() as conn:
            _run(conn)
        engine.dispose()
    else:
        _run(connection)


def _run(connection) -> None:
    render_as_batch = connection.dialect.name == "sqlite"  # SQLite alters tables by copying them
    context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=render_as_batch)
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata)
    with context.begin_transaction():
        context.run_migrations()
else:
    run_migrations_online()
