"""Task images for the Docker backend: a task's Dockerfile built once per content of its environment, its FROM
lines mapped onto local images, and the side services its docker-compose file declares.

No image registry is reachable from a run's machines, so every `FROM` goes through a base-image map
(`BaseImageMap`: exact references, then the repository without its tag, then a default) onto images built
locally (`deploy/docker-engine.sh` makes the default one). The build context is a staged copy of the task folder
without its tests and reference solution, so neither can end up in the image the agent works in; the image tag
is the digest of that context, the rewritten Dockerfile and the mapped base images' ids, so a changed task or a
rebuilt base builds again and anything else is reused. `environment_for` gives the sandbox what it runs:
the agent's image, the side services and whether the task asked for a network.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict

from services.harness.sandbox_spec import DEFAULT_BASE_IMAGE, SideService, TaskEnvironment
from services.harness.tasks import Task

IMAGE_REPOSITORY = "gyre-task"
# What never goes into an image: the tests (copied in only after the agent stops) and the reference solution.
LEFT_OUT = frozenset({"tests", "run-tests.sh", "solution.sh"})
COMPOSE_FILES = ("docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml")
BUILD_TIMEOUT_S = 1800.0
_LOCKS = Path(tempfile.gettempdir()) / "gyre-task-images"
_FROM = re.compile(r"^(\s*FROM\s+)((?:--\S+\s+)*)(\S+)(.*)$", re.IGNORECASE)
_AS = re.compile(r"^\s+AS\s+(\S+)", re.IGNORECASE)
_VARIABLE = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


class TaskImageError(RuntimeError):
    """A task's image could not be made: an unmapped base, a bad compose file, a failed build (its tail)."""


class BaseImageMap(BaseModel):
    """Where each `FROM` reference comes from here: `images` by exact reference or by repository (the reference
    without its tag), else `default`; None refuses references the map does not name."""

    model_config = ConfigDict(frozen=True)

    images: Mapping[str, str] = {}
    default: str | None = DEFAULT_BASE_IMAGE

    @classmethod
    def parse(cls, text: str) -> BaseImageMap:
        """`ref=image,ref=image,*=image` (the GYRE_HARNESS_BASE_IMAGES form); `*` sets the default."""
        images: dict[str, str] = {}
        default: str | None = DEFAULT_BASE_IMAGE
        for item in filter(None, (part.strip() for part in text.split(","))):
            ref, sep, image = item.partition("=")
            if not sep or not ref.strip() or not image.strip():
                raise ValueError(f"expected ref=image in the base-image map, got {item!r}")
            if ref.strip() == "*":
                default = image.strip()
            else:
                images[ref.strip()] = image.strip()
        return cls(images=images, default=default)

    def resolve(self, reference: str) -> str:
        if reference in self.images:
            return self.images[reference]
        head, _, last = reference.split("@", 1)[0].rpartition("/")
        repository = (f"{head}/" if head else "") + last.split(":", 1)[0]
        if repository in self.images:
            return self.images[repository]
        if self.default is None:
            raise TaskImageError(f"FROM {reference}: not in the base-image map and no default base image is set "
                                 "(no registry is reachable: map it to a local image)")
        return self.default


def rewrite_from(dockerfile: str, base: BaseImageMap) -> tuple[str, list[str]]:
    """The Dockerfile with every external FROM mapped (stages it names itself stay), and the images it now uses."""
    stages: set[str] = set()
    used: list[str] = []
    lines = []
    for line in dockerfile.splitlines():
        match = _FROM.match(line)
        if match is None:
            lines.append(line)
            continue
        head, flags, reference, rest = match.groups()
        if reference.lower() not in stages:
            if "$" in reference:
                raise TaskImageError(f"FROM {reference}: a FROM built from ARG values cannot be mapped; name the image")
            reference = base.resolve(reference)
            used.append(reference)
        alias = _AS.match(rest)
        if alias is not None:
            stages.add(alias.group(1).lower())
        lines.append(f"{head}{flags}{reference}{rest}")
    if not used and not stages:
        raise TaskImageError("the Dockerfile has no FROM line")
    return "\n".join(lines) + "\n", used


def stage_context(source: Path, target: Path) -> None:
    """Copy a build context without what must never reach an image (top level only: a task's own layout)."""
    shutil.copytree(source, target, symlinks=True,
                    ignore=lambda folder, names: [n for n in names if Path(folder) == source and n in LEFT_OUT])


