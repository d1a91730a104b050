"""Servers for benchmarks: by URL when GYRE_NATS_URL / GYRE_DATABASE_URL are set, embedded otherwise."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from shared.local import EmbeddedNats, EmbeddedPostgres


@contextmanager
def servers() -> Iterator[tuple[str, str, str]]:
    """Yields (nats_url, database_url, kind)."""
    nats_url, db_url = os.environ.get("GYRE_NATS_URL", ""), os.environ.get("GYRE_DATABASE_URL", "")
    if nats_url and db_url:
        yield nats_url, db_url, "url"
        return
    state = Path(tempfile.mkdtemp(prefix="gyre-bench-"))
    nats, pg = EmbeddedNats(state), EmbeddedPostgres(state)
    nats.start()
    pg.start()
    try:
        yield nats.url, pg.url, "embedded"
    finally:
        nats.stop()
        pg.stop(mode="immediate")
        shutil.rmtree(state, ignore_errors=True)
