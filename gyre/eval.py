"""`gyre eval`: score a policy on held-out tasks — pass@1 and the mean score over several samples of each task —
through the same harness, gateway and rollout worker the run trains with.

`gyre eval --run RUN_ID` scores the run's starting policy (its warm-started model) and its last checkpoint on the
run's held-out tasks (`tasks.held_out`), and writes runs/<id>/eval.json: the before/after a report states about
tasks the run never trained on. `--model DIR` scores one model folder instead; `--checkpoint` names a trainer
checkpoint (a `step-…` folder) to load over the run's model. Each policy is served by a rollout worker of its own
behind a gateway, and every execution runs the builtin agent in a sandbox and is graded by the task's tests, as in
a run; calls are recorded on their own run id (`<run>-eval-<label>`), so `gyre replay` can show them.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from gyre import local
from gyre.config import ConfigError, RunConfig, environment, load_config
from gyre.processes import Proc, start_all, stop_all
from shared.settings import load_settings

console = Console()


class EvalError(RuntimeError):
    """The policy could not be served or scored (a worker that never came up, a checkpoint that does not load)."""


def export_checkpoint(model_dir: Path, checkpoint: Path, out: Path) -> Path:
    """A model folder with the checkpoint's weights: the run's model (architecture, tokenizer) with the trainer's
    distributed checkpoint loaded over it in this one process."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype="auto")
    state = {"model": model.state_dict()}
    try:
        dcp.load(state, checkpoint_id=str(checkpoint))
    except (Exception, dcp.CheckpointException) as exc:  # DCP's own exception is a BaseException
        raise EvalError(f"{checkpoint}: not a checkpoint of {model_dir}'s model ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''})") from exc
    model.load_state_dict(state["model"])
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in os.listdir(model_dir):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template", "generation_config")):
            shutil.copy2(model_dir / name, out / name)
    return out


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The run's newest complete trainer checkpoint (its state file is written last)."""
    done = sorted(p for p in (run_dir / "checkpoints").glob("step-*") if (p / "trainer_state.json").is_file())
    return done[-1] if done else None


def pass_at_1(scores: dict[str, list[float]]) -> float:
    """Mean over tasks of the share of a task's samples that pass (score 1): the unbiased pass@1."""
    per_task = [sum(1 for s in v if s >= 1.0) / len(v) for v in scores.values() if v]
    return sum(per_task) / len(per_task) if per_task else 0.0


def mean_score(scores: dict[str, list[float]]) -> float:
    flat = [s for v in scores.values() for s in v]
    return sum(flat) / len(flat) if flat else 0.0


def score_model(model_dir: Path, *, label: str, config: RunConfig, task_ids: list[str], samples: int,
                run_id: str, out: Path, endpoints: local.Endpoints) -> dict[str, Any]:
    """Serve `model_dir` (a worker and a gateway) and run `samples` executions of each task; their scores."""
    from services.harness.agent_core import AgentConfig, Budget
    from services.harness.execution import BuiltinHarness, run_execution
    from services.harness.external_harness import GatewayAccess
    from services.harness.tasks import load_task
    from shared.execution_tokens import derive_execution_token

    eval_run = f"{run_id}-eval-{label}"
    port, health = local.free_port(), local.free_port()
    secret = secrets.token_urlsafe(32)
    # vLLM's IPC sockets go under TMPDIR, whose path must stay short (a socket path is at most 107 bytes).
    scratch = tempfile.mkdtemp(prefix="gyre-eval-")
    logs = out / "logs" / label
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **environment(config, model_dir, task_ids), "GYRE_RUN_ID": eval_run,
           "GYRE_NATS_URL": endpoints.nats_url, "GYRE_DATABASE_URL": endpoints.database_url,
           "GYRE_STATE_DIR": str(out / "state" / label), "GYRE_ROLLOUT_PORT": str(port),
           "GYRE_ROLLOUT_TOKEN_SECRET": secret, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TMPDIR": scratch, "GYRE_MODEL_DIR": str(model_dir)}
    procs = [Proc("relay", [sys.executable, "-m", "shared.relay"]),
             Proc("gateway", [sys.executable, "-m", "services.rollout", "gateway"]),
             Proc("worker", [sys.executable, "-m", "services.rollout", "worker"],
                  env={"GYRE_ROLLOUT_CELL_ID": "eval-cell0", "GYRE_HEALTH_PORT": str(health)})]
    tasks = {t: load_task(Path(config.tasks.dir) / t) for t in task_ids}
    agent = AgentConfig(model=config.model.served_name, max_tokens=config.budgets.reply_tokens,
                        compact_at_tokens=config.budgets.compact_at_tokens, api_outage_s=60.0)
    budget = Budget(max_calls=config.budgets.calls, wall_clock_s=config.budgets.wall_s)
    scores: dict[str, list[float]] = {t: [] for t in task_ids}
    try:
        start_all(procs, env, logs)
        _wait_serving(f"http://127.0.0.1:{health}/healthz", procs, timeout_s=600)
        jobs = [(t, i) for t in task_ids for i in range(samples)]

        def one(job: tuple[str, int]) -> tuple[str, float]:
            task_id, i = job
            eid = f"execution-{eval_run}-{task_id}-{i:03d}"
            result = run_execution(
                execution_id=eid, task=tasks[task_id],
                harness=BuiltinHarness(agent=agent.model_copy(update={"seed": 1000 * i + 17})),
                gateway=GatewayAccess(base_url=f"http://127.0.0.1:{port}", model=config.model.served_name,
                                      token=derive_execution_token(secret.encode(), eid)),
                state_dir=out / "executions" / label / eid, budget=budget, backend=config.harness.sandbox,
            )
            return task_id, result.grade.score

        with concurrent.futures.ThreadPoolExecutor(max(1, config.harness.concurrency)) as pool:
            for task_id, score in pool.map(one, jobs):
                scores[task_id].append(score)
    finally:
        stop_all(procs, eval_run)
        shutil.rmtree(scratch, ignore_errors=True)
    return {"model": str(model_dir), "run_id": eval_run, "samples": samples, "pass_at_1": pass_at_1(scores),
            "mean_score": mean_score(scores), "scores": scores}


