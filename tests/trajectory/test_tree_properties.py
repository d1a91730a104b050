"""Property tests for the trajectory tree and packing over random call sequences (hypothesis)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.trajectory.cap import cap_tree
from services.trajectory.synthetic import SyntheticExecution
from services.trajectory.tree import TrajectoryTree
from services.trajectory.tree_builder import build_tree
from shared.packing import pack_trees

# A tiny vocabulary makes accidental matches (a retry regenerating the same tokens, a prompt that happens to
# equal generated text) frequent, which is exactly where radix trees go wrong.
VOCAB = 5


@st.composite
def call_logs(draw: st.DrawFn, max_calls: int = 8) -> SyntheticExecution:
    log = SyntheticExecution("exec-prop")
    n = draw(st.integers(1, max_calls))
    for _ in range(n):
        base: list[int] = []
        if log.records and draw(st.booleans()):
            j = draw(st.integers(0, len(log.records) - 1))
            seq = log.sequence(j).tolist()
            base = seq[: draw(st.integers(0, len(seq)))]
        extra = draw(st.lists(st.integers(0, VOCAB - 1), max_size=5))
        prompt = base + extra
        if not prompt:
            prompt = [draw(st.integers(0, VOCAB - 1))]
        completion = draw(st.lists(st.integers(0, VOCAB - 1), max_size=5))
        # The writer normally picks the longest-prefix parent; sometimes a worse one, to prove the tree does
        # not rely on the writer being optimal.
        parent = None
        if log.records and draw(st.integers(0, 3)) == 0:
            j = draw(st.integers(0, len(log.records) - 1))
            seq = log.sequence(j)
            m = min(len(seq), len(prompt))
            mismatch = np.flatnonzero(seq[:m] != np.array(prompt[:m]))
            shared = int(mismatch[0]) if mismatch.size else m
            parent = (j, draw(st.integers(0, shared)))
        log.call(prompt, completion, chain_id=draw(st.sampled_from(["main", "main", "sub"])), parent=parent)
    return log


def _prefixes(tree: TrajectoryTree) -> list[tuple[int, ...]]:
    """The root path of every token, as a tuple of token ids (index i ↔ token i)."""
    out: list[tuple[int, ...]] = []
    for i in range(tree.num_tokens):
        p = int(tree.parent[i])
        out.append((out[p] if p >= 0 else ()) + (int(tree.tokens[i]),))
    return out


def _expected(log: SyntheticExecution) -> tuple[set[tuple[int, ...]], dict[tuple[int, ...], float]]:
    all_prefixes: set[tuple[int, ...]] = set()
    generated: dict[tuple[int, ...], float] = {}
    for rec in log.records:
        seq = tuple(log.sequence(rec.call_index).tolist())
        for j in range(1, len(seq) + 1):
            all_prefixes.add(seq[:j])
        for j in range(rec.prompt_len, len(seq)):
            generated.setdefault(seq[: j + 1], float(rec.tokens.logprobs[j - rec.prompt_len]))
    return all_prefixes, generated


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(call_logs())
def test_tree_holds_exactly_the_union_of_call_sequences(log: SyntheticExecution) -> None:
    tree = build_tree(log.execution_id, log.records)
    prefixes = _prefixes(tree)
    all_prefixes, _ = _expected(log)
    assert len(prefixes) == len(set(prefixes)), "a token path is stored twice"
    assert set(prefixes) == all_prefixes


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(call_logs())
def test_each_generated_token_is_a_target_exactly_once(log: SyntheticExecution) -> None:
    tree = build_tree(log.execution_id, log.records)
    prefixes = _prefixes(tree)
    _, generated = _expected(log)
    targets = {prefixes[i]: float(tree.logprob[i]) for i in np.flatnonzero(tree.is_target)}
    assert len(targets) == tree.num_targets
    # The earliest call that generated a token owns its behaviour logprob.
    assert targets == generated


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(call_logs())
def test_every_call_sequence_is_a_root_path(log: SyntheticExecution) -> None:
    tree = build_tree(log.execution_id, log.records)
    for rec in log.records:
        positions = tree.call_positions(rec.call_index)
        np.testing.assert_array_equal(tree.tokens[positions], log.sequence(rec.call_index))
        # a root path: each position's parent is the previous one
        assert positions.size == 0 or tree.parent[positions[0]] == -1
        np.testing.assert_array_equal(tree.parent[positions[1:]], positions[:-1])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(call_logs())
def test_tree_arrays_are_consistent_preorder(log: SyntheticExecution) -> None:
    tree = build_tree(log.execution_id, log.records)
    n = tree.num_tokens
    idx = np.arange(n)
    assert np.all(tree.parent < idx)
    assert np.all(tree.subtree_end > idx) and np.all(tree.subtree_end <= n)
    has_parent = tree.parent >= 0
    assert np.all(tree.depth[has_parent] == tree.depth[tree.parent[has_parent]] + 1)
    assert np.all(tree.depth[~has_parent] == 0)
    # k is an ancestor of q iff k <= q < subtree_end[k]: check against parent chains
    for q in range(n):
        chain = set()
        p = q
        while p >= 0:
            chain.add(p)
            p = int(tree.parent[p])
        by_interval = {k for k in range(q + 1) if q < tree.subtree_end[k]}
        assert chain == by_interval
    # radix compression: no non-root node has exactly one child
    children = np.bincount(tree.node_parent[tree.node_parent >= 0], minlength=tree.num_nodes)
    assert not np.any(children == 1)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(call_logs())
def test_build_is_deterministic(log: SyntheticExecution) -> None:
    a = build_tree(log.execution_id, log.records)
    b = build_tree(log.execution_id, list(reversed(log.records)))  # sorted by call_index inside
    assert a.digest() == b.digest()


def _unpack_pairs(mb_list: list, labels_only: bool = False) -> list[tuple[tuple[int, ...], int, float]]:
    """(context tokens seen by the prediction position, label, behaviour logprob) for every packed target."""
    out = []
    for mb in mb_list:
        for t, p, lp in zip(mb.target_pos, mb.pred_pos, mb.behaviour_logprob, strict=True):
            chain = [k for k in range(p + 1) if p < mb.subtree_end[k]]  # ancestors-or-self of p, by the mask rule
            assert list(mb.position_ids[chain]) == list(range(len(chain))), "ancestor chain is not a path"
            assert mb.position_ids[t] == len(chain)
            assert t < mb.subtree_end[p], "target is outside its predictor's subtree"
            out.append((tuple(int(x) for x in mb.input_ids[chain]), int(mb.input_ids[t]), float(lp)))
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(call_logs(), st.integers(0, 12), st.integers(1, 4))
def test_pack_unpack_gives_the_flat_trajectory_pairs(log: SyntheticExecution, slack: int, k: int) -> None:
    tree = build_tree(log.execution_id, log.records)
    capped = cap_tree(tree, k).tree
    if capped.num_tokens == 0:
        return
    budget = int(capped.depth.max()) + 1 + slack  # small budgets force subtree splitting
    mbs = pack_trees([(capped.token_tree(), 0)], budget)
    for mb in mbs:
        mb.validate(1)
        assert mb.num_tokens <= budget
    packed = _unpack_pairs(mbs)
    assert len(packed) == len(set(packed)), "a target was trained twice"
    expected = set()
    for path in capped.trajectories():
        flat = capped.tokens[path]
        for t in range(1, len(path)):
            if capped.is_target[path[t]]:
                expected.add((tuple(int(x) for x in flat[:t]), int(flat[t]), float(capped.logprob[path[t]])))
    assert set(packed) == expected


_SCRIPT = """
import numpy as np
from services.trajectory.synthetic import SyntheticExecution
from services.trajectory.tree_builder import build_tree
log = SyntheticExecution("exec-x")
rng = np.random.default_rng(7)
for i in range(40):
    base = log.sequence(int(rng.integers(0, i))).tolist()[: int(rng.integers(0, 30))] if i else []
    log.call(base + rng.integers(0, 50, 8).tolist(), rng.integers(0, 50, 6).tolist(),
             chain_id="main" if i % 3 else "sub")
