"""The host uids sandboxes run as: a pool held through lock files, and the host's processes by uid (to sweep a
sandbox's leftovers and the orphans of a harness that died).

`UID_POOL` is the process-wide pool, configured from the environment (GYRE_SANDBOX_UID_BASE,
GYRE_SANDBOX_UID_LOCKS) when this module is imported; `Sandbox` reads it here at each construction, so a test
replaces it with `monkeypatch.setattr(uid_pool, "UID_POOL", ...)`.
"""

from __future__ import annotations

import fcntl
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from services.harness.sandbox_spec import SandboxError


class UidPool:
    """Hands out distinct unprivileged host uids so RLIMIT_NPROC (counted per uid) is per sandbox.

    A uid is held through an flock on a lock file, so harness processes on one host never share one
    (the post-command sweep kills everything running as the uid) and a crashed holder frees its uids.
    """

    def __init__(self, base: int, size: int, lock_dir: Path) -> None:
        self._base, self._size, self._lock_dir = base, size, lock_dir
        self._held: dict[int, int] = {}
        self._lock = threading.Lock()

    def acquire(self) -> int:
        self._lock_dir.mkdir(parents=True, exist_ok=True)
        with self._lock:
            for uid in range(self._base, self._base + self._size):
                if uid in self._held:
                    continue
                fd = os.open(self._lock_dir / f"{uid}.lock", os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                self._held[uid] = fd
                return uid
        raise SandboxError(f"all {self._size} sandbox uids from {self._base} are in use")

    def release(self, uid: int) -> None:
        with self._lock:
            fd = self._held.pop(uid, None)
        if fd is not None:
            os.close(fd)

    def sweep_orphans(self) -> list[int]:
        """Kill the processes of pool uids that no live holder has: left running by a harness that died (under
        the unshare backend the uid change clears the parent-death signal, so they outlive it and would keep
        changing the preserved work while it is graded). Returns the uids swept."""
        in_range = {uid for _, uid in process_uids() if self._base <= uid < self._base + self._size}
        self._lock_dir.mkdir(parents=True, exist_ok=True)
        swept = []
        for uid in sorted(in_range):
            with self._lock:
                if uid in self._held:
                    continue
                fd = os.open(self._lock_dir / f"{uid}.lock", os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # a live sandbox of another harness process
                    os.close(fd)
                    continue
                try:
                    kill_uid(uid)
                finally:
                    os.close(fd)
            swept.append(uid)
        return swept


UID_POOL = UidPool(
    base=int(os.environ.get("GYRE_SANDBOX_UID_BASE", "61000")),
    size=2048,
    lock_dir=Path(os.environ.get("GYRE_SANDBOX_UID_LOCKS", "/tmp/gyre-sandbox-uids")),
)


def process_uids() -> Iterator[tuple[int, int]]:
    """(pid, effective uid) of every host process."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                # /proc/<pid> is owned by the process's effective uid; one stat is much cheaper than reading status.
                yield int(entry), os.stat(f"/proc/{entry}").st_uid
            except OSError:
                continue


def processes_of_uid(uid: int) -> list[int]:
    """Host pids running as `uid`."""
    return [pid for pid, owner in process_uids() if owner == uid]


def kill_uid(uid: int, patience_s: float = 30.0) -> None:
    """SIGKILL every process of the sandbox uid until none is left (a dying fork bomb cannot fork)."""
    deadline = time.monotonic() + patience_s
    while pids := processes_of_uid(uid):
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise SandboxError(f"processes {pids[:10]} of sandbox uid {uid} survived SIGKILL for {patience_s}s")
        time.sleep(0.02)
