"""Where a vLLM engine's process keeps its files: its IPC sockets (a folder short enough for a socket's path), the
caches it shares with other engines on the machine, and the KV of sessions in transit (shared memory where there is
room). Set before vLLM is imported; the worker service and the benches that start engines call it."""

from __future__ import annotations

import contextlib
import getpass
import os
import re
import shutil
import tempfile
from pathlib import Path

SHM = Path("/dev/shm")
SHM_MIN_FREE_BYTES = 1 << 30


def default_kv_storage(state_dir: Path, run_id: str, worker_id: str, *, shm: Path = SHM) -> Path:
    """Where a worker's KV in transit goes when no folder is set: the node's shared memory (a tmpfs) when it is
    writable and has a GiB free, else the state folder. The connector writes a session's KV there and the
    engine packs it at once (and the reverse on the target): on this machine's disk a 16K-token save took
    0.09 s, in /dev/shm 0.06-0.07 s (docs/rollout.md). Containers get a small /dev/shm unless given one
    (compose's `shm_size`, a memory `emptyDir` on Kubernetes)."""
    try:
        usable = shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free >= SHM_MIN_FREE_BYTES
    except OSError:
        usable = False
    if usable:
        return shm / "gyre-kv" / re.sub(r"[^A-Za-z0-9_.-]", "-", run_id) / worker_id
    return state_dir / "kv" / worker_id


IPC_FOLDER_MAX_CHARS = 60  # a socket path is at most 107 bytes, and vLLM adds a 36-character name and a scheme


def ipc_folder(preferred: Path) -> Path:
    """The folder for the engine's IPC sockets: `preferred` when its path leaves room for a socket's name, else a
    new short folder under the system's temporary folder (a deep work folder, as a test worker's, would not)."""
    if len(str(preferred.absolute())) <= IPC_FOLDER_MAX_CHARS:
        preferred.mkdir(parents=True, exist_ok=True)
        return preferred
    return Path(tempfile.mkdtemp(prefix="gyre-ipc-", dir="/tmp"))


def prepare_cpu_environment(work_dir: Path) -> None:
    """vLLM on CPU must not write to ~/.cache or leave IPC sockets in /tmp (ENVIRONMENT.md)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    cache = work_dir / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    if "TMPDIR" not in os.environ:
        os.environ["TMPDIR"] = str(ipc_folder(work_dir / "tmp"))
    os.environ.setdefault("VLLM_CACHE_ROOT", str(cache))
    share_inductor_headers(Path(os.environ["TMPDIR"]))
    # Weight reload sends a closure to the engine process; V1 needs pickle for that.
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def share_inductor_headers(tmpdir: Path) -> None:
    """The engine compiles its logprob and sampling ops with torch inductor, whose precompiled headers live under
    TMPDIR whatever TORCHINDUCTOR_CACHE_DIR says. With TMPDIR a run's own scratch folder, every engine start would
    build them again (~5 s of CPU, 150 MB): where a shared cache is named, the folder torch looks in is a link to it
    (the headers are keyed by the compiler, its flags and the preprocessed header's digest)."""
    shared = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not shared:
        return
    user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())  # as torch's default_cache_dir names it
    link = tmpdir / f"torchinductor_{user}"
    if not link.exists() and not link.is_symlink():
        Path(shared).mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):  # another engine of the run made it first
            link.symlink_to(Path(shared).resolve(), target_is_directory=True)
