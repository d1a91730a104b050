"""The trajectory cap: keep at most K root-to-leaf trajectories per execution (SPEC §5).

Greedy and deterministic: repeatedly keep the leaf whose path holds the most not-yet-covered target tokens,
ties broken by the earliest call (the call that created the leaf). Targets on no kept path are not trained.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.trajectory.tree import TrajectoryTree, restrict_tree


class CapError(ValueError):
    pass


@dataclass(frozen=True, eq=False)
class CapResult:
    tree: TrajectoryTree  # the union of the kept paths
    kept_leaves: tuple[int, ...]  # leaf node indices of the ORIGINAL tree, in selection order
    kept_targets: int
    dropped_targets: int
    dropped_trajectories: int


def node_target_counts(tree: TrajectoryTree) -> np.ndarray:
    if tree.num_nodes == 0:
        return np.zeros(0, dtype=np.int64)
    return np.add.reduceat(tree.is_target.astype(np.int64), tree.node_start)


def select_leaves(tree: TrajectoryTree, k: int) -> list[int]:
    """Greedy max-coverage over leaves; stops early when no remaining leaf adds a target."""
    if k < 1:
        raise CapError(f"cap K must be at least 1, got {k}")
    leaves = tree.leaves()
    if leaves.size == 0:
        return []
    # Leaf order = creating call, so argmax (first maximum) implements "ties by earliest call".
    order = np.lexsort((leaves, tree.node_first_call[leaves]))
    leaves = leaves[order]
    node_sub_end = tree.subtree_end[tree.node_start]
    leaf_start = tree.node_start[leaves]
    # on_path[l, j]: node j is an ancestor-or-self of leaf l (pre-order interval test, no per-token work).
    on_path = (tree.node_start[None, :] <= leaf_start[:, None]) & (leaf_start[:, None] < node_sub_end[None, :])
    remaining = node_target_counts(tree)
    weights = on_path.astype(np.int64)
    chosen: list[int] = []
    available = np.ones(leaves.shape[0], dtype=bool)
    for _ in range(min(k, leaves.shape[0])):
        gains = np.where(available, weights @ remaining, -1)
        best = int(np.argmax(gains))
        if gains[best] <= 0:
            break
        chosen.append(int(leaves[best]))
        available[best] = False
        remaining = np.where(on_path[best], 0, remaining)
    return chosen


def cap_tree(tree: TrajectoryTree, k: int) -> CapResult:
    leaves = tree.leaves()
    chosen = select_leaves(tree, k)
    keep = np.zeros(tree.num_nodes, dtype=bool)
    if chosen:
        node_sub_end = tree.subtree_end[tree.node_start]
        starts = tree.node_start[np.array(chosen)]
        keep = np.any(
            (tree.node_start[None, :] <= starts[:, None]) & (starts[:, None] < node_sub_end[None, :]), axis=0
        )
    capped = restrict_tree(tree, keep)
    kept = capped.num_targets
    return CapResult(
        tree=capped,
        kept_leaves=tuple(chosen),
        kept_targets=kept,
        dropped_targets=tree.num_targets - kept,
        dropped_trajectories=int(leaves.shape[0]) - len(chosen),
    )
