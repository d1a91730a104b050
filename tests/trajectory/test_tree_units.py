"""Unit tests: branch classification, drift, labels, cap selection, advantages, subtree splitting."""

from __future__ import annotations

import numpy as np
import pytest

from services.trajectory.advantages import AdvantageError, ExecutionReward, compute_advantages
from services.trajectory.cap import CapError, cap_tree, select_leaves
from services.trajectory.synthetic import SyntheticExecution
from services.trajectory.training_batch import ExecutionInput, build_training_batch
from services.trajectory.tree_builder import BranchLabel, TreeBuildError, build_tree
from shared.batch import TrainingBatch
from shared.calls import CallRecord, CallTokens
from shared.packing import PackingError, first_fit_decreasing, pack_trees, split_tree

SYS = [100, 101, 102]  # "system prompt"
TASK = [200, 201]
USER, ASSIST = 300, 301  # role headers: the prompt ends with ASSIST, generated text follows


def kinds(log: SyntheticExecution, labels: tuple[BranchLabel, ...] = ()) -> list[str]:
    return [c.kind for c in build_tree(log.execution_id, log.records, labels).calls]


def test_continuation_extends_the_previous_call_on_one_path() -> None:
    log = SyntheticExecution("e")
    log.call(SYS + TASK + [ASSIST], [1, 2, 3])
    log.call(log.sequence(0).tolist() + [USER, 7, ASSIST], [4, 5])
    tree = build_tree("e", log.records)
    assert kinds(log) == ["root", "continuation"]
    assert tree.stats().trajectories == 1 and tree.num_nodes == 1
    assert tree.stats().flat_tokens == tree.num_tokens == len(log.sequence(1))


def test_generated_tokens_stay_targets_when_resent_as_prompt() -> None:
    log = SyntheticExecution("e")
    log.call(SYS + [ASSIST], [1, 2, 3])
    log.call(log.sequence(0).tolist() + [USER, ASSIST], [4])
    tree = build_tree("e", log.records)
    path = tree.call_positions(1)
    assert tree.is_target[path].tolist() == [False] * 4 + [True] * 3 + [False, False, True]
    assert tree.call_index[path][4:7].tolist() == [0, 0, 0]


def test_retry_branch_shares_prefix_with_original() -> None:
    log = SyntheticExecution("e")
    log.call(SYS + [ASSIST], [1, 2, 3])
    log.call(SYS + [ASSIST], [1, 9])  # re-sample from the same prompt; first token coincides
    tree = build_tree("e", log.records)
    assert kinds(log) == ["root", "retry"]
    placement = tree.calls[1]
    assert placement.shared_len == 5 and placement.matched_len == 5
    assert tree.stats().trajectories == 2
    assert tree.num_targets == 4  # 1, 2, 3 and 9: the shared "1" counted once
    first = tree.call_positions(0)[4]
    assert tree.call_index[first] == 0  # the first generator keeps the attribution


def test_a_retry_that_regenerates_the_previous_completion_and_more_is_still_a_retry() -> None:
    log = SyntheticExecution("e")
    log.call(SYS + [ASSIST], [1])  # cut short (a length limit, a timeout)
    log.call(SYS + [ASSIST], [1, 2, 3])  # the same prompt again: its completion happens to begin the same way
    assert kinds(log) == ["root", "retry"]


def test_compaction_replaces_context_with_a_shorter_summary() -> None:
    log = SyntheticExecution("e")
    log.call(SYS + TASK + [ASSIST], [1, 2, 3, 4])
    log.call(log.sequence(0).tolist() + [USER, 5, 6, ASSIST], [7, 8])
    log.call(SYS + TASK + [USER, 50, 51, ASSIST], [9])  # summary of the above
    assert kinds(log) == ["root", "continuation", "compaction"]


