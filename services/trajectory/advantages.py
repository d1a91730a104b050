"""Group-relative advantages: A_e = (r_e − mean_G r) / (std_G r + ε) over the G executions of one query (SPEC §5).

Pure: rewards arrive as data (timed-out executions included, scored on their preserved work).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_EPS = 1e-6
# Below this the group's rewards are treated as identical: the advantage carries no signal.
ZERO_VARIANCE_STD = 1e-9


class AdvantageError(ValueError):
    pass


@dataclass(frozen=True)
class ExecutionReward:
    execution_id: str
    query_id: str
    reward: float
    timed_out: bool = False


@dataclass(frozen=True)
class Advantage:
    execution_id: str
    query_id: str
    reward: float
    advantage: float
    zero_variance: bool
    timed_out: bool


@dataclass(frozen=True)
class GroupSummary:
    query_id: str
    size: int
    mean: float
    std: float
    zero_variance: bool
    dropped: bool


@dataclass(frozen=True)
class AdvantageResult:
    advantages: tuple[Advantage, ...]  # kept executions, grouped by query id (sorted), input order inside
    groups: tuple[GroupSummary, ...]

    def by_execution(self) -> dict[str, Advantage]:
        return {a.execution_id: a for a in self.advantages}


def compute_advantages(
    rewards: Sequence[ExecutionReward],
    *,
    eps: float = DEFAULT_EPS,
    drop_zero_variance: bool = False,
    group_size: int | None = None,
) -> AdvantageResult:
    """Advantages per query group. `std` is the population standard deviation of the group's rewards.

    With `group_size` set, every group must hold exactly that many executions (else AdvantageError).
    Zero-variance groups are flagged; with `drop_zero_variance` they are left out of `advantages`.
    """
    if eps < 0:
        raise AdvantageError(f"eps must be >= 0, got {eps}")
    groups: dict[str, list[ExecutionReward]] = {}
    seen: set[str] = set()
    for r in rewards:
        if r.execution_id in seen:
            raise AdvantageError(f"execution {r.execution_id} has more than one reward")
        seen.add(r.execution_id)
        if not np.isfinite(r.reward):
            raise AdvantageError(f"execution {r.execution_id}: reward must be finite, got {r.reward}")
        groups.setdefault(r.query_id, []).append(r)
    out: list[Advantage] = []
    summaries: list[GroupSummary] = []
    for query_id in sorted(groups):
        members = groups[query_id]
        if group_size is not None and len(members) != group_size:
            raise AdvantageError(f"query {query_id}: expected a group of {group_size} executions, got {len(members)}")
        values = np.array([m.reward for m in members], dtype=np.float64)
        mean = float(values.mean())
        std = float(values.std())
        flat = std <= ZERO_VARIANCE_STD
        summaries.append(GroupSummary(query_id, len(members), mean, std, flat, flat and drop_zero_variance))
        if flat and drop_zero_variance:
            continue
        adv = np.zeros_like(values) if flat else (values - mean) / (std + eps)
        out.extend(
            Advantage(m.execution_id, query_id, float(m.reward), float(a), flat, m.timed_out)
            for m, a in zip(members, adv, strict=True)
        )
    return AdvantageResult(tuple(out), tuple(summaries))
