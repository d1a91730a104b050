"""The checkpoint stores (services/trainer/checkpoints.py): one contract for a folder every rank sees and for the
NATS Object Store, then a trainer that saves through the Object Store and one that resumes from it.

The store's methods run on a rank's torch thread while its bus lives in the event loop, so each call here goes
through `asyncio.to_thread`, as a rank's do."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from services.trainer.checkpoints import (
    STATE_FILE,
    CheckpointError,
    CheckpointStore,
    FolderCheckpoints,
    ObjectCheckpoints,
    open_checkpoints,
)
from services.trainer.distributed import GroupSpec, free_port
from services.trainer.engine import Trainer, TrainerConfig
from shared.bus import Bus
from tests.trainer.test_engine import local_weights
from tests.trainer.trainer_trees import make_batch, tiny_model

StoreFactory = Callable[[Path], CheckpointStore]


@pytest.fixture(params=["folder", "object"])
async def stores(request: pytest.FixtureRequest, tmp_path: Path, bus: Bus) -> StoreFactory:
    """A factory of one run's store, as seen from one rank (its own local folder): every rank of the run sees
    the same checkpoints."""
    if request.param == "folder":
        return lambda local: FolderCheckpoints(tmp_path / "shared")
    loop = asyncio.get_running_loop()
    return lambda local: open_checkpoints("object:run-1", bus.checkpoints, local=local, loop=loop)


def save(store: CheckpointStore, step: int, files: dict[str, bytes], state: dict[str, Any]) -> None:
    """One rank's save of a step as `save_checkpoint` makes it, without DCP: stage, write, make durable, commit."""
    store.begin(step)
    folder = store.staging(step)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    store.stage_done(step, folder)
    store.commit(step, state)


async def test_a_saved_step_is_complete_and_fetches_whole_on_another_rank(stores: StoreFactory, tmp_path: Path
                                                                         ) -> None:
    rank0, rank1 = stores(tmp_path / "rank0"), stores(tmp_path / "rank1")
    assert await asyncio.to_thread(rank0.complete) == []

    def two_ranks_save() -> None:
        rank0.begin(3)
        mine, theirs = rank0.staging(3), rank1.staging(3)
        (mine / "__0_0.distcp").write_bytes(b"zero" * 1000)
        (mine / ".metadata").write_bytes(b"meta")
        (theirs / "__1_0.distcp").write_bytes(b"one" * 1000)
        rank0.stage_done(3, mine)
        rank1.stage_done(3, theirs)
        rank0.commit(3, {"step": 3, "last_step": 2})

    await asyncio.to_thread(two_ranks_save)
    assert await asyncio.to_thread(rank1.complete) == [3]
    fetched = await asyncio.to_thread(rank1.fetch, 3)
    assert sorted(p.name for p in fetched.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", STATE_FILE]
    assert (fetched / "__0_0.distcp").read_bytes() == b"zero" * 1000
    assert json.loads((fetched / STATE_FILE).read_text()) == {"step": 3, "last_step": 2}


async def test_a_save_cut_short_is_not_a_checkpoint_and_the_next_save_of_its_step_replaces_it(
    stores: StoreFactory, tmp_path: Path
) -> None:
    store = stores(tmp_path / "rank0")

    def crash_mid_save() -> None:
        save(store, 1, {"a": b"1"}, {"step": 1})
        store.begin(2)
        folder = store.staging(2)
        (folder / "__0_0.distcp").write_bytes(b"half")
        (folder / "__1_0.distcp").write_bytes(b"a rank the next group does not have")
        store.stage_done(2, folder)  # no commit: the process died here

    await asyncio.to_thread(crash_mid_save)
    assert await asyncio.to_thread(store.complete) == [1]
    with pytest.raises(CheckpointError if isinstance(store, ObjectCheckpoints) else FileNotFoundError):
        await asyncio.to_thread(lambda: (store.fetch(2) / STATE_FILE).read_text())
    await asyncio.to_thread(save, store, 2, {"__0_0.distcp": b"whole"}, {"step": 2})
    fetched = await asyncio.to_thread(store.fetch, 2)
    assert sorted(p.name for p in fetched.iterdir()) == ["__0_0.distcp", STATE_FILE]
    assert (fetched / "__0_0.distcp").read_bytes() == b"whole"


async def test_prune_keeps_the_newest_complete_checkpoints_only(stores: StoreFactory, tmp_path: Path) -> None:
    store = stores(tmp_path / "rank0")

    def many() -> None:
        for step in range(5):
            save(store, step, {"__0_0.distcp": bytes([step]) * 100}, {"step": step})
        store.begin(5)
        store.stage_done(5, store.staging(5))  # an incomplete newer step is not counted as kept
        store.prune(2)

    await asyncio.to_thread(many)
    assert await asyncio.to_thread(store.complete) == [3, 4]
    if isinstance(store, ObjectCheckpoints):  # nothing of the pruned steps is left in the bucket
        names = await store.objects.list_names("run-1/")
        assert {n.split("/")[1] for n in names} == {"step-00000003", "step-00000004"}
    else:
        assert isinstance(store, FolderCheckpoints)
        assert sorted(p.name for p in store.root.iterdir()) == ["step-00000003", "step-00000004", "step-00000005"]


async def test_two_runs_in_one_bucket_do_not_see_each_other(bus: Bus, tmp_path: Path) -> None:
    loop = asyncio.get_running_loop()
    one = open_checkpoints("object:run-a", bus.checkpoints, local=tmp_path / "a", loop=loop)
    other = open_checkpoints("object:run-b", bus.checkpoints, local=tmp_path / "b", loop=loop)
    await asyncio.to_thread(save, one, 7, {"x": b"x"}, {"step": 7})
    assert await asyncio.to_thread(other.complete) == []
    assert await asyncio.to_thread(one.complete) == [7]


def test_an_object_root_without_a_bus_and_a_bad_run_name_are_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="has no bus"):
        open_checkpoints("object:run-1")
    assert isinstance(open_checkpoints(str(tmp_path)), FolderCheckpoints)
    with pytest.raises(CheckpointError, match="expected a run id of letters"):
        ObjectCheckpoints(None, "a/b", local=tmp_path, loop=asyncio.new_event_loop())  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match="expected a run id of letters"):
        ObjectCheckpoints(None, "run:1", local=tmp_path, loop=asyncio.new_event_loop())  # type: ignore[arg-type]