def test_a_shorter_prompt_that_redoes_the_last_turn_is_a_fork_from_its_sibling_not_a_compaction() -> None:
    # Calls 1 and 2 both extend call 0 (siblings): call 2 leaves call 1 at the tool result, which is prompt
    # text, and is shorter than call 1; but it keeps call 0's whole turn, so nothing was summarised away.
    log = SyntheticExecution("e")
    log.call(SYS + TASK + [ASSIST], [1, 2, 3])
    log.call(log.sequence(0).tolist() + [USER, 7, 7, 7, ASSIST], [4, 5])
    log.call(log.sequence(0).tolist() + [USER, 8, ASSIST], [6])  # the tool result redone, shorter
    assert kinds(log) == ["root", "continuation", "fork"]
    # Back on call 1's line (further along it than along its head, call 2), and shorter than call 2: a fork.
    log.call(log.sequence(0).tolist() + [USER, 7, ASSIST], [9])
    assert len(log.records[3].tokens.new_prompt) + log.records[3].parent_prefix_len < len(log.sequence(2))
    assert kinds(log)[3] == "fork"


def test_first_call_of_a_new_chain_is_a_delegation() -> None:
    log = SyntheticExecution("e")
    log.call(SYS + TASK + [ASSIST], [1, 2])
    log.call(SYS + [USER, 60, ASSIST], [61], chain_id="agent-1")
    log.call(log.sequence(1).tolist() + [USER, 62, ASSIST], [63], chain_id="agent-1")
    log.call(log.sequence(0).tolist() + [USER, 64, ASSIST], [65])  # main chain resumes with the result
    assert kinds(log) == ["root", "delegation", "continuation", "continuation"]


def test_retokenization_drift_is_a_fork_and_keeps_the_original_targets() -> None:
    log = SyntheticExecution("e")
    log.call(SYS + [ASSIST], [1, 2, 3, 4])
    # The harness re-rendered the assistant text: 3, 4 became 33 — a divergence inside generated tokens.
    log.call(SYS + [ASSIST, 1, 2, 33, USER, ASSIST], [5])
    tree = build_tree("e", log.records)
    assert kinds(log) == ["root", "fork"]
    original = tree.call_positions(0)
    assert tree.tokens[original].tolist() == SYS + [ASSIST, 1, 2, 3, 4]
    assert tree.is_target[original].tolist() == [False] * 4 + [True] * 4
    drifted = tree.call_positions(1)
    np.testing.assert_array_equal(drifted[:6], original[:6])  # shared up to the divergence
    # the re-rendered tokens are context on the new branch, not targets
    assert tree.is_target[drifted[6:]].tolist() == [False, False, False, True]
    assert tree.stats().trajectories == 2


def test_other_divergence_is_a_fork() -> None:
    log = SyntheticExecution("e")
    log.call(SYS + [ASSIST], [1])
    log.call(SYS + [77, 78, 79, 80, ASSIST], [2])  # history rewritten to something longer
    assert kinds(log) == ["root", "fork"]


def test_branch_label_overrides_hint_and_inference() -> None:
    log = SyntheticExecution("e")
    log.call(SYS + [ASSIST], [1, 2])
    log.call(SYS + [ASSIST], [3], branch_hint="fork")
    log.call(SYS + [ASSIST], [4])
    labels = (BranchLabel(at_call_index=2, kind="compaction"),)
    tree = build_tree("e", log.records, labels)
    assert [(c.kind, c.source) for c in tree.calls] == [
        ("root", "root"),
        ("fork", "hint"),
        ("compaction", "label"),
    ]
    assert tree.stats().branches == {"continuation": 0, "compaction": 1, "delegation": 0, "retry": 0, "fork": 1}


def test_unknown_label_kind_is_rejected() -> None:
    with pytest.raises(TreeBuildError, match="unknown kind"):
        build_tree("e", [], [BranchLabel(at_call_index=1, kind="teleport")])


def test_gap_in_call_indices_is_rejected() -> None:
    log = SyntheticExecution("e")
    log.call([1], [2])
    log.call([1, 2], [3])
    with pytest.raises(TreeBuildError, match="expected call_index 0"):
        build_tree("e", log.records[1:])


