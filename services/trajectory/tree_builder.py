"""Building the trajectory tree: call records inserted in call order into a token radix tree, each call's branch
kind decided (label > gateway hint > `shared.branching.classify_branch`), then flattened into a `TrajectoryTree`.

Pure core: built from decoded call records plus the labels of `execution.branched` events; no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import cast

import numpy as np

from services.trajectory.tree import BRANCH_KINDS, CallKind, CallPlacement, KindSource, TrajectoryTree
from shared.branching import classify_branch
from shared.calls import CallRecord
from shared.events import BranchKind

_NO_VERSION = -1  # policy_version of a context token
MAIN_CHAIN = "main"


class TreeBuildError(Exception):
    """The call records do not describe a valid execution (gaps, bad parents, mixed executions)."""


@dataclass(frozen=True)
class BranchLabel:
    """What an `execution.branched` event says about one call; it overrides inference."""

    at_call_index: int
    kind: str
    from_call_index: int | None = None
    chain_id: str | None = None


class _Node:
    """A mutable radix node used only while building; arrays are owned (written in place on upgrade)."""

    __slots__ = ("tokens", "target", "logprob", "version", "call", "parent", "start", "children", "first_call")

    def __init__(
        self,
        tokens: np.ndarray,
        target: np.ndarray,
        logprob: np.ndarray,
        version: np.ndarray,
        call: np.ndarray,
        parent: _Node | None,
        start: int,
        first_call: int,
    ) -> None:
        self.tokens = tokens
        self.target = target
        self.logprob = logprob
        self.version = version
        self.call = call
        self.parent = parent
        self.start = start  # depth of its first token
        self.children: dict[int, _Node] = {}
        self.first_call = first_call

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


def _empty_node() -> _Node:
    z = np.zeros(0, dtype=np.int32)
    return _Node(z, np.zeros(0, bool), np.zeros(0, np.float32), z, z, None, 0, -1)


class TreeBuilder:
    """Inserts call records one at a time; `finish()` returns the immutable `TrajectoryTree`.

    Work per call is proportional to the tokens it adds plus the radix nodes it walks (numpy compares
    over whole runs), so a 1M-token execution builds in well under a second.
    """

    def __init__(self, execution_id: str, labels: Iterable[BranchLabel] = ()) -> None:
        self.execution_id = execution_id
        self._root = _empty_node()
        self._labels: dict[int, BranchLabel] = {}
        for label in labels:
            if label.kind not in BRANCH_KINDS:
                raise TreeBuildError(f"branch label for call {label.at_call_index}: unknown kind {label.kind!r}")
            # The last label for a call wins, matching the order the harness emitted them.
            self._labels[label.at_call_index] = label
        self._ends: list[tuple[_Node, int]] = []  # per call: a node on its path and its end depth
        self._placements: list[CallPlacement] = []
        self._chain_head: dict[str, int] = {}

    # -- locating ---------------------------------------------------------------------------------

    def _locate(self, node: _Node, depth: int) -> _Node:
        """The node holding the token at `depth - 1` on the path through `node` (root for depth 0)."""
        while node is not self._root and node.start >= depth:
            assert node.parent is not None
            node = node.parent
        return node

    def _shared_len(self, a: int, b: int) -> int:
        """Length of the common prefix of calls a and b's full sequences (via their lowest common node)."""
        node_a = self._locate(*self._ends[a])
        node_b = self._locate(*self._ends[b])
        depth_a, depth_b = self._ends[a][1], self._ends[b][1]
        # An ancestor starts strictly shallower than its descendants, so stepping up whichever node starts
        # deeper meets at the lowest common node after visiting only the nodes in between (O(1) for the
        # usual continuation, where the two calls end in the same or adjacent nodes).
        x, y = node_a, node_b
        while x is not y:
            if x.start >= y.start and x is not self._root:
                assert x.parent is not None
                x = x.parent
            else:
                assert y.parent is not None
                y = y.parent
        lca = x
        if lca is self._root:
            return 0
        lca_end = lca.start + len(lca)
        end_a = depth_a if node_a is lca else lca_end
        end_b = depth_b if node_b is lca else lca_end
        return min(end_a, end_b)

    def _is_target_at(self, call: int, depth: int) -> bool:
        """Whether the token at `depth` (0-based) of call's full sequence is a generated token."""
        node = self._locate(self._ends[call][0], depth + 1)
        return bool(node.target[depth - node.start])

    # -- mutation ---------------------------------------------------------------------------------

    def _split(self, node: _Node, offset: int) -> _Node:
        """Split `node` before `offset`; returns the new upper node (the lower part keeps its identity)."""
        upper = _Node(
            node.tokens[:offset].copy(),
            node.target[:offset].copy(),
            node.logprob[:offset].copy(),
            node.version[:offset].copy(),
            node.call[:offset].copy(),
            node.parent,
            node.start,
            node.first_call,
        )
        assert node.parent is not None
        node.parent.children[int(node.tokens[0])] = upper
        node.tokens = node.tokens[offset:].copy()
        node.target = node.target[offset:].copy()
        node.logprob = node.logprob[offset:].copy()
        node.version = node.version[offset:].copy()
        node.call = node.call[offset:].copy()
        node.start += offset
        node.parent = upper
        upper.children[int(node.tokens[0])] = node
        return upper

    def add(self, record: CallRecord) -> None:
        """Insert the next call (call_index order); its placement is final only after `finish()`."""
        index = len(self._ends)
        if record.call_index != index:
            raise TreeBuildError(
                f"execution {self.execution_id}: expected call_index {index}, got {record.call_index} "
                f"(call {record.call_id}); calls must be added in order without gaps"
            )
        if record.execution_id != self.execution_id:
            raise TreeBuildError(
                f"call {record.call_id} belongs to execution {record.execution_id}, not {self.execution_id}"
            )
        prefix = record.parent_prefix_len
        if record.parent_call_index is None:
            if prefix != 0:
                raise TreeBuildError(f"call {record.call_id}: parent_prefix_len {prefix} without a parent call")
            node, depth = self._root, 0
        else:
            parent = record.parent_call_index
            if not 0 <= parent < index:
                raise TreeBuildError(f"call {record.call_id}: parent call {parent} is not an earlier call (< {index})")
            parent_node, parent_depth = self._ends[parent]
            if prefix > parent_depth:
                raise TreeBuildError(
                    f"call {record.call_id}: parent_prefix_len {prefix} exceeds parent call {parent}'s "
                    f"{parent_depth} tokens"
                )
            node, depth = self._locate(parent_node, prefix), prefix

        new_prompt = np.asarray(record.tokens.new_prompt, dtype=np.int32)
        completion = np.asarray(record.tokens.completion, dtype=np.int32)
        logprobs = np.asarray(record.tokens.logprobs, dtype=np.float32)
        seq = np.concatenate([new_prompt, completion]) if completion.size else new_prompt
        completion_at = new_prompt.shape[0]  # index in `seq` where generated tokens begin
        end_node, matched = self._insert(node, depth, seq, completion_at, logprobs, record.policy_version, index)
        end_depth = depth + seq.shape[0]
        self._ends.append((end_node, end_depth))
        self._placements.append(
            self._classify(record, index, matched_len=depth + matched, end_depth=end_depth)
        )
        self._chain_head[record.chain_id] = index

    def _insert(
        self,
        node: _Node,
        depth: int,
        seq: np.ndarray,
        completion_at: int,
        logprobs: np.ndarray,
        policy_version: int,
        call: int,
    ) -> tuple[_Node, int]:
        """Walk `seq` down from (node, depth); returns (a node on the call's path, tokens already present)."""
        pos = 0
        offset = depth - node.start
        n = seq.shape[0]
        while True:
            length = len(node)
            if offset < length and pos < n:
                m = min(length - offset, n - pos)
                diff = np.flatnonzero(node.tokens[offset : offset + m] != seq[pos : pos + m])
                k = int(diff[0]) if diff.size else m
                if k:
                    self._upgrade(node, offset, pos, k, completion_at, logprobs, policy_version, call)
                pos += k
                offset += k
                if k < m:
                    upper = self._split(node, offset)
                    return self._attach(upper, seq, pos, completion_at, logprobs, policy_version, call), pos
            if pos == n:
                return node, pos
            # offset == len(node): continue into the child that starts with the next token
            child = node.children.get(int(seq[pos]))
            if child is None:
                return self._attach(node, seq, pos, completion_at, logprobs, policy_version, call), pos
            node, offset = child, 0

    def _upgrade(
        self,
        node: _Node,
        offset: int,
        pos: int,
        k: int,
        completion_at: int,
        logprobs: np.ndarray,
        policy_version: int,
        call: int,
    ) -> None:
        """Generated tokens that match tokens already in the tree: a context token the policy generated
        becomes a target (first generator's logprob); an existing target keeps its original attribution."""
        lo = max(pos, completion_at)
        hi = pos + k
        if lo >= hi:
            return
        a, b = offset + (lo - pos), offset + (hi - pos)
        fresh = ~node.target[a:b]
        if not fresh.any():
            return
        idx = np.flatnonzero(fresh) + a
        node.target[idx] = True
        node.logprob[idx] = logprobs[idx - offset + pos - completion_at]
        node.version[idx] = policy_version
        node.call[idx] = call

    def _attach(
        self,
        parent: _Node,
        seq: np.ndarray,
        pos: int,
        completion_at: int,
        logprobs: np.ndarray,
        policy_version: int,
        call: int,
    ) -> _Node:
        tokens = seq[pos:].copy()
        n = tokens.shape[0]
        target = np.arange(pos, pos + n) >= completion_at
        lp = np.zeros(n, dtype=np.float32)
        first_gen = max(completion_at - pos, 0)
        lp[first_gen:] = logprobs[pos + first_gen - completion_at :]
        version = np.where(target, np.int32(policy_version), np.int32(_NO_VERSION)).astype(np.int32)
        child = _Node(
            tokens, target, lp, version, np.full(n, call, dtype=np.int32), parent, parent.start + len(parent), call
        )
        parent.children[int(tokens[0])] = child
        return child

    # -- classification ---------------------------------------------------------------------------

    def _classify(self, record: CallRecord, index: int, *, matched_len: int, end_depth: int) -> CallPlacement:
        """Where the call landed and its kind; `end_node` is filled in by `finish()` (nodes move until then)."""
        head = self._chain_head.get(record.chain_id)
        label = self._labels.get(index)
        kind: CallKind
        source: KindSource
        from_call = head
        if label is not None and label.from_call_index is not None and label.from_call_index < index:
            from_call = label.from_call_index
        if head is None and record.chain_id == MAIN_CHAIN:
            kind, source = "root", "root"  # the main chain's first call starts the execution's main line
        elif label is not None:
            kind, source = cast(BranchKind, label.kind), "label"  # checked against BRANCH_KINDS on arrival
        elif record.branch_hint is not None:
            kind, source = record.branch_hint, "hint"
        else:
            kind, source = self._infer(record, index, head, matched_len), "inferred"
        shared = self._shared_len(index, from_call) if from_call is not None else 0
        return CallPlacement(
            call_index=index,
            call_id=record.call_id,
            chain_id=record.chain_id,
            kind=kind,
            source=source,
            from_call_index=from_call,
            shared_len=shared,
            matched_len=matched_len,
            prompt_len=record.prompt_len,
            completion_len=int(record.tokens.completion.shape[0]),
            end_node=-1,
            end_depth=end_depth,
        )

    def _infer(self, record: CallRecord, index: int, head: int | None, matched_len: int) -> BranchKind:
        """Classify a call against the previous call of its chain with the one classifier (shared.branching),
        which the gateway also uses for the hints it records; `matched_len`: how far its tokens follow the
        tree of the calls before it (any chain's)."""
        if head is None:
            return classify_branch(new_chain=True, shared=0, prompt_len=record.prompt_len, head_len=0,
                                   diverges_in_completion=False)
        shared = self._shared_len(index, head)
        head_len = self._ends[head][1]
        # Inside generated text: the tokens just before and at the divergence are both the policy's.
        diverges_in_completion = (
            0 < shared < head_len and self._is_target_at(head, shared) and self._is_target_at(head, shared - 1)
        )
        kind = classify_branch(new_chain=False, shared=shared, prompt_len=record.prompt_len, head_len=head_len,
                               diverges_in_completion=diverges_in_completion,
                               sibling_shared=min(matched_len, record.prompt_len))
        if kind == "compaction" and any(  # only then is it worth looking for an earlier call it resumes after
            depth <= shared and self._shared_len(index, i) == depth for i, (_, depth) in enumerate(self._ends[:index])
        ):
            kind = classify_branch(new_chain=False, shared=shared, prompt_len=record.prompt_len, head_len=head_len,
                                   diverges_in_completion=False, after_a_call=True)
        return kind

    # -- finishing --------------------------------------------------------------------------------

    def finish(self) -> TrajectoryTree:
        # Pre-order walk that also merges single-child chains into one run (radix compression).
        node_arrays: list[tuple[np.ndarray, ...]] = []
        node_parent: list[int] = []
        node_depth: list[int] = []
        node_first_call: list[int] = []
        index_of: dict[int, int] = {}
        stack: list[tuple[_Node, int]] = [
            (c, -1) for c in sorted(self._root.children.values(), key=lambda c: c.first_call, reverse=True)
        ]
        while stack:
            node, parent_index = stack.pop()
            me = len(node_parent)
            parts = [node]
            tail = node
            while len(tail.children) == 1:
                (tail,) = tail.children.values()
                parts.append(tail)
            for part in parts:
                index_of[id(part)] = me
            if len(parts) == 1:
                node_arrays.append((node.tokens, node.target, node.logprob, node.version, node.call))
            else:
                node_arrays.append(
                    tuple(
                        np.concatenate([getattr(p, f) for p in parts])
                        for f in ("tokens", "target", "logprob", "version", "call")
                    )
                )
            node_parent.append(parent_index)
            node_depth.append(node.start)
            node_first_call.append(node.first_call)
            for child in sorted(tail.children.values(), key=lambda c: c.first_call, reverse=True):
                stack.append((child, me))

        m = len(node_parent)
        lens = np.array([a[0].shape[0] for a in node_arrays], dtype=np.int32)
        starts = np.zeros(m, dtype=np.int32)
        if m:
            starts[1:] = np.cumsum(lens)[:-1]

        def cat(i: int, dtype: type) -> np.ndarray:
            if not node_arrays:
                return np.zeros(0, dtype=dtype)
            joined: np.ndarray = np.concatenate([a[i] for a in node_arrays]).astype(dtype)
            return joined

        tokens = cat(0, np.int32)
        n = tokens.shape[0]
        parents = np.array(node_parent, dtype=np.int32)
        depth_arr = np.array(node_depth, dtype=np.int32)
        depth = (np.repeat(depth_arr - starts, lens) + np.arange(n, dtype=np.int32)).astype(np.int32)
        parent_tok = np.arange(n, dtype=np.int32) - 1
        if m:
            last_of_parent = np.where(parents >= 0, starts[parents] + lens[parents] - 1, -1)
            parent_tok[starts] = last_of_parent
        # Subtree ends: children follow their parent in pre-order, so a reverse sweep sees children first.
        node_sub_end = starts + lens
        for i in range(m - 1, -1, -1):
            p = parents[i]
            if p >= 0 and node_sub_end[i] > node_sub_end[p]:
                node_sub_end[p] = node_sub_end[i]
        subtree_end = np.repeat(node_sub_end, lens).astype(np.int32)

        placements = []
        for i, (end_node, end_depth) in enumerate(self._ends):
            if end_depth == 0:
                placements.append(self._placements[i])
            else:
                end = index_of[id(self._locate(end_node, end_depth))]
                placements.append(replace(self._placements[i], end_node=end))
        return TrajectoryTree(
            execution_id=self.execution_id,
            tokens=tokens,
            is_target=cat(1, np.bool_),
            logprob=cat(2, np.float32),
            policy_version=cat(3, np.int32),
            call_index=cat(4, np.int32),
            depth=depth,
            parent=parent_tok,
            subtree_end=subtree_end,
            node_start=starts,
            node_len=lens,
            node_parent=parents,
            node_first_call=np.array(node_first_call, dtype=np.int32),
            calls=tuple(placements),
        )


def build_tree(
    execution_id: str, records: Sequence[CallRecord], labels: Iterable[BranchLabel] = ()
) -> TrajectoryTree:
    """Build the tree of one execution from its call records (sorted by call_index here)."""
    builder = TreeBuilder(execution_id, labels)
    for record in sorted(records, key=lambda r: r.call_index):
        builder.add(record)
    return builder.finish()