print(build_tree(log.execution_id, log.records).digest())
"""


def test_digest_is_identical_across_processes() -> None:
    digests = {
        subprocess.run(
            [sys.executable, "-c", _SCRIPT],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": str(seed), "PATH": "/usr/bin:/bin"},
            cwd=str(__import__("pathlib").Path(__file__).resolve().parents[2]),
        ).stdout.strip()
        for seed in (1, 2)
    }
    assert len(digests) == 1 and next(iter(digests)).startswith("sha256:")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(call_logs(), st.integers(1, 6))
def test_cap_keeps_at_most_k_paths_and_drops_only_uncovered_targets(log: SyntheticExecution, k: int) -> None:
    tree = build_tree(log.execution_id, log.records)
    result = cap_tree(tree, k)
    capped = result.tree
    assert capped.stats().trajectories == len(result.kept_leaves) <= k
    assert result.kept_targets + result.dropped_targets == tree.num_targets
    # the capped tree is exactly the union of the kept root-to-leaf paths of the original
    kept_paths = {tuple(tree.tokens[tree.path_positions(leaf)].tolist()) for leaf in result.kept_leaves}
    assert {tuple(capped.tokens[p].tolist()) for p in capped.trajectories()} == kept_paths
    if k >= tree.stats().trajectories:
        assert result.dropped_targets == 0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 50), min_size=1, max_size=6),
                          st.lists(st.integers(0, 50), max_size=6)), min_size=1, max_size=10))
def test_a_chain_of_continuations_is_one_trajectory(turns: list[tuple[list[int], list[int]]]) -> None:
    log = SyntheticExecution("exec-chain")
    context: list[int] = []
    for tool, completion in turns:
        log.call(context + tool, completion)
        context = log.sequence(len(log.records) - 1).tolist()
    tree = build_tree(log.execution_id, log.records)
    assert [c.kind for c in tree.calls] == ["root"] + ["continuation"] * (len(turns) - 1)
    stats = tree.stats()
    assert stats.trajectories == 1 and stats.flat_tokens == stats.unique_tokens == len(context)
    assert stats.target_tokens == sum(len(c) for _, c in turns)
