"""`gyre scheduler …`: run the live scheduler (`serve`) or a node's cell agent (`cell`).

Options override the matching `GYRE_…` environment variables; everything else comes from the environment
(see docs/operating.md).
"""

from __future__ import annotations

import os
from typing import Annotated, Optional

import typer

scheduler_app = typer.Typer(help="The live scheduler and the cell agents.", no_args_is_help=True)


def _override(**values: object) -> None:
    for name, value in values.items():
        if value is not None:
            os.environ[name] = str(value)


@scheduler_app.command()
def serve(
    mode: Annotated[Optional[str], typer.Option(help="async, colocate or elastic (GYRE_MODE).")] = None,
    tasks: Annotated[Optional[str], typer.Option(help="Comma-separated task ids (GYRE_SCHEDULER_TASK_IDS).")] = None,
    steps: Annotated[Optional[int], typer.Option(help="Training steps (GYRE_SCHEDULER_TOTAL_STEPS).")] = None,
    queries_per_step: Annotated[Optional[int], typer.Option(help="GYRE_SCHEDULER_QUERIES_PER_STEP.")] = None,
    seed: Annotated[Optional[int], typer.Option(help="Run seed for tasks and samples (GYRE_SCHEDULER_SEED).")] = None,
    tick: Annotated[Optional[float], typer.Option(help="Seconds between decisions (GYRE_SCHEDULER_TICK_S).")] = None,
) -> None:
    """Run the live scheduler for GYRE_RUN_ID: assign cells and dispatch queries until the last step."""
    from services.scheduler.service import main

    _override(
        GYRE_MODE=mode, GYRE_SCHEDULER_TASK_IDS=tasks, GYRE_SCHEDULER_TOTAL_STEPS=steps,
        GYRE_SCHEDULER_QUERIES_PER_STEP=queries_per_step, GYRE_SCHEDULER_SEED=seed, GYRE_SCHEDULER_TICK_S=tick,
    )
    main()


@scheduler_app.command()
def cell(
    cells: Annotated[Optional[int], typer.Option(help="Cells on this node (GYRE_CELL_COUNT).")] = None,
    node_id: Annotated[Optional[str], typer.Option(help="Node id; cells are <node>-cell<i> (GYRE_CELL_NODE_ID).")] = None,
    device: Annotated[Optional[str], typer.Option(help="cpu or cuda (GYRE_CELL_DEVICE).")] = None,
    accelerators: Annotated[Optional[int], typer.Option(help="Accelerators per cell (GYRE_CELL_ACCELERATORS).")] = None,
    warm: Annotated[Optional[bool], typer.Option(
        "--warm/--restart",
        help="Keep both roles' processes on a cell and switch between them, or restart on each switch "
             "(GYRE_CELL_WARM).")] = None,
) -> None:
    """Run this node's cell agent: register its cells and run what the scheduler orders on them."""
    from services.scheduler.cell_agent import main

    _override(GYRE_CELL_COUNT=cells, GYRE_CELL_NODE_ID=node_id, GYRE_CELL_DEVICE=device,
              GYRE_CELL_ACCELERATORS=accelerators, GYRE_CELL_WARM=None if warm is None else int(warm))
    main()
