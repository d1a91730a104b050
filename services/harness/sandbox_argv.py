"""The command lines that build a sandbox around a command, one function per backend (bubblewrap, unshare +
chroot, docker run), plus the rlimit and privilege-drop prefixes they share.

Pure: every host fact they depend on (which read-only paths exist and which are links, whether bubblewrap can
size a tmpfs, the sandbox's uid) arrives as an argument, so each builder is a function of its inputs.
"""

from __future__ import annotations

import os.path
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath

from pydantic import BaseModel, ConfigDict

from services.harness.sandbox_spec import (
    GYRE_RUN_DIR,
    HOME_DIR,
    INSIDE_RELAY_PORT,
    Bind,
    SandboxLimits,
    writable_mounts,
)

# The character devices an unshare sandbox's /dev gets (bubblewrap's --dev makes the same set).
DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")


class HostPath(BaseModel):
    """A host path to show read-only at the same place inside; `link` is its target when it is a symlink."""

    model_config = ConfigDict(frozen=True)

    path: str
    link: str | None = None


def rlimit_args(limits: SandboxLimits) -> list[str]:
    """`prlimit` with one option per limit that is set, ending in `--`."""
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


def drop_privileges_args(uid: int) -> list[str]:
    """`setpriv` to the sandbox uid with no groups and no capabilities, ending in `--`."""
    # no_new_privs: a setuid program (su, mount) cannot gain euid 0 inside (bwrap sets it itself; unshare does not).
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all",
            "--no-new-privs", "--"]


def confined(argv: Sequence[str], *, uid: int, limits: SandboxLimits) -> list[str]:
    """The command as the process backends run it inside their namespaces: unprivileged, then limited."""
    return [*drop_privileges_args(uid), *rlimit_args(limits), *argv]


def with_relay(argv: Sequence[str]) -> list[str]:
    """The command preceded by the gateway relay, started inside on 127.0.0.1:INSIDE_RELAY_PORT."""
    start = f'python3 {GYRE_RUN_DIR}/relay.py {INSIDE_RELAY_PORT} {GYRE_RUN_DIR}/gw.sock && exec "$@"'
    return ["sh", "-c", start, "sh", *argv]


