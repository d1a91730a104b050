"""What the dashboard shows, computed from a run's events alone (pure): the curves and the cell timeline as
plotly figures (JSON the page hands to plotly.js unchanged), the executions with their calls, and one
execution's trajectory tree as an icicle chart.

The curves and the timeline are the run report's (gyre/report.py), so the page and `report.json` agree; a
figure is data, never pixels: the page draws it.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from gyre.report import RunReport, build_report
from services.trajectory.cap import cap_tree
from services.trajectory.replay import ExecutionReplay
from shared.events import (
    CallCompleted,
    CallRefused,
    Event,
    ExecutionBranched,
    ExecutionFinished,
    ExecutionResumed,
    ExecutionScored,
    ExecutionStarted,
    ExecutionTimedOut,
)

ROLE_COLOURS = {"rollout": "#1f77b4", "train": "#ff7f0e", "idle": "#c7c7c7"}
KIND_COLOURS = {"root": "#4c78a8", "continuation": "#72b7b2", "retry": "#e45756", "compaction": "#f58518",
                "delegation": "#54a24b", "fork": "#b279a2"}
DROPPED = "#d9d9d9"  # a node on no trajectory the cap kept: its targets do not train
MARGIN = {"l": 60, "r": 20, "t": 40, "b": 40}
LAYOUT: dict[str, Any] = {"margin": MARGIN, "template": "plotly_white", "height": 380}


def _figure(fig: go.Figure) -> dict[str, Any]:
    """A figure as the JSON plotly.js takes (numpy arrays and all made plain)."""
    out: dict[str, Any] = json.loads(fig.to_json())
    return out


# ---- executions ----------------------------------------------------------------------------------


@dataclass
class ExecutionRow:
    execution_id: str
    task_id: str
    query_id: str
    step: int
    sample: int
    started_s: float
    status: str = "running"  # running | finished | timed out | scored | infra failure
    calls: int = 0
    prompt_tokens: int = 0  # of the newest call: the context the execution has reached
    completion_tokens: int = 0  # generated over all its calls
    last_call_s: float | None = None
    reward: float | None = None
    stop_reason: str | None = None
    refusals: int = 0
    resumes: int = 0
    branches: dict[str, int] = field(default_factory=dict)


def executions(events: Sequence[Event]) -> list[ExecutionRow]:
    """Every execution of the run with its progress, the running ones first, newest first within each."""
    t0 = events[0].occurred_at if events else None
    rows: dict[str, ExecutionRow] = {}

    def at(event: Event) -> float:
        assert t0 is not None
        return round((event.occurred_at - t0).total_seconds(), 3)

    for event in events:
        data = event.data
        if isinstance(data, ExecutionStarted):
            rows[data.execution_id] = ExecutionRow(data.execution_id, data.task_id, data.query_id, data.step,
                                                   data.sample_index, at(event))
            continue
        row = rows.get(getattr(data, "execution_id", ""))
        if row is None:
            continue
        if isinstance(data, CallCompleted):
            row.calls += 1
            row.prompt_tokens = data.prompt_tokens
            row.completion_tokens += data.completion_tokens
            row.last_call_s = at(event)
        elif isinstance(data, CallRefused):
            row.refusals += 1
        elif isinstance(data, ExecutionBranched):
            row.branches[data.kind] = row.branches.get(data.kind, 0) + 1
        elif isinstance(data, ExecutionResumed):
            row.resumes += 1
        elif isinstance(data, ExecutionFinished):
            row.status, row.stop_reason = "finished", data.stop_reason
        elif isinstance(data, ExecutionTimedOut):
            row.status, row.stop_reason = "timed out", data.budget
        elif isinstance(data, ExecutionScored):
            row.reward = data.reward
            row.status = "infra failure" if data.infra_failure else "scored"
            if data.infra_failure:
                row.stop_reason = data.infra_failure
    return sorted(rows.values(), key=lambda r: (r.status != "running", -r.started_s))


def calls_of(events: Sequence[Event], execution_id: str) -> list[dict[str, Any]]:
    """The calls of one execution as the log recorded them (the summary of each `call.completed`)."""
    t0 = events[0].occurred_at if events else None
    out = []
    for event in events:
        data = event.data
        if isinstance(data, CallCompleted) and data.execution_id == execution_id:
            assert t0 is not None
            row = data.model_dump(mode="json", exclude={"record"})
            out.append({**row, "t_s": round((event.occurred_at - t0).total_seconds(), 3),
                        "record": data.record.digest})
    return sorted(out, key=lambda c: c["call_index"])


# ---- a run ---------------------------------------------------------------------------------------


def curves_figure(report: RunReport) -> dict[str, Any]:
    """Reward and pass rate per step over the loss per step."""
    steps = [r.step for r in report.steps]
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=("reward and pass rate", "loss"))
    fig.add_trace(go.Scatter(x=steps, y=[r.mean_reward for r in report.steps], name="mean reward",
                             mode="lines+markers"), row=1, col=1)
    fig.add_trace(go.Scatter(x=steps, y=[r.pass_rate for r in report.steps], name="pass rate",
                             mode="lines+markers", line={"dash": "dot"}), row=1, col=1)
    trained = [r for r in report.steps if r.loss is not None]
    fig.add_trace(go.Scatter(x=[r.step for r in trained], y=[r.loss for r in trained], name="loss",
                             mode="lines+markers", line={"color": "#7f7f7f"}), row=2, col=1)
    fig.update_xaxes(title_text="step", row=2, col=1)
    fig.update_layout(**{**LAYOUT, "height": 420, "margin": {**MARGIN, "t": 80}},
                      legend={"orientation": "h", "y": 1.08, "yanchor": "bottom"})
    return _figure(fig)


def timeline_figure(report: RunReport) -> dict[str, Any]:
    """Each cell's role over the run (a switch hatched, in the colour of the role it moves to), each switch's
    phases on hover at its end, and the trainer's world size below."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.75, 0.25], vertical_spacing=0.06)
    cells = sorted({s["cell_id"] for s in report.timeline} | {s["cell_id"] for s in report.switches})
    for label in sorted({s["role"] for s in report.timeline}):
        segs = [s for s in report.timeline if s["role"] == label]
        role = label.split(" ")[0]
        switching = label.endswith("(switching)")
        fig.add_trace(go.Bar(
            y=[s["cell_id"] for s in segs], x=[s["end_s"] - s["start_s"] for s in segs],
            base=[s["start_s"] for s in segs], orientation="h", name=label,
            marker={"color": ROLE_COLOURS.get(role, "#8c564b"), "pattern": {"shape": "/" if switching else ""},
                    "line": {"width": 0.5, "color": "black"}},
            hovertemplate=f"{label}<br>%{{y}}: %{{base:.1f}} s → %{{x:.1f}} s long<extra></extra>",
        ), row=1, col=1)
    done = [s for s in report.switches if s.get("seconds") is not None]
    fig.add_trace(go.Scatter(
        x=[s["start_s"] + s["seconds"] for s in done], y=[s["cell_id"] for s in done], mode="markers",
        name="switch done", marker={"symbol": "diamond", "size": 9, "color": "black"},
        text=[_switch_text(s) for s in done], hovertemplate="%{text}<extra></extra>",
    ), row=1, col=1)
    sizes = report.world_sizes
    fig.add_trace(go.Scatter(x=[w["t_s"] for w in sizes], y=[w["world_size"] for w in sizes], mode="lines+markers",
                             line={"shape": "hv", "color": ROLE_COLOURS["train"]}, name="trainer world size",
                             text=[w["reason"] for w in sizes], hovertemplate="%{y} ranks: %{text}<extra></extra>"),
                  row=2, col=1)
    fig.update_yaxes(categoryorder="array", categoryarray=cells[::-1], row=1, col=1)
    fig.update_yaxes(title_text="ranks", rangemode="tozero", dtick=1, row=2, col=1)
    fig.update_xaxes(title_text="seconds since the run's first event", row=2, col=1)
    fig.update_layout(**{**LAYOUT, "height": 220 + 40 * max(1, len(cells)), "margin": {**MARGIN, "t": 80}},
                      barmode="overlay",
                      legend={"orientation": "h", "y": 1.02, "yanchor": "bottom"})
    return _figure(fig)


