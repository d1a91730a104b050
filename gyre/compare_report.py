"""`gyre compare`'s report: the same seeded workload under each mode, side by side, from each run's report.json.

Pure but for `write_images`: wall-clock per step and in total (from the first dispatch, so the engines' start-up,
the same in every mode, is apart), cell-time shares (rollout busy/empty, train busy/waiting, switching, idle),
switches and sessions moved, staleness, the training-score curves and whether they agree within their noise.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

SHARES = ("rollout_busy", "rollout_empty", "train_busy", "train_waiting", "switching", "idle")


def _overlap(start: float, end: float, spans: list[list[float]]) -> float:
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in spans)


def cell_shares(report: dict[str, Any], start: float, end: float) -> dict[str, float]:
    """Cell-seconds in each state over [start, end]: a rollout cell is busy while it holds a live session, a train
    cell while its rank computes a step; a cell before its first role, or in none, is idle."""
    out = dict.fromkeys(SHARES, 0.0)
    cells = sorted({s["cell_id"] for s in report["timeline"]} | set(report.get("occupied", {})))
    for cell in cells:
        covered = 0.0
        for seg in (s for s in report["timeline"] if s["cell_id"] == cell):
            a, b = max(start, seg["start_s"]), min(end, seg["end_s"])
            if b <= a:
                continue
            covered += b - a
            role = seg["role"]
            if "switching" in role:
                out["switching"] += b - a
            elif role == "rollout":
                busy = _overlap(a, b, report.get("occupied", {}).get(cell, []))
                out["rollout_busy"] += busy
                out["rollout_empty"] += b - a - busy
            elif role == "train":
                busy = min(b - a, _overlap(a, b, report.get("rank_busy", {}).get(cell, [])))
                out["train_busy"] += busy
                out["train_waiting"] += b - a - busy
            else:
                out["idle"] += b - a
        out["idle"] += max(0.0, (end - start) - covered)
    return out


def mode_summary(mode: str, run_id: str, report: dict[str, Any]) -> dict[str, Any]:
    """One mode's figures from its run report."""
    steps = [s for s in report["steps"] if s.get("completed_s") is not None]
    start = report.get("first_dispatch_s") or 0.0
    end = max((s["completed_s"] for s in steps), default=start)
    per_step, previous = [], start
    for s in sorted(steps, key=lambda s: s["step"]):
        per_step.append(round(s["completed_s"] - previous, 3))
        previous = s["completed_s"]
    seconds = cell_shares(report, start, end)
    total = sum(seconds.values()) or 1.0
    moved = report.get("migrations", {})
    return {
        "mode": mode,
        "run_id": run_id,
        "wall_s": round(end - start, 3),
        "startup_s": round(start, 3),
        "steps": len(steps),
        "step_wall_s": per_step,
        "cell_seconds": {k: round(v, 3) for k, v in seconds.items()},
        "cell_share": {k: round(v / total, 4) for k, v in seconds.items()},
        "switches": sum(1 for s in report["switches"] if s["from_role"] != "idle"),
        "sessions_moved": dict(moved),
        "sessions_moved_total": sum(moved.values()),
        "staleness": report.get("staleness", {}),
        "curve": [{"step": s["step"], "mean_reward": s["mean_reward"], "pass_rate": s["pass_rate"],
                   "executions": s["executions"]} for s in report["steps"]],
        "branches": report.get("branches", {}),
        "dedup_factor": report.get("dedup_factor"),
        "trajectories_per_execution": _per_execution(report),
        "timeline": report["timeline"],
    }


def _per_execution(report: dict[str, Any]) -> dict[str, float] | None:
    n = report.get("trained_executions") or 0
    if not n:
        return None
    return {"before_cap": report["trajectories_before_cap"] / n, "after_cap": report["trajectories_after_cap"] / n}


def _mean_and_error(curve: list[dict[str, Any]]) -> tuple[float, float]:
    values = [p["mean_reward"] for p in curve]
    if not values:
        return math.nan, math.nan
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, math.inf
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, math.sqrt(var / len(values))


def curves_agree(modes: dict[str, dict[str, Any]], reference: str = "elastic") -> dict[str, dict[str, Any]]:
    """Each mode's mean reward over its steps against the reference mode's: the same seeds should give curves that
    differ only by noise; a difference beyond twice the combined standard error of the step means is flagged."""
    if reference not in modes:
        return {}
    ref_mean, ref_err = _mean_and_error(modes[reference]["curve"])
    out = {}
    for name, m in modes.items():
        if name == reference:
            continue
        mean, err = _mean_and_error(m["curve"])
        bound = 2 * math.sqrt(ref_err**2 + err**2)
        out[name] = {"mean_reward": round(mean, 4), "reference_mean_reward": round(ref_mean, 4),
                     "difference": round(mean - ref_mean, 4), "noise_bound": round(bound, 4) if math.isfinite(bound)
                     else None, "within_noise": bool(abs(mean - ref_mean) <= bound)}
    return out


