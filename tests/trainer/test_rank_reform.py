"""A rank process re-formed into a later group at another rank: its shards are that rank's (two real processes,
gloo, the rank's own torch side as rank.py drives it).

DTensor caches sharding decisions by mesh equality, which ignores the rank a process is: a process that was rank 0
of a two-rank group and rank 1 of a later two-rank group got the first group's mesh back, computed its shards'
offsets as rank 0's and saved (or loaded) a checkpoint that covered half of each tensor twice. In a live elastic run
the step's save then failed inside DCP and the step was never answered.
"""

from __future__ import annotations

import multiprocessing as mp
import tempfile
from pathlib import Path
from queue import Queue
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load as load_safetensors

from services.trainer.protocol import FormRequest, StepRequest, TrainerSpec
from shared.events import BlobRef
from tests.trainer.cluster import batch_of
from tests.trainer.trainer_trees import tiny_model

pytestmark = pytest.mark.timeout(600)

NO_BLOB = BlobRef(digest="sha256:" + "0" * 64, size=0)  # the worker below hands the batch over itself


def _rank_process(model_dir: str, orders: Queue[Any], answers: Queue[Any]) -> None:
    """One rank's torch side, taking orders from the test as the rank service takes them from the coordinator."""
    from services.trainer.rank_work import RankWork

    work = RankWork(Path(model_dir))
    work.warm()
    while (order := orders.get())[0] != "quit":
        try:
            match order:
                case ("form", request):
                    answers.put(("formed", work.form(request).state.last_step))
                case ("step", request):
                    reply, _ = work.step(request, batch_of(request.step).encode(), "rank")
                    answers.put(("stepped", reply.policy_version))
                case ("publish", generation):
                    answers.put(("published", work.publish(generation)))
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is one: the test reports it
            answers.put(("failed", f"{type(exc).__name__}: {exc}"[:2000]))


class Ranks:
    def __init__(self, n: int, model_dir: Path, checkpoints: Path) -> None:
        ctx = mp.get_context("spawn")
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
        self.checkpoints = checkpoints
        self.orders: list[Queue[Any]] = [ctx.Queue() for _ in range(n)]
        self.answers: list[Queue[Any]] = [ctx.Queue() for _ in range(n)]
        self.procs = [ctx.Process(target=_rank_process, args=(str(model_dir), o, a), daemon=True)
                      for o, a in zip(self.orders, self.answers, strict=True)]
        for p in self.procs:
            p.start()
        self.generation = 0

    def _all(self, members: list[int], orders: list[Any], expect: str) -> list[Any]:
        for m, order in zip(members, orders, strict=True):
            self.orders[m].put(order)
        answers = [self.answers[m].get(timeout=300) for m in members]
        failed = [a for a in answers if a[0] != expect]
        assert not failed, failed
        return [a[1] for a in answers]

    def form(self, members: list[int]) -> None:
        """A group of `members` in that rank order."""
        self.generation += 1
        self._all(members, [("form", FormRequest(
            generation=self.generation, rank_id="rank", rank=rank, world_size=len(members), store_host="127.0.0.1",
            store_port=self.store.port, checkpoint_root=str(self.checkpoints), keep_checkpoints=2, first_step=0,
            timeout_s=60.0, trainer=TrainerSpec(lr=1e-3, precision="fp32", eps_low=0.2, eps_high=0.28,
                                recompute_old_logprobs=True),
        )) for rank in range(len(members))], "formed")

    def step(self, members: list[int], step: int) -> None:
        request = StepRequest(step=step, generation=self.generation, batch=NO_BLOB, publish=False, max_staleness=4)
        self._all(members, [("step", request)] * len(members), "stepped")

    def weights(self, members: list[int]) -> dict[str, torch.Tensor]:
        published = self._all(members, [("publish", self.generation)] * len(members), "published")
        out: dict[str, torch.Tensor] = {}
        for data, _ in published[0].shards():  # rank 0's PublishedShards
            out.update(load_safetensors(data))
        return out

    def stop(self) -> None:
        for q in self.orders:
            q.put(("quit",))
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def test_a_process_that_was_rank_0_trains_and_checkpoints_as_rank_1_of_a_later_group() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tiny_model("qwen3", seed=11).save_pretrained(root / "model")
        swapped = Ranks(2, root / "model", root / "swapped")
        try:
            swapped.form([0, 1])
            swapped.step([0, 1], 0)
            swapped.form([1, 0])  # process 0 is rank 1 now, in a group of the same size
            swapped.step([1, 0], 1)  # trains, checkpoints (every rank's shards) and is resumable
            swapped.form([0])
            elastic = swapped.weights([0])
        finally:
            swapped.stop()
        fixed = Ranks(1, root / "model", root / "fixed")
        try:
            fixed.form([0])
            fixed.step([0], 0)
            fixed.step([0], 1)
            alone = fixed.weights([0])
        finally:
            fixed.stop()
    # Resharding changes nothing but the layout: the parameters of a fixed one-rank run on the same batches.
    assert elastic.keys() == alone.keys()
    for name, tensor in alone.items():
        diff = (elastic[name] - tensor).abs().max().item()
        assert diff <= 2e-5, f"{name} differs by {diff}"