def _switch_text(s: dict[str, Any]) -> str:
    phases = ", ".join(f"{k} {v:.2f} s" for k, v in s.get("phases", {}).items())
    moved = ", ".join(f"{v} by {k}" for k, v in s.get("sessions_moved", {}).items())
    return (f"{s['cell_id']}: {s['from_role']} → {s['to_role']} in {s['seconds']:.2f} s"
            f"{' (warm)' if s.get('warm') else ''}<br>{phases or 'no phases'}"
            + (f"<br>sessions moved: {moved}" if moved else ""))


def run_view(run_id: str, events: Sequence[Event], *, position: int) -> dict[str, Any]:
    """Everything the page shows for one run, as of log position `position`."""
    report = build_report(run_id, events)
    rows = executions(events)
    states = Counter(r.status for r in rows)
    last = report.steps[-1] if report.steps else None
    return {
        "run_id": run_id,
        "position": position,
        "summary": {
            "events": len(events), "wall_s": round(report.wall_s or 0.0, 1), "steps": len(report.steps),
            "reward_last": last.mean_reward if last else None, "pass_rate_last": last.pass_rate if last else None,
            "executions": dict(states), "branches": report.branches,
            "dedup_factor": report.dedup_factor, "trajectories_before_cap": report.trajectories_before_cap,
            "trajectories_after_cap": report.trajectories_after_cap, "switches": len(report.switches),
            "migrations": report.migrations, "infra_failures": report.infra_failures,
            "resumed_executions": report.resumed_executions,
        },
        "curves": curves_figure(report),
        "timeline": timeline_figure(report),
        "switches": report.switches[-50:],
        "executions": [asdict(r) for r in rows[:500]],
    }


