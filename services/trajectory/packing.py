"""Tree packing: trajectory trees → tree-packed micro-batches (shared.batch) under a token budget (SPEC §5).

Each tree is laid out in depth-first pre-order; a tree over the budget is cut into contiguous pre-order ranges
that carry their ancestor path as context, so every target is trained exactly once. Pieces are then packed
first-fit-decreasing. `build_training_batch` runs cap → advantages → packing for one training step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from services.trajectory.advantages import DEFAULT_EPS, ExecutionReward, compute_advantages
from services.trajectory.cap import cap_tree
from services.trajectory.tree import TrajectoryTree
from shared.batch import ExecutionEntry, MicroBatch, TrainingBatch


class PackingError(ValueError):
    pass


@dataclass(frozen=True, eq=False)
class Piece:
    """One contiguous pre-order range of a tree plus its carried ancestors; local positions."""

    exec_index: int
    input_ids: np.ndarray
    position_ids: np.ndarray
    subtree_end: np.ndarray
    target_pos: np.ndarray
    pred_pos: np.ndarray
    behaviour_logprob: np.ndarray
    policy_version: np.ndarray
    source_start: int  # pre-order index range [source_start, source_end) of the tree it trains
    source_end: int

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def _piece(tree: TrajectoryTree, exec_index: int, s: int, e: int) -> Piece:
    depth_s = int(tree.depth[s]) if s < tree.num_tokens else 0
    if s > 0 and depth_s > 0:
        node = int(np.searchsorted(tree.node_start, s, side="right")) - 1
        anc = tree.path_positions(node, depth_s)
    else:
        anc = np.zeros(0, dtype=np.int32)
    a = int(anc.shape[0])
    idx = np.concatenate([anc, np.arange(s, e, dtype=np.int32)])
    local_end = a + np.minimum(tree.subtree_end[idx], e) - s
    rng = np.arange(s, e, dtype=np.int64)
    parents = tree.parent[s:e]
    is_t = tree.is_target[s:e] & (parents >= 0)  # a target at a root has no position to predict it from
    tq = rng[is_t]
    tp = parents[is_t].astype(np.int64)
    pred = np.where(tp >= s, a + tp - s, tree.depth[np.maximum(tp, 0)])
    return Piece(
        exec_index=exec_index,
        input_ids=tree.tokens[idx].astype(np.int32),
        position_ids=tree.depth[idx].astype(np.int32),
        subtree_end=local_end.astype(np.int32),
        target_pos=(a + tq - s).astype(np.int32),
        pred_pos=pred.astype(np.int32),
        behaviour_logprob=tree.logprob[tq].astype(np.float32),
        policy_version=tree.policy_version[tq].astype(np.int32),
        source_start=s,
        source_end=e,
    )


def split_tree(tree: TrajectoryTree, exec_index: int, budget: int) -> list[Piece]:
    """The whole tree as one piece when it fits; else greedy maximal pre-order ranges [s, e) with
    depth(s) + (e − s) ≤ budget. A range's tokens have all their outside ancestors among s's ancestors."""
    if budget < 1:
        raise PackingError(f"token budget must be positive, got {budget}")
    n = tree.num_tokens
    if n == 0:
        return []
    if n <= budget:
        return [_piece(tree, exec_index, 0, n)]
    pieces = []
    s = 0
    while s < n:
        carried = int(tree.depth[s])
        if carried + 1 > budget:
            raise PackingError(
                f"execution {tree.execution_id}: token {s} sits at depth {carried}, so its context alone "
                f"exceeds the micro-batch budget of {budget} tokens; raise the budget above the longest trajectory"
            )
        e = min(n, s + budget - carried)
        pieces.append(_piece(tree, exec_index, s, e))
        s = e
    return pieces


def first_fit_decreasing(sizes: Sequence[int], budget: int) -> list[list[int]]:
    """Bins of item indices; items sorted by size descending (stable), each into the first bin it fits."""
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order:
        if sizes[i] > budget:
            raise PackingError(f"item {i} has {sizes[i]} tokens, over the budget of {budget}")
        for b, room in enumerate(free):
            if sizes[i] <= room:
                bins[b].append(i)
                free[b] -= sizes[i]
                break
        else:
            bins.append([i])
            free.append(budget - sizes[i])
    return bins


def assemble(pieces: Sequence[Piece]) -> MicroBatch:
    offsets = np.cumsum([0] + [p.num_tokens for p in pieces])

    def cat(name: str, shift: bool, dtype: type) -> np.ndarray:
        parts = [getattr(p, name) + (offsets[i] if shift else 0) for i, p in enumerate(pieces)]
        return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype=dtype)

    return MicroBatch(
        input_ids=cat("input_ids", False, np.int32),
        position_ids=cat("position_ids", False, np.int32),
        subtree_end=cat("subtree_end", True, np.int32),
        target_pos=cat("target_pos", True, np.int32),
        pred_pos=cat("pred_pos", True, np.int32),
        behaviour_logprob=cat("behaviour_logprob", False, np.float32),
        policy_version=cat("policy_version", False, np.int32),
        target_exec=np.concatenate(
            [np.full(p.target_pos.shape[0], p.exec_index, dtype=np.int32) for p in pieces]
        ).astype(np.int32)
        if pieces
        else np.zeros(0, dtype=np.int32),
    )


def pack_trees(trees: Sequence[tuple[TrajectoryTree, int]], budget: int) -> list[MicroBatch]:
    """Pack (tree, execution index) pairs into micro-batches of at most `budget` tokens each."""
    pieces: list[Piece] = []
    for tree, exec_index in trees:
        pieces.extend(split_tree(tree, exec_index, budget))
    bins = first_fit_decreasing([p.num_tokens for p in pieces], budget)
    return [assemble([pieces[i] for i in b]) for b in bins]


@dataclass(frozen=True, eq=False)
class ExecutionInput:
    """One finished, scored execution with its tree, as the batch builder needs it."""

    execution_id: str
    query_id: str
    tree: TrajectoryTree
    reward: float
    timed_out: bool = False
    sample_index: int = 0


def build_training_batch(
    step: int,
    executions: Sequence[ExecutionInput],
    *,
    budget: int,
    cap_k: int,
    eps: float = DEFAULT_EPS,
    drop_zero_variance: bool = False,
    group_size: int | None = None,
    min_policy_version: int | None = None,
    extra_meta: dict[str, int | float | str] | None = None,
) -> TrainingBatch:
    """Cap each tree, compute group advantages, pack. Input order does not matter (sorted here).

    With `min_policy_version`, an execution holding a target generated by an older policy is left out of the
    packing (beyond the staleness bound); its reward still counts in its group's normalisation.
    """
    ordered = sorted(executions, key=lambda x: (x.query_id, x.sample_index, x.execution_id))
    result = compute_advantages(
        [ExecutionReward(x.execution_id, x.query_id, x.reward, x.timed_out) for x in ordered],
        eps=eps,
        drop_zero_variance=drop_zero_variance,
        group_size=group_size,
    )
    adv = result.by_execution()
    entries: list[ExecutionEntry] = []
    packed: list[tuple[TrajectoryTree, int]] = []
    unique = flat = dropped_targets = stale = 0
    for x in ordered:
        if x.execution_id not in adv:
            continue  # a dropped zero-variance group
        if min_policy_version is not None and x.tree.num_targets:
            if int(x.tree.policy_version[x.tree.is_target].min()) < min_policy_version:
                stale += 1
                continue
        capped = cap_tree(x.tree, cap_k)
        stats = capped.tree.stats()
        unique += stats.unique_tokens
        flat += stats.flat_tokens
        dropped_targets += capped.dropped_targets
        trainable = int(np.count_nonzero(capped.tree.is_target & (capped.tree.parent >= 0)))
        entries.append(
            ExecutionEntry(
                execution_id=x.execution_id,
                query_id=x.query_id,
                reward=float(x.reward),
                advantage=adv[x.execution_id].advantage,
                num_targets=trainable,
                timed_out=x.timed_out,
            )
        )
        packed.append((capped.tree, len(entries) - 1))
    micro_batches = pack_trees(packed, budget)
    targets = sum(mb.num_targets for mb in micro_batches)
    versions = np.concatenate([mb.policy_version for mb in micro_batches]) if micro_batches else np.zeros(0)
    meta: dict[str, int | float | str] = {
        "budget": budget,
        "cap_k": cap_k,
        "eps": eps,
        "drop_zero_variance": int(drop_zero_variance),
        "unique_tokens": unique,
        "flat_tokens": flat,
        "packed_tokens": sum(mb.num_tokens for mb in micro_batches),
        "target_tokens": targets,
        "dropped_targets": dropped_targets,
        "zero_variance_groups": sum(1 for g in result.groups if g.zero_variance),
        "dropped_executions": len(ordered) - len(entries),
        "stale_executions": stale,
        "min_policy_version": int(versions.min()) if versions.size else 0,
        "max_policy_version": int(versions.max()) if versions.size else 0,
        **(extra_meta or {}),
    }
    return TrainingBatch(step=step, executions=entries, micro_batches=micro_batches, meta=meta)
