"""The supervised warm start of `gyre run`: demonstrations written, then `gyre train sft` as a process of its own,
its step lines followed into a progress bar and its whole output into the run's log."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from gyre.config import RunConfig
from gyre.run_plan import LEARNABLE_FAMILIES

console = Console()


def warm_start(python: str, base: Path, run_dir: Path, config: RunConfig, env: dict[str, str]) -> Path:
    """The supervised warm start: an imperfect demonstrator's demonstrations of the learnable family (`slip_rate`
    of them skip the work or run a wrong command, services/harness/demos.py), in the harness's format (the
    builtin agent's, or Claude Code's: gyre/claude_code_demos.py), trained by `gyre train sft` as its own
    process, so the policy solves the tasks only part of the time and RL has something to learn. Returns the
    fine-tuned model."""
    options = config.warm_start
    out = run_dir / "sft"
    data = run_dir / "warmstart" / "demos.jsonl"
    count = options.steps * options.conversations_per_step
    families = tuple(options.families) or LEARNABLE_FAMILIES
    if config.demo_format() == "claude-code":
        from gyre.claude_code_demos import write_claude_code_demos

        count = write_claude_code_demos(data, seed=config.seed, count=count, families=families,
                                        slip_rate=options.slip_rate, tools=config.harness.claude_code_tools)
    else:
        from services.harness.demos import write_demos

        count = write_demos(data, seed=config.seed, count=count, families=families, slip_rate=options.slip_rate)
    # A demonstration is never split: micro-batches hold the longest one (Claude Code's run to ~30,000 tokens).
    argv = [
        python, "-m", "gyre.cli", "train", "sft", "--model", str(base), "--data", str(data), "--out", str(out),
        "--lr", str(options.lr), "--conversations-per-step", str(options.conversations_per_step),
        "--micro-batch-tokens", str(env["GYRE_MICRO_BATCH_TOKENS"]), "--epochs", "1", "--precision", "fp32",
    ]
    log = run_dir / "logs" / "sft.log"
    console.print(
        f"warm-start: {count} {config.demo_format()} demonstrations ({options.slip_rate:.0%} with a slip) → "
        f"{options.steps} SFT steps; log {log}"
    )
    started = time.monotonic()
    with open(log, "ab") as sink, Progress(TextColumn("supervised warm-start (SFT)"), BarColumn(),
                                         MofNCompleteColumn(), TextColumn("{task.fields[loss]}"),
                                         TimeRemainingColumn(), console=console, transient=True) as progress:
        task = progress.add_task("sft", total=options.steps, loss="")
        returncode = _follow(argv, env, sink, lambda line: _sft_progress(progress, task, line))
    if returncode != 0:
        raise RuntimeError(f"the warm-start failed (exit {returncode}); see {log}")
    console.print(f"warm-start done in {time.monotonic() - started:.0f} s → {out}")
    return out


def _follow(argv: list[str], env: dict[str, str], sink: Any, on_line: Any) -> int:
    """Run `argv`, copying its output to `sink` line by line and handing each line to `on_line`; its exit code."""
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    for raw in proc.stdout:
        sink.write(raw)
        on_line(raw.decode(errors="replace"))
    return proc.wait()


def _sft_progress(progress: Progress, task: Any, line: str) -> None:
    """A `gyre train sft` step line moves the bar (its total is the trainer's own count of steps)."""
    if not line.startswith("sft_step "):
        return
    with contextlib.suppress(ValueError, KeyError, TypeError):
        step = json.loads(line.split(" ", 1)[1])
        loss = step.get("loss")
        progress.update(task, completed=step["step"], total=step["steps"],
                        loss="" if loss is None else f"loss {loss:.3f}")


__all__ = ["warm_start"]
