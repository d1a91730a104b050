"""The sandbox contract, one suite for every backend (bubblewrap, unshare, Docker): filesystem, network, runaway
processes, limits, uids (bounded so the host is safe)."""

from __future__ import annotations

import contextlib
import os
import shlex
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from services.harness.sandbox import Sandbox
from services.harness.sandbox_spec import SandboxLimits, SandboxSpec
from services.harness.sandboxes import make_sandbox


def processes_of_uid(uid: int) -> list[int]:
    """Host pids whose real uid is the sandbox's: what would have escaped the kill."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("Uid:") and int(line.split()[1]) == uid:
                found.append(int(entry))
    return found


def limited(tmp_path: Path, backend: str, **limits: int) -> Sandbox:
    spec = SandboxSpec(workdir="/app", limits=SandboxLimits(**limits), kill_grace_s=0.5)
    return make_sandbox(tmp_path / "limited", spec, backend=backend)


def test_workspace_is_mapped_at_workdir_and_writable(sandbox: Sandbox) -> None:
    result = sandbox.exec("pwd && echo made > result.txt", timeout_s=60)
    assert result.ok, result.stderr
    assert result.stdout.strip() == "/app"
    assert (sandbox.work_host / "result.txt").read_text() == "made\n"


@pytest.mark.parametrize("target", ["/etc/gyre-escape", "/usr/gyre-escape", "/gyre-escape", "/root/gyre-escape"])
def test_writing_outside_the_workspace_fails(sandbox: Sandbox, target: str) -> None:
    result = sandbox.exec(f"echo x > {target}", timeout_s=60)
    assert result.exit_code != 0
    assert not Path(target).exists()


def test_host_project_and_tmp_are_not_writable_from_inside(sandbox: Sandbox, tmp_path: Path) -> None:
    host_file = tmp_path / "host-owned.txt"
    host_file.write_text("original")
    # tmp_path is under the host's /tmp, which the sandbox replaces with its own.
    result = sandbox.exec(f"echo changed > {host_file}; ls {tmp_path}", timeout_s=60)
    assert result.exit_code != 0
    assert host_file.read_text() == "original"
    venv_file = Path(os.__file__)
    assert sandbox.exec(f"echo x >> {venv_file}", timeout_s=60).exit_code != 0


def test_network_connections_fail(sandbox: Sandbox) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(3)
    port = listener.getsockname()[1]
    accepted: list[object] = []

    def accept() -> None:
        try:
            accepted.append(listener.accept())
        except OSError:
            pass

    thread = threading.Thread(target=accept)
    thread.start()
    script = (
        "import socket\n"
        "for addr in [('127.0.0.1', %d), ('1.1.1.1', 53), ('8.8.8.8', 443)]:\n"
        "    try:\n"
        "        socket.create_connection(addr, timeout=2); print('CONNECTED', addr)\n"
        "    except OSError as exc:\n"
        "        print('BLOCKED', addr, exc)\n"
    ) % port
    result = sandbox.exec(["python", "-c", script], timeout_s=60)
    thread.join()
    listener.close()
    assert "CONNECTED" not in result.stdout
    assert result.stdout.count("BLOCKED") == 3
    assert accepted == []


def test_background_processes_do_not_outlive_the_command(sandbox: Sandbox) -> None:
    result = sandbox.exec("(sleep 300 &) ; setsid sleep 300 & echo started", timeout_s=60)
    assert result.ok
    assert processes_of_uid(sandbox.uid) == []


def test_fork_bomb_is_contained_and_killed_at_timeout(tmp_path: Path, backend: str) -> None:
    box = limited(tmp_path, backend, max_processes=64)
    try:
        result = box.exec(":(){ :|:& };:; sleep 300", timeout_s=5)
        assert result.timed_out or result.exit_code != 0
        assert processes_of_uid(box.uid) == []
    finally:
        box.close(remove=True)
    # The host can still start processes.
    assert subprocess.run(["true"]).returncode == 0


def test_memory_hog_is_capped_and_killed_at_timeout(tmp_path: Path, backend: str) -> None:
    box = limited(tmp_path, backend, memory_bytes=256 * 1024**2)
    hog = (
        "import time\n"
        "chunks = []\n"
        "try:\n"
        "    for _ in range(64):\n"
        "        chunks.append(bytearray(64 * 1024 * 1024))\n"
        "    print('allocated 4 GiB', flush=True)\n"
        "except MemoryError:\n"
        "    print('capped at', len(chunks) * 64, 'MiB', flush=True)\n"
        "time.sleep(300)\n"
    )
    try:
        result = box.exec(["python", "-c", hog], timeout_s=8)
        assert result.timed_out
        assert "capped at" in result.stdout
        assert int(result.stdout.split()[2]) < 256
        assert processes_of_uid(box.uid) == []
    finally:
        box.close(remove=True)


def test_process_ignoring_sigterm_is_killed_at_timeout(tmp_path: Path, backend: str) -> None:
    box = limited(tmp_path, backend)
    stubborn = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\ntime.sleep(600)\n"
    try:
        quoted = shlex.quote(stubborn)
        result = box.exec(f"trap '' TERM; python -c {quoted} & python -c {quoted}; wait", timeout_s=5)
        assert result.timed_out and result.exit_code is None
        assert result.stdout.count("ready") == 2
        assert processes_of_uid(box.uid) == []
    finally:
        box.close(remove=True)


def test_cpu_time_limit_stops_a_busy_loop(tmp_path: Path, backend: str) -> None:
    box = limited(tmp_path, backend, cpu_seconds=1)
    try:
        result = box.exec(["python", "-c", "while True: pass"], timeout_s=120)
        assert not result.timed_out
        assert result.exit_code != 0
    finally:
        box.close(remove=True)


def test_file_size_limit_caps_a_large_write(tmp_path: Path, backend: str) -> None:
    box = limited(tmp_path, backend, file_size_bytes=1024 * 1024)
    try:
        result = box.exec("head -c 10000000 /dev/zero > big.bin", timeout_s=60)
        assert result.exit_code != 0
        assert (box.work_host / "big.bin").stat().st_size <= 1024 * 1024
    finally:
        box.close(remove=True)


def test_a_command_whose_files_outgrow_the_disk_limit_is_killed(tmp_path: Path, backend: str) -> None:
    """Many files, each under the per-file cap, still hit the sandbox's total."""
    spec = SandboxSpec(workdir="/app", limits=SandboxLimits(disk_bytes=8 * 1024**2, disk_check_s=0.2),
                       kill_grace_s=0.5)
    box = make_sandbox(tmp_path / "disk", spec, backend=backend)
    try:
        small = box.exec("head -c 2M /dev/urandom > small.bin && sleep 1", timeout_s=60)
        assert small.ok and not small.disk_exceeded
        grown = box.exec("for i in $(seq 100); do head -c 1M /dev/urandom > /tmp/f$i; sleep 0.05; done; sleep 30",
                         timeout_s=60)
        assert grown.disk_exceeded and not grown.ok and not grown.timed_out
        assert grown.duration_s < 30, "killed when found over the limit, not at the timeout"
        assert "over its limit of 8,388,608" in grown.stderr
        assert not box.host_path("/tmp/f100").exists(), "the writes stopped when the command was killed"
        assert processes_of_uid(box.uid) == []
        cleaned = box.exec("rm -f /tmp/f* && sleep 1", timeout_s=60)
        assert cleaned.ok, "a command that frees space runs"
    finally:
        box.close(remove=True)


