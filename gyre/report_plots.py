"""The run report's images: the training-score curve and the per-cell role timeline with the trainer's world size
(matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

from gyre.report import RunReport, _mean


def write_report(report: RunReport, out_dir: Path) -> list[Path]:
    """report.json plus PNGs: the training-score curve and the per-cell timeline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "report.json"]
    written[0].write_text(report.to_json())

    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = [r.step for r in report.steps]
    ax.plot(steps, [r.mean_reward for r in report.steps], marker="o", label="mean group reward")
    ax.plot(steps, [r.pass_rate for r in report.steps], marker="s", linestyle="--", label="pass rate")
    if len(steps) >= 6:
        means = [r.mean_reward for r in report.steps]
        smooth = [_mean(means[max(0, i - 2) : i + 1]) for i in range(len(means))]
        ax.plot(steps, smooth, color="black", linewidth=2, label="mean reward, 3-step average")
    ax.set_xlabel("RL step")
    ax.set_ylabel("score")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title(f"Training score — {report.run_id}")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out_dir / "training_curve.png", dpi=120)
    plt.close(fig)
    written.append(out_dir / "training_curve.png")

    cells = sorted({seg["cell_id"] for seg in report.timeline})
    if cells:
        written.append(_timeline(report, cells, out_dir / "cell_timeline.png"))
    return written


def _timeline(report: RunReport, cells: list[str], path: Path) -> Path:
    """Each cell's role over time (hatched while switching, a tick at each warm switch's end), and under it the
    trainer's world size as its group re-formed."""
    import matplotlib.pyplot as plt

    colours = {"rollout": "tab:blue", "train": "tab:orange", "idle": "lightgrey"}
    sizes = report.world_sizes
    rows = 2 if sizes else 1
    fig, axes = plt.subplots(rows, 1, figsize=(8, 0.6 * len(cells) + 1.2 + (1.4 if sizes else 0)), sharex=True,
                             gridspec_kw={"height_ratios": [max(1.0, 0.6 * len(cells)), 1.0][:rows]}, squeeze=False)
    ax = axes[0][0]
    for y, cell in enumerate(cells):
        for seg in (s for s in report.timeline if s["cell_id"] == cell):
            role = seg["role"].split(" ")[0]
            hatch = "//" if "switching" in seg["role"] else None
            ax.barh(y, seg["end_s"] - seg["start_s"], left=seg["start_s"], color=colours.get(role, "grey"),
                    hatch=hatch, edgecolor="black", linewidth=0.3)
    ax.set_yticks(range(len(cells)), cells)
    ax.set_title("Cell roles (blue rollout, orange train, hatched: switching)")
    if sizes:
        w = axes[1][0]
        times = [g["t_s"] for g in sizes] + [report.wall_s or sizes[-1]["t_s"]]
        values = [g["world_size"] for g in sizes]
        w.step(times, values + values[-1:], where="post", color="tab:orange")
        w.set_ylabel("trainer ranks")
        w.set_ylim(-0.2, max(values + [1]) + 0.5)
        w.set_yticks(range(0, max(values + [1]) + 1))
        w.set_xlabel("seconds since the run started")
    else:
        ax.set_xlabel("seconds since the run started")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
