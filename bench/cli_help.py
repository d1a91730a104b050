"""How long every `gyre … --help` takes, as a user waits for it: a whole process per command.

Walks the CLI's command tree (every lazy group mounted here, in the bench's process, to list its commands), then
times `gyre <command> --help` for each, `--repeat` times, against the interpreter's own start (`python -c pass`)
measured in the same run. The last stdout line is JSON:
{"bench": "cli_help", "commands": N, "max_help_s": ..., "median_help_s": ..., "slowest": "...",
 "python_start_s": ..., "max_over_python_start": ...} (medians per command, seconds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import typer

GYRE = str(Path(sys.executable).with_name("gyre"))


def command_paths() -> list[list[str]]:
    """Every command's path under `gyre`, groups included (the top level is the empty path)."""
    from gyre import cli

    for name in cli.LAZY_GROUPS:
        cli._mount(name)
    root = typer.main.get_command(cli.app)
    paths: list[list[str]] = []

    def walk(command: object, path: list[str]) -> None:
        paths.append(path)
        for name, sub in sorted(getattr(command, "commands", {}).items()):  # a group (typer vendors its click)
            walk(sub, [*path, name])

    walk(root, [])
    return paths


def timed(argv: list[str], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    python_start = timed([sys.executable, "-c", "pass"], args.repeat)
    results = {" ".join(path) or "(top level)": timed([GYRE, *path, "--help"], args.repeat)
               for path in command_paths()}
    for name, seconds in sorted(results.items(), key=lambda item: -item[1])[:10]:
        print(f"{seconds:6.3f} s  gyre {name} --help")
    slowest = max(results, key=lambda name: results[name])
    print(json.dumps({
        "bench": "cli_help",
        "commands": len(results),
        "max_help_s": round(results[slowest], 3),
        "median_help_s": round(statistics.median(results.values()), 3),
        "slowest": slowest,
        "python_start_s": round(python_start, 3),
        "max_over_python_start": round(results[slowest] / python_start, 2),
    }))


if __name__ == "__main__":
    main()
