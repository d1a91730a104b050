"""Spawned trainer ranks for the FSDP2 tests: run phases of training with re-forms between them."""

from __future__ import annotations

import faulthandler
import json
import multiprocessing as mp
import os
import sys
from pathlib import Path

import torch

from services.trainer.distributed import GroupSpec
from services.trainer.engine import Trainer, TrainerConfig
from services.trainer.loss import GspoConfig

CONFIG = TrainerConfig(lr=1e-3, grad_clip=1.0, loss=GspoConfig(eps_low=0.2, eps_high=0.28), recompute_old_logprobs=True)


def _worker(rank: int, phases: list[tuple[int, int, int]], model_dir: str, ckpt: str, out: str) -> None:
    from tests.trainer.trainer_trees import make_batch

    faulthandler.enable()  # an abort inside the run prints every thread's Python stack
    os.environ["LOCAL_RANK"] = str(rank)  # on CUDA, each rank its own GPU (distributed.default_device)
    torch.set_num_threads(1)
    losses: list[float] = []
    reforms: list[dict[str, float]] = []
    for p, (world, port, steps) in enumerate(phases):
        if rank >= world:
            continue
        spec = GroupSpec(rank=rank, world_size=world, master_port=port, timeout_s=300)
        trainer, timing = Trainer.start(Path(model_dir), spec, CONFIG, checkpoints=Path(ckpt))
        reforms.append({"world": world, "group_s": timing.group_s, "build_s": timing.build_s, "load_s": timing.load_s})
        for _ in range(steps):
            metrics = trainer.step(make_batch(seed=7, step=trainer.step_count))
            losses.append(metrics["loss"])
        trainer.save(Path(ckpt))
        if p == len(phases) - 1:
            weights = trainer.full_weights()
            if rank == 0:
                torch.save(weights, os.path.join(out, "weights.pt"))
        trainer.close()
    if rank == 0:
        Path(out, "result.json").write_text(json.dumps({"losses": losses, "reforms": reforms}))
    # The rank's work is done and written. Leave without the interpreter's teardown: in one full-suite
    # run a rank died with SIGABRT ("terminate called without an active exception") after the whole
    # run had completed on both ranks, most likely as native threads were torn down at exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_phases(phases: list[tuple[int, int]], model_dir: Path, workdir: Path) -> dict:
    """phases: (world_size, steps). Spawns max(world) processes; ranks outside a phase sit it out."""
    from services.trainer.distributed import free_port

    with_ports = [(w, free_port(), s) for w, s in phases]
    ckpt, out = workdir / "ckpt", workdir / "out"
    out.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_worker, args=(r, with_ports, str(model_dir), str(ckpt), str(out)))
        for r in range(max(w for w, _ in phases))
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
    codes = [p.exitcode for p in procs]
    if any(c != 0 for c in codes):
        raise RuntimeError(f"trainer ranks exited with {codes}")
    result = json.loads((out / "result.json").read_text())
    result["weights"] = torch.load(out / "weights.pt")
    return result