# ---- a tree --------------------------------------------------------------------------------------


def tree_view(replayed: ExecutionReplay, *, cap_k: int, levels_shown: int = 10) -> dict[str, Any]:
    """One execution's trajectory tree as an icicle: a box per radix node (a run of tokens shared by every
    trajectory below it), as wide as the trajectories through it, coloured by the kind of branch that created
    it; a node on no trajectory the cap (`cap_k`) keeps is grey, its targets untrained. Each box carries the
    call that created it, for the link to the recorded call. Clicking a box zooms into it (a deep tree shows
    `levels_shown` levels at a time)."""
    tree = replayed.tree
    kinds = {c.call_index: c.kind for c in tree.calls}
    chains = {c.call_index: c.chain_id for c in tree.calls}
    leaves = [int(x) for x in tree.leaves()]
    kept: set[int] = set()
    through: Counter[int] = Counter()  # trajectories through each node
    for leaf in leaves:
        through.update(tree.node_path(leaf))
    capped = cap_tree(tree, cap_k) if tree.num_nodes else None
    for leaf in capped.kept_leaves if capped else ():
        kept.update(tree.node_path(leaf))
    roots = [n for n in range(tree.num_nodes) if int(tree.node_parent[n]) < 0]
    forest = len(roots) != 1  # calls that share no first token: one box above the roots holds them together
    ids, parents, labels, values, colours = (["tree"], [""], ["execution"], [len(leaves)], ["white"]) if forest \
        else ([], [], [], [], [])
    nodes: list[dict[str, Any]] = []
    level: dict[int, int] = {}
    for node in range(tree.num_nodes):
        start, length = int(tree.node_start[node]), int(tree.node_len[node])
        first = int(tree.node_first_call[node])
        kind = kinds.get(first, "root")
        targets = int(tree.is_target[start:start + length].sum())
        parent = int(tree.node_parent[node])
        level[node] = level[parent] + 1 if parent >= 0 else 0
        ids.append(f"n{node}")
        parents.append(f"n{parent}" if parent >= 0 else ("tree" if forest else ""))
        labels.append(f"call {first} · {kind}")
        values.append(through[node])
        colours.append(KIND_COLOURS.get(kind, "#9d755d") if node in kept else DROPPED)
        nodes.append({"node": node, "call_index": first, "kind": kind, "chain": chains.get(first, "main"),
                      "tokens": length, "targets": targets, "depth": int(tree.depth[start]),
                      "trajectories": through[node], "trains": node in kept and targets > 0})
    custom = [[c["call_index"], c["kind"], c["tokens"], c["targets"], c["trajectories"], c["trains"]] for c in nodes]
    fig = go.Figure(go.Icicle(
        ids=ids, parents=parents, labels=labels, values=values, branchvalues="total",
        marker={"colors": colours, "line": {"width": 1, "color": "white"}}, tiling={"orientation": "v"},
        customdata=([[None, "", 0, 0, len(leaves), False]] if forest else []) + custom,
        texttemplate="%{label}<br>%{customdata[2]} tok, %{customdata[3]} generated",
        hovertemplate=("%{label}<br>%{customdata[2]} tokens, %{customdata[3]} generated"
                       "<br>shared by %{customdata[4]} trajectories<br>trains: %{customdata[5]}<extra></extra>"),
        maxdepth=levels_shown, sort=False,
    ))
    shown = min(levels_shown, max(level.values(), default=0) + 1 + int(forest))
    fig.update_layout(**{**LAYOUT, "height": min(840, 120 + 90 * shown),
                         "margin": {"l": 10, "r": 10, "t": 10, "b": 10}})
    return {
        "execution_id": replayed.execution_id, "query_id": replayed.query_id, "step": replayed.step,
        "status": replayed.status, "reward": replayed.reward, "advantage": replayed.advantage,
        "digest": replayed.digest, "stats": tree.stats().as_dict(), "cap_k": cap_k,
        "trajectories": len(leaves), "trajectories_kept": len(capped.kept_leaves) if capped else 0,
        "targets_kept": capped.kept_targets if capped else 0,
        "targets_dropped": capped.dropped_targets if capped else 0,
        "kinds": {k: KIND_COLOURS[k] for k in sorted({c["kind"] for c in nodes} & KIND_COLOURS.keys())},
        "nodes": nodes,
        "figure": _figure(fig),
    }
