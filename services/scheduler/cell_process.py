"""One process running a role on a cell: started in its own process group, so that a stop reaches its children,
and tied to the cell agent's life, so that a killed agent leaves no orphan engines behind."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from datetime import datetime
from pathlib import Path
from collections.abc import Callable
from typing import IO

from shared.cells import Role
from shared.runtime import utcnow

# A command template of just `hold` runs a placeholder that only occupies the cell until it is stopped: for tests
# and deployments whose role's work runs outside the agent (no run that trains uses it: the train role is a rank).
HOLD = "hold"
HOLD_ARGV = [sys.executable, "-c", "import signal; signal.pause()"]


class CellProcess:
    """One process running `role` on a cell, with its output in `log_file`."""

    def __init__(self, proc: asyncio.subprocess.Process, role: Role, log_file: IO[bytes], launched_at: datetime) -> None:
        self.proc = proc
        self.role = role
        self.log_file = log_file
        # Wall-clock time of the launch, to date the process's own events against (it runs on this node, so
        # its clock is this one); monotonic time for durations.
        self.launched_at = launched_at
        self.started_at = time.monotonic()

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def exited(self) -> bool:
        return self.proc.returncode is not None

    @classmethod
    async def start(cls, argv: list[str], *, env: dict[str, str], role: Role, log_path: Path,
                    cores: list[int] | None = None) -> CellProcess:
        """Start `argv`; with `cores`, pinned to them (it and every thread and child it starts)."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_file = open(log_path, "ab")
        launched_at = utcnow()
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=log_file, stderr=asyncio.subprocess.STDOUT,
                start_new_session=True, preexec_fn=_child_setup(cores),
            )
        except BaseException:
            log_file.close()
            raise
        return cls(proc, role, log_file, launched_at)

    async def wait(self) -> int:
        """Until the process exits; its exit code."""
        return await self.proc.wait()

    async def stop(self, timeout_s: float) -> int:
        """SIGTERM the group, SIGKILL it after `timeout_s`; returns the exit code."""
        if not self.exited:
            self._signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout_s)
            except asyncio.TimeoutError:
                self._signal(signal.SIGKILL)
        code = await self.proc.wait()
        self._signal(signal.SIGKILL)  # whatever the leader left behind in its group
        self.log_file.close()
        return code

    def _signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)


def _child_setup(cores: list[int] | None) -> Callable[[], None]:
    def setup() -> None:
        _die_with_parent()
        if cores:
            os.sched_setaffinity(0, cores)

    return setup


def _die_with_parent() -> None:
    """In the child: die with the agent (Linux), so a killed agent leaves no orphan engines behind."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
