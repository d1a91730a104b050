"""The one tree packer: token trees (shared/token_tree.py) → tree-packed micro-batches (shared/batch.py) of at most
a token budget each. Used by the trajectory service for RL batches and by the trainer for SFT. Pure numpy.

Each tree is laid out in depth-first pre-order; a tree over the budget is cut into contiguous pre-order ranges
that carry their ancestor path as context, so every target is trained exactly once. Pieces are then packed
first-fit-decreasing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from shared.batch import MicroBatch
from shared.token_tree import TokenTree


class PackingError(ValueError):
    """The trees cannot be packed under the budget: a token's context alone exceeds it, or it is not positive."""


@dataclass(frozen=True, eq=False)
class Piece:
    """One contiguous pre-order range of a tree plus its carried ancestors; local positions."""

    target_exec: npt.NDArray[np.int32]  # the execution of each target (its advantage)
    input_ids: npt.NDArray[np.int32]
    position_ids: npt.NDArray[np.int32]
    subtree_end: npt.NDArray[np.int32]
    target_pos: npt.NDArray[np.int32]
    pred_pos: npt.NDArray[np.int32]
    behaviour_logprob: npt.NDArray[np.float32]
    policy_version: npt.NDArray[np.int32]
    source_start: int  # pre-order index range [source_start, source_end) of the tree it trains
    source_end: int

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def _piece(tree: TokenTree, exec_index: int, s: int, e: int) -> Piece:
    depth_s = int(tree.depth[s]) if s < tree.num_tokens else 0
    anc = tree.ancestors(s) if depth_s > 0 else np.zeros(0, dtype=np.int32)
    a = int(anc.shape[0])
    idx = np.concatenate([anc, np.arange(s, e, dtype=np.int32)])
    local_end = a + np.minimum(tree.subtree_end[idx], e) - s
    rng = np.arange(s, e, dtype=np.int64)
    parents = tree.parent[s:e]
    is_t = tree.is_target[s:e] & (parents >= 0)  # a target at a root has no position to predict it from
    tq = rng[is_t]
    tp = parents[is_t].astype(np.int64)
    # A parent inside the range sits at its local index; one outside is a carried ancestor, laid out at its depth.
    pred = np.where(tp >= s, a + tp - s, tree.depth[np.maximum(tp, 0)])
    target_exec = (tree.exec_of[tq] if tree.exec_of is not None else np.full(tq.shape[0], exec_index))
    return Piece(
        target_exec=target_exec.astype(np.int32),
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


def split_tree(tree: TokenTree, exec_index: int, budget: int) -> list[Piece]:
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
                f"{tree.name or 'tree'}: token {s} sits at depth {carried}, so its context alone exceeds the "
                f"micro-batch budget of {budget} tokens; raise the budget above the longest sequence"
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
    """Pieces side by side in one micro-batch: each keeps its `subtree_end` inside itself, so none attends another."""
    offsets = np.cumsum([0] + [p.num_tokens for p in pieces])

    def cat(name: str, shift: bool, dtype: type) -> npt.NDArray[np.generic]:
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
        target_exec=cat("target_exec", False, np.int32),
    )


def pack_trees(trees: Sequence[tuple[TokenTree, int]], budget: int) -> list[MicroBatch]:
    """Pack (tree, execution index) pairs into micro-batches of at most `budget` tokens each; every trainable
    target (one with a parent) lands in exactly one micro-batch, or `PackingError` says why it cannot. A tree of
    several executions (`exec_of`, shared/token_tree.py: share_prefix) says each target's execution itself."""
    pieces: list[Piece] = []
    for tree, exec_index in trees:
        pieces.extend(split_tree(tree, exec_index, budget))
    bins = first_fit_decreasing([p.num_tokens for p in pieces], budget)
    return [assemble([pieces[i] for i in b]) for b in bins]


__all__ = ["PackingError", "Piece", "assemble", "first_fit_decreasing", "pack_trees", "split_tree"]