async def test_a_transfer_asked_for_on_the_buss_own_loop_is_refused_not_deadlocked(bus: Bus, tmp_path: Path) -> None:
    store = open_checkpoints("object:run-1", bus.checkpoints, local=tmp_path, loop=asyncio.get_running_loop())
    with pytest.raises(CheckpointError, match="wait on itself"):
        store.complete()  # on the loop's thread, where a rank never calls it


async def test_the_object_store_leaves_no_copy_on_the_node_once_stored_or_loaded(bus: Bus, tmp_path: Path) -> None:
    store = open_checkpoints("object:run-1", bus.checkpoints, local=tmp_path / "rank", loop=asyncio.get_running_loop())
    await asyncio.to_thread(save, store, 1, {"__0_0.distcp": b"x" * 100}, {"step": 1})
    assert not (tmp_path / "rank" / "staging" / "step-00000001").exists()
    fetched = await asyncio.to_thread(store.fetch, 1)
    assert (fetched / "__0_0.distcp").read_bytes() == b"x" * 100
    store.release()
    assert not fetched.exists()


async def test_a_trainer_checkpoints_to_the_object_store_and_another_resumes_from_it(bus: Bus, tmp_path: Path
                                                                                    ) -> None:
    """DCP through the Object Store: a trainer steps and saves, a new trainer (another process's view: its own
    local folder) resumes the model and the optimiser's moments, and both take the same next step."""
    tiny_model("qwen3", seed=1).save_pretrained(tmp_path / "model")
    loop = asyncio.get_running_loop()

    def rank(local: str) -> CheckpointStore:
        return open_checkpoints("object:run-1", bus.checkpoints, local=tmp_path / local, loop=loop)

    def first() -> dict[str, Any]:
        trainer, _ = Trainer.start(tmp_path / "model", GroupSpec(rank=0, world_size=1, master_port=free_port()),
                                   TrainerConfig(lr=1e-3), checkpoints=rank("first"))
        try:
            trainer.step(make_batch(seed=0, step=0))
            trainer.save(rank("first"), extra={"last_step": 0})
            trainer.step(make_batch(seed=1, step=1))
            return local_weights(trainer)
        finally:
            trainer.close()

    def resumed() -> tuple[dict[str, Any], int]:
        trainer, timing = Trainer.start(tmp_path / "model", GroupSpec(rank=0, world_size=1, master_port=free_port()),
                                        TrainerConfig(lr=1e-3), checkpoints=rank("second"))
        try:
            assert timing.load_s > 0
            step_count = trainer.step_count
            trainer.step(make_batch(seed=1, step=1))
            return local_weights(trainer), step_count
        finally:
            trainer.close()

    expected = await asyncio.to_thread(first)
    got, step_count = await asyncio.to_thread(resumed)
    assert step_count == 1
    assert max(float((expected[k] - got[k]).abs().max()) for k in expected) == 0.0
