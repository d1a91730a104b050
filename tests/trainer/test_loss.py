"""gspo_loss against a deliberately naive loop over executions and tokens, in value and gradient."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.trainer.loss import (
    GspoConfig,
    GspoStats,
    GspoStep,
    LossInputError,
    execution_log_ratio_sums,
    gspo_loss,
    gspo_metrics,
    gspo_pass,
)


def naive_gspo(
    logp: list[torch.Tensor],
    old: list[float],
    mu: list[float],
    texec: list[int],
    adv: list[float],
    cfg: GspoConfig,
) -> torch.Tensor:
    """SPEC §6 written out token by token, with Python control flow for the clip and max."""
    executions = sorted(set(texec))
    total = torch.zeros((), dtype=torch.float64)
    for e in executions:
        ts = [t for t in range(len(texec)) if texec[t] == e]
        s_e = torch.exp(sum((logp[t].double() - old[t] for t in ts), torch.zeros((), dtype=torch.float64)) / len(ts))
        acc = torch.zeros((), dtype=torch.float64)
        for t in ts:
            pi = torch.exp(logp[t].double())
            s_et = s_e.detach() * pi / pi.detach()
            w = min(math.exp(old[t] - mu[t]), cfg.is_cap)
            a = adv[e]
            if s_et.item() > 1 + cfg.eps_high:
                clipped = torch.tensor(1 + cfg.eps_high, dtype=torch.float64)
            elif s_et.item() < 1 - cfg.eps_low:
                clipped = torch.tensor(1 - cfg.eps_low, dtype=torch.float64)
            else:
                clipped = s_et
            unclipped_term = -a * s_et
            clipped_term = -a * clipped
            acc = acc + w * (unclipped_term if unclipped_term.item() >= clipped_term.item() else clipped_term)
        total = total + acc / len(ts)
    return total / len(executions)


def _random_case(seed: int, num_exec: int, num_targets: int, spread: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    texec = torch.randint(0, num_exec, (num_targets,), generator=g)
    texec[:num_exec] = torch.arange(num_exec)  # every execution has at least one target
    logp = -torch.rand(num_targets, generator=g, dtype=torch.float64) * 4
    # Per-execution drift of pi_theta from pi_old around the clip range, so both branches occur.
    drift = (torch.rand(num_exec, generator=g, dtype=torch.float64) * 2 - 1) * spread
    old = logp - drift[texec] + (torch.rand(num_targets, generator=g, dtype=torch.float64) - 0.5) * 1e-5
    mu = old + (torch.rand(num_targets, generator=g, dtype=torch.float64) * 2 - 1.2) * 1.5  # some w_t > C
    adv = torch.randn(num_exec, generator=g, dtype=torch.float64)
    return {"logp": logp.float(), "old": old.float(), "mu": mu.float(), "texec": texec, "adv": adv.float()}


def _compare(case: dict[str, torch.Tensor], cfg: GspoConfig) -> tuple[float, float, torch.Tensor]:
    n = case["logp"].shape[0]
    num_exec = case["adv"].shape[0]
    logp = case["logp"].clone().requires_grad_(True)
    counts = torch.bincount(case["texec"], minlength=num_exec)
    terms = gspo_loss(logp, case["old"], case["mu"], case["texec"], case["adv"], counts, config=cfg)
    terms.loss.backward()
    leaves = [case["logp"][i].clone().requires_grad_(True) for i in range(n)]
    ref = naive_gspo(
        leaves, case["old"].tolist(), case["mu"].tolist(), case["texec"].tolist(), case["adv"].tolist(), cfg
    )
    if ref.requires_grad:  # every execution clipped: the reference is a constant, its gradient zero
        ref.backward()
    # A leaf of a clipped execution gets no gradient at all (None): that is a zero.
    ref_grad = torch.stack([leaf.grad if leaf.grad is not None else torch.zeros(()) for leaf in leaves])
    return abs(terms.loss.item() - ref.item()), (logp.grad - ref_grad.float()).abs().max().item(), terms.clipped


@pytest.mark.parametrize("seed", range(6))
def test_gspo_loss_matches_naive_reference_in_value_and_gradient(seed: int) -> None:
    cfg = GspoConfig()
    case = _random_case(seed, num_exec=16, num_targets=100, spread=2e-3)
    dv, dg, clipped = _compare(case, cfg)
    assert dv <= 1e-6
    assert dg <= 1e-7
    # The drift straddles the clip range: some executions clipped, some not.
    assert 0 < int(clipped.sum()) < 16


def test_gspo_loss_covers_both_advantage_signs_and_is_truncation() -> None:
    case = _random_case(7, num_exec=10, num_targets=80, spread=8e-4)
    assert (case["adv"] > 0).any() and (case["adv"] < 0).any()
    counts = torch.bincount(case["texec"], minlength=10)
    terms = gspo_loss(case["logp"], case["old"], case["mu"], case["texec"], case["adv"], counts)
    assert terms.is_truncated.any() and (~terms.is_truncated).any()
    assert float(terms.is_weight.max()) == pytest.approx(2.0)


@settings(deadline=None)
@given(
    seed=st.integers(0, 10_000),
    num_exec=st.integers(1, 5),
    extra=st.integers(0, 20),
    spread=st.sampled_from([0.0, 2e-4, 8e-4, 5e-2]),
    eps=st.sampled_from([(3e-4, 4e-4), (0.2, 0.28)]),
)
def test_gspo_loss_matches_naive_reference_property(
    seed: int, num_exec: int, extra: int, spread: float, eps: tuple[float, float]
) -> None:
    cfg = GspoConfig(eps_low=eps[0], eps_high=eps[1])
    dv, dg, _ = _compare(_random_case(seed, num_exec, num_exec + extra, spread), cfg)
    assert dv <= 1e-6 and dg <= 1e-6


def test_split_targets_with_shared_ratio_sums_add_up_to_the_whole() -> None:
    case = _random_case(11, num_exec=5, num_targets=40, spread=3e-4)
    counts = torch.bincount(case["texec"], minlength=5)
    whole_logp = case["logp"].clone().requires_grad_(True)
    whole = gspo_loss(whole_logp, case["old"], case["mu"], case["texec"], case["adv"], counts)
    whole.loss.backward()

    parts_logp = case["logp"].clone().requires_grad_(True)
    pieces = [slice(0, 13), slice(13, 29), slice(29, 40)]
    # As the trainer does: partial sums per micro-batch, added up (all-reduced) before the loss.
    sums = sum(
        execution_log_ratio_sums(case["logp"][p], case["old"][p], case["texec"][p], 5) for p in pieces
    )
    total = sum(
        gspo_loss(
            parts_logp[p], case["old"][p], case["mu"][p], case["texec"][p], case["adv"], counts,
            num_executions=5, log_ratio_sums=sums,
        ).loss
        for p in pieces
    )
    total.backward()  # type: ignore[union-attr]
    assert abs(total.item() - whole.loss.item()) <= 1e-7  # type: ignore[union-attr]
    assert torch.allclose(parts_logp.grad, whole_logp.grad, atol=1e-8)  # type: ignore[arg-type]


def test_pass_statistics_of_split_targets_merge_into_the_statistics_of_the_whole() -> None:
    """What the engine does with `gspo_pass` per micro-batch (then an all-reduce) gives the metrics of one pass
    over every target: the counts, IS weights, staleness and the s_e behind the clip fraction."""
    case = _random_case(14, num_exec=5, num_targets=40, spread=3e-4)
    counts = torch.bincount(case["texec"], minlength=5)
    versions = torch.randint(0, 3, (40,), generator=torch.Generator().manual_seed(1))
    sums = execution_log_ratio_sums(case["logp"], case["old"], case["texec"], 5)
    step = GspoStep(advantages=case["adv"], exec_num_targets=counts, num_executions=5, log_ratio_sums=sums,
                    trainer_version=3, config=GspoConfig())

    def stats_of(p: slice) -> tuple[torch.Tensor, GspoStats]:
        return gspo_pass(step, case["logp"][p], case["old"][p], case["mu"][p], case["texec"][p], versions[p])

    whole_loss, whole = stats_of(slice(0, 40))
    merged, loss = GspoStats.zeros(5, whole_loss.device), torch.zeros(())
    for p in (slice(0, 13), slice(13, 13), slice(13, 40)):  # an empty pass changes nothing
        part_loss, part = stats_of(p)
        merged, loss = merged.merge(part), loss + part_loss
    assert float(loss) == pytest.approx(float(whole_loss), abs=1e-7)
    assert torch.allclose(merged.totals, whole.totals) and torch.equal(merged.maxima, whole.maxima)
    assert torch.allclose(merged.log_ratio_sums, sums.double())
    assert merged.targets == 40.0
    metrics, expected = gspo_metrics(step, merged), gspo_metrics(step, whole)
    assert metrics.keys() == expected.keys()
    assert all(metrics[k] == pytest.approx(expected[k], rel=1e-9) for k in metrics)
    assert metrics["staleness_max"] == float(3 - versions.min())


def test_partial_targets_without_ratio_sums_is_rejected() -> None:
    case = _random_case(12, num_exec=3, num_targets=12, spread=0.0)
    counts = torch.bincount(case["texec"], minlength=3)
    with pytest.raises(LossInputError, match="log_ratio_sums"):
        gspo_loss(case["logp"][:6], case["old"][:6], case["mu"][:6], case["texec"][:6], case["adv"], counts)


def test_on_policy_gradient_is_advantage_weighted_mean_of_logprob_gradients() -> None:
    # pi_old = mu = pi_theta: s_e = 1, w_t = 1, so grad wrt logp_t = -A_e / (|T_e| * E).
    texec = torch.tensor([0, 0, 1, 1, 1, 2])
    adv = torch.tensor([1.0, -2.0, 0.5])
    logp = torch.tensor([-1.0, -0.5, -2.0, -0.1, -0.3, -1.5], requires_grad=True)
    counts = torch.bincount(texec)
    terms = gspo_loss(logp, logp.detach(), logp.detach(), texec, adv, counts)
    terms.loss.backward()
    expected = -adv[texec] / (counts[texec].float() * 3)
    assert torch.allclose(logp.grad, expected)  # type: ignore[arg-type]
    assert terms.loss.item() == pytest.approx(-adv.mean().item())
    assert not terms.clipped.any()


def test_zero_advantage_executions_contribute_no_gradient() -> None:
    case = _random_case(13, num_exec=4, num_targets=20, spread=1e-3)
    adv = case["adv"].clone()
    adv[1] = 0.0
    logp = case["logp"].clone().requires_grad_(True)
    counts = torch.bincount(case["texec"], minlength=4)
    gspo_loss(logp, case["old"], case["mu"], case["texec"], adv, counts).loss.backward()
    assert (logp.grad[case["texec"] == 1] == 0).all()  # type: ignore[index]
