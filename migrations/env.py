"""Alembic environment for ckstore's catalog.

ckstore runs migrations from code (``ckstore db upgrade``); it passes an open connection in
``config.attributes["connection"]``. Running ``alembic`` by hand works too, with
``-x url=...`` or ``sqlalchemy.url`` set.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from ckstore.catalog._schema import Base

config = context.config
target_metadata = Base.metadata


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
        context.run_migrations()
        return
    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option("sqlalchemy.url")
    engine = create_engine(url)
    with engine.begin() as conn:
        context.configure(connection=conn, target_metadata=target_metadata, render_as_batch=True)
        context.run_migrations()


if context.is_offline_mode():
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata)
    with context.begin_transaction():
        context.run_migrations()
else:
    run_migrations_online()
