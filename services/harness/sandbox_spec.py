"""What a sandbox is, as plain data: its spec and limits, a bind mount, a command's result, the layout of its
state folder, and the errors every backend raises. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field

Backend = Literal["bwrap", "unshare", "docker"]

INSIDE_RELAY_PORT = 8765  # where the relay inside a sandbox listens for the gateway route
GYRE_RUN_DIR = "/run/gyre"  # where the state folder's .run/ (relay script, gateway socket) appears inside
HOME_DIR = "/home/agent"
# The Docker backend's image where a task brings no Dockerfile, and the default its FROM lines map onto: no
# registry is reachable, so it is built here (deploy/docker-engine.sh: Debian with Python and pytest).
DEFAULT_BASE_IMAGE = "gyre-base:bookworm"
# Writable areas of the state folder besides work/ (which appears at the spec's workdir), and where they appear.
WRITABLE_AREAS: Mapping[str, str] = {"tmp": "/tmp", "home": HOME_DIR}


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


class SideService(BaseModel):
    """A service a task's compose file runs beside the agent (a database, a server), reachable by its name."""

    model_config = ConfigDict(frozen=True)

    name: str
    image: str
    environment: Mapping[str, str] = Field(default_factory=dict)
    command: tuple[str, ...] = ()


class TaskEnvironment(BaseModel):
    """What the Docker backend runs a task in: the image of its commands, its side services, and whether it has
    a network to the outside (without one, only its side services are reachable). Process backends run over the
    host's system and take none of it."""

    model_config = ConfigDict(frozen=True)

    image: str
    services: tuple[SideService, ...] = ()
    network: bool = False


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


def writable_mounts(workdir: str) -> list[tuple[str, str]]:
    """(folder of the state folder, where it appears inside) for every writable area, work/ first."""
    return [("work", workdir), *WRITABLE_AREAS.items()]


def area_path(workdir: str, inside: str) -> tuple[str, str]:
    """(state-folder area, path relative to it) of a path inside one of the writable areas."""
    for name, mount in writable_mounts(workdir):
        if inside == mount or inside.startswith(mount.rstrip("/") + "/"):
            return name, inside[len(mount) :].lstrip("/")
    raise SandboxError(f"expected a path under {workdir}, /tmp or {HOME_DIR}, got {inside!r}")


def gateway_target(gateway_url: str) -> tuple[str, int]:
    """(host, port) the host side of the gateway route connects to."""
    parts = urlsplit(gateway_url)
    if parts.hostname is None:
        raise SandboxError(f"expected a gateway URL like http://host:port, got {gateway_url!r}")
    return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)


def gateway_url_inside(gateway_url: str) -> str:
    """The gateway's URL as seen from inside a sandbox (the relay on 127.0.0.1), path kept."""
    parts = urlsplit(gateway_url)
    return urlunsplit(("http", f"127.0.0.1:{INSIDE_RELAY_PORT}", parts.path, parts.query, ""))
