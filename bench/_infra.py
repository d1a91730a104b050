"""Servers for benchmarks: by URL when GYRE_NATS_URL / GYRE_DATABASE_URL are set, embedded otherwise;
and the CPU time a process tree has used, to say where a benchmark's CPU went."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from gyre.local import EmbeddedNats, EmbeddedPostgres


@dataclass(frozen=True)
class Servers:
    nats_url: str
    database_url: str
    kind: str  # "embedded" or "url"
    pids: dict[str, int] = field(default_factory=dict)  # embedded only: "nats-server", "postgres"


@contextmanager
def servers() -> Iterator[Servers]:
    nats_url, db_url = os.environ.get("GYRE_NATS_URL", ""), os.environ.get("GYRE_DATABASE_URL", "")
    if nats_url and db_url:
        yield Servers(nats_url, db_url, "url")
        return
    state = Path(tempfile.mkdtemp(prefix="gyre-bench-"))
    nats, pg = EmbeddedNats(state), EmbeddedPostgres(state)
    nats.start()
    pg.start()
    try:
        pids = {"postgres": int((pg.data / "postmaster.pid").read_text().split()[0])}
        if nats.proc is not None:
            pids["nats-server"] = nats.proc.pid
        yield Servers(nats.url, pg.url, "embedded", pids)
    finally:
        nats.stop()
        pg.stop(mode="immediate")
        shutil.rmtree(state, ignore_errors=True)


def rss_bytes(pid: int) -> int:
    """A process's resident memory now (Linux)."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def tree_cpu_s(root: int) -> float | None:
    """CPU seconds (user + system) used so far by `root` and its descendants, live and reaped; None where
    /proc cannot tell (not Linux, or the process is gone)."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    used: dict[int, float] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(entry)
        parents[pid] = int(fields[1])
        # utime, stime, and cutime, cstime of children already reaped (postgres backends come and go)
        used[pid] = sum(int(x) for x in fields[11:15]) / tick
    if root not in used:
        return None
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    total, stack = 0.0, [root]
    while stack:
        pid = stack.pop()
        total += used.get(pid, 0.0)
        stack += children.get(pid, [])
    return total