def test_parent_prefix_longer_than_parent_is_rejected() -> None:
    log = SyntheticExecution("e")
    log.call([1], [2])
    bad = CallRecord("e", "c1", 1, 0, 5, CallTokens(np.array([3], np.int32), np.zeros(0, np.int32),
                                                     np.zeros(0, np.float32)), 0)
    with pytest.raises(TreeBuildError, match="exceeds parent"):
        build_tree("e", [log.records[0], bad])


# ---- cap ---------------------------------------------------------------------------------------


def _fan_tree(execution_id: str = "e") -> SyntheticExecution:
    """Root prompt, then retries with 3, 1, 3 and 2 generated tokens."""
    log = SyntheticExecution(execution_id)
    log.call(SYS + [ASSIST], [1, 2, 3])
    log.call(SYS + [ASSIST], [4])
    log.call(SYS + [ASSIST], [5, 6, 7])
    log.call(SYS + [ASSIST], [8, 9])
    return log


def test_cap_keeps_the_final_call_then_most_uncovered_targets_ties_by_earliest_call() -> None:
    tree = build_tree("e", _fan_tree().records)
    leaves = tree.leaves()
    by_call = {int(tree.node_first_call[leaf]): int(leaf) for leaf in leaves}
    # The final call (3) first; then calls 0 and 2 tie at 3 targets: call 0; then call 2; then call 1.
    assert select_leaves(tree, 4) == [by_call[3], by_call[0], by_call[2], by_call[1]]
    result = cap_tree(tree, 2)
    assert result.kept_targets == 5 and result.dropped_targets == 4 and result.dropped_trajectories == 2
    assert sorted(result.tree.tokens[result.tree.is_target].tolist()) == [1, 2, 3, 8, 9]
    assert result.tree.stats().trajectories == 2 and result.trajectories == 4
    # The rule of batches written before it: greedy from the start, ties by the earliest call.
    assert select_leaves(tree, 4, keep_final=False) == [by_call[0], by_call[2], by_call[3], by_call[1]]
    assert cap_tree(tree, 2, keep_final=False).kept_targets == 6


def test_a_long_execution_capped_keeps_its_final_segment_and_answer() -> None:
    """Fourteen compaction segments of equal size and a cap of 8: every segment ties, and the earliest-call
    rule alone would keep the first eight and drop the last, where the final answer is."""
    log = SyntheticExecution("e")
    for segment in range(14):
        summary = [500 + segment]  # each segment starts from a fresh, compacted context
        context = SYS + TASK + summary + [ASSIST]
        log.call(context, [10 * segment + 1, 10 * segment + 2])
        log.call(log.sequence(len(log.records) - 1).tolist() + [USER, 7, ASSIST], [10 * segment + 3])
    final_answer = log.records[-1]
    tree = build_tree("e", log.records)
    assert tree.stats().trajectories == 14
    capped = cap_tree(tree, 8)
    kept = set(capped.tree.tokens[capped.tree.is_target].tolist())
    assert {131, 132, 133} <= kept  # the last segment, its final call included
    assert final_answer.call_index in set(capped.tree.call_index[capped.tree.is_target].tolist())
    assert len(capped.kept_leaves) == 8 and capped.trajectories == 14 and capped.dropped_trajectories == 6
    old = cap_tree(tree, 8, keep_final=False)
    assert not {131, 132, 133} & set(old.tree.tokens[old.tree.is_target].tolist())  # what it fixes


def test_cap_tie_break_does_not_move_with_an_unrelated_branch() -> None:
    """Two leaves tie; a later call that splits a node on one of their paths (and adds fewer targets than
    either) must not change which one is kept."""
    log = SyntheticExecution("e")
    log.call([1], [2])
    log.call([1], [5, 6, 7])  # 3 targets on its leaf, ending with call 1
    log.call([1, 2, 9], [10, 11])  # with 2: 3 targets on its path, ending with call 2
    before = cap_tree(build_tree("e", log.records), 1, keep_final=False).tree
    log.call([1, 2], [20])  # splits [2, 9, 10, 11] into [2] → {[9, 10, 11], [20]}
    after = cap_tree(build_tree("e", log.records), 1, keep_final=False).tree
    kept = [sorted(t.tokens[t.is_target].tolist()) for t in (before, after)]
    assert kept == [[5, 6, 7], [5, 6, 7]]


