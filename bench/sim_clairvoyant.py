"""Benchmark: how close a schedule that knows every duration gets to the lower bound, beside elastic.

Usage: python bench/sim_clairvoyant.py [--preset flagship] [--seeds 0,1,2] [--slacks 1.1,1.15,1.2]
Per seed: the lower bound, elastic, and the clairvoyant reference (services/scheduler/sim/clairvoyant.py) at
each deadline slack, best kept. The reference runs under the same rules as every policy (admission reserve,
staleness bound, budget; the engine validates its actions). The last line of stdout is the JSON summary.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.scheduler.policies import make_policy  # noqa: E402
from services.scheduler.sim.bounds import lower_bound  # noqa: E402
from services.scheduler.sim.clairvoyant import ClairvoyantPolicy  # noqa: E402
from services.scheduler.sim.engine import SimOptions, Simulation  # noqa: E402
from services.scheduler.sim.presets import get_preset  # noqa: E402
from services.scheduler.sim.workload import HOUR, sample_workload  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="flagship")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--slacks", default="1.1,1.15,1.2")
    args = parser.parse_args()
    started = time.perf_counter()
    preset = get_preset(args.preset)
    options = SimOptions(record_timeline=False)
    rows = []
    for seed in (int(s) for s in args.seeds.split(",")):
        workload = sample_workload(preset, seed)
        bound = lower_bound(preset, workload, options).hours
        elastic = make_policy("elastic", budget_cells=preset.cells, fill=preset.fill)
        elastic_h = Simulation(preset, workload, elastic, options).run() / HOUR
        by_slack = {}
        for slack in (float(s) for s in args.slacks.split(",")):
            policy = ClairvoyantPolicy(preset, workload, slack=slack)
            by_slack[slack] = Simulation(preset, workload, policy, options).run() / HOUR
        best = min(by_slack.values())
        row = {
            "seed": seed,
            "lower_bound_h": round(bound, 2),
            "elastic_h": round(elastic_h, 2),
            "clairvoyant_h": round(best, 2),
            "clairvoyant_by_slack_h": {str(k): round(v, 2) for k, v in by_slack.items()},
            "elastic_to_lower_bound": round(elastic_h / bound, 3),
            "clairvoyant_to_lower_bound": round(best / bound, 3),
            "elastic_to_clairvoyant": round(elastic_h / best, 3),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    summary = {
        "bench": "sim_clairvoyant",
        "preset": preset.name,
        "clairvoyant_to_lower_bound": [r["clairvoyant_to_lower_bound"] for r in rows],
        "elastic_to_lower_bound": [r["elastic_to_lower_bound"] for r in rows],
        "elastic_to_clairvoyant": [r["elastic_to_clairvoyant"] for r in rows],
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