def test_output_is_capped_keeping_head_and_tail(tmp_path: Path, backend: str) -> None:
    spec = SandboxSpec(workdir="/app", max_output_bytes=4096)
    box = make_sandbox(tmp_path / "out", spec, backend=backend)
    try:
        result = box.exec("echo FIRST; head -c 100000 /dev/zero | tr '\\0' x; echo; echo LAST", timeout_s=60)
        assert result.truncated
        assert result.stdout.startswith("FIRST") and result.stdout.rstrip().endswith("LAST")
        assert len(result.stdout) < 5000
    finally:
        box.close(remove=True)


def test_concurrent_sandboxes_get_distinct_uids(tmp_path: Path, backend: str) -> None:
    boxes = [make_sandbox(tmp_path / f"b{i}", SandboxSpec(), backend=backend) for i in range(3)]
    try:
        assert len({box.uid for box in boxes}) == 3
        assert all(box.uid != 0 for box in boxes)
    finally:
        for box in boxes:
            box.close(remove=True)


def test_uid_locks_exclude_other_processes(tmp_path: Path) -> None:
    from services.harness.uid_pool import UidPool

    first = UidPool(base=70000, size=2, lock_dir=tmp_path / "locks")
    second = UidPool(base=70000, size=2, lock_dir=tmp_path / "locks")
    a = first.acquire()
    b = second.acquire()
    assert a != b
    first.release(a)
    assert second.acquire() == a


