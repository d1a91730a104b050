"""Per-command overhead of the process sandbox vs a plain subprocess, measured in the same run.

Runs the same short commands (`true`, a small file write) N times each way; the last stdout line is JSON:
{"bench": "harness", "plain_exec_s": ..., "sandbox_exec_s": ..., "overhead_ratio": ...} (medians, seconds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from services.harness.sandbox import available_backends, make_sandbox

COMMANDS = ["true", "echo bench > out.txt && cat out.txt > /dev/null"]


def time_plain(workdir: Path, n: int) -> list[float]:
    samples = []
    for i in range(n):
        command = COMMANDS[i % len(COMMANDS)]
        started = time.perf_counter()
        subprocess.run(["bash", "-c", command], cwd=workdir, check=True, stdout=subprocess.DEVNULL)
        samples.append(time.perf_counter() - started)
    return samples


def time_sandbox(root: Path, backend: str, n: int) -> list[float]:
    sandbox = make_sandbox(root / f"sandbox-{backend}", backend=backend)
    samples = []
    try:
        for i in range(n):
            command = COMMANDS[i % len(COMMANDS)]
            started = time.perf_counter()
            result = sandbox.exec(command, timeout_s=60)
            samples.append(time.perf_counter() - started)
            if not result.ok:
                raise RuntimeError(f"sandbox command failed: {result}")
    finally:
        sandbox.close(remove=True)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-n", type=int, default=40, help="commands per variant")
    args = parser.parse_args()
    backends = available_backends()
    if not backends:
        raise SystemExit("no process sandbox backend works here (needs root and bwrap or unshare)")
    with tempfile.TemporaryDirectory(prefix="gyre-bench-") as tmp:
        root = Path(tmp)
        (root / "plain").mkdir()
        # Interleave the variants' warm-ups so page cache and CPU frequency treat them alike.
        time_plain(root / "plain", 3)
        plain = time_plain(root / "plain", args.n)
        per_backend = {backend: time_sandbox(root, backend, args.n) for backend in backends}
    plain_s = statistics.median(plain)
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
