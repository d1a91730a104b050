"""Where a trainer group's distributed checkpoints live: a folder every rank sees, or the NATS Object Store.

A checkpoint is one torch.distributed.checkpoint (DCP) directory per step, `step-00000012/`: each rank's shards
(`__<rank>_0.distcp`), rank 0's `.metadata`, and `trainer_state.json`, which rank 0 writes last, once every rank's
shards are durable. Its presence marks the checkpoint complete: a crash mid-save leaves a step that `latest`
ignores and the next save of that step clears.

- `FolderCheckpoints`: the directory itself, on a filesystem every rank mounts (one node, or a shared volume).
- `ObjectCheckpoints`: each rank writes its shards to a folder of its own node and uploads them to a bucket of
  the NATS Object Store (`<prefix>-checkpoints`, kept on as many servers as the streams), named
  `<run id>/step-00000012/<file>`; loading downloads a step's objects (each checked against its digest) to a
  node-local folder. Nodes then share nothing but the bus, and a re-formed group finds the checkpoint wherever
  its ranks run.

The DCP calls run on a rank's torch thread while its NATS connection lives in the event loop: `ObjectCheckpoints`
hands each transfer to that loop and waits for it.

Retention: the newest `keep` complete checkpoints (TrainerOptions.keep_checkpoints, default 2: the last one and
the one before it, in case the last is unreadable); older steps, complete or not, are removed after each save.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
from collections.abc import Coroutine, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from services.trainer.protocol import OBJECT_SCHEME
from shared.objects import ObjectStore

CHECKPOINT_PREFIX = "step-"
STATE_FILE = "trainer_state.json"
TRANSFER_TIMEOUT_S = 1800.0  # one checkpoint's upload or download, from the torch thread's side
_STEP = re.compile(rf"^{CHECKPOINT_PREFIX}(\d{{8}})$")
_NAME = re.compile(r"^[A-Za-z0-9._-]+$")  # object names are read back as given (no ':' the store rewrites)
T = TypeVar("T")


class CheckpointError(Exception):
    pass


@contextmanager
def _checkpoint_failures(what: str, where: object) -> Iterator[None]:
    """DCP's failures as a `CheckpointError`: its own `CheckpointException` is a BaseException, which handlers that
    catch `Exception` (a rank's verb, the runtime's) would let through, ending the task that ran it unanswered."""
    try:
        yield
    except dcp.CheckpointException as exc:
        raise CheckpointError(f"{what} {where} failed: {exc}") from exc


def step_name(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}{step:08d}"


def checkpoint_dir(root: Path, step: int) -> Path:
    return Path(root) / step_name(step)


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint (one whose trainer_state.json was written last) under a folder."""
    steps = FolderCheckpoints(root).complete()
    return checkpoint_dir(root, steps[-1]) if steps else None


