"""deploy/gpu-check.sh: every check names tests that exist (so the script cannot rot while CI has no GPU), and on
a machine without a CUDA device it says so in one line and checks nothing."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "deploy" / "gpu-check.sh"


def _checks() -> list[tuple[str, str]]:
    listed = subprocess.run([str(SCRIPT), "--list"], capture_output=True, text=True, check=True, timeout=30)
    return [tuple(line.split("\t")) for line in listed.stdout.splitlines()]  # type: ignore[misc]


def test_every_check_names_tests_that_exist() -> None:
    """Each target is a test module, or a test function in one, that is there (read from the source: collecting
    the vLLM modules would import vLLM for nothing)."""
    checks = _checks()
    assert len(checks) >= 6 and len({name for name, _ in checks}) == len(checks)
    for _, target in checks:
        path, _, function = target.partition("::")
        module = REPO / path
        assert module.is_file(), f"{path} does not exist"
        tests = {node.name for node in ast.walk(ast.parse(module.read_text()))
                 if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test_")}
        assert (function in tests) if function else tests, f"{target} names no test"


@pytest.mark.skipif(torch.cuda.is_available(), reason=(
    "this machine has a CUDA device, so the no-device answer cannot be seen here (the script runs its checks)"))
def test_without_a_cuda_device_it_checks_nothing_and_says_why() -> None:
    done = subprocess.run([str(SCRIPT)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "gpu-check: no CUDA device here (torch.cuda.is_available() is False): nothing to check"]
