"""Packing equivalence: one packed forward over a tree equals separate flat forwards of each trajectory."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.trainer.loss import GspoConfig, gspo_loss
from services.trainer.packed_forward import (
    ancestor_mask,
    packed_logprobs,
    to_tensors,
    tree_attention_plan,
    tree_block_mask,
)
from tests.trainer.trainer_trees import Step, Trajectory, flat_logprobs, pack, random_trajectories, tiny_model

TOL = 1e-5


@pytest.fixture(scope="module")
def qwen3() -> torch.nn.Module:
    return tiny_model("qwen3")


def _check_equivalence(model: torch.nn.Module, trajs: list[Trajectory], attention: str, **kw: object) -> float:
    mb, positions = pack(trajs)
    batch = to_tensors(mb)
    with torch.no_grad():
        packed = packed_logprobs(model, batch, attention=attention, **kw)  # type: ignore[arg-type]
        by_pos = {int(p): float(v) for p, v in zip(mb.target_pos, packed, strict=True)}
        worst = 0.0
        checked = 0
        for tr, path in zip(trajs, positions, strict=True):
            flat = flat_logprobs(model, [s.token for s in tr.steps])
            for i in range(1, len(path)):
                if path[i] in by_pos:
                    worst = max(worst, abs(by_pos[path[i]] - float(flat[i - 1])))
                    checked += 1
    assert checked >= len(by_pos)
    return worst


def test_ancestor_mask_allows_exactly_ancestors_in_a_hand_built_tree() -> None:
    # Tree: 0 -> 1 -> {2, 3 -> 4}; second tree 5 -> 6.
    ends = torch.tensor([5, 5, 3, 5, 5, 7, 7])
    mask = ancestor_mask(ends)
    parents = {0: None, 1: 0, 2: 1, 3: 1, 4: 3, 5: None, 6: 5}

    def ancestors(q: int) -> set[int]:
        out = {q}
        while parents[q] is not None:
            q = parents[q]  # type: ignore[assignment]
            out.add(q)
        return out

    for q in range(7):
        assert {k for k in range(7) if mask[q, k]} == ancestors(q)


@pytest.mark.parametrize("attention", ["dense", "tree", "flex"])
def test_packed_logprobs_equal_flat_forwards_on_branched_trees(qwen3: torch.nn.Module, attention: str) -> None:
    rng = np.random.default_rng(1)
    trajs = random_trajectories(rng, executions=3, branches=4, vocab=97)
    assert _check_equivalence(qwen3, trajs, attention) <= TOL


def test_tree_attention_with_small_chunks_matches_flat(qwen3: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    # Chunks of 5 tokens cut through branches, so each chunk's key set mixes ancestors and its own tokens.
    import services.trainer.packed_forward as pf

    real = pf.tree_attention_plan
    monkeypatch.setattr(pf, "tree_attention_plan", lambda ends, dtype: real(ends, dtype, chunk=5))
    trajs = random_trajectories(np.random.default_rng(2), executions=2, branches=5, vocab=97)
    assert _check_equivalence(qwen3, trajs, "tree") <= TOL


def test_tree_attention_plan_keys_are_only_ancestors_of_the_chunk() -> None:
    ends = torch.tensor([8, 4, 3, 4, 8, 6, 8, 8])  # 0 -> {1 -> {2, 3}, 4 -> {5, 6 -> 7}}
    plan = tree_attention_plan(ends, torch.float32, chunk=2)
    keys = [c.keys.tolist() for c in plan]
    assert keys == [[0, 1], [0, 1, 2, 3], [0, 4, 5], [0, 4, 6, 7]]


def _blocks(counts: torch.Tensor, indices: torch.Tensor) -> set[tuple[int, int]]:
    return {(row, int(indices[0, 0, row, j])) for row in range(counts.shape[-1]) for j in range(int(counts[0, 0, row]))}


def _tree_ends(shape: str, block: int) -> torch.Tensor:
    if shape == "one-chain":  # a single trajectory, not a whole number of blocks long
        return torch.full((1000,), 1000)
    if shape == "block-edges":  # a prefix of 4 blocks, then two branches of 2 blocks: subtrees end on edges
        return torch.tensor([8 * block] * (4 * block) + [6 * block] * (2 * block) + [8 * block] * (2 * block))
    prefix = {"branchy": 6, "shared-prefix": 100}[shape]
    trajs = random_trajectories(np.random.default_rng(prefix + block), executions=3, branches=4, vocab=97,
                                prefix=prefix, suffix=4)
    return to_tensors(pack(trajs)[0]).subtree_end


@pytest.mark.parametrize("shape", ["branchy", "shared-prefix", "one-chain", "block-edges"])
@pytest.mark.parametrize("block", [16, 128])
def test_tree_block_mask_has_the_blocks_of_the_dense_construction(shape: str, block: int) -> None:
    """The BlockMask built from subtree_end in O((L/block)²) lists the same partial and full blocks, both ways,
    as torch's `create_block_mask`, which evaluates the whole [L, L] grid."""
    from torch.nn.attention.flex_attention import create_block_mask

    ends = _tree_ends(shape, block)
    length = int(ends.shape[0])
    ours = tree_block_mask(ends, block=block)
    dense = create_block_mask(lambda b, h, q, kv: (kv <= q) & (q < ends[kv]), None, None, length, length,
                              device="cpu", BLOCK_SIZE=block)
    for side in ("kv", "q"):
        for kind in ("", "full_"):
            theirs = _blocks(getattr(dense, f"{kind}{side}_num_blocks"), getattr(dense, f"{kind}{side}_indices"))
            assert _blocks(getattr(ours, f"{kind}{side}_num_blocks"), getattr(ours, f"{kind}{side}_indices")) == theirs
    assert _blocks(ours.full_kv_num_blocks, ours.full_kv_indices) or shape not in ("one-chain", "block-edges")


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_packed_forward_supports_qwen2_and_llama(arch: str) -> None:
    model = tiny_model(arch, seed=3)
    trajs = random_trajectories(np.random.default_rng(3), executions=2, branches=3, vocab=97)
    assert _check_equivalence(model, trajs, "dense") <= TOL
    assert _check_equivalence(model, trajs, "tree") <= TOL


