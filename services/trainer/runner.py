"""Per-rank entry points behind `gyre train`: supervised warm-start and one RL step from a batch file.

Run one process per train cell (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); one process
alone is a world of one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.trainer.distributed import GroupSpec
from services.trainer.engine import Trainer, TrainerConfig
from services.trainer.sft import load_conversations, pack_sequences, render_conversation
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
) -> list[dict[str, float]]:
    """Cross-entropy on the assistant turns of a JSONL of conversations; writes a model directory to out_dir."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    rendered = [render_conversation(tokenizer, c) for c in load_conversations(data)]
    trainer, _ = Trainer.start(model_dir, spec, config)
    history: list[dict[str, float]] = []
    try:
        for epoch in range(options.epochs):
            for start in range(0, len(rendered), options.conversations_per_step):
                chunk = rendered[start : start + options.conversations_per_step]
                metrics = trainer.sft_step(pack_sequences(chunk, options.micro_batch_tokens))
                history.append({"epoch": float(epoch), "step": float(trainer.step_count), **metrics})
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
    trainer, timing = Trainer.start(model_dir, spec, config, checkpoint_root=checkpoint_root)
    try:
        metrics = trainer.step(batch)
        trainer.save(checkpoint_root)
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
