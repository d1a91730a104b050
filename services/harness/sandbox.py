"""Process sandboxes for executions: bubblewrap (preferred) or unshare+chroot, with rlimits and tree kill.

A sandbox owns a state folder on the host (work/, tmp/, home/ ...) whose work/ is mapped at the task's
working directory; each `exec` is a fresh set of namespaces (no network unless the gateway is asked for),
running as an unprivileged uid with no capabilities, limited by rlimits, killed as a whole at its timeout.
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field

INSIDE_RELAY_PORT = 8765
GYRE_RUN_DIR = "/run/gyre"
HOME_DIR = "/home/agent"
_RELAY_SOURCE = Path(__file__).with_name("relay_inside.py")
# Writable areas of the state folder and where they appear inside.
_AREAS = {"tmp": "/tmp", "home": HOME_DIR}


class SandboxError(RuntimeError):
    """The sandbox could not be created or a command could not be started in it."""


class SandboxUnavailableError(SandboxError):
    """No sandbox backend of the requested kind works on this machine."""


class SandboxLimits(BaseModel):
    """Per-command resource limits; None means unlimited. Memory is RLIMIT_DATA (heap + private maps)."""

    model_config = ConfigDict(frozen=True)

    cpu_seconds: int | None = Field(default=3600, gt=0)
    memory_bytes: int | None = Field(default=4 * 1024**3, gt=0)
    # /dev/shm is a tmpfs in host memory that RLIMIT_DATA does not count: its own size caps it.
    shm_bytes: int = Field(default=64 * 1024**2, gt=0)
    max_processes: int | None = Field(default=256, gt=0)
    file_size_bytes: int | None = Field(default=1024**3, gt=0)
    open_files: int | None = Field(default=1024, gt=0)
    # Everything the sandbox writes together (its working directory, /tmp, home and the command's captured
    # output): RLIMIT_FSIZE caps one file, not how many. Checked while a command runs, every `disk_check_s`
    # (less often when counting takes long), and a command found over it is killed.
    disk_bytes: int | None = Field(default=16 * 1024**3, gt=0)
    disk_check_s: float = Field(default=2.0, gt=0)


class Bind(BaseModel):
    """A host path made visible inside at `inside`."""

    model_config = ConfigDict(frozen=True)

    host: Path
    inside: str
    read_only: bool = True


class SandboxSpec(BaseModel):
    """How a sandbox is built: working directory, limits, extra read-only host paths, base environment."""

    model_config = ConfigDict(frozen=True)

    workdir: str = "/app"
    limits: SandboxLimits = SandboxLimits()
    ro_paths: tuple[str, ...] = ()
    env: Mapping[str, str] = Field(default_factory=dict)
    # SIGTERM first, SIGKILL this long after, so well-behaved tools can flush.
    kill_grace_s: float = Field(default=1.0, ge=0)
    max_output_bytes: int = Field(default=64 * 1024, gt=0)
    # Host uid the sandbox runs as; None takes one from the process-wide pool.
    uid: int | None = None


class ExecResult(BaseModel):
    model_config = ConfigDict(frozen=True)

    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool
    duration_s: float
    truncated: bool = False
    disk_exceeded: bool = False  # killed because the sandbox's files grew past `SandboxLimits.disk_bytes`

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.disk_exceeded


def _system_ro_paths() -> list[str]:
    """The host's system folders plus the Python the harness runs on (tests and relay need it)."""
    paths = ["/usr", "/etc", "/opt", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"]
    for prefix in (sys.prefix, sys.base_prefix, str(Path(os.path.realpath(sys.executable)).parent.parent)):
        paths.append(prefix)
    seen: list[str] = []
    for path in paths:
        if os.path.lexists(path) and path not in seen:
            seen.append(path)
    return seen


def _sandbox_path(spec: SandboxSpec) -> str:
    venv_bin = str(Path(sys.executable).parent)
    return f"{venv_bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class _UidPool:
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
                    _kill_uid(uid)
                finally:
                    os.close(fd)
            swept.append(uid)
        return swept


UID_POOL = _UidPool(
    base=int(os.environ.get("GYRE_SANDBOX_UID_BASE", "61000")),
    size=2048,
    lock_dir=Path(os.environ.get("GYRE_SANDBOX_UID_LOCKS", "/tmp/gyre-sandbox-uids")),
)


class GatewayBridge:
    """Host side of the gateway route: a Unix socket whose connections are piped to the gateway's TCP port."""

    def __init__(self, socket_path: Path, target_host: str, target_port: int) -> None:
        self.socket_path = socket_path
        self._target = (target_host, target_port)
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._server: asyncio.AbstractServer | None = None
        self._thread = threading.Thread(target=self._run, name=f"gw-bridge-{socket_path.name}", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise SandboxError(f"gateway bridge on {socket_path} did not start")

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_unix_server(self._handle, path=str(self.socket_path)))
        # The sandbox uid must be able to connect; the folder above keeps other users out of the state dir.
        os.chmod(self.socket_path, 0o777)
        self._ready.set()
        self._loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.close()
            return

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))

    def close(self) -> None:
        async def stop() -> None:
            if self._server is not None:
                self._server.close()

        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
        self.socket_path.unlink(missing_ok=True)