def test_threshold_switches_to_tree_attention_with_same_result(qwen3: torch.nn.Module) -> None:
    trajs = random_trajectories(np.random.default_rng(4), executions=2, branches=3, vocab=97)
    mb, _ = pack(trajs)
    batch = to_tensors(mb)
    with torch.no_grad():
        dense = packed_logprobs(qwen3, batch, flex_threshold=10_000)
        assert qwen3.config._attn_implementation == "sdpa"
        sparse = packed_logprobs(qwen3, batch, flex_threshold=4)
        assert qwen3.config._attn_implementation == "gyre_tree"
    assert torch.allclose(dense, sparse, atol=TOL, rtol=0)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), executions=st.integers(1, 3), branches=st.integers(1, 5))
def test_packing_equivalence_property(qwen3: torch.nn.Module, seed: int, executions: int, branches: int) -> None:
    trajs = random_trajectories(
        np.random.default_rng(seed), executions=executions, branches=branches, vocab=97, prefix=6, suffix=4
    )
    assert _check_equivalence(qwen3, trajs, "tree") <= TOL


def test_gradients_of_packed_loss_equal_flat_loss_with_shared_targets_counted_once() -> None:
    model = tiny_model("qwen3", seed=5)
    rng = np.random.default_rng(5)
    trajs = random_trajectories(rng, executions=3, branches=4, vocab=97)
    mb, positions = pack(trajs)
    advantages = torch.tensor([1.0, -0.7, 0.4])
    texec = torch.from_numpy(mb.target_exec.astype(np.int64))
    counts = torch.bincount(texec, minlength=3)
    mu = torch.from_numpy(mb.behaviour_logprob)

    wide = GspoConfig(eps_low=0.9, eps_high=10.0)  # wide clip range: gradients flow for every execution

    def loss_of(logp: torch.Tensor) -> torch.Tensor:
        # A perturbed pi_old so that s_e != 1 and the IS weights vary, making the gradient non-trivial.
        old = logp.detach() + 0.01 * torch.from_numpy(np.sin(np.arange(logp.shape[0]))).float()
        return gspo_loss(logp, old, mu, texec, advantages, counts, config=wide).loss


    model.zero_grad()
    packed = packed_logprobs(model, to_tensors(mb), attention="tree")
    loss_of(packed).backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    # Flat: each trajectory separately; each unique target taken from the first trajectory that contains it.
    model.zero_grad()
    index = {int(p): i for i, p in enumerate(mb.target_pos)}
    flat = [None] * len(index)
    for tr, path in zip(trajs, positions, strict=True):
        lp = flat_logprobs(model, [s.token for s in tr.steps])
        for i in range(1, len(path)):
            j = index.get(path[i])
            if j is not None and flat[j] is None:
                flat[j] = lp[i - 1]
    assert all(v is not None for v in flat)
    loss_of(torch.stack(flat)).backward()  # type: ignore[arg-type]
    for name, p in model.named_parameters():
        assert p.grad is not None
        diff = (p.grad - packed_grads[name]).abs().max().item()
        assert diff <= TOL, f"{name}: {diff}"
    assert any(g.abs().sum() > 0 for g in packed_grads.values())


def test_micro_batch_without_targets_still_runs_the_model(qwen3: torch.nn.Module) -> None:
    mb, _ = pack([Trajectory(0, [Step(3, False), Step(4, False), Step(5, False)])])
    out = packed_logprobs(qwen3, to_tensors(mb))
    assert out.shape == (0,)
    out.sum().backward()
    assert any(p.grad is not None for p in qwen3.parameters())
    qwen3.zero_grad()
