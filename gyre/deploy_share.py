"""A prepared run's files through the NATS Object Store, for nodes that share nothing but the bus
(`GYRE_DEPLOY_SHARE=object`).

`gyre deploy prepare` writes the run's folder once (its settings `run.env`, the resolved config, the model it made
and the warm-started one). With a shared volume every node reads that folder. Without one, `prepare` also stores
those files in the checkpoint bucket of the Object Store, under `runs/<run id>/`, and `serve` and `report` on a
node that has no copy fetch them into the node's own run folder first.

Paths inside the run folder are written as `{run_dir}` in the stored `run.env` and become the fetching node's own
folder; paths outside it (the tasks, a mounted checkpoint, the Claude Code install) must exist on every node (the
image, or a mount). The stored `run.env` is written last: a node fetches a run only once every file is stored.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Literal

import nats.errors
from pydantic import ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.bus import Bus
from shared.objects import ObjectStoreError
from shared.settings import Settings

ShareMode = Literal["folder", "object"]
PLACEHOLDER = "{run_dir}"
SHARED_FOLDERS = ("model", "sft")  # the model `prepare` makes and the warm start's result, when there are any
SHARED_FILES = ("config.yaml",)


class ShareError(Exception):
    pass


class DeployOptions(BaseSettings):
    """`gyre deploy`'s own settings (env `GYRE_DEPLOY_…`)."""

    model_config = SettingsConfigDict(env_prefix="GYRE_DEPLOY_", extra="ignore", frozen=True)

    # How the nodes share the prepared run and the trainer's checkpoints: `folder`, a volume every node mounts;
    # `object`, the NATS Object Store.
    share: ShareMode = "folder"


def share_mode() -> ShareMode:
    try:
        return DeployOptions().share
    except ValidationError:
        raise ShareError(f"GYRE_DEPLOY_SHARE={os.environ.get('GYRE_DEPLOY_SHARE')!r}: expected folder (a volume "
                         f"every node mounts) or object (the NATS Object Store)") from None


def _prefix(run_id: str) -> str:
    return f"runs/{run_id}/"


async def _connect(settings: Settings) -> Bus:
    if not settings.nats_url:
        raise ShareError("GYRE_NATS_URL must be set to share the run through the Object Store")
    return await Bus.connect(settings.nats_url, prefix=settings.subject_prefix, replicas=settings.stream_replicas,
                             name="gyre-deploy")


def _to_placeholder(run_env: str, here: Path) -> str:
    """The settings with every path in the run folder written from the placeholder (a value that is the folder
    or lies inside it; a sibling sharing its prefix is left alone)."""
    lines = []
    for line in run_env.splitlines():
        key, sep, value = line.partition("=")
        if sep and (value == str(here) or value.startswith(f"{here}/")):
            line = f"{key}={PLACEHOLDER}{value.removeprefix(str(here))}"
        lines.append(line)
    return "".join(f"{line}\n" for line in lines)


def _from_placeholder(stored: str, here: Path) -> str:
    lines = []
    for line in stored.splitlines():
        key, sep, value = line.partition("=")
        if sep and value.startswith(PLACEHOLDER):
            line = f"{key}={here}{value.removeprefix(PLACEHOLDER)}"
        lines.append(line)
    return "".join(f"{line}\n" for line in lines)


def _write(target: Path, data: bytes, mode: int = 0o644) -> None:
    """Write a file whole under its name (a temporary name first), so that another process on the node fetching
    the same run, or a service already reading it, never sees it half written."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.part")
    partial.touch(mode=mode)
    partial.write_bytes(data)
    os.replace(partial, target)


async def stored_settings(settings: Settings) -> str | None:
    """The run's stored settings (with the placeholder), or None while the run is not stored whole."""
    bus = await _connect(settings)
    name = _prefix(settings.run_id) + "run.env"
    try:
        if name not in await bus.checkpoints.list_names(_prefix(settings.run_id)):
            return None
        return (await bus.checkpoints.get_object(name)).decode()
    finally:
        await bus.close()


def same_run(stored: str, here: Path, run_env: str) -> bool:
    """Whether the stored settings are this folder's (the same model, tasks, token secret)."""
    return stored == _to_placeholder(run_env, here)


async def publish_run(settings: Settings, here: Path, run_env: str) -> int:
    """Store the prepared run's files and then its settings (with `here` as the placeholder); returns the bytes
    stored."""
    bus = await _connect(settings)
    stored = 0
    try:
        files = [here / name for name in SHARED_FILES if (here / name).is_file()]
        for folder in SHARED_FOLDERS:
            if (here / folder).is_dir():
                files += sorted(p for p in (here / folder).rglob("*") if p.is_file())
        for path in files:
            data = path.read_bytes()
            await bus.checkpoints.put_object(data, name=_prefix(settings.run_id) + str(path.relative_to(here)))
            stored += len(data)
        env = _to_placeholder(run_env, here).encode()
        await bus.checkpoints.put_object(env, name=_prefix(settings.run_id) + "run.env")
        return stored + len(env)
    finally:
        await bus.close()


async def fetch_run(settings: Settings, here: Path, run_env_name: str, deadline: float) -> bool:
    """Fetch a run stored by `publish_run` into this node's run folder (`here`), waiting until `deadline`
    (monotonic) for it to be stored; True once `here` holds it (fetched here, or by another process of the
    node meanwhile), False when it never was stored."""
    bus = await _connect(settings)
    prefix = _prefix(settings.run_id)
    try:
        while True:
            if (here / run_env_name).is_file():
                return True
            try:
                names = await bus.checkpoints.list_names(prefix)
            except (nats.errors.Error, ObjectStoreError) as exc:  # a cluster still electing its leaders
                names = []
                if time.monotonic() > deadline:
                    raise ShareError(f"the Object Store did not answer: {type(exc).__name__}: {exc}") from exc
            if prefix + "run.env" in names:
                break
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(1.0)
        for name in names:
            relative = name.removeprefix(prefix)
            if relative != "run.env" and ".." not in Path(relative).parts:
                _write(here / relative, await bus.checkpoints.get_object(name))
        stored = (await bus.checkpoints.get_object(prefix + "run.env")).decode()
        # Last, and readable by its owner only (it holds the token secret): a fetch cut short fetches again.
        _write(here / run_env_name, _from_placeholder(stored, here).encode(), mode=0o600)
        return True
    finally:
        await bus.close()


__all__ = ["PLACEHOLDER", "DeployOptions", "ShareError", "ShareMode", "fetch_run", "publish_run", "same_run",
           "share_mode", "stored_settings"]
