"""The sandbox every backend shares: a state folder on the host (work/, tmp/, home/ ...) whose work/ is mapped at
the task's working directory, a uid of its own, and `exec`, which supervises one command (deadline, disk watch,
capped output, tree kill, sweep). Backends (process_sandbox.py, docker_sandbox.py) say how a command is wrapped,
killed and swept; `sandboxes.make_sandbox` picks one.
"""

from __future__ import annotations

import abc
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Self

from services.harness import uid_pool
from services.harness.gateway_bridge import GatewayBridge
from services.harness.sandbox_argv import command_env, with_relay
from services.harness.sandbox_spec import (
    Backend,
    Bind,
    ExecResult,
    SandboxError,
    SandboxSpec,
    area_path,
    gateway_target,
    gateway_url_inside,
    writable_mounts,
)

_RELAY_SOURCE = Path(__file__).with_name("relay_inside.py")


class Sandbox(abc.ABC):
    """One execution's sandbox; `close` frees its uid and keeps its state folder (the preserved work)."""

    backend: Backend

    def __init__(self, state_dir: Path | str, spec: SandboxSpec | None = None, *, gateway_url: str | None = None) -> None:
        self._check_available()
        self.spec = spec or SandboxSpec()
        self.state_dir = Path(state_dir).resolve()
        self._own_uid = self.spec.uid is None
        self.uid = uid_pool.UID_POOL.acquire() if self.spec.uid is None else self.spec.uid
        self._gateway_url = gateway_url
        self._bridge: GatewayBridge | None = None
        self._exec_count = 0
        self._closed = False
        # What the sandbox's files held when a command was last killed for them (0 once seen under the limit): a
        # command that starts over the limit may run to free space, and is killed only if it adds more.
        self._left_over = 0
        try:
            self._create_layout()
        except BaseException:
            self.close()  # nobody else holds this object to close it: give the uid back
            raise

    # --- what a backend decides -----------------------------------------------------------------------

    @abc.abstractmethod
    def _check_available(self) -> None:
        """Raise SandboxUnavailableError when this backend cannot run here."""

    @abc.abstractmethod
    def _full_argv(self, argv: list[str], env: Mapping[str, str], cwd: str, gateway: bool, binds: Sequence[Bind],
                   tag: str) -> list[str]:
        """The host command line that runs `argv` inside (`tag` names this command among the sandbox's)."""

    def _kill(self, pgid: int, exited: threading.Event, tag: str) -> None:
        """Stop a command at its deadline (or over the disk limit)."""
        kill_tree(pgid, exited, self.spec.kill_grace_s)

    @abc.abstractmethod
    def _sweep(self, tag: str) -> None:
        """After a command: stop whatever of it is still running."""

    # --- layout ---------------------------------------------------------------------------------------

    @property
    def workdir(self) -> str:
        return self.spec.workdir

    @property
    def work_host(self) -> Path:
        return self.state_dir / "work"

    def host_path(self, inside: str) -> Path:
        """The host path of a path inside one of the writable areas (workdir, /tmp, home)."""
        area, relative = area_path(self.workdir, inside)
        return self.state_dir / area / relative

    def _create_layout(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        # Only root may enter the state dir; the sandbox reaches its parts through bind mounts.
        os.chmod(self.state_dir, 0o711)
        for name, _ in writable_mounts(self.workdir):
            (self.state_dir / name).mkdir(exist_ok=True)
        for name in (".exec", ".run"):
            (self.state_dir / name).mkdir(exist_ok=True)
        shutil.copyfile(_RELAY_SOURCE, self.state_dir / ".run" / "relay.py")
        os.chmod(self.state_dir / ".run", 0o755)
        self.give_to_sandbox()
        if self._gateway_url is not None:
            host, port = gateway_target(self._gateway_url)
            self._bridge = GatewayBridge(self.state_dir / ".run" / "gw.sock", host, port)

    def give_to_sandbox(self) -> None:
        """Hand the writable areas to the sandbox uid (after copying files in as root)."""
        for name, _ in writable_mounts(self.workdir):
            chown_tree(self.state_dir / name, self.uid)

    def gateway_url_inside(self) -> str | None:
        """The gateway's URL as seen from inside (the relay on 127.0.0.1), path kept."""
        return None if self._gateway_url is None else gateway_url_inside(self._gateway_url)

    # --- exec -----------------------------------------------------------------------------------------

    def exec(
        self,
        command: str | Sequence[str],
        *,
        timeout_s: float,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        gateway: bool = False,
        binds: Sequence[Bind] = (),
        stdin: bytes | None = None,
    ) -> ExecResult:
        """Run a command inside; the whole process tree is killed when timeout_s passes."""
        if self._closed:
            raise SandboxError(f"sandbox {self.state_dir} is closed")
        if gateway and self._bridge is None:
            raise SandboxError("gateway access asked for, but the sandbox was created without gateway_url")
        argv = ["bash", "-c", command] if isinstance(command, str) else list(command)
        if gateway:
            argv = with_relay(argv)
        full_env = command_env(python_bin=str(Path(sys.executable).parent), base=self.spec.env, extra=env)
        self._exec_count += 1
        tag = f"{self._exec_count:06d}"
        out_path = self.state_dir / ".exec" / f"{tag}.out"
        err_path = self.state_dir / ".exec" / f"{tag}.err"
        in_path = self.state_dir / ".exec" / f"{tag}.in"
        if stdin is not None:
            in_path.write_bytes(stdin)
        # The spec's extra read-only paths go after the writable areas, so one under /tmp stays visible.
        extra = [Bind(host=Path(p), inside=p) for p in self.spec.ro_paths if os.path.lexists(p)]
        full = self._full_argv(argv, full_env, cwd or self.workdir, gateway, [*extra, *binds], tag)
        if self._left_over:  # the last command was killed over the limit: what this one starts from
            self._left_over = self.disk_usage()
        started = time.monotonic()
        with out_path.open("wb") as out, err_path.open("wb") as err:
            stdin_file = in_path.open("rb") if stdin is not None else subprocess.DEVNULL
            try:
                proc = subprocess.Popen(full, stdout=out, stderr=err, stdin=stdin_file, start_new_session=True,
                                        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
            except OSError as exc:
                raise SandboxError(f"could not start {full[0]}: {exc}") from exc
            finally:
                if stdin is not None:
                    stdin_file.close()  # type: ignore[union-attr]
            # A timer thread kills at the deadline while this thread blocks in wait(): Popen.wait(timeout=)
            # polls with sleeps and would add tens of milliseconds to every short command.
            fired, exited = threading.Event(), threading.Event()

            def on_deadline() -> None:
                fired.set()
                self._kill(proc.pid, exited, tag)

            timer = threading.Timer(timeout_s, on_deadline)
            timer.daemon = True
            timer.start()
            over_disk: list[int] = []  # the usage the watch found over the limit
            watch = None
            if self.spec.limits.disk_bytes is not None:
                watch = threading.Thread(target=self._watch_disk, args=(proc.pid, exited, tag, over_disk),
                                         name=f"disk-watch-{tag}", daemon=True)
                watch.start()
            proc.wait()
            exited.set()
            timer.cancel()
            if fired.is_set():
                timer.join()
            if watch is not None:
                watch.join()
            timed_out = fired.is_set() and not over_disk
            self._sweep(tag)
        duration = time.monotonic() - started
        stdout, cut_out = read_capped(out_path, self.spec.max_output_bytes)
        stderr, cut_err = read_capped(err_path, self.spec.max_output_bytes)
        for path in (out_path, err_path, in_path):
            path.unlink(missing_ok=True)
        if over_disk:
            stderr += (f"\n[sandbox] command killed: the sandbox's files hold {over_disk[0]:,} bytes, over its "
                       f"limit of {self.spec.limits.disk_bytes:,}; delete some before going on\n")
        return ExecResult(
            exit_code=None if timed_out else proc.returncode,
            stdout=stdout,
            stderr=stderr,
            timed_out=timed_out,
            duration_s=duration,
            truncated=cut_out or cut_err,
            disk_exceeded=bool(over_disk),
        )

    def disk_usage(self) -> int:
        """Bytes the sandbox's files take on disk: working directory, /tmp, home and captured output."""
        written = [*(name for name, _ in writable_mounts(self.workdir)), ".exec"]
        return sum(tree_bytes(self.state_dir / name) for name in written)

    def _watch_disk(self, pgid: int, exited: threading.Event, tag: str, over: list[int]) -> None:
        limit = self.spec.limits.disk_bytes
        assert limit is not None
        interval = self.spec.limits.disk_check_s
        while not exited.wait(interval):
            began = time.monotonic()
            used = self.disk_usage()
            if used > max(limit, self._left_over):
                over.append(used)
                self._left_over = used
                self._kill(pgid, exited, tag)
                return
            if used <= limit:
                self._left_over = 0
            # Counting a large tree costs CPU: keep it to a tenth of the time at most.
            interval = max(self.spec.limits.disk_check_s, 10 * (time.monotonic() - began))

    # --- lifecycle -------------------------------------------------------------------------------------

    def close(self, *, remove: bool = False) -> None:
        """Stop the gateway bridge and free the uid; the state folder (the preserved work) stays unless remove."""
        if self._closed:
            return
        self._closed = True
        if self._bridge is not None:
            self._bridge.close()
        if self._own_uid:
            uid_pool.UID_POOL.release(self.uid)
        if remove:
            shutil.rmtree(self.state_dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_capped(path: Path, cap: int) -> tuple[str, bool]:
    """A captured output file as text, cut to `cap` bytes keeping its head and its tail; True when cut."""
    size = path.stat().st_size if path.exists() else 0
    if size <= cap:
        return (path.read_bytes().decode(errors="replace") if size else ""), False
    head = cap // 4
    with path.open("rb") as handle:
        first = handle.read(head)
        handle.seek(size - (cap - head))
        last = handle.read()
    marker = f"\n[... {size - cap} bytes cut ...]\n".encode()
    return (first + marker + last).decode(errors="replace"), True


def tree_bytes(root: Path) -> int:
    """Allocated bytes of everything under `root` (symlinks not followed; files vanishing meanwhile skipped)."""
    total, stack = 0, [str(root)]
    while stack:
        try:
            entries = os.scandir(stack.pop())
        except OSError:
            continue
        with entries:
            for entry in entries:
                try:
                    info = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                total += info.st_blocks * 512
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
    return total


def chown_tree(root: Path, uid: int) -> None:
    os.chown(root, uid, uid)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            os.lchown(os.path.join(dirpath, name), uid, uid)


def kill_tree(pgid: int, exited: threading.Event, grace_s: float) -> None:
    """SIGTERM the session, then SIGKILL it; the sandbox's PID namespace takes every descendant with its init."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if sig is signal.SIGKILL and grace_s > 0 and exited.wait(grace_s):
            # The leader went on SIGTERM; children that ignored it are still in the group.
            pass
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