def test_cap_counts_shared_targets_once() -> None:
    log = SyntheticExecution("e")
    log.call(SYS + [ASSIST], [1, 2, 3, 4, 5])  # a long shared generation
    log.call(log.sequence(0).tolist() + [USER, ASSIST], [6])  # leaf A: shares 5 targets, adds 1
    log.call(SYS + [ASSIST], [7, 8, 9])  # leaf B: 3 own targets
    log.call(log.sequence(0).tolist() + [USER, 10, ASSIST], [11, 12])  # leaf C: shares 5, adds 2
    tree = build_tree("e", log.records)
    chosen = select_leaves(tree, 2)
    first_calls = [int(tree.node_first_call[c]) for c in chosen]
    assert first_calls == [3, 2]  # C covers 7 new; then B adds 3 while A would add only 1


def test_cap_stops_when_no_leaf_adds_a_target() -> None:
    log = SyntheticExecution("e")
    log.call(SYS + [ASSIST], [1])
    log.call(SYS + [USER, 5, 6], [])  # a context-only branch (e.g. a failed call)
    tree = build_tree("e", log.records)
    assert tree.stats().trajectories == 2
    assert len(select_leaves(tree, 5)) == 1


def test_cap_rejects_nonpositive_k() -> None:
    with pytest.raises(CapError):
        select_leaves(build_tree("e", _fan_tree().records), 0)


# ---- advantages --------------------------------------------------------------------------------


def test_advantages_are_group_normalised() -> None:
    rewards = [ExecutionReward(f"e{i}", "q1", r) for i, r in enumerate([0.0, 1.0, 1.0, 0.0])]
    rewards.append(ExecutionReward("t1", "q2", 0.5, timed_out=True))
    rewards.append(ExecutionReward("t2", "q2", 0.0))
    result = compute_advantages(rewards, eps=0.0)
    adv = result.by_execution()
    assert [adv[f"e{i}"].advantage for i in range(4)] == pytest.approx([-1.0, 1.0, 1.0, -1.0])
    # a timed-out execution's score counts like any other
    assert adv["t1"].advantage == pytest.approx(1.0) and adv["t1"].timed_out
    assert adv["t2"].advantage == pytest.approx(-1.0)


def test_zero_variance_groups_are_flagged_and_optionally_dropped() -> None:
    rewards = [ExecutionReward("a", "q1", 1.0), ExecutionReward("b", "q1", 1.0), ExecutionReward("c", "q2", 0.0),
               ExecutionReward("d", "q2", 1.0)]
    kept = compute_advantages(rewards)
    assert [g.zero_variance for g in kept.groups] == [True, False]
    assert kept.by_execution()["a"].advantage == 0.0 and kept.by_execution()["a"].zero_variance
    dropped = compute_advantages(rewards, drop_zero_variance=True)
    assert set(dropped.by_execution()) == {"c", "d"} and dropped.groups[0].dropped


def test_incomplete_group_is_rejected_when_size_given() -> None:
    with pytest.raises(AdvantageError, match="expected a group of 16"):
        compute_advantages([ExecutionReward("a", "q", 1.0)], group_size=16)


# ---- packing -----------------------------------------------------------------------------------


def _long_log(execution_id: str = "e") -> SyntheticExecution:
    log = SyntheticExecution(execution_id)
    log.call(SYS + TASK + [ASSIST], [1, 2, 3, 4, 5, 6])
    log.call(log.sequence(0).tolist() + [USER, ASSIST], [7, 8, 9, 10])
    log.call(SYS + TASK + [ASSIST], [11, 12, 13])
    log.call(SYS + [USER, 14, ASSIST], [15, 16, 17, 18, 19], chain_id="sub")
    return log


