"""Chaos benchmark: the loop under a long seeded fault schedule (every process killed repeatedly, NATS and
PostgreSQL restarted under it), against the same run with no faults, in the same invocation. Prints each fault as
it lands and a JSON object as its last line: faults by kind with how long each took to come back and what it
cost (executions resumed, calls answered again from the log, infrastructure failures, sessions and tokens
recomputed, calls refused), whether anything was lost or repeated, `gyre replay --verify`, and the seconds a
step takes under the faults against a run without them (`slowdown`).

    nice .venv/bin/python bench/chaos.py [--faults 52 --seed 1 --cells 2]

Each run starts its own NATS and PostgreSQL (the faults restart them). About 25 minutes on 2 cores for 52 faults.
A run's steps are (every_steps + 1) x faults + 4, so that it outlasts the plan.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


async def main() -> None:
    from gyre.chaos_run import run_chaos

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", type=int, default=52)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--cells", type=int, default=2)
    parser.add_argument("--every-steps", type=int, default=3,
                        help="fault i waits for step every_steps*i+1 (steps also complete while a fault recovers)")
    parser.add_argument("--baseline-steps", type=int, default=40, help="steps of the run without faults")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="gyre-chaos-bench-") as tmp:
        chaos = await run_chaos(Path(tmp) / "chaos", seed=args.seed, faults=args.faults, cells=args.cells,
                                every_steps=args.every_steps)
        print(f"chaos: {chaos.steps} steps in {chaos.wall_s} s; now the same run without faults", flush=True)
        baseline = await run_chaos(Path(tmp) / "baseline", seed=args.seed, faults=0, cells=args.cells,
                                   steps=args.baseline_steps)
    faults = {k: v for k, v in chaos.faults.items() if k != "records"}
    print(json.dumps({
        "bench": "chaos",
        "faults": faults["faults"],
        "by_kind": faults["by_kind"],
        "costs": faults["costs"],
        "steps": chaos.steps,
        "problems": chaos.problems,  # lost or repeated steps and executions: [] when none
        "unplanned_restarts": chaos.unplanned,
        "replay_verified": chaos.replay_ok,
        "wall_s": chaos.wall_s,
        "s_per_step": round(chaos.wall_s / chaos.steps, 2),
        "baseline_steps": baseline.steps,
        "baseline_wall_s": baseline.wall_s,
        "baseline_s_per_step": round(baseline.wall_s / baseline.steps, 2),
        "baseline_problems": baseline.problems,
        # Seconds a step under the faults against without them (the runs' first minute, starting every
        # process, is in both).
        "slowdown": round((chaos.wall_s / chaos.steps) / (baseline.wall_s / baseline.steps), 2),
    }))


if __name__ == "__main__":
    asyncio.run(main())
