"""Task images: the base-image map, FROM rewriting, what reaches a build, the compose file's side services, the
build cache, and the shipped tasks that need their image (check-all under the Docker backend)."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from services.harness.sandbox_spec import DEFAULT_BASE_IMAGE
from services.harness.task_images import (
    BaseImageMap,
    TaskImageError,
    build_image,
    environment_for,
    rewrite_from,
    side_services,
    stage_context,
    tree_digest,
)
from services.harness.tasks import load_task

from .conftest import DOCKER_TASKS, needs_docker


def test_the_map_takes_exact_references_then_repositories_then_its_default() -> None:
    images = BaseImageMap.parse("python:3.11-slim=py311, node=nodebase, registry:5000/tools:1=tools,*=fallback")
    assert images.resolve("python:3.11-slim") == "py311"
    assert images.resolve("node:20-bookworm") == "nodebase"
    assert images.resolve("node@sha256:abc") == "nodebase"
    assert images.resolve("registry:5000/tools:1") == "tools"
    assert images.resolve("ubuntu:22.04") == "fallback"
    assert BaseImageMap.parse("").resolve("anything") == DEFAULT_BASE_IMAGE


def test_a_reference_the_map_does_not_name_is_refused_without_a_default() -> None:
    strict = BaseImageMap(images={"python": "py"}, default=None)
    with pytest.raises(TaskImageError, match="FROM ubuntu:22.04: not in the base-image map"):
        strict.resolve("ubuntu:22.04")


@pytest.mark.parametrize("text", ["python", "=img", "python=", "a=b,,c"])
def test_a_malformed_map_is_named(text: str) -> None:
    with pytest.raises(ValueError, match="expected ref=image"):
        BaseImageMap.parse(text)


def test_from_lines_are_mapped_and_a_files_own_stages_are_not() -> None:
    dockerfile = textwrap.dedent("""\
        FROM --platform=linux/amd64 golang:1.22 AS build
        RUN echo build
        from build as tested
        FROM python:3.11-slim
        COPY --from=build /out /out
    """)
    rewritten, used = rewrite_from(dockerfile, BaseImageMap(images={"golang": "go-local"}, default="base"))
    assert rewritten.splitlines() == [
        "FROM --platform=linux/amd64 go-local AS build",
        "RUN echo build",
        "from build as tested",
        "FROM base",
        "COPY --from=build /out /out",
    ]
    assert used == ["go-local", "base"]


@pytest.mark.parametrize(("dockerfile", "problem"), [("ARG IMG=x\nFROM $IMG\n", "ARG values"),
                                                     ("RUN true\n", "no FROM line")])
def test_a_dockerfile_that_cannot_be_mapped_is_named(dockerfile: str, problem: str) -> None:
    with pytest.raises(TaskImageError, match=problem):
        rewrite_from(dockerfile, BaseImageMap())


def _build_context(task: Path, dockerfile: str) -> Path:
    """A task folder as a build context: its Dockerfile beside tests and a solution that must stay out."""
    (task / "tests").mkdir(parents=True)
    (task / "tests" / "test_outputs.py").write_text("def test(): pass\n")
    (task / "solution.sh").write_text("echo solved\n")
    (task / "run-tests.sh").write_text("pytest\n")
    (task / "Dockerfile").write_text(dockerfile)
    return task


def test_tests_and_the_solution_never_reach_the_build_and_do_not_change_its_digest(tmp_path: Path) -> None:
    task = _build_context(tmp_path / "task", "FROM python:3.11-slim\n")
    (task / "data").mkdir()
    (task / "data" / "input.csv").write_text("a,b\n")

    def staged_digest(name: str) -> tuple[str, set[str]]:
        target = tmp_path / name
        stage_context(task, target)
        return tree_digest(target), {str(p.relative_to(target)) for p in target.rglob("*")}

    first, names = staged_digest("one")
    assert names == {"Dockerfile", "data", "data/input.csv"}
    (task / "tests" / "test_outputs.py").write_text("def test(): assert False\n")
    (task / "solution.sh").write_text("echo other\n")
    assert staged_digest("two")[0] == first
    (task / "data" / "input.csv").write_text("a,b,c\n")
    assert staged_digest("three")[0] != first


def _task(root: Path, compose: str) -> Path:
    (root / "tests").mkdir(parents=True)
    (root / "tests" / "test_outputs.py").write_text("def test(): pass\n")
    (root / "task.yaml").write_text("instruction: do it\n")
    (root / "docker-compose.yaml").write_text(compose)
    return root


def test_compose_side_services_come_with_their_settings_and_the_agents_own_is_left_out(tmp_path: Path) -> None:
    task = load_task(_task(tmp_path / "t", textwrap.dedent("""\
        services:
          client:
            build: {dockerfile: Dockerfile}
            image: ${T_BENCH_TASK_DOCKER_CLIENT_IMAGE_NAME}
            environment:
              - TEST_DIR=${T_BENCH_TEST_DIR}
          db:
            image: postgres:16
            command: postgres -c fsync=off
            environment:
              POSTGRES_PASSWORD: ${DB_PASSWORD:-secret}
              EMPTY:
          cache:
            image: redis:7
            environment:
              - MODE=lru
              - NAME=${NAME}
    """)))
    found = side_services(task, BaseImageMap(images={"postgres": "pg-local"}, default="base"))
    assert [(s.name, s.image) for s in found] == [("db", "pg-local"), ("cache", "base")]
    assert found[0].command == ("sh", "-c", "postgres -c fsync=off")
    assert dict(found[0].environment) == {"POSTGRES_PASSWORD": "secret", "EMPTY": ""}
    assert dict(found[1].environment) == {"MODE": "lru", "NAME": ""}


@pytest.mark.parametrize(("compose", "problem"), [
    ("services: [\n", "not valid YAML"),
    ("version: '3'\n", "expected a 'services' mapping"),
    ("services:\n  db: 3\n", "service 'db' must be a mapping"),
    ("services:\n  db: {command: x}\n", "service 'db' needs a build or an image"),
    ("services:\n  db: {build: ../../elsewhere}\n", "build context must be a folder of the task"),
    ("services:\n  db: {image: x, environment: 5}\n", "environment must be a list or a mapping"),
])
def test_a_bad_compose_file_is_named(tmp_path: Path, compose: str, problem: str) -> None:
    task = load_task(_task(tmp_path / "t", compose))
    with pytest.raises(TaskImageError, match=problem):
        side_services(task, BaseImageMap())


@needs_docker
def test_an_image_is_built_once_per_content_and_holds_no_tests(tmp_path: Path) -> None:
    context = _build_context(tmp_path / "task", "FROM python:3.11-slim\nCOPY . /ctx\n")
    tag = build_image(context, context / "Dockerfile", BaseImageMap(), label="cache-test")
    first_id = subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}}", tag], capture_output=True,
                              text=True, check=True).stdout
    assert build_image(context, context / "Dockerfile", BaseImageMap(), label="cache-test") == tag
    assert subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}}", tag], capture_output=True,
                          text=True, check=True).stdout == first_id
    listed = subprocess.run(["docker", "run", "--rm", "--network", "none", tag, "ls", "-A", "/ctx"],
                            capture_output=True, text=True, check=True).stdout.split()
    assert {"tests", "solution.sh", "run-tests.sh"}.isdisjoint(listed) and "Dockerfile" in listed
    (context / "Dockerfile").write_text("FROM python:3.11-slim\nCOPY . /ctx\nENV CHANGED=1\n")
    assert build_image(context, context / "Dockerfile", BaseImageMap(), label="cache-test") != tag


@needs_docker
def test_a_failed_build_and_a_missing_base_are_named(tmp_path: Path) -> None:
    context = tmp_path / "task"
    context.mkdir()
    (context / "Dockerfile").write_text("FROM python:3.11-slim\nRUN echo broken-step && exit 3\n")
    with pytest.raises(TaskImageError, match="docker build failed"):
        build_image(context, context / "Dockerfile", BaseImageMap(), label="broken")
    with pytest.raises(TaskImageError, match="base image gyre-missing:none is not on this machine"):
        build_image(context, context / "Dockerfile", BaseImageMap(default="gyre-missing:none"), label="broken")


@needs_docker
def test_the_shipped_image_tasks_resolve_with_their_solution_only_under_docker(tmp_path: Path) -> None:
    """`gyre harness check-all --backend docker` over docker-tasks/, and a task whose base cannot be mapped is
    reported with its reason while the rest are checked."""
    from services.harness.cli import harness_app

    runner = CliRunner()
    result = runner.invoke(harness_app, ["check-all", "--tasks-dir", str(DOCKER_TASKS), "--backend", "docker"])
    assert result.exit_code == 0, result.output
    lines = sorted(result.output.splitlines())
    assert [line.split()[:2] for line in lines] == [["ok", "kv-service-handshake"], ["ok", "lua-word-count"],
                                                   ["ok", "repo-regression"]]
    strict = runner.invoke(harness_app, ["check-all", "--tasks-dir", str(DOCKER_TASKS), "--backend", "docker",
                                         "--base-images", "python=gyre-missing:none,*=gyre-missing:none"])
    assert strict.exit_code == 1
    assert [line.split()[0] for line in strict.output.splitlines()] == ["BAD", "BAD", "BAD"]
    assert "base image gyre-missing:none is not on this machine" in strict.output


@needs_docker
def test_an_image_task_keeps_its_side_services_through_the_tests(tmp_path: Path) -> None:
    task = load_task(DOCKER_TASKS / "kv-service-handshake")
    environment = environment_for(task)
    assert [service.name for service in environment.services] == ["kv"]
    assert environment.image.startswith("gyre-task:kv-service-handshake-") and not environment.network


@needs_docker
def test_a_run_plan_leaves_out_a_task_whose_image_cannot_be_made_here(tmp_path: Path) -> None:
    from gyre.config import RunConfig
    from gyre.run_plan import plan_run

    def plan(base_images: str):  # type: ignore[no-untyped-def]
        return plan_run(RunConfig.model_validate({
            "tasks": {"dir": str(DOCKER_TASKS), "train": ["lua-word-count", "repo-regression"]},
            "harness": {"sandbox": "docker", "base_images": base_images}}))

    ready = plan("")
    assert ready.errors == [] and ready.task_ids == ["lua-word-count", "repo-regression"] and not ready.left_out
    missing = plan("*=gyre-missing:none")
    assert set(missing.left_out) == {"lua-word-count", "repo-regression"}
    assert "base image gyre-missing:none is not on this machine" in missing.left_out["lua-word-count"]
    assert missing.errors == ["tasks: no task's image can be made here: nothing to train on"]


@needs_docker
def test_every_shipped_task_without_an_image_of_its_own_passes_in_the_base_image() -> None:
    """The tasks of tasks/ bring no Dockerfile: under Docker they run in the base image, and check-all passes."""
    from services.harness.cli import harness_app

    from .conftest import TASKS

    result = CliRunner().invoke(harness_app, ["check-all", "--tasks-dir", str(TASKS), "--backend", "docker"])
    assert result.exit_code == 0, result.output
    assert len(result.output.splitlines()) == len(list(TASKS.glob("*/task.yaml")))


def test_a_task_whose_setup_fails_is_reported_and_the_rest_are_checked(tmp_path: Path, best_backend: str) -> None:
    import shutil

    from services.harness.cli import harness_app

    from .conftest import TASKS

    shutil.copytree(TASKS / "create-file-1", tmp_path / "create-file-1")
    broken = tmp_path / "broken-setup"
    shutil.copytree(TASKS / "create-file-1", broken)
    (broken / "setup.sh").write_text("echo 'no such tool' >&2\nexit 3\n")
    result = CliRunner().invoke(harness_app, ["check-all", "--tasks-dir", str(tmp_path), "--backend", best_backend])
    assert result.exit_code == 1 and result.exception is None or isinstance(result.exception, SystemExit)
    lines = result.output.splitlines()
    assert [line.split()[:2] for line in lines] == [["BAD", "broken-setup"], ["ok", "create-file-1"]], lines
    assert "expected exit 0, got 3" in lines[0] and "no such tool" in lines[0]