def read_trainer_state(path: Path) -> dict[str, Any]:
    try:
        return json.loads((Path(path) / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} has no readable {STATE_FILE}: {exc}") from exc


class CheckpointStore(Protocol):
    """One run's checkpoints. Every rank calls `staging`, `stage_done` and `fetch`; rank 0 alone `begin`s a save,
    `commit`s it and `prune`s, between the barriers of `save_checkpoint`."""

    def begin(self, step: int) -> None:
        """Remove whatever an earlier, interrupted save of this step left."""

    def staging(self, step: int) -> Path:
        """The folder this rank's DCP save writes into (made if need be; no earlier save's files in it)."""

    def stage_done(self, step: int, folder: Path) -> None:
        """This rank's files of the step are written in `folder`: make them durable in the store."""

    def commit(self, step: int, state: dict[str, Any]) -> None:
        """Every rank's files are durable: write the state file, which marks the step complete."""

    def prune(self, keep: int) -> None:
        """Remove all but the newest `keep` complete checkpoints (and any incomplete step older than them)."""

    def complete(self) -> list[int]:
        """The steps with a complete checkpoint, oldest first."""

    def fetch(self, step: int) -> Path:
        """A folder on this node holding the whole checkpoint of a step, its state file included."""

    def release(self) -> None:
        """The fetched checkpoint is loaded: a copy `fetch` made may go."""


def open_checkpoints(root: str | Path, objects: ObjectStore | None = None, *, local: Path | None = None,
                     loop: asyncio.AbstractEventLoop | None = None) -> CheckpointStore:
    """The store a checkpoint root names: `object:<run id>` (needs the bucket, a node-local folder and the loop
    the bucket's connection runs in) or a folder path."""
    text = str(root)
    if not text.startswith(OBJECT_SCHEME):
        return FolderCheckpoints(Path(text))
    if objects is None or local is None or loop is None:
        raise CheckpointError(f"checkpoint root {text!r} is in the Object Store, and this process has no bus")
    return ObjectCheckpoints(objects, text.removeprefix(OBJECT_SCHEME), local=local, loop=loop)


def _pruned(steps: Iterable[int], complete: list[int], keep: int) -> list[int]:
    """The steps older than the newest `keep` complete checkpoints, complete or not (none with `keep` 0: every
    checkpoint is kept)."""
    if keep <= 0 or not complete:
        return []
    oldest_kept = sorted(complete)[-keep:][0]
    return sorted(step for step in steps if step < oldest_kept)


def as_store(checkpoints: CheckpointStore | Path) -> CheckpointStore:
    """A store as given, or a folder's."""
    return FolderCheckpoints(checkpoints) if isinstance(checkpoints, Path) else checkpoints


class FolderCheckpoints:
    """Checkpoints in a folder every rank sees."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def begin(self, step: int) -> None:
        shutil.rmtree(checkpoint_dir(self.root, step), ignore_errors=True)

    def staging(self, step: int) -> Path:
        path = checkpoint_dir(self.root, step)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def stage_done(self, step: int, folder: Path) -> None:
        pass  # written where every rank reads

    def commit(self, step: int, state: dict[str, Any]) -> None:
        path = checkpoint_dir(self.root, step)
        tmp = path / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state, sort_keys=True))
        os.replace(tmp, path / STATE_FILE)

    def _steps(self) -> list[Path]:
        return sorted(p for p in self.root.iterdir() if _STEP.match(p.name)) if self.root.is_dir() else []

    def complete(self) -> list[int]:
        return [int(p.name.removeprefix(CHECKPOINT_PREFIX)) for p in self._steps() if (p / STATE_FILE).is_file()]

    def prune(self, keep: int) -> None:
        steps = [int(p.name.removeprefix(CHECKPOINT_PREFIX)) for p in self._steps()]
        for step in _pruned(steps, self.complete(), keep):
            shutil.rmtree(checkpoint_dir(self.root, step), ignore_errors=True)

    def fetch(self, step: int) -> Path:
        return checkpoint_dir(self.root, step)

    def release(self) -> None:
        pass  # read in place


class ObjectCheckpoints:
    """Checkpoints in the Object Store under `<name>/step-N/<file>`, staged and fetched through `local` (a folder
    of this process's own: ranks on one node must not share it, or one would upload the other's files)."""

    def __init__(self, objects: ObjectStore, name: str, *, local: Path, loop: asyncio.AbstractEventLoop) -> None:
        if not _NAME.match(name):
            raise CheckpointError(f"checkpoint name {name!r}: expected a run id of letters, digits, '.', '_', '-'")
        self.objects, self.name, self.local, self.loop = objects, name, Path(local), loop

    def _key(self, step: int, file: str) -> str:
        return f"{self.name}/{step_name(step)}/{file}"

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run one transfer in the bus's loop from the torch thread and wait for it. A transfer that fails or
        times out is cancelled there, so a late one cannot overwrite or delete what a later save stored."""
        try:
            if asyncio.get_running_loop() is self.loop:
                coro.close()
                raise CheckpointError("a checkpoint transfer was started from the bus's own loop: it would wait "
                                      "on itself")
        except RuntimeError:  # no loop in this thread: the torch thread, as it should be
            pass
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(TRANSFER_TIMEOUT_S)
        except BaseException:
            future.cancel()
            raise

    def _objects_of(self, names: list[str]) -> dict[int, list[str]]:
        steps: dict[int, list[str]] = {}
        for name in names:
            parts = name.split("/")
            if len(parts) == 3 and parts[0] == self.name and (m := _STEP.match(parts[1])):
                steps.setdefault(int(m.group(1)), []).append(parts[2])
        return steps

    def _listing(self) -> dict[int, list[str]]:
        return self._objects_of(self._run(self.objects.list_names(f"{self.name}/")))

    def _delete(self, step: int, files: list[str]) -> None:
        # The state file first: a step whose removal is cut short is an incomplete one, never a broken complete one.
        for file in sorted(files, key=lambda f: f != STATE_FILE):
            self._run(self.objects.delete_object(self._key(step, file)))

    def begin(self, step: int) -> None:
        self._delete(step, self._listing().get(step, []))

    def staging(self, step: int) -> Path:
        folder = self.local / "staging" / step_name(step)
        shutil.rmtree(self.local / "staging", ignore_errors=True)  # this process's earlier steps are stored
        folder.mkdir(parents=True)
        return folder

    def stage_done(self, step: int, folder: Path) -> None:
        # A file at a time, read here (the torch thread), so the bus's loop only moves bytes and holds one file.
        for path in sorted(folder.iterdir()):
            self._run(self.objects.put_object(path.read_bytes(), name=self._key(step, path.name)))
        shutil.rmtree(folder, ignore_errors=True)  # stored: the node keeps no copy

    def commit(self, step: int, state: dict[str, Any]) -> None:
        data = json.dumps(state, sort_keys=True).encode()
        self._run(self.objects.put_object(data, name=self._key(step, STATE_FILE)))

    def complete(self) -> list[int]:
        return sorted(step for step, files in self._listing().items() if STATE_FILE in files)

    def prune(self, keep: int) -> None:
        listing = self._listing()
        for step in _pruned(listing, [s for s, files in listing.items() if STATE_FILE in files], keep):
            self._delete(step, listing[step])

    def fetch(self, step: int) -> Path:
        files = self._listing().get(step, [])
        if STATE_FILE not in files:
            raise CheckpointError(f"{self.name}/{step_name(step)} is not a complete checkpoint in the Object Store")
        folder = self.local / "fetched" / step_name(step)
        self.release()  # the one fetched before: loaded already
        folder.mkdir(parents=True)
        for file in files:  # written here (the torch thread), as `stage_done` reads
            (folder / file).write_bytes(self._run(self.objects.get_object(self._key(step, file))))
        return folder

    def release(self) -> None:
        """Remove the copy `fetch` made, once it is loaded."""
        shutil.rmtree(self.local / "fetched", ignore_errors=True)


# ------------------------------------------------------------------------------------------------
# Saving and loading a sharded model (collectives: every rank of the group calls them)


def save_checkpoint(
    store: CheckpointStore,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    keep: int = 2,
) -> dict[str, Any]:
    """Save sharded model + optimizer state with DCP (every rank writes its shards) as `step`'s checkpoint, then
    the state file (rank 0, after every rank's shards are durable), then prune to `keep`. Returns the state."""
    if dist.get_rank() == 0:
        store.begin(step)
    dist.barrier()
    folder = store.staging(step)
    # An optimiser that has not stepped has no state, and get_state_dict would create it by running a
    # zero-lr step (Adam's step count then starts at 1): save the model alone and say so.
    with_optimizer = bool(optimizer.state)
    if with_optimizer:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        with _checkpoint_failures("saving", folder):
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder))
    else:
        with _checkpoint_failures("saving", folder):
            dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(folder))
    store.stage_done(step, folder)
    dist.barrier()
    state = {**trainer_state, "step": step, "world_size": dist.get_world_size(), "optimizer": with_optimizer}
    if dist.get_rank() == 0:
        store.commit(step, state)
        store.prune(keep)
    dist.barrier()
    return state


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Load a DCP checkpoint folder into an already sharded model and its optimizer (any world size)."""
    state = read_trainer_state(path)
    if not state.get("optimizer", True):  # saved before the first step: a fresh optimiser, as then
        model_sd = get_model_state_dict(model)
        with _checkpoint_failures("loading", path):
            dcp.load({"model": model_sd}, checkpoint_id=str(path))
        set_model_state_dict(model, model_sd)
        optimizer.state.clear()
        return state
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with _checkpoint_failures("loading", path):
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    return state


__all__ = [
    "CHECKPOINT_PREFIX", "OBJECT_SCHEME", "STATE_FILE", "CheckpointError", "CheckpointStore", "FolderCheckpoints",
    "as_store",
    "ObjectCheckpoints", "checkpoint_dir", "latest_checkpoint", "load_checkpoint", "open_checkpoints",
    "read_trainer_state", "save_checkpoint", "step_name",
]