def test_subtree_splitting_trains_every_target_once_under_a_small_budget() -> None:
    tree = build_tree("e", _long_log().records)
    budget = int(tree.depth.max()) + 2
    assert tree.num_tokens > budget
    pieces = split_tree(tree.token_tree(), 0, budget)
    assert len(pieces) > 1
    assert all(p.num_tokens <= budget for p in pieces)
    # the ranges partition the tree
    assert [p.source_start for p in pieces][0] == 0 and pieces[-1].source_end == tree.num_tokens
    assert all(a.source_end == b.source_start for a, b in zip(pieces, pieces[1:]))
    total_targets = sum(p.target_pos.shape[0] for p in pieces)
    assert total_targets == tree.num_targets
    # a later piece starts with its carried ancestor path: position ids 0, 1, 2, ...
    later = pieces[1]
    carried = int(tree.depth[later.source_start])
    assert later.position_ids[:carried].tolist() == list(range(carried))
    assert not np.isin(np.arange(carried), later.target_pos).any()  # carried tokens are context only


def test_budget_below_trajectory_depth_is_a_named_error() -> None:
    tree = build_tree("e", _long_log().records)
    with pytest.raises(PackingError, match="exceeds the micro-batch budget"):
        split_tree(tree.token_tree(), 0, 4)


def test_first_fit_decreasing_fills_bins_in_size_order() -> None:
    assert first_fit_decreasing([3, 7, 5, 2, 4], 10) == [[1, 0], [2, 4], [3]]


def test_whole_trees_share_a_micro_batch_without_attending_each_other() -> None:
    a = build_tree("a", _fan_tree("a").records)
    b = build_tree("b", _long_log("b").records)
    mbs = pack_trees([(a.token_tree(), 0), (b.token_tree(), 1)], a.num_tokens + b.num_tokens)
    assert len(mbs) == 1
    mb = mbs[0]
    mb.validate(2)
    first = b.num_tokens  # b is bigger, so it is placed first
    assert b.num_tokens > a.num_tokens
    assert np.all(mb.subtree_end[:first] <= first)
    assert set(mb.target_exec[mb.target_pos < first].tolist()) == {1}


def test_training_batch_is_deterministic_and_round_trips() -> None:
    trees = [build_tree("a", _fan_tree("a").records), build_tree("b", _long_log("b").records)]
    inputs = [ExecutionInput("a", "q", trees[0], 1.0, sample_index=0),
              ExecutionInput("b", "q", trees[1], 0.0, timed_out=True, sample_index=1)]
    batch = build_training_batch(3, inputs, budget=24, cap_k=2)
    again = build_training_batch(3, list(reversed(inputs)), budget=24, cap_k=2)
    assert batch.digest() == again.digest()
    decoded = TrainingBatch.decode(batch.encode())
    assert decoded.digest() == batch.digest()
    assert [e.execution_id for e in batch.executions] == ["a", "b"]
    assert batch.executions[1].timed_out and batch.executions[1].advantage < 0
    assert sum(mb.num_targets for mb in batch.micro_batches) == sum(e.num_targets for e in batch.executions)
    assert batch.meta["dropped_targets"] == cap_tree(trees[0], 2).dropped_targets + cap_tree(trees[1], 2).dropped_targets


