"""The layout's rules hold, and breaking one fails the build: the import contracts (composition root → services →
shared, no service importing another, no import circles), checked by import-linter as `make check` runs it, and
the size rule for source files."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("gyre", "shared", "services")
MAX_LINES = 450  # above it a module must say in its opening docstring why it is one cohesive thing


def lint_imports(tree: Path) -> subprocess.CompletedProcess[str]:
    """Run import-linter on `tree` (a copy of the packages and pyproject.toml), as `make check` does."""
    linter = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert linter is not None, "import-linter is a dev dependency (pip install -e '.[dev]')"
    return subprocess.run([linter, "--no-cache"], cwd=tree, env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_the_tree_keeps_every_import_contract(tree: Path) -> None:
    result = lint_imports(tree)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "BROKEN" not in result.stdout


@pytest.mark.parametrize(
    ("module", "import_line", "contract"),
    [
        ("shared/events.py", "import services.trainer.loss", "composition root -> services -> shared"),
        ("shared/bus.py", "import gyre.report", "composition root -> services -> shared"),
        ("services/harness/grading.py", "import gyre.local", "composition root -> services -> shared"),
        ("services/harness/grading.py", "import services.rollout.errors", "no service imports another"),
        ("shared/cells.py", "import shared.events", "no import circles"),
    ],
)
def test_breaking_a_boundary_fails_the_check(tree: Path, module: str, import_line: str, contract: str) -> None:
    path = tree / module
    path.write_text(path.read_text() + f"\n{import_line}  # a boundary broken on purpose\n")
    result = lint_imports(tree)
    assert result.returncode != 0
    assert f"{contract} BROKEN" in result.stdout


def test_a_long_module_says_why_it_is_one_cohesive_thing() -> None:
    too_long = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            source = path.read_text()
            if source.count("\n") <= MAX_LINES:
                continue
            docstring = ast.get_docstring(ast.parse(source)) or ""
            if "cohesive" not in docstring.lower():
                too_long.append(f"{path.relative_to(ROOT)} ({source.count(chr(10))} lines)")
    assert not too_long, "split these along their concerns, or say in the opening docstring why each is one " \
                         "cohesive thing: " + ", ".join(too_long)