def comparison(modes: dict[str, dict[str, Any]], *, workload: dict[str, Any]) -> dict[str, Any]:
    """The whole comparison: per-mode figures, elastic's speedups, and whether the curves agree."""
    out: dict[str, Any] = {"workload": workload, "modes": modes}
    if "elastic" in modes and modes["elastic"]["wall_s"] > 0:
        elastic = modes["elastic"]["wall_s"]
        if "async" in modes:
            out["elastic_vs_async"] = round(modes["async"]["wall_s"] / elastic, 4)
        colocates = [m["wall_s"] for name, m in modes.items() if name.startswith("colocate")]
        if colocates:
            out["elastic_vs_best_colocate"] = round(min(colocates) / elastic, 4)
        if "reprefill" in modes:
            out["elastic_vs_reprefill"] = round(modes["reprefill"]["wall_s"] / elastic, 4)
    out["curves"] = curves_agree(modes)
    return out


def summary_lines(result: dict[str, Any]) -> list[str]:
    lines = []
    for name, m in result["modes"].items():
        share = m["cell_share"]
        sim = f" (simulator: {m['sim_wall_s']:.0f} s)" if m.get("sim_wall_s") is not None else ""
        lines.append(f"{name:<10} {m['wall_s']:8.1f} s for {m['steps']} steps{sim}; rollout busy "
                     f"{share['rollout_busy']:.0%}, empty {share['rollout_empty']:.0%}, train busy "
                     f"{share['train_busy']:.0%}, waiting {share['train_waiting']:.0%}, switching "
                     f"{share['switching']:.0%}; {m['switches']} switches, {m['sessions_moved_total']} sessions moved")
    for key in ("elastic_vs_async", "elastic_vs_best_colocate", "elastic_vs_reprefill"):
        if key in result:
            lines.append(f"{key.replace('_', ' ')}: {result[key]:.3f}×")
    for name, c in result.get("curves", {}).items():
        verdict = "within noise" if c["within_noise"] else "NOT within noise"
        lines.append(f"curve {name} vs elastic: mean reward {c['mean_reward']:.3f} vs {c['reference_mean_reward']:.3f}"
                     f" ({verdict}, bound {c['noise_bound']})")
    return lines


def write_images(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """compare_timelines.png (each mode's cells side by side), compare_curves.png (the score curves on one plot),
    compare_shares.png (cell-time shares per mode)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"rollout": "#2b8cbe", "train": "#e6550d", "switching": "#222222", "idle": "#dddddd"}
    modes = result["modes"]
    written = []
    fig, axes = plt.subplots(len(modes), 1, figsize=(10, 1.6 + 1.1 * len(modes)), sharex=True, squeeze=False)
    for ax, (name, m) in zip(axes[:, 0], modes.items()):
        start = m["startup_s"]
        cells = sorted({s["cell_id"] for s in m["timeline"]})
        for row, cell in enumerate(cells):
            for seg in (s for s in m["timeline"] if s["cell_id"] == cell):
                label = "switching" if "switching" in seg["role"] else seg["role"]
                ax.broken_barh([(seg["start_s"] - start, seg["end_s"] - seg["start_s"])], (row, 0.8),
                               facecolors=colours.get(label, "#999999"))
        ax.set_yticks([r + 0.4 for r in range(len(cells))], cells, fontsize=7)
        ax.set_xlim(0, max(mm["wall_s"] for mm in modes.values()))
        ax.set_title(f"{name}: {m['wall_s']:.0f} s for {m['steps']} steps", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("seconds since the first dispatch")
    fig.tight_layout()
    written.append(out_dir / "compare_timelines.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for name, m in modes.items():
        ax.plot([p["step"] for p in m["curve"]], [p["mean_reward"] for p in m["curve"]], marker="o", label=name)
    ax.set_xlabel("RL step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("Training score, same seeds, per mode")
    ax.legend()
    fig.tight_layout()
    written.append(out_dir / "compare_curves.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 0.8 + 0.6 * len(modes)))
    palette = ["#2b8cbe", "#a6bddb", "#e6550d", "#fdae6b", "#222222", "#dddddd"]
    for row, (name, m) in enumerate(modes.items()):
        left = 0.0
        for key, colour in zip(SHARES, palette):
            ax.barh(row, m["cell_share"][key], left=left, color=colour, label=key if row == 0 else None)
            left += m["cell_share"][key]
    ax.set_yticks(range(len(modes)), list(modes))
    ax.set_xlabel("share of cell time")
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    fig.tight_layout()
    written.append(out_dir / "compare_shares.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    return written
