"""Test infrastructure: real PostgreSQL and nats-server, given by URL or started embedded by the suite.

Every test that touches them gets its own Postgres schema and its own subject/stream prefix, and cleans up.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from shared.bus import Bus
from gyre.local import EmbeddedNats, EmbeddedPostgres
from shared.store import EventStore, async_url, run_migrations
from tests.suite_layout import pytest_collection_modifyitems, pytest_xdist_make_scheduler  # noqa: F401  (hooks)
from tests.timing import pytest_addoption, pytest_configure  # noqa: F401  (hooks: the slow tests' times)


@dataclass
class Infra:
    kind: str  # "url" or "embedded"
    nats_url: str
    database_url: str
    nats: EmbeddedNats | None = None
    postgres: EmbeddedPostgres | None = None


def _urls_configured() -> bool:
    return bool(os.environ.get("GYRE_DATABASE_URL") and os.environ.get("GYRE_NATS_URL"))


@pytest.fixture(scope="session")
def embedded_infra() -> Iterator[Infra]:
    # Not under pytest's tmp_path: pytest resets its base folder to 0700, which the postgres user
    # (nobody, when the suite runs as root) could then no longer traverse.
    state = Path(tempfile.mkdtemp(prefix="gyre-infra-"))
    nats = EmbeddedNats(state)
    pg = EmbeddedPostgres(state)
    nats.start()
    pg.start()
    try:
        yield Infra("embedded", nats.url, pg.url, nats, pg)
    finally:
        nats.stop()
        pg.stop(mode="immediate")
        shutil.rmtree(state, ignore_errors=True)


@pytest.fixture(scope="session")
def url_infra() -> Infra:
    if not _urls_configured():
        pytest.skip("GYRE_DATABASE_URL / GYRE_NATS_URL are not set: no servers given by URL")
    return Infra("url", os.environ["GYRE_NATS_URL"], os.environ["GYRE_DATABASE_URL"])


def _backends() -> list[str]:
    return ["embedded", "url"] if _urls_configured() else ["embedded"]


@pytest.fixture(params=_backends())
def backend(request: pytest.FixtureRequest) -> Infra:
    """Contract suites run once per backend: embedded always, by URL when URLs are configured."""
    return request.getfixturevalue(f"{request.param}_infra")


@pytest.fixture(scope="session")
def infra(request: pytest.FixtureRequest) -> Infra:
    """The servers for everything else: by URL when configured, embedded otherwise."""
    return request.getfixturevalue("url_infra" if _urls_configured() else "embedded_infra")


def unique(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:10]}"


async def make_store(database_url: str) -> EventStore:
    schema = unique("t_")
    await asyncio.to_thread(run_migrations, database_url, schema)
    return await EventStore.connect(database_url, schema=schema)


async def drop_store(store: EventStore) -> None:
    async with store.engine.connect() as conn:
        await conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{store.schema}" CASCADE'))
        await conn.commit()
    await store.close()


async def make_bus(nats_url: str) -> Bus:
    bus = await Bus.connect(nats_url, prefix=unique("t"), duplicate_window_s=120)
    await bus.ensure_streams()
    return bus


async def drop_bus(bus: Bus) -> None:
    if bus.nc.is_connected:
        await bus.delete_streams()
        for objects in (bus.objects, bus.kv_objects, bus.checkpoints):
            try:
                await bus.js.delete_object_store(objects.bucket)
            except Exception:
                pass
    await bus.close()


@pytest.fixture
async def store(infra: Infra) -> AsyncIterator[EventStore]:
    s = await make_store(infra.database_url)
    yield s
    await drop_store(s)


@pytest.fixture
async def bus(infra: Infra) -> AsyncIterator[Bus]:
    b = await make_bus(infra.nats_url)
    yield b
    await drop_bus(b)


@pytest.fixture
def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


def database_url_for(store: EventStore, base_url: str) -> str:
    """A URL whose connections use the store's schema (for subprocesses)."""
    sep = "&" if "?" in base_url else "?"
    return f"{base_url}{sep}options=-csearch_path%3D{store.schema}"


class RunningRelay:
    """An outbox relay running in this process for a test (the services under test run as subprocesses)."""

    def __init__(self, store: EventStore, bus: Any, infra: Infra) -> None:
        from shared.relay import OutboxRelay

        self._stop = asyncio.Event()
        relay = OutboxRelay(store, bus, dsn=database_url_for(store, infra.database_url), idle_wait_s=0.2)
        self._task = asyncio.create_task(relay.run(self._stop))

    async def stop(self) -> None:
        self._stop.set()
        await self._task


__all__ = ["Infra", "RunningRelay", "async_url", "database_url_for", "drop_bus", "drop_store", "make_bus", "make_store", "unique"]
