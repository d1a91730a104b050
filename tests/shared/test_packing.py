"""The one tree packer (shared/packing.py) and its tree builder (shared/token_tree.py), as properties over random
prefix-sharing sequences. The oracle is computed from the sequences themselves, never from the tree."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.batch import MicroBatch
from shared.packing import PackingError, first_fit_decreasing, pack_trees
from shared.token_tree import TokenTree, TokenTreeError, context_chain, share_prefix, tree_from_sequences

# A tiny vocabulary makes shared prefixes, and sequences that re-send or re-generate each other's tokens, frequent.
VOCAB = 4

Sequences = list[tuple[list[int], list[bool]]]


@st.composite
def sequence_sets(draw: st.DrawFn, max_sequences: int = 6) -> Sequences:
    """Sequences that often extend or branch off earlier ones, each token a target or not."""
    out: Sequences = []
    for _ in range(draw(st.integers(1, max_sequences))):
        base: list[int] = []
        if out and draw(st.booleans()):
            earlier = out[draw(st.integers(0, len(out) - 1))][0]
            base = earlier[: draw(st.integers(0, len(earlier)))]
        ids = base + draw(st.lists(st.integers(0, VOCAB - 1), min_size=0 if base else 1, max_size=6))
        targets = draw(st.lists(st.booleans(), min_size=len(ids), max_size=len(ids)))
        out.append((ids, targets))
    return out


def _logprob(s: int, j: int) -> float:
    return -(s * 16 + j + 1) / 64  # distinct per (sequence, position): shows which sequence a target came from


def build(execution: int, seqs: Sequences) -> TokenTree:
    return tree_from_sequences(
        [ids for ids, _ in seqs],
        [targets for _, targets in seqs],
        logprobs=[[_logprob(s, j) for j in range(len(ids))] for s, (ids, _) in enumerate(seqs)],
        policy_versions=[[execution * 10 + s] * len(ids) for s, (ids, _) in enumerate(seqs)],
        name=f"execution {execution}",
    ).tree


Pair = tuple[int, tuple[int, ...], int]  # (execution, context, label)


def flat_pairs(executions: list[Sequences]) -> dict[Pair, tuple[float, int]]:
    """What flat training sees: per execution, every target position of every sequence after the first token, with
    the logprob and version of the first sequence that generated it (a target is trained once)."""
    out: dict[Pair, tuple[float, int]] = {}
    for e, seqs in enumerate(executions):
        for s, (ids, targets) in enumerate(seqs):
            for j in range(1, len(ids)):
                if targets[j]:
                    out.setdefault((e, tuple(ids[:j]), ids[j]), (_logprob(s, j), e * 10 + s))
    return out


def unpack(mbs: list[MicroBatch]) -> list[tuple[Pair, tuple[float, int]]]:
    """Every packed target with the context its predictor attends to, read back by the attention rule alone."""
    out = []
    for mb in mbs:
        for t, p, lp, v, e in zip(mb.target_pos, mb.pred_pos, mb.behaviour_logprob, mb.policy_version,
                                  mb.target_exec, strict=True):
            chain = [k for k in range(p + 1) if p < mb.subtree_end[k]]  # ancestors-or-self of p
            assert mb.position_ids[chain].tolist() == list(range(len(chain))), "the context is not a root path"
            assert mb.position_ids[t] == len(chain) and t < mb.subtree_end[p]
            context = tuple(int(x) for x in mb.input_ids[chain])
            out.append(((int(e), context, int(mb.input_ids[t])), (float(lp), int(v))))
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(sequence_sets(), min_size=1, max_size=3), st.integers(1, 30))
def test_packing_trains_every_target_once_with_its_flat_context_or_names_the_budget(
    executions: list[Sequences], budget: int
) -> None:
    trees = [(build(e, seqs), e) for e, seqs in enumerate(executions)]
    longest = max(len(ids) for seqs in executions for ids, _ in seqs)
    if longest > budget:
        with pytest.raises(PackingError, match="exceeds the micro-batch budget"):
            pack_trees(trees, budget)
        return
    mbs = pack_trees(trees, budget)
    for mb in mbs:
        mb.validate(len(executions))
        assert mb.num_tokens <= budget
    packed = unpack(mbs)
    assert len(packed) == len({pair for pair, _ in packed}), "a target was trained twice"
    assert dict(packed) == flat_pairs(executions)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=8), st.lists(sequence_sets(), min_size=1, max_size=4),
       st.integers(1, 40))
def test_a_groups_common_context_packed_once_trains_the_same_targets_with_the_same_context(
    prompt: list[int], executions: list[Sequences], budget: int
) -> None:
    """A query's executions open with the same prompt (context, never a target): merged over it, every target is
    trained once with its own execution, logprob, version and flat context, and the prompt is held once."""
    executions = [[(prompt + ids, [False] * len(prompt) + targets) for ids, targets in seqs] for seqs in executions]
    trees = [(build(e, seqs), e) for e, seqs in enumerate(executions)]
    merged, saved = share_prefix(trees, name="query q")
    assert merged.num_tokens == sum(t.num_tokens for t, _ in trees) - saved
    assert saved >= (len(trees) - 1) * len(prompt)
    assert set(merged.exec_of[merged.is_target].tolist()) <= set(range(len(trees)))
    longest = max(len(ids) for seqs in executions for ids, _ in seqs)
    if longest > budget:
        with pytest.raises(PackingError):
            pack_trees([(merged, -1)], budget)
        return
    mbs = pack_trees([(merged, -1)], budget)
    for mb in mbs:
        mb.validate(len(executions))
    packed = unpack(mbs)
    assert len(packed) == len({pair for pair, _ in packed}), "a target was trained twice"
    assert dict(packed) == flat_pairs(executions)


def test_trees_with_no_common_context_are_merged_over_nothing() -> None:
    a, b = build(0, [([1, 2], [False, True])]), build(1, [([3, 2], [False, True])])
    merged, saved = share_prefix([(a, 0), (b, 1)])
    assert saved == 0 and merged.num_tokens == 4 and merged.exec_of.tolist() == [0, 0, 1, 1]
    assert context_chain(build(0, [([1, 2, 3], [False, True, False])])) == 1  # a target ends the context


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sequence_sets())
def test_the_tree_of_sequences_holds_each_of_them_as_a_root_path_and_each_prefix_once(seqs: Sequences) -> None:
    built = tree_from_sequences([ids for ids, _ in seqs], [targets for _, targets in seqs])
    tree = built.tree
    n = tree.num_tokens
    idx = np.arange(n)
    for (ids, _), positions in zip(seqs, built.positions, strict=True):
        assert tree.tokens[positions].tolist() == ids
        assert positions.size == 0 or tree.parent[positions[0]] == -1
        assert tree.parent[positions[1:]].tolist() == positions[:-1].tolist()
    prefixes = {tuple(ids[: j + 1]) for ids, _ in seqs for j in range(len(ids))}
    assert n == len(prefixes), "a shared prefix is stored twice"
    # pre-order: k is an ancestor-or-self of q iff k <= q < subtree_end[k]
    assert np.all(tree.parent < idx) and np.all(tree.subtree_end > idx) and np.all(tree.subtree_end <= n)
    for q in range(n):
        chain = {q, *tree.ancestors(q).tolist()}
        assert chain == {k for k in range(q + 1) if q < tree.subtree_end[k]}
        assert tree.ancestors(q).tolist() == sorted(chain - {q}) and len(chain) == tree.depth[q] + 1


def test_a_target_in_any_sequence_is_a_target_with_the_first_markers_attribution() -> None:
    built = tree_from_sequences(
        [[1, 2, 3], [1, 2, 3, 4], [1, 2, 5]],
        [[False, False, False], [False, False, True, True], [False, True, True]],
        logprobs=[[0.0] * 3, [-1.0, -2.0, -3.0, -4.0], [-5.0, -6.0, -7.0]],
    )
    tree = built.tree
    # The first sequence marks nothing; its 3 is marked by the second, its 2 by the third: both are targets.
    assert tree.is_target[built.positions[0]].tolist() == [False, True, True]
    assert tree.logprob[built.positions[1]].tolist() == [0.0, -6.0, -3.0, -4.0]
    assert tree.num_targets == 4


def test_a_sequence_longer_than_the_budget_is_a_named_error_not_an_oversized_micro_batch() -> None:
    tree = build(0, [([0, 1, 2, 3, 0, 1], [False, True, True, True, True, True]), ([0, 2], [False, True])])
    with pytest.raises(PackingError, match="execution 0: token .* exceeds the micro-batch budget of 5"):
        pack_trees([(tree, 0)], 5)
    with pytest.raises(PackingError, match="must be positive"):
        pack_trees([(tree, 0)], 0)


def test_a_tree_over_the_budget_is_cut_into_ranges_that_carry_their_ancestors_as_context() -> None:
    seqs = [([0, 1, 2, 3, 0, 1], [False] + [True] * 5), ([0, 1, 3, 3], [False, False, True, True]),
            ([2, 2], [False, True])]
    mbs = pack_trees([(build(0, seqs), 0)], 6)
    assert [mb.input_ids.tolist() for mb in mbs] == [[0, 1, 2, 3, 0, 1], [0, 1, 3, 3, 2, 2]]
    carried = mbs[1]
    assert carried.position_ids.tolist() == [0, 1, 2, 3, 0, 1]
    assert carried.target_pos.tolist() == [2, 3, 5]  # the carried [0, 1] is context: trained in the first
    assert sum(mb.num_targets for mb in mbs) == 8


def test_first_fit_decreasing_fills_bins_in_size_order() -> None:
    assert first_fit_decreasing([3, 7, 5, 2, 4], 10) == [[1, 0], [2, 4], [3]]
    with pytest.raises(PackingError, match="item 1 has 7 tokens, over the budget of 6"):
        first_fit_decreasing([3, 7], 6)


def test_a_tree_whose_arrays_disagree_in_length_is_refused_by_name() -> None:
    z = np.zeros(3, dtype=np.int32)
    with pytest.raises(TokenTreeError, match="broken: parent has shape"):
        TokenTree(tokens=z, is_target=z.astype(bool), logprob=z.astype(np.float32), policy_version=z, depth=z,
                  parent=z[:2], subtree_end=z, name="broken")
    with pytest.raises(TokenTreeError, match="2 sequences but 1 targets"):
        tree_from_sequences([[1], [2]], [[True]])
