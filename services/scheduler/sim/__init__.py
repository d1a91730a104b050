"""The cluster simulator: drives the scheduler's own policy objects on a discrete-event model."""

from __future__ import annotations

from services.scheduler.sim.runner import run_sim

__all__ = ["run_sim"]
