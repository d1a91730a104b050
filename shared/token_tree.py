"""A token tree in depth-first pre-order: the one shape the tree packer (shared/packing.py) reads, and its one
builder from token sequences. The trajectory service's `TrajectoryTree` provides it; SFT builds it from
prefix-shared conversations. Pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int32]


class TokenTreeError(ValueError):
    """Arrays that do not describe one pre-order tree, or sequences that cannot be merged into one."""


@dataclass(frozen=True, eq=False)
class TokenTree:
    """One tree (or forest) of tokens in depth-first pre-order, one entry per unique token.

    Token k is an ancestor-or-self of token q iff `k <= q < subtree_end[k]`; `depth` is a token's position in
    its root-to-leaf sequence. A target is a token to train on; a target at a root has no position to predict
    it from and is never trained.
    """

    tokens: IntArray  # int32 [N]
    is_target: npt.NDArray[np.bool_]  # bool [N]
    logprob: npt.NDArray[np.float32]  # float32 [N]: behaviour logprob of a target (0 where unknown)
    policy_version: IntArray  # int32 [N]: the policy that generated a target
    depth: IntArray  # int32 [N]
    parent: IntArray  # int32 [N]: previous token on its path, -1 at a root
    subtree_end: IntArray  # int32 [N]: one past its last descendant
    name: str = ""  # what the tree is, for error messages ("execution e-3")
    # int32 [N]: the execution each token's targets belong to, for a tree holding several executions (their
    # shared context merged: `share_prefix`); None for a tree of one execution (the packer is told which).
    exec_of: IntArray | None = None

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        for field_name in ("is_target", "logprob", "policy_version", "depth", "parent", "subtree_end", "exec_of"):
            if getattr(self, field_name) is None:
                continue
            shape = getattr(self, field_name).shape
            if shape != (n,):
                raise TokenTreeError(f"{self.name or 'token tree'}: {field_name} has shape {shape}, expected ({n},)")

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_targets(self) -> int:
        return int(np.count_nonzero(self.is_target))

    @cached_property
    def _run_start(self) -> IntArray:
        # A run is a stretch of tokens each the child of the one before it (a radix node, or several); walking
        # a path run by run takes one step per branch point instead of one per token.
        idx = np.arange(self.num_tokens, dtype=np.int32)
        starts = np.where(self.parent != idx - 1, idx, 0)
        return np.maximum.accumulate(starts).astype(np.int32) if starts.size else starts

    def ancestors(self, i: int) -> IntArray:
        """Token indices of the strict ancestors of token `i`, root first (`depth[i]` of them)."""
        parts: list[IntArray] = []
        cur = int(self.parent[i])
        while cur >= 0:
            start = int(self._run_start[cur])
            parts.append(np.arange(start, cur + 1, dtype=np.int32))
            cur = int(self.parent[start])
        if not parts:
            return np.zeros(0, dtype=np.int32)
        return np.concatenate(parts[::-1])


@dataclass(frozen=True, eq=False)
class SequenceTree:
    """The tree of some token sequences and where each of their tokens landed in it."""

    tree: TokenTree
    positions: tuple[IntArray, ...]  # per input sequence: the tree index of each of its tokens


def tree_from_sequences(
    ids: Sequence[Sequence[int]],
    targets: Sequence[Sequence[bool]],
    *,
    logprobs: Sequence[Sequence[float]] | None = None,
    policy_versions: Sequence[Sequence[int]] | None = None,
    name: str = "",
) -> SequenceTree:
    """Merge token sequences into one prefix tree (a trie; sequences with different first tokens give a forest).

    Children and roots come in the order their first token first appears. A token is a target when any
    sequence marks it so; its logprob and policy version come from the first sequence that does (the first
    generator keeps the attribution, as in the trajectory tree), so every target is trained once.
    """
    for label, per_seq in (("targets", targets), ("logprobs", logprobs), ("policy_versions", policy_versions)):
        if per_seq is not None and len(per_seq) != len(ids):
            raise TokenTreeError(f"{name or 'sequences'}: {len(ids)} sequences but {len(per_seq)} {label}")
    token: list[int] = []
    target: list[bool] = []
    logprob: list[float] = []
    version: list[int] = []
    children: list[dict[int, int]] = []
    roots: dict[int, int] = {}
    paths: list[list[int]] = []
    for s, seq in enumerate(ids):
        marks = targets[s]
        lps = logprobs[s] if logprobs is not None else None
        vers = policy_versions[s] if policy_versions is not None else None
        for label, values in (("targets", marks), ("logprobs", lps), ("policy_versions", vers)):
            if values is not None and len(values) != len(seq):
                raise TokenTreeError(
                    f"{name or 'sequences'}: sequence {s} has {len(seq)} tokens but {len(values)} {label}"
                )
        level = roots
        path: list[int] = []
        for j, tok in enumerate(seq):
            node = level.get(int(tok))
            if node is None:
                node = len(token)
                level[int(tok)] = node
                token.append(int(tok))
                target.append(False)
                logprob.append(0.0)
                version.append(0)
                children.append({})
            if marks[j] and not target[node]:
                target[node] = True
                logprob[node] = float(lps[j]) if lps is not None else 0.0
                version[node] = int(vers[j]) if vers is not None else 0
            path.append(node)
            level = children[node]
        paths.append(path)

    # Pre-order: a node's subtree follows it, children in order of first appearance.
    n = len(token)
    order: list[int] = []
    parent = np.full(n, -1, dtype=np.int32)
    depth = np.zeros(n, dtype=np.int32)
    index_of = np.zeros(n, dtype=np.int32)
    stack: list[tuple[int, int, int]] = [(node, -1, 0) for node in reversed(list(roots.values()))]
    while stack:
        node, parent_index, d = stack.pop()
        me = len(order)
        order.append(node)
        index_of[node] = me
        parent[me] = parent_index
        depth[me] = d
        stack.extend((child, me, d + 1) for child in reversed(list(children[node].values())))
    subtree_end = np.arange(1, n + 1, dtype=np.int32)
    for i in range(n - 1, 0, -1):  # children follow their parent, so a reverse sweep sees them first
        p = parent[i]
        if p >= 0 and subtree_end[i] > subtree_end[p]:
            subtree_end[p] = subtree_end[i]
    pick = np.array(order, dtype=np.int64)
    tree = TokenTree(
        tokens=np.array(token, dtype=np.int32)[pick],
        is_target=np.array(target, dtype=np.bool_)[pick],
        logprob=np.array(logprob, dtype=np.float32)[pick],
        policy_version=np.array(version, dtype=np.int32)[pick],
        depth=depth,
        parent=parent,
        subtree_end=subtree_end,
        name=name,
    )
    positions = tuple(index_of[np.array(path, dtype=np.int64)] for path in paths)
    return SequenceTree(tree=tree, positions=positions)


def context_chain(tree: TokenTree) -> int:
    """How many leading tokens form one unbranched chain of context every other token descends from: no target
    among them, each the only child of the one before."""
    n = tree.num_tokens
    if n == 0:
        return 0
    idx = np.arange(n, dtype=np.int32)
    ok = (tree.parent == idx - 1) & (tree.subtree_end == n) & ~tree.is_target
    bad = np.flatnonzero(~ok)
    return int(bad[0]) if bad.size else n


def share_prefix(trees: Sequence[tuple[TokenTree, int]], *, name: str = "") -> tuple[TokenTree, int]:
    """One tree of several executions' trees (tree, execution index) whose leading context is the same tokens:
    that context once, each tree's remainder hanging from its end, every token tagged with its execution
    (`exec_of`). Returns the tree and how many tokens it saved. Targets are never merged: the shared part holds
    none, so each target keeps its own execution, logprob and policy version, and its context is unchanged.
    """
    if not trees:
        raise TokenTreeError(f"{name or 'share_prefix'}: no trees")
    first = trees[0][0]
    k = min(context_chain(t) for t, _ in trees)
    for t, _ in trees[1:]:
        same = np.flatnonzero(t.tokens[:k] != first.tokens[:k])
        k = int(same[0]) if same.size else k
    parts: list[dict[str, npt.NDArray[np.generic]]] = []
    size = k
    for tree, exec_index in trees:
        rest = slice(k, tree.num_tokens)
        shift = size - k
        parent = tree.parent[rest].astype(np.int64)
        parts.append({
            "tokens": tree.tokens[rest], "is_target": tree.is_target[rest], "logprob": tree.logprob[rest],
            "policy_version": tree.policy_version[rest], "depth": tree.depth[rest],
            # The remainder's first token hangs from the shared context's last token, which keeps its index.
            "parent": np.where(parent >= k, parent + shift, parent),
            "subtree_end": tree.subtree_end[rest].astype(np.int64) + shift,
            "exec_of": np.full(tree.num_tokens - k, exec_index, dtype=np.int32),
        })
        size += tree.num_tokens - k
    head = {
        "tokens": first.tokens[:k], "is_target": np.zeros(k, dtype=np.bool_), "logprob": np.zeros(k, np.float32),
        "policy_version": np.zeros(k, np.int32), "depth": first.depth[:k], "parent": first.parent[:k],
        "subtree_end": np.full(k, size, dtype=np.int64), "exec_of": np.full(k, -1, dtype=np.int32),
    }
    dtypes = {"tokens": np.int32, "is_target": np.bool_, "logprob": np.float32, "policy_version": np.int32,
              "depth": np.int32, "parent": np.int32, "subtree_end": np.int32, "exec_of": np.int32}
    merged = {key: np.concatenate([head[key], *(p[key] for p in parts)]).astype(dtype) for key, dtype in dtypes.items()}
    saved = sum(t.num_tokens for t, _ in trees) - size
    return TokenTree(name=name, **merged), saved


__all__ = ["SequenceTree", "TokenTree", "TokenTreeError", "context_chain", "share_prefix", "tree_from_sequences"]