def _rlimit_args(limits: SandboxLimits) -> list[str]:
    args = ["prlimit"]
    if limits.cpu_seconds is not None:
        args.append(f"--cpu={limits.cpu_seconds}")
    if limits.memory_bytes is not None:
        args.append(f"--data={limits.memory_bytes}")
    if limits.max_processes is not None:
        args.append(f"--nproc={limits.max_processes}")
    if limits.file_size_bytes is not None:
        args.append(f"--fsize={limits.file_size_bytes}")
    if limits.open_files is not None:
        args.append(f"--nofile={limits.open_files}")
    return [*args, "--"]


@functools.lru_cache(maxsize=1)
def _bwrap_sizes_tmpfs() -> bool:
    """bubblewrap takes `--size` for a tmpfs from 0.7 on; an older one refuses the option (and so every
    command), so there /dev/shm stays uncapped."""
    try:
        shown = subprocess.run(["bwrap", "--help"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return "--size" in shown.stdout + shown.stderr


def _drop_privileges_args(uid: int) -> list[str]:
    # no_new_privs: a setuid program (su, mount) cannot gain euid 0 inside (bwrap sets it itself; unshare does not).
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all",
            "--no-new-privs", "--"]


def _read_capped(path: Path, cap: int) -> tuple[str, bool]:
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


Backend = Literal["bwrap", "unshare", "docker"]


class ProcessSandbox:
    """A sandbox on this host's kernel; `backend` picks bubblewrap or unshare+chroot to build the mounts."""

    def __init__(
        self,
        state_dir: Path | str,
        spec: SandboxSpec | None = None,
        *,
        backend: Backend = "bwrap",
        gateway_url: str | None = None,
    ) -> None:
        self.backend: Backend = backend
        self._check_available()
        self.spec = spec or SandboxSpec()
        self.state_dir = Path(state_dir).resolve()
        self._own_uid = self.spec.uid is None
        self.uid = UID_POOL.acquire() if self.spec.uid is None else self.spec.uid
        self._gateway_url = gateway_url
        self._bridge: GatewayBridge | None = None
        self._exec_count = 0
        self._closed = False
        try:
            self._create_layout()
        except BaseException:
            self.close()  # nobody else holds this object to close it: give the uid back
            raise

    def _check_available(self) -> None:
        if os.geteuid() != 0:
            raise SandboxUnavailableError("the process sandbox runs as root to switch to a sandbox uid")
        tool = "bwrap" if self.backend == "bwrap" else "unshare"
        if shutil.which(tool) is None or shutil.which("setpriv") is None or shutil.which("prlimit") is None:
            raise SandboxUnavailableError(f"backend {self.backend!r} needs {tool}, setpriv and prlimit on PATH")

    # --- layout ---------------------------------------------------------------------------------------

    @property
    def workdir(self) -> str:
        return self.spec.workdir

    @property
    def work_host(self) -> Path:
        return self.state_dir / "work"

    def host_path(self, inside: str) -> Path:
        """The host path of a path inside one of the writable areas (workdir, /tmp, home)."""
        for name, mount in [("work", self.workdir), *_AREAS.items()]:
            if inside == mount or inside.startswith(mount.rstrip("/") + "/"):
                return self.state_dir / name / inside[len(mount) :].lstrip("/")
        raise SandboxError(f"expected a path under {self.workdir}, /tmp or {HOME_DIR}, got {inside!r}")

    def _create_layout(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        # Only root may enter the state dir; the sandbox reaches its parts through bind mounts.
        os.chmod(self.state_dir, 0o711)
        for name in ("work", *_AREAS):
            (self.state_dir / name).mkdir(exist_ok=True)
        for name in (".exec", ".run"):
            (self.state_dir / name).mkdir(exist_ok=True)
        shutil.copyfile(_RELAY_SOURCE, self.state_dir / ".run" / "relay.py")
        os.chmod(self.state_dir / ".run", 0o755)
        self.give_to_sandbox()
        if self._gateway_url is not None:
            parts = urlsplit(self._gateway_url)
            if parts.hostname is None:
                raise SandboxError(f"expected a gateway URL like http://host:port, got {self._gateway_url!r}")
            port = parts.port or (443 if parts.scheme == "https" else 80)
            self._bridge = GatewayBridge(self.state_dir / ".run" / "gw.sock", parts.hostname, port)

    def give_to_sandbox(self) -> None:
        """Hand the writable areas to the sandbox uid (after copying files in as root)."""
        for name in ("work", *_AREAS):
            chown_tree(self.state_dir / name, self.uid)

    def gateway_url_inside(self) -> str | None:
        """The gateway's URL as seen from inside (the relay on 127.0.0.1), path kept."""
        if self._gateway_url is None:
            return None
        parts = urlsplit(self._gateway_url)
        return urlunsplit(("http", f"127.0.0.1:{INSIDE_RELAY_PORT}", parts.path, parts.query, ""))

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
            relay = f"{GYRE_RUN_DIR}/relay.py"
            sock = f"{GYRE_RUN_DIR}/gw.sock"
            start = f'python3 {relay} {INSIDE_RELAY_PORT} {sock} && exec "$@"'
            argv = ["sh", "-c", start, "sh", *argv]
        full_env = {
            "PATH": _sandbox_path(self.spec),
            "HOME": HOME_DIR,
            "TMPDIR": "/tmp",
            "LANG": "C.UTF-8",
            "TEST_DIR": "/tests",
            **self.spec.env,
            **(env or {}),
        }
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
        started = time.monotonic()
        with out_path.open("wb") as out, err_path.open("wb") as err:
            stdin_file = in_path.open("rb") if stdin is not None else subprocess.DEVNULL
            try:
                proc = subprocess.Popen(full, stdout=out, stderr=err, stdin=stdin_file, start_new_session=True, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
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
        stdout, cut_out = _read_capped(out_path, self.spec.max_output_bytes)
        stderr, cut_err = _read_capped(err_path, self.spec.max_output_bytes)
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
        return sum(_tree_bytes(self.state_dir / name) for name in ("work", *_AREAS, ".exec"))

    def _watch_disk(self, pgid: int, exited: threading.Event, tag: str, over: list[int]) -> None:
        limit = self.spec.limits.disk_bytes
        assert limit is not None
        interval = self.spec.limits.disk_check_s
        while not exited.wait(interval):
            began = time.monotonic()
            used = self.disk_usage()
            if used > limit:
                over.append(used)
                self._kill(pgid, exited, tag)
                return
            # Counting a large tree costs CPU: keep it to a tenth of the time at most.
            interval = max(self.spec.limits.disk_check_s, 10 * (time.monotonic() - began))

    def _full_argv(self, argv: list[str], env: Mapping[str, str], cwd: str, gateway: bool, binds: Sequence[Bind], tag: str) -> list[str]:
        inner = [*_drop_privileges_args(self.uid), *_rlimit_args(self.spec.limits), *argv]
        match self.backend:
            case "bwrap":
                return self._bwrap_argv(inner, env, cwd, gateway, binds)
            case "unshare":
                return self._unshare_argv(inner, env, cwd, gateway, binds)
            case other:
                raise ValueError(f"unknown sandbox backend {other!r}")

    def _kill(self, pgid: int, exited: threading.Event, tag: str) -> None:
        _kill_tree(pgid, exited, self.spec.kill_grace_s)

    def _sweep(self, tag: str) -> None:
        # The PID namespace's teardown is asynchronous; the uid is this sandbox's alone, so anything
        # still running as it is a leftover of this command.
        _kill_uid(self.uid)

    def _ro_paths(self) -> list[str]:
        return _system_ro_paths()

    def _bwrap_argv(self, inner: list[str], env: Mapping[str, str], cwd: str, gateway: bool, binds: Sequence[Bind]) -> list[str]:
        args = ["bwrap", "--die-with-parent", "--new-session", "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try", "--hostname", "sandbox"]
        made: set[str] = {"/"}

        def parents(path: str) -> None:
            # bwrap creates missing parents with the host's modes (e.g. /root 0700); make them traversable.
            parts = Path(path).parts
            for depth in range(2, len(parts)):
                parent = str(Path(*parts[:depth]))
                if parent not in made:
                    made.add(parent)
                    args.extend(["--perms", "0755", "--dir", parent])

        # The writable areas first: a read-only path below one of them (a virtualenv under /tmp, say)
        # must be mounted on top of the area, not hidden by it.
        for name, mount in [("work", self.workdir), *_AREAS.items()]:
            parents(mount)
            args.extend(["--bind", str(self.state_dir / name), mount])
            made.add(mount)
        for path in self._ro_paths():
            if os.path.islink(path) and not os.path.isabs(os.readlink(path)):
                args.extend(["--symlink", os.readlink(path), path])
                made.add(path)
                continue
            parents(path)
            args.extend(["--ro-bind", path, path])
            made.add(path)
        args.extend(["--proc", "/proc", "--dev", "/dev", "--perms", "1777"])
        if _bwrap_sizes_tmpfs():
            args.extend(["--size", str(self.spec.limits.shm_bytes)])
        args.extend(["--tmpfs", "/dev/shm"])
        for bind in binds:
            parents(bind.inside)
            args.extend(["--ro-bind" if bind.read_only else "--bind", str(bind.host), bind.inside])
            made.add(bind.inside)
        if gateway:
            parents(GYRE_RUN_DIR)
            args.extend(["--ro-bind", str(self.state_dir / ".run"), GYRE_RUN_DIR])
        args.extend(["--clearenv"])
        for key, value in env.items():
            args.extend(["--setenv", key, value])
        args.extend(["--chdir", cwd])
        return [*args, *inner]

    def _unshare_argv(self, inner: list[str], env: Mapping[str, str], cwd: str, gateway: bool, binds: Sequence[Bind]) -> list[str]:
        root = self.state_dir / ".root"
        root.mkdir(exist_ok=True)
        q = shlex.quote
        lines = ["set -e", f"R={q(str(root))}", 'mount --make-rprivate /', 'mount -t tmpfs -o mode=0755 gyre-root "$R"']

        def mkdirs(inside: str) -> None:
            lines.append(f'mkdir -p "$R"{q(inside)}')

        for name, mount in [("work", self.workdir), *_AREAS.items()]:  # areas first, as for bwrap
            mkdirs(mount)
            lines.append(f'mount --bind {q(str(self.state_dir / name))} "$R"{q(mount)}')
        for path in self._ro_paths():
            if os.path.islink(path):
                parent = str(Path(path).parent)
                mkdirs(parent)
                lines.append(f'ln -s {q(os.readlink(path))} "$R"{q(path)}')
                continue
            mkdirs(path)
            lines.append(f'mount --rbind {q(path)} "$R"{q(path)}')
            lines.append(f'mount -o remount,bind,ro "$R"{q(path)}')
        for bind in binds:
            mkdirs(bind.inside)
            lines.append(f'mount --bind {q(str(bind.host))} "$R"{q(bind.inside)}')
            if bind.read_only:
                lines.append(f'mount -o remount,bind,ro "$R"{q(bind.inside)}')
        if gateway:
            mkdirs(GYRE_RUN_DIR)
            lines.append(f'mount --bind {q(str(self.state_dir / ".run"))} "$R"{q(GYRE_RUN_DIR)}')
            lines.append(f'mount -o remount,bind,ro "$R"{q(GYRE_RUN_DIR)}')
        mkdirs("/proc")
        lines.append('mount -t proc proc "$R"/proc')
        mkdirs("/dev")
        lines.append('mount -t tmpfs -o mode=0755 gyre-dev "$R"/dev')
        for node in ("null", "zero", "full", "random", "urandom", "tty"):
            lines.append(f'touch "$R"/dev/{node} && mount --bind /dev/{node} "$R"/dev/{node}')
        lines.append(f'mkdir -p "$R"/dev/shm && mount -t tmpfs -o mode=1777,nosuid,nodev,size={self.spec.limits.shm_bytes} '
                     'gyre-shm "$R"/dev/shm')
        lines.append('ln -s /proc/self/fd "$R"/dev/fd')
        lines.append("ip link set lo up 2>/dev/null || true")
        env_args = " ".join(q(f"{k}={v}") for k, v in env.items())
        command = " ".join(q(part) for part in inner)
        # chroot, then drop uid and capabilities: without CAP_SYS_CHROOT the process cannot leave the root.
        lines.append(f'exec chroot "$R" /usr/bin/env -i {env_args} sh -c {q("cd " + q(cwd) + " && exec " + command)}')
        script = "\n".join(lines)
        return ["unshare", "--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child", "--", "sh", "-c", script]

    # --- lifecycle -------------------------------------------------------------------------------------

    def close(self, *, remove: bool = False) -> None:
        """Stop the gateway bridge and free the uid; the state folder (the preserved work) stays unless remove."""
        if self._closed:
            return
        self._closed = True
        if self._bridge is not None:
            self._bridge.close()
        if self._own_uid:
            UID_POOL.release(self.uid)
        if remove:
            shutil.rmtree(self.state_dir, ignore_errors=True)

    def __enter__(self) -> ProcessSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tree_bytes(root: Path) -> int:
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


def _kill_tree(pgid: int, exited: threading.Event, grace_s: float) -> None:
    """SIGTERM the session, then SIGKILL it; the sandbox's PID namespace takes every descendant with its init."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if sig is signal.SIGKILL and grace_s > 0 and exited.wait(grace_s):
            # The leader went on SIGTERM; children that ignored it are still in the group.
            pass
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return


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


def _kill_uid(uid: int, patience_s: float = 30.0) -> None:
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


def available_backends() -> list[Backend]:
    """The process-sandbox backends that work here, best first (checked by running `true` in each)."""
    found: list[Backend] = []
    if os.geteuid() != 0:
        return found
    candidates: tuple[Backend, ...] = ("bwrap", "unshare")
    for backend in candidates:
        try:
            probe = ProcessSandbox(Path(f"/tmp/gyre-probe-{os.getpid()}-{backend}"), backend=backend)
        except SandboxUnavailableError:
            continue
        try:
            if probe.exec("true", timeout_s=20).ok:
                found.append(backend)
        finally:
            probe.close(remove=True)
    return found


def make_sandbox(
    state_dir: Path | str,
    spec: SandboxSpec | None = None,
    *,
    backend: str = "auto",
    gateway_url: str | None = None,
) -> ProcessSandbox:
    """Create a sandbox with the named backend; 'auto' takes bubblewrap when present, else unshare."""
    match backend:
        case "bwrap" | "unshare":
            return ProcessSandbox(state_dir, spec, backend=backend, gateway_url=gateway_url)
        case "auto":
            chosen: Backend = "bwrap" if shutil.which("bwrap") else "unshare"
            return ProcessSandbox(state_dir, spec, backend=chosen, gateway_url=gateway_url)
        case "docker":
            from services.harness.docker_sandbox import DockerSandbox

            return DockerSandbox(state_dir, spec, gateway_url=gateway_url)  # type: ignore[return-value]
        case other:
            raise ValueError(f"unknown sandbox backend {other!r}: expected auto, bwrap, unshare or docker")