def tree_digest(root: Path) -> str:
    """sha256 over every path under root with its mode and its bytes (a link's target), in a fixed order."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        info = path.lstat()
        digest.update(f"{path.relative_to(root)}\0{info.st_mode:o}\0".encode())
        if path.is_symlink():
            digest.update(os.readlink(path).encode())
        elif path.is_file():
            digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


def image_id(image: str) -> str | None:
    found = subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}}", image], capture_output=True,
                           text=True, timeout=60)
    return found.stdout.strip() if found.returncode == 0 else None


def build_image(context: Path, dockerfile: Path, base: BaseImageMap, *, label: str) -> str:
    """Build `dockerfile` in `context` (mapped, staged) unless an image of the same content exists; its tag."""
    rewritten, bases = rewrite_from(dockerfile.read_text(errors="replace"), base)
    missing = [image for image in bases if image_id(image) is None]
    if missing:
        raise TaskImageError(f"{dockerfile}: base image {missing[0]} is not on this machine "
                             "(deploy/docker-engine.sh builds the default one)")
    with tempfile.TemporaryDirectory(prefix="gyre-context-") as staging:
        staged = Path(staging) / "context"
        stage_context(context, staged)
        (staged / ".gyre.Dockerfile").write_text(rewritten)
        key = hashlib.sha256(f"{tree_digest(staged)}\0{dockerfile.relative_to(context)}".encode())
        for image in bases:
            key.update(f"\0{image_id(image)}".encode())
        tag = f"{IMAGE_REPOSITORY}:{label[:40]}-{key.hexdigest()[:16]}".lower()
        _LOCKS.mkdir(parents=True, exist_ok=True)
        with (_LOCKS / f"{tag.replace(':', '-').replace('/', '-')}.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one build per content, however many executions start at once
            if image_id(tag) is not None:
                return tag
            build = subprocess.run(
                ["docker", "build", "-q", "-t", tag, "-f", str(staged / ".gyre.Dockerfile"), str(staged)],
                capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, env={**os.environ, "DOCKER_BUILDKIT": "0"},
            )
        if build.returncode != 0:
            tail = " | ".join((build.stderr or build.stdout).strip().splitlines()[-6:])
            raise TaskImageError(f"{dockerfile}: docker build failed: {tail}")
    return tag


def compose_file(task: Task) -> Path | None:
    return next((task.root / name for name in COMPOSE_FILES if (task.root / name).is_file()), None)


def _environment(raw: object, where: Path, name: str) -> dict[str, str]:
    """A compose `environment` (list of K=V or a mapping), `${VAR:-default}` read as its default."""
    items: list[tuple[str, object]]
    if raw is None:
        items = []
    elif isinstance(raw, dict):
        items = list(raw.items())
    elif isinstance(raw, list):
        items = [tuple(str(entry).partition("=")[::2]) for entry in raw]  # type: ignore[misc]
    else:
        raise TaskImageError(f"{where}: service {name!r}: environment must be a list or a mapping")
    return {str(key): _VARIABLE.sub(lambda m: m.group(2) or "", "" if value is None else str(value))
            for key, value in items}


def side_services(task: Task, base: BaseImageMap, *, build: bool = True) -> tuple[SideService, ...]:
    """The services of the task's compose file beside the agent's own (`client`, or the one built from the
    task's Dockerfile), each with its image built or mapped; the agent's service's settings are Gyre's to set.
    build=False checks a service's Dockerfile maps and names the image it would be built from instead."""
    path = compose_file(task)
    if path is None:
        return ()
    try:
        raw = yaml.safe_load(path.read_text(errors="replace"))
    except yaml.YAMLError as exc:
        raise TaskImageError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from exc
    services = raw.get("services") if isinstance(raw, dict) else None
    if not isinstance(services, dict) or not services:
        raise TaskImageError(f"{path}: expected a 'services' mapping")
    found: list[SideService] = []
    for name, service in services.items():
        if not isinstance(service, dict):
            raise TaskImageError(f"{path}: service {name!r} must be a mapping")
        recipe = service.get("build")
        if isinstance(recipe, str):
            recipe = {"context": recipe}
        if name == "client" or (isinstance(recipe, dict) and Path(str(recipe.get("context", "."))) == Path(".")
                                and recipe.get("dockerfile", "Dockerfile") == "Dockerfile"):
            continue  # the agent's own container
        if isinstance(recipe, dict):
            context = (task.root / str(recipe.get("context", "."))).resolve()
            if not context.is_relative_to(task.root) or not context.is_dir():
                raise TaskImageError(f"{path}: service {name!r}: build context must be a folder of the task")
            dockerfile = context / str(recipe.get("dockerfile", "Dockerfile"))
            if not dockerfile.is_file():
                raise TaskImageError(f"{path}: service {name!r}: no Dockerfile at {dockerfile}")
            if build:
                image = build_image(context, dockerfile, base, label=f"{task.task_id}-{name}")
            else:
                rewrite_from(dockerfile.read_text(errors="replace"), base)
                image = f"(built from {dockerfile})"
        elif isinstance(service.get("image"), str):
            image = base.resolve(service["image"])
        else:
            raise TaskImageError(f"{path}: service {name!r} needs a build or an image")
        command = service.get("command")
        if isinstance(command, str):
            command = ["sh", "-c", command]
        found.append(SideService(name=str(name), image=image,
                                 environment=_environment(service.get("environment"), path, str(name)),
                                 command=tuple(str(part) for part in command) if command else ()))
    return tuple(found)


def environment_for(task: Task, base: BaseImageMap | None = None) -> TaskEnvironment:
    """The task's image (built from its Dockerfile, or the default base without one), its side services and
    whether it asked for a network."""
    base = base or BaseImageMap()
    dockerfile = task.root / "Dockerfile"
    if dockerfile.is_file():
        image = build_image(task.root, dockerfile, base, label=task.task_id)
    elif base.default is not None:
        image = base.default
    else:
        raise TaskImageError(f"{task.root}: no Dockerfile and no default base image")
    return TaskEnvironment(image=image, services=side_services(task, base), network=task.config.network)


def check_environment(task: Task, base: BaseImageMap) -> list[str]:
    """What stops the task's image from being made here, without building it: an unmapped or missing base, a
    Dockerfile or compose file that cannot be read. Empty when nothing does."""
    problems: list[str] = []
    try:
        dockerfile = task.root / "Dockerfile"
        bases = rewrite_from(dockerfile.read_text(errors="replace"), base)[1] if dockerfile.is_file() else (
            [base.default] if base.default else [])
        problems += [f"base image {image} is not on this machine" for image in bases if image_id(image) is None]
        side_services(task, base, build=False)
    except TaskImageError as exc:
        problems.append(str(exc))
    return problems
