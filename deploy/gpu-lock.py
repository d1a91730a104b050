"""Compile deploy/gpu-requirements.txt: every package `pip install '.[gpu]'` installs, pinned, as pip's resolver
chose them (a dry run: nothing is installed; only the packages' metadata is fetched).

    python deploy/gpu-lock.py                  resolve now (Python 3.11, this platform) and write the lock
    python deploy/gpu-lock.py --report F.json  write the lock from a report `pip install --dry-run --report` made

The GPU image installs exactly these pins (deploy/Dockerfile, ENGINE=gpu), and tests/deploy/test_gpu_lock.py
checks, without any download, that they still satisfy pyproject.toml: so a change of a dependency that the GPU
build can no longer resolve shows in CI, where no GPU wheel is ever fetched. Local version labels (a `+cpu`
build of torch taken from a local wheel during the resolution) are dropped: the GPU build takes the same release
from its own index.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "deploy" / "gpu-requirements.txt"
HEADER = """\
# Every package `pip install '.[gpu]'` installs, pinned as pip's resolver chose them for Python {python} on
# {machine} Linux. Compiled by `make gpu-lock` (deploy/gpu-lock.py); the GPU image installs these pins and
# tests/deploy/test_gpu_lock.py checks them against pyproject.toml. Do not edit by hand. Where torch resolved to
# a CPU build (a local wheel), its own CUDA runtime packages are not listed: pip adds them at the install.
"""


def pins(report: dict) -> list[str]:
    """`name==version` of every package the report installs but the project itself, sorted by name."""
    from packaging.utils import canonicalize_name

    project = canonicalize_name(_project_name())
    out = {}
    for item in report["install"]:
        name, version = canonicalize_name(item["metadata"]["name"]), item["metadata"]["version"]
        if name != project:
            out[name] = f"{name}=={version.split('+', 1)[0]}"
    return [out[k] for k in sorted(out)]


def render(report: dict) -> str:
    env = report.get("environment", {})
    header = HEADER.format(python=env.get("python_version", "?"), machine=env.get("platform_machine", "?"))
    return header + "\n".join(pins(report)) + "\n"


def resolve() -> dict:
    with tempfile.TemporaryDirectory() as work:
        report = Path(work) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                        "--report", str(report), f"{REPO}[gpu]"], check=True)
        return json.loads(report.read_text())


def _project_name() -> str:
    import tomllib

    return str(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["name"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", type=Path, help="a pip --dry-run --report file instead of resolving now")
    args = parser.parse_args()
    report = json.loads(args.report.read_text()) if args.report else resolve()
    LOCK.write_text(render(report))
    print(f"{LOCK.relative_to(REPO)}: {len(pins(report))} packages")


if __name__ == "__main__":
    main()