def test_a_querys_executions_are_packed_over_their_common_prompt_once() -> None:
    """G executions of one query open with the same prompt: the batch holds it once, each execution's targets
    keep their own advantage; another query's execution is not merged in."""
    logs = []
    for i, name in enumerate(("a", "b", "c")):
        log = SyntheticExecution(name)
        log.call(SYS + [ASSIST], [10 + i, 11], policy_version=0)
        logs.append(log)
    inputs = [ExecutionInput(n, "q" if n != "c" else "r", build_tree(n, log.records), r, sample_index=i)
              for i, (n, log, r) in enumerate(zip("abc", logs, (1.0, 0.0, 1.0)))]
    shared = build_training_batch(0, inputs, budget=64, cap_k=2)
    apart = build_training_batch(0, inputs, budget=64, cap_k=2, share_group_prefix=False)
    prompt = len(SYS) + 1
    assert shared.meta["pack_rule"] == "group-prefix" and shared.meta["group_shared_tokens"] == prompt
    assert "pack_rule" not in apart.meta  # batches built before the rule rebuild as they were
    assert shared.meta["packed_tokens"] == apart.meta["packed_tokens"] - prompt
    by_exec = {e: [] for e in range(3)}
    for mb in shared.micro_batches:
        mb.validate(3)
        for e, t in zip(mb.target_exec.tolist(), mb.input_ids[mb.target_pos].tolist(), strict=True):
            by_exec[e].append(t)
    assert [sorted(v) for v in by_exec.values()] == [[10, 11], [11, 11], [11, 12]]  # each its own completion
    assert sum(mb.num_targets for mb in shared.micro_batches) == sum(mb.num_targets for mb in apart.micro_batches)


def test_zero_variance_group_is_left_out_of_the_batch_when_dropping() -> None:
    tree = build_tree("a", _fan_tree("a").records)
    inputs = [ExecutionInput("a", "q", tree, 1.0), ExecutionInput("b", "q", tree, 1.0)]
    batch = build_training_batch(0, inputs, budget=64, cap_k=4, drop_zero_variance=True)
    assert batch.executions == [] and batch.micro_batches == []
    assert batch.meta["zero_variance_groups"] == 1 and batch.meta["dropped_executions"] == 2


def test_stale_execution_is_left_out_but_its_reward_still_normalises_the_group() -> None:
    fresh_log = SyntheticExecution("fresh")
    fresh_log.call(SYS + [ASSIST], [1, 2], policy_version=5)
    stale_log = SyntheticExecution("stale")
    stale_log.call(SYS + [ASSIST], [3, 4], policy_version=2)
    inputs = [
        ExecutionInput("fresh", "q", build_tree("fresh", fresh_log.records), 1.0, sample_index=0),
        ExecutionInput("stale", "q", build_tree("stale", stale_log.records), 0.0, sample_index=1),
    ]
    batch = build_training_batch(6, inputs, budget=64, cap_k=2, min_policy_version=6 - 1)
    assert [e.execution_id for e in batch.executions] == ["fresh"]
    assert batch.meta["stale_executions"] == 1
    from services.trajectory.service import batch_ready_data
    from shared.events import BlobRef
    ref = BlobRef(digest="sha256:" + "0" * 64, size=1)
    assert batch_ready_data(6, batch, ref).stale_executions == 1  # the event says so (the run report counts it)
    assert batch.executions[0].advantage == pytest.approx(1.0, rel=1e-5)  # normalised with the stale reward
    assert set(np.concatenate([mb.policy_version for mb in batch.micro_batches]).tolist()) == {5}


def test_a_batch_says_its_cap_rule_and_what_the_cap_dropped_and_older_batches_rebuild_by_theirs() -> None:
    from services.trajectory.state import BatchParams

    inputs = [ExecutionInput(e, "q", build_tree(e, _fan_tree(e).records), r) for e, r in (("e", 1.0), ("f", 0.0))]
    batch = build_training_batch(0, inputs, budget=64, cap_k=2)
    assert batch.meta["cap_rule"] == "final-first" and BatchParams.from_meta(batch.meta).cap_keeps_final
    assert (batch.meta["trajectories_before_cap"], batch.meta["trajectories_after_cap"],
            batch.meta["capped_executions"]) == (8, 4, 2)
    old = build_training_batch(0, inputs, budget=64, cap_k=2, cap_keeps_final=False)
    assert "cap_rule" not in old.meta and not BatchParams.from_meta(old.meta).cap_keeps_final
    assert old.meta["target_tokens"] != batch.meta["target_tokens"]  # the rules differ on these trees
