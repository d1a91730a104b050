"""Process sandboxes on this host's kernel: bubblewrap (preferred) or unshare + chroot, with rlimits, an
unprivileged uid of their own and a sweep of that uid after every command.

Each `exec` is a fresh set of namespaces (no network unless the gateway is asked for), running with no
capabilities, limited by rlimits, killed as a whole at its timeout. The host probes (which system folders
exist, which are links, what bubblewrap supports) live here; the command lines are built in sandbox_argv.py.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from services.harness.sandbox import Sandbox
from services.harness.sandbox_argv import HostPath, bwrap_argv, confined, unshare_argv, unshare_root
from services.harness.sandbox_spec import Backend, Bind, SandboxSpec, SandboxUnavailableError
from services.harness.uid_pool import kill_uid

SYSTEM_FOLDERS = ("/usr", "/etc", "/opt", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


def system_ro_paths() -> list[HostPath]:
    """The host's system folders plus the Python the harness runs on (tests and relay need it), as they are here."""
    paths = [*SYSTEM_FOLDERS, sys.prefix, sys.base_prefix, str(Path(os.path.realpath(sys.executable)).parent.parent)]
    seen: list[str] = []
    for path in paths:
        if os.path.lexists(path) and path not in seen:
            seen.append(path)
    return [HostPath(path=path, link=os.readlink(path) if os.path.islink(path) else None) for path in seen]


@functools.lru_cache(maxsize=1)
def bwrap_sizes_tmpfs() -> bool:
    """bubblewrap takes `--size` for a tmpfs from 0.7 on; an older one refuses the option (and so every
    command), so there /dev/shm stays uncapped."""
    try:
        shown = subprocess.run(["bwrap", "--help"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return "--size" in shown.stdout + shown.stderr


class ProcessSandbox(Sandbox):
    """A sandbox on this host's kernel; `backend` picks bubblewrap or unshare+chroot to build the mounts."""

    def __init__(
        self,
        state_dir: Path | str,
        spec: SandboxSpec | None = None,
        *,
        backend: Backend = "bwrap",
        gateway_url: str | None = None,
    ) -> None:
        if backend not in ("bwrap", "unshare"):
            raise ValueError(f"unknown process sandbox backend {backend!r}: expected bwrap or unshare")
        self.backend = backend
        super().__init__(state_dir, spec, gateway_url=gateway_url)

    def _check_available(self) -> None:
        if os.geteuid() != 0:
            raise SandboxUnavailableError("the process sandbox runs as root to switch to a sandbox uid")
        tool = "bwrap" if self.backend == "bwrap" else "unshare"
        if shutil.which(tool) is None or shutil.which("setpriv") is None or shutil.which("prlimit") is None:
            raise SandboxUnavailableError(f"backend {self.backend!r} needs {tool}, setpriv and prlimit on PATH")

    def _full_argv(self, argv: list[str], env: Mapping[str, str], cwd: str, gateway: bool, binds: Sequence[Bind],
                   tag: str) -> list[str]:
        inner = confined(argv, uid=self.uid, limits=self.spec.limits)
        ro_paths = system_ro_paths()
        match self.backend:
            case "bwrap":
                return bwrap_argv(inner, state_dir=self.state_dir, workdir=self.workdir, ro_paths=ro_paths,
                                  binds=binds, gateway=gateway, env=env, cwd=cwd,
                                  shm_bytes=self.spec.limits.shm_bytes if bwrap_sizes_tmpfs() else None)
            case "unshare":
                unshare_root(self.state_dir).mkdir(exist_ok=True)
                return unshare_argv(inner, state_dir=self.state_dir, workdir=self.workdir, ro_paths=ro_paths,
                                    binds=binds, gateway=gateway, env=env, cwd=cwd,
                                    shm_bytes=self.spec.limits.shm_bytes)
            case other:
                raise ValueError(f"unknown sandbox backend {other!r}")

    def _sweep(self, tag: str) -> None:
        # The PID namespace's teardown is asynchronous; the uid is this sandbox's alone, so anything
        # still running as it is a leftover of this command.
        kill_uid(self.uid)