def search_path(python_bin: str) -> str:
    """PATH inside a process sandbox: the harness's Python first (tests and the relay need it), then the system's."""
    return f"{python_bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def command_env(*, python_bin: str, base: Mapping[str, str], extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """A command's whole environment: the sandbox's defaults, then the spec's, then the command's own."""
    return {
        "PATH": search_path(python_bin),
        "HOME": HOME_DIR,
        "TMPDIR": "/tmp",
        "LANG": "C.UTF-8",
        "TEST_DIR": "/tests",
        **base,
        **(extra or {}),
    }


def bwrap_argv(
    inner: Sequence[str],
    *,
    state_dir: Path,
    workdir: str,
    ro_paths: Sequence[HostPath],
    binds: Sequence[Bind],
    gateway: bool,
    env: Mapping[str, str],
    cwd: str,
    shm_bytes: int | None,
) -> list[str]:
    """bubblewrap around `inner`; `shm_bytes` None leaves /dev/shm unsized (bubblewrap before 0.7)."""
    args = ["bwrap", "--die-with-parent", "--new-session", "--unshare-ipc", "--unshare-pid", "--unshare-net",
            "--unshare-uts", "--unshare-cgroup-try", "--hostname", "sandbox"]
    made: set[str] = {"/"}

    def parents(path: str) -> None:
        # bwrap creates missing parents with the host's modes (e.g. /root 0700); make them traversable.
        parts = PurePosixPath(path).parts
        for depth in range(2, len(parts)):
            parent = str(PurePosixPath(*parts[:depth]))
            if parent not in made:
                made.add(parent)
                args.extend(["--perms", "0755", "--dir", parent])

    # The writable areas first: a read-only path below one of them (a virtualenv under /tmp, say)
    # must be mounted on top of the area, not hidden by it.
    for name, mount in writable_mounts(workdir):
        parents(mount)
        args.extend(["--bind", str(state_dir / name), mount])
        made.add(mount)
    for host in ro_paths:
        # A relative link (/bin -> usr/bin) is recreated as a link; an absolute one is bound through.
        if host.link is not None and not os.path.isabs(host.link):
            args.extend(["--symlink", host.link, host.path])
            made.add(host.path)
            continue
        parents(host.path)
        args.extend(["--ro-bind", host.path, host.path])
        made.add(host.path)
    args.extend(["--proc", "/proc", "--dev", "/dev", "--perms", "1777"])
    if shm_bytes is not None:
        args.extend(["--size", str(shm_bytes)])
    args.extend(["--tmpfs", "/dev/shm"])
    for bind in binds:
        parents(bind.inside)
        args.extend(["--ro-bind" if bind.read_only else "--bind", str(bind.host), bind.inside])
        made.add(bind.inside)
    if gateway:
        parents(GYRE_RUN_DIR)
        args.extend(["--ro-bind", str(state_dir / ".run"), GYRE_RUN_DIR])
    args.extend(["--clearenv"])
    for key, value in env.items():
        args.extend(["--setenv", key, value])
    args.extend(["--chdir", cwd])
    return [*args, *inner]


def unshare_root(state_dir: Path) -> Path:
    """The folder an unshare sandbox mounts its tmpfs root on (the caller creates it)."""
    return state_dir / ".root"


def unshare_argv(
    inner: Sequence[str],
    *,
    state_dir: Path,
    workdir: str,
    ro_paths: Sequence[HostPath],
    binds: Sequence[Bind],
    gateway: bool,
    env: Mapping[str, str],
    cwd: str,
    shm_bytes: int,
) -> list[str]:
    """unshare + a shell script that mounts a tmpfs root, binds the areas and paths, and chroots into it."""
    q = shlex.quote
    lines = ["set -e", f"R={q(str(unshare_root(state_dir)))}", "mount --make-rprivate /",
             'mount -t tmpfs -o mode=0755 gyre-root "$R"']

    def mkdirs(inside: str) -> None:
        lines.append(f'mkdir -p "$R"{q(inside)}')

    for name, mount in writable_mounts(workdir):  # areas first, as for bwrap
        mkdirs(mount)
        lines.append(f'mount --bind {q(str(state_dir / name))} "$R"{q(mount)}')
    for host in ro_paths:
        if host.link is not None:
            mkdirs(str(PurePosixPath(host.path).parent))
            lines.append(f'ln -s {q(host.link)} "$R"{q(host.path)}')
            continue
        mkdirs(host.path)
        lines.append(f'mount --rbind {q(host.path)} "$R"{q(host.path)}')
        lines.append(f'mount -o remount,bind,ro "$R"{q(host.path)}')
    for bind in binds:
        mkdirs(bind.inside)
        lines.append(f'mount --bind {q(str(bind.host))} "$R"{q(bind.inside)}')
        if bind.read_only:
            lines.append(f'mount -o remount,bind,ro "$R"{q(bind.inside)}')
    if gateway:
        mkdirs(GYRE_RUN_DIR)
        lines.append(f'mount --bind {q(str(state_dir / ".run"))} "$R"{q(GYRE_RUN_DIR)}')
        lines.append(f'mount -o remount,bind,ro "$R"{q(GYRE_RUN_DIR)}')
    mkdirs("/proc")
    lines.append('mount -t proc proc "$R"/proc')
    mkdirs("/dev")
    lines.append('mount -t tmpfs -o mode=0755 gyre-dev "$R"/dev')
    for node in DEV_NODES:
        lines.append(f'touch "$R"/dev/{node} && mount --bind /dev/{node} "$R"/dev/{node}')
    lines.append(f'mkdir -p "$R"/dev/shm && mount -t tmpfs -o mode=1777,nosuid,nodev,size={shm_bytes} '
                 'gyre-shm "$R"/dev/shm')
    lines.append('ln -s /proc/self/fd "$R"/dev/fd')
    lines.append("ip link set lo up 2>/dev/null || true")
    env_args = " ".join(q(f"{k}={v}") for k, v in env.items())
    command = " ".join(q(part) for part in inner)
    # chroot, then drop uid and capabilities: without CAP_SYS_CHROOT the process cannot leave the root.
    lines.append(f'exec chroot "$R" /usr/bin/env -i {env_args} sh -c {q("cd " + q(cwd) + " && exec " + command)}')
    script = "\n".join(lines)
    return ["unshare", "--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child", "--", "sh", "-c", script]


def docker_run_argv(
    argv: Sequence[str],
    *,
    image: str,
    container: str,
    labels: Mapping[str, str],
    uid: int,
    limits: SandboxLimits,
    state_dir: Path,
    workdir: str,
    binds: Sequence[Bind],
    gateway: bool,
    env: Mapping[str, str],
    cwd: str,
    network: str = "none",
) -> list[str]:
    """`docker run --rm` of `argv` in a fresh container over the sandbox's state folder, on `network` (none: no
    network at all; the sandbox's own network: its task's side services only)."""
    args = ["docker", "run", "--rm", "--name", container, "--network", network, "--init"]
    for key, value in labels.items():
        args += ["--label", f"{key}={value}"]
    args += ["--user", f"{uid}:{uid}", "--cap-drop", "ALL", "--security-opt", "no-new-privileges", "--read-only"]
    if limits.max_processes is not None:
        args += ["--pids-limit", str(limits.max_processes)]
    if limits.memory_bytes is not None:
        # RLIMIT_DATA as in the process sandbox (an allocation past it fails: MemoryError, not a kill); the
        # cgroup's cap at the same size stops what RLIMIT_DATA does not count.
        args += ["--memory", str(limits.memory_bytes), "--ulimit", f"data={limits.memory_bytes}"]
    args += ["--shm-size", str(limits.shm_bytes)]
    if limits.cpu_seconds is not None:
        args += ["--ulimit", f"cpu={limits.cpu_seconds}"]
    if limits.file_size_bytes is not None:
        args += ["--ulimit", f"fsize={limits.file_size_bytes}"]
    if limits.open_files is not None:
        args += ["--ulimit", f"nofile={limits.open_files}"]
    for name, mount in writable_mounts(workdir):
        args += ["-v", f"{state_dir / name}:{mount}:rw"]
    for bind in binds:
        args += ["-v", f"{bind.host}:{bind.inside}:{'ro' if bind.read_only else 'rw'}"]
    if gateway:
        # The image needs python3 for the relay, which listens on the container's own loopback.
        args += ["-v", f"{state_dir / '.run'}:{GYRE_RUN_DIR}:ro"]
    for key, value in env.items():
        if key != "PATH":  # the image's own PATH: the host's Python is not inside
            args += ["-e", f"{key}={value}"]
    args += ["-w", cwd, image]
    return [*args, *argv]
