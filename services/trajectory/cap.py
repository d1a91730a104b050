"""The trajectory cap: keep at most K root-to-leaf trajectories per execution (SPEC §5).

Greedy and deterministic: first the trajectory that holds the execution's final call (the last call with a
target: the work the grade judges; `keep_final`), then repeatedly the leaf whose path holds the most
not-yet-covered target tokens, ties broken by the earliest call (the call the leaf's last token came from).
Targets on no kept path are not trained. Without `keep_final` (the rule of batches written before it, which
replay must rebuild as they were) a long execution's last segments, final answer included, could lose to
earlier ones of equal size.
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
    trajectories: int = 0  # before the cap


def node_target_counts(tree: TrajectoryTree) -> np.ndarray:
    if tree.num_nodes == 0:
        return np.zeros(0, dtype=np.int64)
    return np.add.reduceat(tree.is_target.astype(np.int64), tree.node_start)


def _path_sums(tree: TrajectoryTree, values: np.ndarray) -> np.ndarray:
    """Sum of `values` over each node's root path (parents precede children in pre-order)."""
    parents = tree.node_parent.tolist()
    sums = values.astype(np.int64).tolist()
    for node, parent in enumerate(parents):
        if parent >= 0:
            sums[node] += sums[parent]
    return np.array(sums, dtype=np.int64)


def _path_mask(tree: TrajectoryTree, leaves: list[int]) -> np.ndarray:
    keep = np.zeros(tree.num_nodes, dtype=bool)
    for leaf in leaves:
        node = leaf
        while node >= 0 and not keep[node]:
            keep[node] = True
            node = int(tree.node_parent[node])
    return keep


def select_leaves(tree: TrajectoryTree, k: int, *, keep_final: bool = True) -> list[int]:
    """Greedy max-coverage over leaves, the final call's leaf first (`keep_final`); stops early when no
    remaining leaf adds a target.

    Memory and time are O(nodes) per pick (path sums over the pre-order), never leaves × nodes.
    """
    if k < 1:
        raise CapError(f"cap K must be at least 1, got {k}")
    leaves = tree.leaves()
    if leaves.size == 0:
        return []
    # Leaf order = the call its last token came from, so argmax (first maximum) implements "ties by earliest
    # call". Not the node's first call: merging single-child runs makes that depend on unrelated branches.
    ending_call = tree.call_index[tree.node_start[leaves] + tree.node_len[leaves] - 1]
    leaves = leaves[np.lexsort((leaves, ending_call))]
    remaining = node_target_counts(tree)
    available = np.ones(leaves.shape[0], dtype=bool)
    chosen: list[int] = []
    for pick in range(min(k, leaves.shape[0])):
        gains = np.where(available, _path_sums(tree, remaining)[leaves], -1)
        best = int(np.argmax(gains))
        if pick == 0 and keep_final and gains[best] > 0:
            # Leaves are in ending-call order: the last one with a target holds the execution's final call.
            best = int(np.flatnonzero(gains > 0)[-1])
        if gains[best] <= 0:
            break
        chosen.append(int(leaves[best]))
        available[best] = False
        remaining[_path_mask(tree, [chosen[-1]])] = 0
    return chosen


def cap_tree(tree: TrajectoryTree, k: int, *, keep_final: bool = True) -> CapResult:
    leaves = tree.leaves()
    chosen = select_leaves(tree, k, keep_final=keep_final)
    capped = restrict_tree(tree, _path_mask(tree, chosen))
    kept = capped.num_targets
    return CapResult(
        tree=capped,
        kept_leaves=tuple(chosen),
        kept_targets=kept,
        dropped_targets=tree.num_targets - kept,
        dropped_trajectories=int(leaves.shape[0]) - len(chosen),
        trajectories=int(leaves.shape[0]),
    )
