"""Alembic environment: runs Gyre's migrations against the URL and schema passed in the Config attributes."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, text

config = context.config
url = config.attributes["url"]
schema = config.attributes.get("schema")


def run_migrations_online() -> None:
    engine = create_engine(url, future=True)
    with engine.begin() as conn:
        if schema:
            conn.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{schema}"'))
            conn.execute(text(f'SET search_path TO "{schema}"'))
        context.configure(connection=conn, version_table_schema=schema, target_metadata=None)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


run_migrations_online()
