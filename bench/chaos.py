"""Chaos benchmark: the loop under a long seeded fault schedule (every process killed repeatedly, NATS and
PostgreSQL restarted under it), against the same run with no faults, in the same invocation. Prints each fault as
it lands and a JSON object as its last line: faults by kind with how long each took to come back and what it
cost (executions resumed, calls answered again from the log, infrastructure failures, sessions and tokens
recomputed, calls refused), whether anything was lost or repeated, `gyre replay --verify`, and the wall time
against the baseline (`slowdown`).

    nice .venv/bin/python bench/chaos.py [--faults 52 --seed 1 --cells 2]

Each run starts its own NATS and PostgreSQL (the faults restart them). About 25 minutes on 2 cores for 52 faults.
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
    parser.add_argument("--every-steps", type=int, default=2, help="steps the loop completes between faults")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="gyre-chaos-bench-") as tmp:
        chaos = await run_chaos(Path(tmp) / "chaos", seed=args.seed, faults=args.faults, cells=args.cells,
                                every_steps=args.every_steps)
        print(f"chaos: {chaos.steps} steps in {chaos.wall_s} s; now the same run without faults", flush=True)
        baseline = await run_chaos(Path(tmp) / "baseline", seed=args.seed, faults=0, cells=args.cells,
                                   steps=chaos.steps)
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
        "baseline_wall_s": baseline.wall_s,
        "baseline_problems": baseline.problems,
        "slowdown": round(chaos.wall_s / baseline.wall_s, 2) if baseline.wall_s else None,
    }))


if __name__ == "__main__":
    asyncio.run(main())
