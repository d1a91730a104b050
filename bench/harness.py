"""Per-command overhead of the sandbox backends (bubblewrap, unshare, and Docker where an engine answers) vs a plain
subprocess, measured in the same run.

Runs the same short commands (`true`, a small file write) N times each way; the last stdout line is JSON:
{"bench": "harness", "plain_exec_s": ..., "sandbox_exec_s": ..., "overhead_ratio": ..., "<backend>_overhead_s": ...}
(medians, seconds). The variants run in interleaved rounds after untimed warm-up rounds. The plain command
takes only milliseconds, so `overhead_ratio` moves a lot with load; `<backend>_overhead_s` is the steadier figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from services.harness.sandbox import Sandbox
from services.harness.sandboxes import available_backends, make_sandbox

COMMANDS = ["true", "echo bench > out.txt && cat out.txt > /dev/null"]


WARM_UP = 3  # untimed rounds: every variant's first commands pay page-cache and import costs


def run_plain(workdir: Path, command: str) -> float:
    started = time.perf_counter()
    subprocess.run(["bash", "-c", command], cwd=workdir, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def run_sandboxed(sandbox: Sandbox, command: str) -> float:
    started = time.perf_counter()
    result = sandbox.exec(command, timeout_s=60)
    elapsed = time.perf_counter() - started
    if not result.ok:
        raise RuntimeError(f"sandbox command failed: {result}")
    return elapsed


def measure(root: Path, backends: list[str], n: int) -> dict[str, list[float]]:
    """Rounds of one command per variant (plain, then each backend), so load drift over the run reaches every
    variant alike rather than whichever ran in its block; the first WARM_UP rounds are not timed."""
    (root / "plain").mkdir()
    sandboxes = {b: make_sandbox(root / f"sandbox-{b}", backend=b) for b in backends}
    samples: dict[str, list[float]] = {"plain": [], **{b: [] for b in backends}}
    try:
        for i in range(WARM_UP + n):
            command = COMMANDS[i % len(COMMANDS)]
            timed = {"plain": run_plain(root / "plain", command)}
            for backend, sandbox in sandboxes.items():
                timed[backend] = run_sandboxed(sandbox, command)
            if i >= WARM_UP:
                for name, seconds in timed.items():
                    samples[name].append(seconds)
    finally:
        for sandbox in sandboxes.values():
            sandbox.close(remove=True)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-n", type=int, default=40, help="commands per variant")
    args = parser.parse_args()
    backends = available_backends()
    if not backends:
        raise SystemExit("no process sandbox backend works here (needs root and bwrap or unshare)")
    from services.harness.docker_sandbox import docker_engine_available

    # Docker too where an engine answers (deploy/docker-engine.sh): a fresh container per command.
    measured = [*backends, *(["docker"] if docker_engine_available() else [])]
    with tempfile.TemporaryDirectory(prefix="gyre-bench-") as tmp:
        samples = measure(Path(tmp), measured, args.n)
    plain_s = statistics.median(samples.pop("plain"))
    per_backend = samples
    report: dict[str, object] = {"bench": "harness", "n": args.n, "backend": backends[0]}
    for backend, samples in per_backend.items():
        median = statistics.median(samples)
        report[f"{backend}_exec_s"] = round(median, 5)
        report[f"{backend}_overhead_s"] = round(median - plain_s, 5)
        print(f"{backend:8s} median {median * 1000:7.2f} ms  p90 {sorted(samples)[int(0.9 * len(samples))] * 1000:7.2f} ms")
    print(f"plain    median {plain_s * 1000:7.2f} ms")
    sandbox_s = statistics.median(per_backend[backends[0]])
    report.update(plain_exec_s=round(plain_s, 5), sandbox_exec_s=round(sandbox_s, 5), overhead_ratio=round(sandbox_s / plain_s, 2))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
