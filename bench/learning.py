"""Benchmark: the warm-start recipe — SFT on generated demonstrations, then the first-call pass rate on the
shipped tasks (held out of the demonstrations), sampled as the gateway would at RL time.

    python bench/learning.py sft  --base MODEL --out DIR [--count 2000 --lr 1e-3 --epochs 1 --per-step 8]
    python bench/learning.py eval --model DIR [--tasks create-file-1,... --samples 16 --temperature 1]
    python bench/learning.py both --base MODEL --out DIR ...   (sft, then eval)
    python bench/learning.py curve --base MODEL --out DIR --steps 250 --every 50 --lr 2e-3 --per-step 32
        (SFT in-process on create-file demos; every N steps the first-call score, the model saved to DIR)
Evaluation samples the first model call (system + tools + instruction) with transformers in fp32 (the same
distribution vLLM samples from), runs the reply's shell command in the task's sandbox and grades it with the
task's own tests. The last stdout line is the JSON result.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.harness import demos  # noqa: E402
from services.harness.agent_core import SYSTEM_PROMPT  # noqa: E402

DEFAULT_TASKS = "create-file-1,create-file-2,create-file-3,create-file-4"


def run_sft_recipe(args: argparse.Namespace) -> dict[str, Any]:
    from services.trainer.distributed import GroupSpec
    from services.trainer.engine import TrainerConfig
    from services.trainer.runner import SftOptions, run_sft

    families = [f for f in args.families.split(",") if f]
    weights = [float(w) for w in args.weights.split(",")] if args.weights else None
    data = Path(args.out).with_suffix(".demos.jsonl")
    t0 = time.monotonic()
    demos.write_demos(data, seed=args.seed, count=args.count, families=families, weights=weights, slip_rate=args.slip_rate)
    t_demos = time.monotonic() - t0
    if Path(args.out).exists():
        shutil.rmtree(args.out)
    t0 = time.monotonic()
    history = run_sft(
        Path(args.base), data, Path(args.out), GroupSpec.from_env(), TrainerConfig(lr=args.lr, precision="fp32"),
        SftOptions(epochs=args.epochs, conversations_per_step=args.per_step, micro_batch_tokens=args.micro_batch_tokens),
    )
    return {
        "demos": args.count, "demos_s": round(t_demos, 2), "sft_s": round(time.monotonic() - t0, 2),
        "sft_steps": len(history), "first_loss": round(history[0]["loss"], 4), "last_loss": round(history[-1]["loss"], 4),
        "lr": args.lr, "slip_rate": args.slip_rate, "epochs": args.epochs, "per_step": args.per_step, "families": families, "weights": weights,
    }


def evaluate(args: argparse.Namespace, model_dir: str) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.harness.sandboxes import make_sandbox
    from services.harness.taskrun import prepare, run_tests, sandbox_spec_for
    from services.harness.tasks import load_task
    from shared.chat import parse_tool_calls

    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tools = [demos.tool_function(name) for name in demos.AGENT_TOOLS]
    per_task: dict[str, Any] = {}
    grades: dict[tuple[str, str], float] = {}
    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="gyre-learning-"))
    try:
        for task_id in [t for t in args.tasks.split(",") if t]:
            task = load_task(Path(args.tasks_dir) / task_id)
            messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task.instruction}]
            prompt = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False)
            ids = torch.tensor([list(prompt)])
            with torch.no_grad():
                out = model.generate(
                    ids, do_sample=args.temperature > 0, temperature=args.temperature or None, top_p=1.0, top_k=0,
                    max_new_tokens=args.max_tokens, num_return_sequences=args.samples,
                    eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), pad_token_id=tokenizer.pad_token_id,
                )
            scores: list[float] = []
            commands: list[str] = []
            for row in out[:, ids.shape[1] :]:
                text = tokenizer.decode(row.tolist(), skip_special_tokens=True)
                parsed = parse_tool_calls(text)
                shell = [c for c in parsed.tool_calls if c.name == "shell" and isinstance(c.arguments.get("command"), str)]
                command = str(shell[0].arguments["command"]) if shell else ""
                commands.append(command if shell else f"<no shell call: {text[:60]!r}>")
                if not command.strip():
                    scores.append(0.0)
                    continue
                key = (task_id, command)
                if key not in grades:
                    state = work / f"{task_id}-{len(grades)}"
                    sandbox = make_sandbox(state, sandbox_spec_for(task))
                    try:
                        prepare(task, sandbox)
                        sandbox.exec(command, timeout_s=10)
                        graded, _ = run_tests(task, sandbox)
                        grades[key] = graded.score
                    finally:
                        sandbox.close()
                scores.append(grades[key])
            distinct = sorted(set(commands), key=commands.count, reverse=True)
            per_task[task_id] = {
                "mean_score": round(sum(scores) / len(scores), 3),
                "pass_rate": round(sum(s >= 1.0 for s in scores) / len(scores), 3),
                "top_commands": [[c, commands.count(c)] for c in distinct[:4]],
            }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    mean = sum(v["mean_score"] for v in per_task.values()) / max(1, len(per_task))
    passed = sum(v["pass_rate"] for v in per_task.values()) / max(1, len(per_task))
    return {"eval_s": round(time.monotonic() - t0, 1), "mean_score": round(mean, 3), "pass_rate": round(passed, 3),
            "samples": args.samples, "temperature": args.temperature, "per_task": per_task}


def sft_curve(args: argparse.Namespace) -> dict[str, Any]:
    """SFT in this process with the trainer's own step, scoring create-file-1..4 every `--every` steps.

    The grade is the create-file tests' two checks done directly (file exists: 0.5; its stripped text equals
    the task's: 1.0), so an evaluation costs seconds, not a pytest run per sample.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.harness.sandboxes import make_sandbox
    from services.harness.taskrun import prepare, sandbox_spec_for
    from services.harness.tasks import load_task
    from services.trainer.distributed import GroupSpec
    from services.trainer.engine import Trainer, TrainerConfig
    from services.trainer.sft import pack_sequences, render_conversation
    from services.trainer.weights import write_model_dir
    from shared.chat import parse_tool_calls

    torch.manual_seed(args.seed)
    base, out = Path(args.base), Path(args.out)
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    families = [f for f in args.families.split(",") if f]
    instances = demos.sample_instances(seed=args.seed, count=args.steps * args.per_step, families=families,
                                       exclude=demos.shipped_params().values())
    system_text = demos.tools_system_text()
    trainer, _ = Trainer.start(base, GroupSpec.from_env(), TrainerConfig(lr=args.lr, precision="fp32"))
    tools = [demos.tool_function(name) for name in demos.AGENT_TOOLS]
    tasks = [load_task(Path(args.tasks_dir) / t) for t in args.tasks.split(",") if t]
    work = Path(tempfile.mkdtemp(prefix="gyre-curve-"))
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    points: list[dict[str, Any]] = []

    def score() -> dict[str, float]:
        shutil.rmtree(out, ignore_errors=True)
        write_model_dir(trainer.weights_bytes(), base, out)
        model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
        result: dict[str, float] = {}
        for task in tasks:
            params = json.loads((task.root / "params.json").read_text())
            prompt = tokenizer.apply_chat_template(
                [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task.instruction}],
                tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False)
            ids = torch.tensor([list(prompt)])
            with torch.no_grad():
                rows = model.generate(ids, do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0,
                                      max_new_tokens=args.max_tokens, num_return_sequences=args.samples,
                                      eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
            scores = []
            for n, row in enumerate(rows[:, ids.shape[1] :]):
                calls = [c for c in parse_tool_calls(tokenizer.decode(row.tolist(), skip_special_tokens=True)).tool_calls
                         if c.name == "shell" and isinstance(c.arguments.get("command"), str)]
                if not calls:
                    scores.append(0.0)
                    continue
                sandbox = make_sandbox(work / f"{task.root.name}-{len(points)}-{n}", sandbox_spec_for(task))
                try:
                    prepare(task, sandbox)
                    sandbox.exec(str(calls[0].arguments["command"]), timeout_s=10)
                    made = sandbox.work_host / params["name"]
                    ok = made.is_file()
                    scores.append(0.0 if not ok else 1.0 if made.read_text(errors="replace").strip() == params["text"] else 0.5)
                finally:
                    sandbox.close()
            result[task.root.name] = round(sum(scores) / len(scores), 3)
        return result

    t0 = time.monotonic()
    try:
        for step in range(args.steps):
            chunk = instances[step * args.per_step : (step + 1) * args.per_step]
            rendered = [render_conversation(tokenizer, demos.demo_messages(i, system_text)) for i in chunk]
            metrics = trainer.sft_step(pack_sequences(rendered, args.micro_batch_tokens))
            if (step + 1) % args.every == 0 or step + 1 == args.steps:
                train_s = time.monotonic() - t0
                per_task = score()
                point = {"step": step + 1, "loss": round(metrics["loss"], 4), "train_s": round(train_s, 1),
                         "mean_score": round(sum(per_task.values()) / len(per_task), 3), "per_task": per_task}
                points.append(point)
                print(json.dumps(point), flush=True)
                t0 = time.monotonic()
    finally:
        trainer.close()
        shutil.rmtree(work, ignore_errors=True)
    return {"lr": args.lr, "per_step": args.per_step, "families": families, "samples": args.samples, "curve": points}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["sft", "eval", "both", "curve"])
    parser.add_argument("--base", help="model directory to fine-tune (sft)")
    parser.add_argument("--out", help="fine-tuned model directory (sft)")
    parser.add_argument("--model", help="model directory to evaluate (eval)")
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--per-step", type=int, default=8)
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    parser.add_argument("--families", default=",".join(demos.FAMILIES))
    parser.add_argument("--weights", default="")
    parser.add_argument("--slip-rate", type=float, default=0.0, help="share of demonstrations with a mistake")
    parser.add_argument("--tasks", default=DEFAULT_TASKS)
    parser.add_argument("--tasks-dir", default="tasks")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=250, help="curve: SFT steps")
    parser.add_argument("--every", type=int, default=50, help="curve: score every N steps")
    args = parser.parse_args()
    result: dict[str, Any] = {}
    if args.mode in ("sft", "both"):
        result["sft"] = run_sft_recipe(args)
    if args.mode == "curve":
        if args.families == ",".join(demos.FAMILIES):
            args.families = "create-file"
        result["curve"] = sft_curve(args)
    if args.mode in ("eval", "both"):
        result["eval"] = evaluate(args, args.model or args.out)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
