"""Per-rank entry points behind `gyre train`: supervised warm-start and one RL step from a batch file.

Run one process per train cell (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); one process
alone is a world of one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.trainer.checkpoints import latest_checkpoint, read_trainer_state
from services.trainer.distributed import GroupSpec
from services.trainer.engine import StepAlreadyTrained, Trainer, TrainerConfig
from services.trainer.sft import load_records, pack_sequences, render_conversation
from services.trainer.weights import write_model_dir
from shared.batch import TrainingBatch


@dataclass(frozen=True)
class SftOptions:
    epochs: int = 1
    conversations_per_step: int = 8
    micro_batch_tokens: int = 4096


def run_sft(
    model_dir: Path,
    data: Path,
    out_dir: Path,
    spec: GroupSpec,
    config: TrainerConfig,
    options: SftOptions = SftOptions(),
    on_step: Callable[[int, int, dict[str, float]], None] | None = None,
) -> list[dict[str, float]]:
    """Cross-entropy on the assistant turns of a JSONL of conversations; writes a model directory to out_dir.
    `on_step(step, steps, metrics)` is told of each step as it ends (the CLI prints it for a progress bar)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    rendered = [render_conversation(tokenizer, messages, tools) for messages, tools in load_records(data)]
    trainer, _ = Trainer.start(model_dir, spec, config)
    history: list[dict[str, float]] = []
    steps = options.epochs * -(-len(rendered) // options.conversations_per_step)
    try:
        for epoch in range(options.epochs):
            for start in range(0, len(rendered), options.conversations_per_step):
                chunk = rendered[start : start + options.conversations_per_step]
                metrics = trainer.sft_step(pack_sequences(chunk, options.micro_batch_tokens))
                history.append({"epoch": float(epoch), "step": float(trainer.step_count), **metrics})
                if on_step is not None:
                    on_step(len(history), steps, metrics)
        weights = trainer.weights_bytes()
        if weights is not None:
            write_model_dir(weights, model_dir, out_dir)
            (Path(out_dir) / "sft_metrics.json").write_text(json.dumps(history))
    finally:
        trainer.close()
    return history


def run_step(
    model_dir: Path,
    batch_file: Path,
    checkpoint_root: Path,
    spec: GroupSpec,
    config: TrainerConfig,
    weights_out: Path | None = None,
) -> dict[str, Any]:
    """Resume from the latest checkpoint, train one GSPO step on an encoded TrainingBatch, checkpoint again."""
    batch = TrainingBatch.decode(Path(batch_file).read_bytes())
    latest = latest_checkpoint(checkpoint_root)
    done = read_trainer_state(latest).get("last_step") if latest is not None else None
    if done is not None and batch.step <= int(done):
        raise StepAlreadyTrained(f"{batch_file} is the batch of step {batch.step}; the checkpoint {latest} "
                                 f"already holds steps up to {done}")
    trainer, timing = Trainer.start(model_dir, spec, config, checkpoints=Path(checkpoint_root))
    try:
        metrics = trainer.step(batch)
        trainer.save(Path(checkpoint_root), extra={"last_step": batch.step})
        weights = trainer.weights_bytes()
        if weights is not None and weights_out is not None:
            Path(weights_out).write_bytes(weights)
    finally:
        trainer.close()
    return {
        "step": trainer.step_count - 1,
        "policy_version": trainer.policy_version,
        "reform_s": timing.total_s,
        "metrics": metrics,
    }
