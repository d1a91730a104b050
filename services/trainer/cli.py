"""`gyre train …` commands (the lead mounts `train_app`); each process is one trainer rank."""

from __future__ import annotations

import json
from pathlib import Path

import typer

SFT_STEP = "sft_step"  # the prefix of the line `gyre train sft` prints after each step

train_app = typer.Typer(help="Train: supervised warm-start and GSPO steps (FSDP2 over the train cells).")


@train_app.command("sft")
def sft(
    model: Path = typer.Option(..., help="Hugging Face model directory to start from"),
    data: Path = typer.Option(..., help="JSONL of conversations ({'messages': [...]} per line)"),
    out: Path = typer.Option(..., help="where to write the fine-tuned model directory"),
    epochs: int = typer.Option(1),
    lr: float = typer.Option(1e-3),
    conversations_per_step: int = typer.Option(8),
    micro_batch_tokens: int = typer.Option(4096),
    precision: str = typer.Option("auto", help="auto, fp32 or bf16"),
) -> None:
    """Cross-entropy on assistant turns, tree-packed, sharded over RANK/WORLD_SIZE (torchrun) or one process."""
    # torch loads here, not with the CLI: `--help` answers without it.
    from services.trainer.distributed import GroupSpec
    from services.trainer.engine import TrainerConfig
    from services.trainer.runner import SftOptions, run_sft

    spec = GroupSpec.from_env()

    def progress(step: int, steps: int, metrics: dict[str, float]) -> None:
        # One line a step (rank 0): `gyre run`'s warm start reads them into a progress bar.
        if spec.rank == 0:
            typer.echo(f"{SFT_STEP} " + json.dumps({"step": step, "steps": steps, "loss": metrics.get("loss")}),
                       nl=True)

    history = run_sft(
        model,
        data,
        out,
        spec,
        TrainerConfig(lr=lr, precision=precision),  # type: ignore[arg-type]
        SftOptions(epochs=epochs, conversations_per_step=conversations_per_step, micro_batch_tokens=micro_batch_tokens),
        on_step=progress,
    )
    if GroupSpec.from_env().rank == 0:
        typer.echo(json.dumps({"steps": len(history), "first_loss": history[0]["loss"], "last_loss": history[-1]["loss"]}))


@train_app.command("run-step")
def run_step_cmd(
    model: Path = typer.Option(..., help="base model directory (architecture, initial weights)"),
    batch: Path = typer.Option(..., help="an encoded TrainingBatch (shared/batch.py)"),
    checkpoints: Path = typer.Option(..., help="checkpoint root shared by all ranks"),
    weights_out: Path = typer.Option(None, help="write the new safetensors weights here (rank 0)"),
    lr: float = typer.Option(1e-6),
    eps_low: float = typer.Option(3e-4),
    eps_high: float = typer.Option(4e-4),
    is_cap: float = typer.Option(2.0),
    recompute_old_logprobs: bool = typer.Option(False),
    precision: str = typer.Option("auto"),
) -> None:
    """Resume from the latest checkpoint, train one GSPO step on the batch, checkpoint; prints the metrics."""
    from services.trainer.distributed import GroupSpec
    from services.trainer.engine import StepAlreadyTrained, TrainerConfig
    from services.trainer.loss import GspoConfig
    from services.trainer.runner import run_step

    config = TrainerConfig(
        lr=lr,
        precision=precision,  # type: ignore[arg-type]
        loss=GspoConfig(eps_low=eps_low, eps_high=eps_high, is_cap=is_cap),
        recompute_old_logprobs=recompute_old_logprobs,
    )
    spec = GroupSpec.from_env()
    try:
        result = run_step(model, batch, checkpoints, spec, config, weights_out)
    except StepAlreadyTrained as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    if spec.rank == 0:
        typer.echo(json.dumps(result, sort_keys=True))


@train_app.command("rank")
def rank_cmd() -> None:
    """A trainer rank on this cell (GYRE_TRAINER_CELL_ID): stands by warm and serves the coordinator's group."""
    from services.trainer.rank import main

    main()
