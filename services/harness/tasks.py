"""Terminal-Bench task folders: the `task.yaml` model and the loader that validates a folder.

A task folder holds task.yaml, tests (run-tests.sh and/or tests/test_outputs.py), optional
solution.sh / setup.sh, and a workspace/ that becomes the agent's working directory.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

DEFAULT_WORKDIR = "/app"
# The test parsers the harness reads (grading.grade): Terminal-Bench's `pytest` and `swebench`, and `reward`.
# Terminal-Bench's others (swelancer, mlebench, sweperf) score by dataset-specific files and are refused.
PARSERS = ("pytest", "reward", "swebench")
TEST_DIR = "/tests"


class TaskFormatError(ValueError):
    """A task folder does not follow the Terminal-Bench format; the message names file and field."""

    def __init__(self, path: Path, field: str | None, problem: str) -> None:
        self.path = path
        self.field = field
        self.problem = " ".join(problem.split())  # one line, whatever the parser said (YAML's errors span lines)
        problem = self.problem
        where = f"{path}: field '{field}'" if field else str(path)
        super().__init__(f"{where}: {problem}")


class TaskConfig(BaseModel):
    """The fields of task.yaml that Gyre uses; unknown Terminal-Bench fields are kept, not rejected."""

    model_config = ConfigDict(frozen=True, extra="allow")

    instruction: str = Field(min_length=1)
    max_agent_timeout_sec: float = Field(default=360.0, gt=0)
    max_test_timeout_sec: float = Field(default=60.0, gt=0)
    author_name: str | None = None
    author_email: str | None = None
    difficulty: str | None = None
    category: str | None = None
    tags: tuple[str, ...] = ()
    parser_name: str = "pytest"
    # Gyre extension: where the workspace is mapped; Terminal-Bench gets it from the Dockerfile.
    workdir: str | None = None
    # Gyre extension: the agent's and the tests' containers reach the outside (Docker backend). Without it they
    # reach nothing but the task's own compose services.
    network: bool = False
    # Gyre extension: the generator family and parameters of a generated task.
    family: str | None = None

    @field_validator("instruction")
    @classmethod
    def _instruction_not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be blank")
        return value

    @field_validator("workdir")
    @classmethod
    def _workdir_absolute(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("/"):
            raise ValueError(f"must be an absolute path, got {value!r}")
        return value

    @field_validator("parser_name")
    @classmethod
    def _known_parser(cls, value: str) -> str:
        if value not in PARSERS:
            raise ValueError(f"expected one of {', '.join(map(repr, PARSERS))}, got {value!r} (a parser the harness "
                             "does not read)")
        return value


class Task(BaseModel):
    """A validated task folder: its config plus the paths of its parts on the host."""

    model_config = ConfigDict(frozen=True)

    task_id: str
    root: Path
    config: TaskConfig
    workdir: str
    run_tests: Path | None
    tests_dir: Path | None
    solution: Path | None
    setup: Path | None
    workspace: Path | None

    @property
    def instruction(self) -> str:
        return self.config.instruction

    @property
    def workdir_path(self) -> PurePosixPath:
        return PurePosixPath(self.workdir)


_WORKDIR_LINE = re.compile(r"^\s*WORKDIR\s+(\S+)\s*$", re.MULTILINE | re.IGNORECASE)


def _dockerfile_workdir(root: Path) -> str | None:
    dockerfile = root / "Dockerfile"
    if not dockerfile.is_file():
        return None
    found = _WORKDIR_LINE.findall(dockerfile.read_text(errors="replace"))
    # The last WORKDIR wins in Docker, so it is the directory the agent starts in.
    if found and found[-1].startswith("/"):
        return str(found[-1])
    return None


def load_task(root: Path | str) -> Task:
    """Load and validate one task folder; raise TaskFormatError naming the file and field on bad input."""
    root = Path(root).resolve()
    if not root.is_dir():
        raise TaskFormatError(root, None, "expected a task folder, found no directory")
    task_yaml = root / "task.yaml"
    if not task_yaml.is_file():
        raise TaskFormatError(task_yaml, None, "missing: every task folder needs a task.yaml")
    try:
        raw = yaml.safe_load(task_yaml.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise TaskFormatError(task_yaml, None, f"not UTF-8 text: {exc}") from exc
    except yaml.YAMLError as exc:
        raise TaskFormatError(task_yaml, None, f"not valid YAML: {exc}") from exc
    except RecursionError as exc:
        raise TaskFormatError(task_yaml, None, "not valid YAML: nested too deeply") from exc
    if not isinstance(raw, dict):
        raise TaskFormatError(task_yaml, None, f"expected a mapping at the top level, got {type(raw).__name__}")
    try:
        config = TaskConfig.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or None
        raise TaskFormatError(task_yaml, field, first["msg"]) from exc

    run_tests = root / "run-tests.sh"
    tests_dir = root / "tests"
    has_run_tests = run_tests.is_file()
    has_pytest = (tests_dir / "test_outputs.py").is_file()
    if config.parser_name == "pytest" and not (has_run_tests or has_pytest):
        raise TaskFormatError(root, "tests", "expected run-tests.sh or tests/test_outputs.py, found neither")
    if config.parser_name == "reward" and not has_run_tests:
        raise TaskFormatError(task_yaml, "parser_name", "'reward' needs a run-tests.sh that writes the reward file")
    if config.parser_name == "swebench" and not has_run_tests:
        raise TaskFormatError(task_yaml, "parser_name", "'swebench' needs a run-tests.sh that prints the verdict block")

    def optional(name: str) -> Path | None:
        path = root / name
        return path if path.exists() else None

    workspace = optional("workspace")
    if workspace is not None and not workspace.is_dir():
        raise TaskFormatError(workspace, None, "expected a directory")
    return Task(
        task_id=root.name,
        root=root,
        config=config,
        workdir=config.workdir or _dockerfile_workdir(root) or DEFAULT_WORKDIR,
        run_tests=run_tests if has_run_tests else None,
        tests_dir=tests_dir if tests_dir.is_dir() else None,
        solution=optional("solution.sh"),
        setup=optional("setup.sh"),
        workspace=workspace,
    )


def discover_tasks(root: Path | str) -> list[Task]:
    """Load every task folder directly under root (folders holding a task.yaml), sorted by name; the first
    malformed one raises its TaskFormatError."""
    root = Path(root)
    return [load_task(path) for path in sorted(root.iterdir()) if (path / "task.yaml").is_file()]


def scan_tasks(root: Path | str) -> tuple[list[Task], dict[str, TaskFormatError]]:
    """Every task folder directly under root (holding a task.yaml), sorted by name: the ones that load, and
    what is wrong with each one that does not, by folder name (a checker reports those and checks the rest)."""
    tasks: list[Task] = []
    problems: dict[str, TaskFormatError] = {}
    for path in sorted(Path(root).iterdir()):
        if (path / "task.yaml").is_file():
            try:
                tasks.append(load_task(path))
            except TaskFormatError as exc:
                problems[path.name] = exc
    return tasks, problems