def _wait_serving(url: str, procs: list[Proc], *, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        dead = [p.name for p in procs if not p.alive()]
        if dead:
            raise EvalError(f"{', '.join(dead)} exited before the worker served (see its log)")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                body = json.loads(response.read() or b"{}")
                if body.get("ok") and body.get("worker", {}).get("state") == "active":
                    return
        except (OSError, ValueError):
            pass
        time.sleep(1.0)
    raise EvalError(f"the rollout worker did not serve within {timeout_s:.0f} s")


def evaluate(
    run: Annotated[str | None, typer.Option("--run", help="Score this run's (id or folder) starting policy and "
                                            "last checkpoint on its held-out tasks; writes runs/<id>/eval.json.")]
    = None,
    model: Annotated[Path | None, typer.Option(help="Score this model folder instead.")] = None,
    checkpoint: Annotated[Path | None, typer.Option(help="A trainer checkpoint (step-… folder) to load over the "
                                                    "model.")] = None,
    config_file: Annotated[Path | None, typer.Option("--config", help="The run config (budgets, harness, tasks; "
                                                     "default: the run's own).")] = None,
    tasks: Annotated[str | None, typer.Option(help="Comma-separated task ids (default: tasks.held_out).")] = None,
    samples: Annotated[int, typer.Option(min=1, help="Executions per task.")] = 4,
    out: Annotated[Path | None, typer.Option(help="Where eval.json goes (default: the run's folder).")] = None,
) -> None:
    """Score a policy on held-out tasks: pass@1 and the mean score over `samples` executions of each."""
    try:
        if (run is None) == (model is None):
            raise ConfigError("give --run RUN_ID or --model DIR (one of them)")
        runs_dir = Path(load_config(config_file)[0].logging.runs_dir)
        # A run's id (under the config's runs folder) or the run's folder itself.
        run_dir = (Path(run) if Path(run).is_dir() else runs_dir / run) if run else None
        if run_dir is not None and not (run_dir / "run.json").is_file():
            raise ConfigError(f"--run {run}: no {run_dir / 'run.json'} (a run of `gyre run` that started)")
        config, _ = load_config(config_file or (run_dir / "config.yaml" if run_dir else None))
        task_ids = [t for t in (tasks.split(",") if tasks else config.tasks.held_out) if t]
        if not task_ids:
            raise ConfigError("no tasks to score: the config holds no tasks.held_out (give --tasks)")
    except ConfigError as exc:
        console.print(f"[red]error:[/] {exc}", highlight=False, markup=False)
        raise typer.Exit(2) from exc
    settings = load_settings()
    endpoints = local.up(settings.state_dir, nats_url=settings.nats_url, database_url=settings.database_url,
                         schema=settings.db_schema)
    # eval.json in the run's folder (or --out); the servers' logs, the executions and exported models under eval/.
    report_dir = out or run_dir or Path("runs") / "eval"
    target = report_dir / "eval"
    target.mkdir(parents=True, exist_ok=True)
    policies: dict[str, Path] = {}
    if run_dir is not None:
        start = Path(json.loads((run_dir / "run.json").read_text())["model_dir"])
        policies["before"] = start
        last = checkpoint or latest_checkpoint(run_dir)
        if last is not None:
            policies["after"] = export_checkpoint(start, last, target / "eval-model" / last.name)
    else:
        assert model is not None
        policies["model"] = export_checkpoint(model, checkpoint, target / "eval-model" / checkpoint.name) \
            if checkpoint else model
    result: dict[str, Any] = {"tasks": task_ids, "samples": samples}
    for label, path in policies.items():
        console.print(f"scoring {label} ({path}) on {len(task_ids)} tasks × {samples} samples…")
        result[label] = score_model(path, label=label, config=config, task_ids=task_ids, samples=samples,
                                    run_id=run_dir.name if run_dir else "model", out=target, endpoints=endpoints)
        console.print(f"  {label}: pass@1 {result[label]['pass_at_1']:.3f}, mean score "
                      f"{result[label]['mean_score']:.3f}")
    (report_dir / "eval.json").write_text(json.dumps(result, indent=2))
    console.print(f"eval: {report_dir / 'eval.json'}")


eval_app = evaluate
