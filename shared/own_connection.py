"""A PostgreSQL connection of the event store's own, outside its pool, for the paths every event pays on: opened
on first use in the store's schema, closed (and opened again by the next use) after a loss."""

from __future__ import annotations

from typing import Any

import psycopg


class OwnConnection:
    def __init__(self, dsn: str, schema: str | None, *, autocommit: bool = False, application_name: str = "") -> None:
        self.dsn, self.schema = dsn, schema
        self.autocommit, self.application_name = autocommit, application_name
        self._conn: psycopg.AsyncConnection[Any] | None = None

    async def get(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is None or self._conn.closed:
            extra: dict[str, Any] = {"application_name": self.application_name} if self.application_name else {}
            if self.schema:  # otherwise the URL's own options stand
                extra["options"] = f"-csearch_path={self.schema}"
            self._conn = await psycopg.AsyncConnection.connect(self.dsn, autocommit=self.autocommit, **extra)
        return self._conn

    async def drop(self) -> None:
        if self._conn is not None:
            try:
                await self._conn.close()
            except psycopg.Error:
                pass
            self._conn = None


__all__ = ["OwnConnection"]
