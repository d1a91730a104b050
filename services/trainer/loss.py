"""The GSPO-adapted policy loss of SPEC §6 as a pure function over per-target tensors, plus its metrics: one
pass's loss and statistics (`gspo_pass`) and a step's metrics from them (`gspo_metrics`).

No I/O, no randomness, no collectives: the trainer feeds it logprobs from packed forwards and all-reduces the
statistics; tests compare it to a loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class LossInputError(Exception):
    pass


@dataclass(frozen=True)
class GspoConfig:
    eps_low: float = 3e-4
    eps_high: float = 4e-4
    is_cap: float = 2.0  # C: truncation of the rollout/trainer importance weight


@dataclass(frozen=True)
class GspoTerms:
    """The loss contribution of some targets and the per-target quantities behind it."""

    loss: torch.Tensor  # scalar: sum_t L_{e,t} / (|T_e| * num_executions) over the given targets
    seq_ratio: torch.Tensor  # [E] s_e (detached) for every execution
    clipped: torch.Tensor  # [E] bool: the clipped branch is the active one for execution e
    is_weight: torch.Tensor  # [T] w_t (detached)
    is_truncated: torch.Tensor  # [T] bool: w_t hit the cap C


def execution_log_ratio_sums(
    logp: torch.Tensor, old_logp: torch.Tensor, target_exec: torch.Tensor, num_executions: int
) -> torch.Tensor:
    """sum_{t in T_e} (log pi_theta,t - log pi_old,t) per execution [E], detached (fp64 for stable sums).

    Summed over the targets given; when an execution's targets span micro-batches or ranks, add these
    partial sums together (all-reduce) before calling `gspo_loss`.
    """
    diff = (logp.detach() - old_logp.detach()).double()
    return torch.zeros(num_executions, dtype=torch.float64, device=logp.device).index_add_(0, target_exec, diff)


def gspo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    target_exec: torch.Tensor,
    advantages: torch.Tensor,
    exec_num_targets: torch.Tensor,
    *,
    num_executions: int | None = None,
    log_ratio_sums: torch.Tensor | None = None,
    config: GspoConfig = GspoConfig(),
) -> GspoTerms:
    """GSPO loss of SPEC §6 over a set of targets (a micro-batch, or the whole batch).

    For execution e with unique targets T_e:
        s_e     = exp( mean_{t in T_e} (log pi_theta,t - log pi_old,t) )
        s_{e,t} = sg[s_e] * pi_theta,t / sg[pi_theta,t]        (value s_e; gradient sg[s_e] * grad log pi_theta,t)
        w_t     = min( exp(log pi_old,t - log mu_t), C )       (stop-gradient)
        L_{e,t} = w_t * max( -A_e s_{e,t}, -A_e clip(s_{e,t}, 1 - eps_low, 1 + eps_high) )
        loss    = mean_e mean_{t in T_e} L_{e,t}

    The returned loss is this sum restricted to the given targets, each divided by |T_e| and by the number of
    executions, so the contributions of disjoint target sets (micro-batches, ranks) add up to the full loss
    and their gradients add up to its gradient.

    logp: [T] current logprobs (carries the gradient); old_logp, behaviour_logp: [T] (no gradient used);
    target_exec: [T] execution index of each target; advantages, exec_num_targets: [E] over the whole batch.
    num_executions: the E in mean_e (default: executions with at least one target).
    log_ratio_sums: [E] sums of (logp - old_logp) over ALL of T_e (see `execution_log_ratio_sums`); when
    omitted the given targets must be all targets of their executions.
    """
    num_targets = logp.shape[0]
    for name, t in (("old_logp", old_logp), ("behaviour_logp", behaviour_logp), ("target_exec", target_exec)):
        if t.shape != (num_targets,):
            raise LossInputError(f"{name} has shape {tuple(t.shape)}, expected ({num_targets},) like logp")
    num_exec = advantages.shape[0]
    if exec_num_targets.shape != (num_exec,):
        raise LossInputError(f"exec_num_targets has shape {tuple(exec_num_targets.shape)}, expected ({num_exec},)")
    counts = exec_num_targets.to(torch.float64)
    if num_executions is None:
        num_executions = int((exec_num_targets > 0).sum())
    if log_ratio_sums is None:
        log_ratio_sums = execution_log_ratio_sums(logp, old_logp, target_exec, num_exec)
        present = torch.zeros(num_exec, dtype=torch.float64, device=logp.device).index_add_(
            0, target_exec, torch.ones(num_targets, dtype=torch.float64, device=logp.device)
        )
        if bool((present != counts)[present > 0].any()):
            raise LossInputError(
                "some executions have targets outside the given set (exec_num_targets exceeds the targets "
                "present); pass log_ratio_sums summed over all of their targets"
            )
    if log_ratio_sums.shape != (num_exec,):
        raise LossInputError(f"log_ratio_sums has shape {tuple(log_ratio_sums.shape)}, expected ({num_exec},)")

    # s_e from the sum over all of T_e; fp64 so that 1 - s_e is exact enough next to eps of 3e-4.
    mean_log_ratio = torch.where(counts > 0, log_ratio_sums.double() / counts.clamp(min=1), torch.zeros_like(counts))
    seq_ratio = torch.exp(mean_log_ratio)

    lp = logp.double()
    s_e = seq_ratio[target_exec]
    s_et = s_e * torch.exp(lp - lp.detach())  # value s_e, gradient s_e * d log pi
    adv = advantages.to(torch.float64)[target_exec]
    unclipped = -adv * s_et
    clipped_term = -adv * torch.clamp(s_et, 1.0 - config.eps_low, 1.0 + config.eps_high)
    raw_w = torch.exp(old_logp.detach().double() - behaviour_logp.detach().double())
    w = torch.clamp(raw_w, max=config.is_cap)
    per_target = w * torch.maximum(unclipped, clipped_term)
    scale = 1.0 / (counts[target_exec].clamp(min=1) * max(num_executions, 1))
    loss = (per_target * scale).sum().to(logp.dtype)

    adv_e = advantages.to(torch.float64)
    lo, hi = 1.0 - config.eps_low, 1.0 + config.eps_high
    # The clipped branch is active (and the gradient zero) when it is strictly larger than the unclipped one.
    clip_active = ((adv_e > 0) & (seq_ratio > hi)) | ((adv_e < 0) & (seq_ratio < lo))
    return GspoTerms(
        loss=loss,
        seq_ratio=seq_ratio.detach(),
        clipped=clip_active & (counts > 0),
        is_weight=w.detach(),
        is_truncated=(raw_w > config.is_cap).detach(),
    )


def staleness(policy_version: torch.Tensor, trainer_version: int) -> torch.Tensor:
    """Versions between the policy that generated each target and the one being trained."""
    return trainer_version - policy_version


# ---- one optimiser step's passes: the per-pass loss and the step's metrics ----------------------------------


@dataclass(frozen=True)
class GspoStep:
    """What every pass of one optimiser step shares: the batch-wide quantities `gspo_loss` normalises by."""

    advantages: torch.Tensor  # [E]
    exec_num_targets: torch.Tensor  # [E] |T_e| over the whole batch
    num_executions: int  # executions with at least one target
    log_ratio_sums: torch.Tensor | None  # [E] over all of T_e (all-reduced), or None when no execution is split
    trainer_version: int  # the policy version being trained (for staleness)
    config: GspoConfig


@dataclass(frozen=True)
class GspoStats:
    """Statistics of some targets towards a step's metrics (fp64, detached); passes and ranks add up (`merge`,
    or an all-reduce: SUM on `totals` and `log_ratio_sums`, MAX on `maxima`)."""

    totals: torch.Tensor  # [5]: targets, Σ w_t, truncated, Σ |log π_old − log μ|, Σ staleness
    maxima: torch.Tensor  # [2]: max w_t, max staleness (−1e30 while no target was seen)
    log_ratio_sums: torch.Tensor  # [E] Σ (log π_θ − log π_old) per execution, at the weights of the passes

    @classmethod
    def zeros(cls, num_executions: int, device: torch.device) -> GspoStats:
        return cls(
            totals=torch.zeros(5, dtype=torch.float64, device=device),
            maxima=torch.full((2,), -1e30, dtype=torch.float64, device=device),
            log_ratio_sums=torch.zeros(num_executions, dtype=torch.float64, device=device),
        )

    @property
    def targets(self) -> float:
        return float(self.totals[0])

    def merge(self, other: GspoStats) -> GspoStats:
        return GspoStats(
            totals=self.totals + other.totals,
            maxima=torch.maximum(self.maxima, other.maxima),
            log_ratio_sums=self.log_ratio_sums + other.log_ratio_sums,
        )


def gspo_pass(
    step: GspoStep,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    target_exec: torch.Tensor,
    policy_version: torch.Tensor,
) -> tuple[torch.Tensor, GspoStats]:
    """The loss of one pass's targets (its gradient is this pass's share of the step's) and their statistics."""
    num_exec = step.advantages.shape[0]
    terms = gspo_loss(
        logp,
        old_logp,
        behaviour_logp,
        target_exec,
        step.advantages,
        step.exec_num_targets,
        num_executions=step.num_executions,
        log_ratio_sums=step.log_ratio_sums,
        config=step.config,
    )
    stats = GspoStats.zeros(num_exec, logp.device)
    stale = staleness(policy_version, step.trainer_version).double()
    n = logp.shape[0]
    totals = stats.totals + torch.stack(
        [
            torch.tensor(float(n), dtype=torch.float64, device=logp.device),
            terms.is_weight.sum(),
            terms.is_truncated.double().sum(),
            (old_logp.double() - behaviour_logp.double()).abs().sum(),
            stale.sum(),
        ]
    )
    maxima = torch.maximum(stats.maxima, torch.stack([terms.is_weight.max(), stale.max()])) if n else stats.maxima
    ratio_sums = stats.log_ratio_sums + execution_log_ratio_sums(logp, old_logp, target_exec, num_exec)
    return terms.loss, GspoStats(totals=totals, maxima=maxima, log_ratio_sums=ratio_sums)