def test_a_sandbox_that_fails_to_build_gives_its_uid_back(tmp_path: Path, backend: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Nobody holds a sandbox whose constructor raised, so nobody can close it: it must free its uid itself
    (otherwise every such failure leaks one, until the pool is empty and no execution can start)."""
    from services.harness import uid_pool
    from services.harness.sandbox_spec import SandboxError

    pool = uid_pool.UidPool(base=71000, size=1, lock_dir=tmp_path / "locks")
    monkeypatch.setattr(uid_pool, "UID_POOL", pool)
    with pytest.raises(SandboxError, match="gateway URL"):
        make_sandbox(tmp_path / "bad", SandboxSpec(), backend=backend, gateway_url="http:///no-host")
    box = make_sandbox(tmp_path / "good", SandboxSpec(), backend=backend)
    try:
        assert box.uid == 71000
    finally:
        box.close(remove=True)


def test_extra_read_only_paths_are_visible_even_under_tmp(tmp_path: Path, backend: str) -> None:
    tool_dir = tmp_path / "tool"
    tool_dir.mkdir()
    (tool_dir / "run.sh").write_text("echo tool ran\n")
    box = make_sandbox(tmp_path / "box", SandboxSpec(ro_paths=(str(tool_dir),)), backend=backend)
    try:
        result = box.exec(f"bash {tool_dir}/run.sh && touch {tool_dir}/x", timeout_s=60)
        assert "tool ran" in result.stdout
        assert result.exit_code != 0 and not (tool_dir / "x").exists()
    finally:
        box.close(remove=True)


def test_concurrent_sandboxes_do_not_kill_each_others_processes(tmp_path: Path, backend: str) -> None:
    """One sandbox's timeout and post-command sweep leave a neighbour's running command alone."""
    import concurrent.futures

    long_box = limited(tmp_path / "long", backend)
    short_boxes = [limited(tmp_path / f"short{i}", backend) for i in range(2)]
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
            survivor = pool.submit(long_box.exec, "sleep 6 && echo survived", timeout_s=120)
            killed = [pool.submit(box.exec, "trap '' TERM; sleep 300", timeout_s=2) for box in short_boxes]
            assert all(f.result().timed_out for f in killed)
            result = survivor.result()
        assert result.ok and "survived" in result.stdout
    finally:
        for box in [long_box, *short_boxes]:
            box.close(remove=True)


def test_dev_shm_is_capped_and_setuid_programs_gain_nothing(tmp_path: Path, backend: str) -> None:
    """/dev/shm lives in host memory outside RLIMIT_DATA, so its own size caps it; no_new_privs keeps a setuid
    program (su, mount) from running with euid 0 inside."""
    spec = SandboxSpec(workdir="/app", limits=SandboxLimits(shm_bytes=8 * 1024**2), kill_grace_s=0.5)
    box = make_sandbox(tmp_path / "shm", spec, backend=backend)
    try:
        assert box.exec("head -c 4M /dev/zero > /dev/shm/small", timeout_s=60).ok
        full = box.exec("head -c 32M /dev/zero > /dev/shm/big", timeout_s=60)
        assert full.exit_code != 0 and "No space left" in full.stderr
        status = box.exec("grep NoNewPrivs /proc/self/status", timeout_s=60)
        assert status.stdout.split() == ["NoNewPrivs:", "1"], status
    finally:
        box.close(remove=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="running and killing processes as other uids needs root")
def test_orphans_of_a_dead_harness_are_swept_and_live_sandboxes_are_not(tmp_path: Path) -> None:
    """A harness that died can leave sandbox processes running (under unshare a uid change clears the
    parent-death signal). A restarted harness kills those of uids nobody holds, and only those."""
    from services.harness.uid_pool import UidPool

    restarted = UidPool(base=72000, size=4, lock_dir=tmp_path / "locks")
    neighbour = UidPool(base=72000, size=4, lock_dir=tmp_path / "locks")  # another live harness process
    held = neighbour.acquire()
    orphan_uid = held + 1

    def run_as(uid: int) -> int:
        """A `sleep` running as `uid` that is not our child (its parent exits), as an orphan would be."""
        out = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "sh", "-c",
                              "sleep 300 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True, check=True)
        return int(out.stdout)

    orphan, live = run_as(orphan_uid), run_as(held)
    try:
        assert restarted.sweep_orphans() == [orphan_uid]
        assert processes_of_uid(orphan_uid) == []
        assert processes_of_uid(held) == [live]
    finally:
        for pid in (orphan, live):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        neighbour.release(held)
