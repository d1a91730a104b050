"""`gyre rollout worker|gateway`: the rollout service's processes (the same as `python -m services.rollout`)."""

from __future__ import annotations

import typer

rollout_app = typer.Typer(help="Rollout gateway and workers.", no_args_is_help=True)


@rollout_app.command()
def worker() -> None:
    """A rollout worker for one cell (GYRE_ROLLOUT_CELL_ID), wrapping a vLLM engine."""
    from services.rollout.service import main  # the service and its engine load here: `--help` answers without

    main(["worker"])


@rollout_app.command()
def gateway() -> None:
    """The Anthropic / OpenAI gateway (GYRE_ROLLOUT_PORT) in front of the workers."""
    from services.rollout.service import main

    main(["gateway"])