def gspo_metrics(step: GspoStep, stats: GspoStats) -> dict[str, float]:
    """The step's loss metrics from the statistics of all of its targets (after the all-reduce over ranks):
    `s_e` at the weights the passes ran with, and the clip fraction it implies."""
    counts = step.exec_num_targets
    has = counts > 0
    s_e = torch.exp(stats.log_ratio_sums[has] / counts[has].double())
    adv = step.advantages.double()[has]
    lo, hi = 1.0 - step.config.eps_low, 1.0 + step.config.eps_high
    clipped = ((adv > 0) & (s_e > hi)) | ((adv < 0) & (s_e < lo))
    totals, maxima = stats.totals, stats.maxima
    targets = max(float(totals[0]), 1.0)
    any_execution = step.num_executions > 0
    return {
        "clip_fraction": float(clipped.double().mean()) if any_execution else 0.0,
        "seq_ratio_mean": float(s_e.mean()) if any_execution else 1.0,
        "seq_ratio_min": float(s_e.min()) if any_execution else 1.0,
        "seq_ratio_max": float(s_e.max()) if any_execution else 1.0,
        "is_weight_mean": float(totals[1]) / targets,
        "is_weight_max": float(maxima[0]) if totals[0] > 0 else 1.0,
        "is_truncated_fraction": float(totals[2]) / targets,
        "old_behaviour_abs_diff": float(totals[3]) / targets,
        "staleness_mean": float(totals[4]) / targets,
        "staleness_max": float(maxima[1]) if totals[0] > 0 else 0.0,
    }
