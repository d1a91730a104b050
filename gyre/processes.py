"""The processes of a run on one machine: each service as its own process with the same command compose.yaml
runs, started, restarted when it dies (it resumes from the log), and stopped with anything it left behind."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

console = Console()


@dataclass
class Proc:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen[bytes] | None = None
    restarts: int = 0

    def start(self, base_env: dict[str, str], log_dir: Path) -> None:
        log = open(log_dir / f"{self.name}.log", "ab")
        self.popen = subprocess.Popen(
            self.argv, env={**base_env, **self.env}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, timeout: float = 20.0) -> None:
        if not self.alive():
            return
        assert self.popen is not None
        os.killpg(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait()


def service_processes(python: str, *, more_gateway_ports: Sequence[int] = ()) -> list[Proc]:
    """Every long-running process of a run, in start order (the same entry points compose.yaml runs).

    The cell agent starts a rollout worker or a trainer rank on each of its cells, as the scheduler orders;
    the trainer process is the coordinator of the ranks (it holds no model). A run with several gateways runs
    one more process for each of `more_gateway_ports`, each with a name of its own (its durable consumer).
    """
    gateway = [python, "-m", "services.rollout", "gateway"]
    return [
        Proc("relay", [python, "-m", "shared.relay"]),
        Proc("trajectory", [python, "-m", "services.trajectory"]),
        Proc("trainer", [python, "-m", "services.trainer"]),
        Proc("gateway", gateway),
        *(Proc(f"gateway-{i}", gateway, env={"GYRE_ROLLOUT_PORT": str(port), "GYRE_ROLLOUT_GATEWAY_ID": str(i)})
          for i, port in enumerate(more_gateway_ports, start=1)),
        Proc("harness", [python, "-m", "services.harness"]),
        Proc("cells", [python, "-m", "services.scheduler", "cell"]),
        Proc("scheduler", [python, "-m", "services.scheduler", "serve"]),
    ]


def serve_metrics(procs: Sequence[Proc], env: dict[str, str], ports: Sequence[int]) -> list[dict[str, object]]:
    """Give each process a health port of its own (`/health`, `/metrics`: shared/metrics.py) and return the
    run's scrape targets in Prometheus's file_sd form: one per process, and one per cell process (a cell's
    rollout worker on GYRE_CELL_HEALTH_PORT_BASE + i, its trainer rank on base + cells + i)."""
    host = env.get("GYRE_HEALTH_HOST", "127.0.0.1").replace("0.0.0.0", "127.0.0.1")
    targets: list[dict[str, object]] = []
    for proc, port in zip(procs, ports, strict=True):
        proc.env["GYRE_HEALTH_PORT"] = str(port)
        targets.append({"targets": [f"{host}:{port}"], "labels": {"job": "gyre", "service": proc.name}})
    base, cells = int(env.get("GYRE_CELL_HEALTH_PORT_BASE", "0")), int(env.get("GYRE_CELL_COUNT", "0"))
    if base:
        for i in range(cells):
            for role, port in (("rollout", base + i), ("train", base + cells + i)):
                targets.append({"targets": [f"{host}:{port}"],
                                "labels": {"job": "gyre", "service": f"cell-{role}", "cell": str(i)}})
    return targets


def start_all(procs: list[Proc], env: dict[str, str], log_dir: Path) -> None:
    log_dir.mkdir(parents=True, exist_ok=True)
    for proc in procs:
        proc.start(env, log_dir)


def scratch_folder(run_id: str) -> Path:
    """The run's folder for its engines' IPC sockets (their TMPDIR), under the system's temporary folder: a socket's
    path may not exceed 107 bytes, which a deep run folder would. The same for a resumed run; removed by `stop_all`."""
    return Path(tempfile.gettempdir()) / f"gyre-{hashlib.sha1(run_id.encode()).hexdigest()[:10]}"


def stop_all(procs: list[Proc], run_id: str | None = None) -> None:
    """Stop every process, then (given the run) any stray of it and its scratch folder, which nothing uses then."""
    for proc in reversed(procs):
        proc.stop()
    if run_id is not None:
        reap_strays(run_id)
        shutil.rmtree(scratch_folder(run_id), ignore_errors=True)


def reap_strays(run_id: str) -> list[int]:
    """SIGKILL any process still carrying this run's GYRE_RUN_ID (Linux /proc), e.g. an engine a cell agent
    was starting when it was stopped: each cell process runs in its own session, out of the agent's group."""
    marker = f"GYRE_RUN_ID={run_id}".encode()
    killed = []
    for entry in Path("/proc").glob("[0-9]*"):
        pid = int(entry.name)
        if pid == os.getpid():
            continue
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        except (OSError, ValueError):
            continue
    if killed:
        console.print(f"[yellow]stopped {len(killed)} stray process(es) of run {run_id}[/]")
    return killed


MAX_RESTARTS = 3


class ServiceKeptDying(RuntimeError):
    """A service exited more often than the launcher restarts one."""


def restart(proc: Proc, env: dict[str, str], log_dir: Path) -> None:
    """A service that died is started again, as compose's restart policy would: each resumes from the log."""
    code = proc.popen.returncode if proc.popen is not None else None
    if proc.restarts >= MAX_RESTARTS:
        raise ServiceKeptDying(f"{proc.name} exited ({code}) {proc.restarts + 1} times; see {log_dir / proc.name}.log")
    proc.restarts += 1
    console.print(f"[yellow]{proc.name} exited ({code}); starting it again ({proc.restarts}/{MAX_RESTARTS})[/]")
    proc.start(env, log_dir)


__all__ = ["MAX_RESTARTS", "Proc", "ServiceKeptDying", "reap_strays", "restart", "scratch_folder", "service_processes",
           "start_all", "stop_all"]
