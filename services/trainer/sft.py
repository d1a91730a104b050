"""Supervised warm-start data: conversations rendered with the chat template, assistant turns as targets,
prefix-shared conversations packed into trees (the same MicroBatch format RL uses).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from shared.batch import MicroBatch


class SftDataError(Exception):
    pass


@dataclass(frozen=True)
class RenderedConversation:
    """One rendered conversation: token ids and which of them are targets (assistant output)."""

    ids: list[int]
    target: list[bool]


def load_conversations(path: Path) -> list[list[dict[str, Any]]]:
    """JSONL, one conversation a line: {"messages": [{"role": ..., "content": ...}, ...]} or a bare list."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SftDataError(f"{path}:{n}: expected a JSON object per line: {exc}") from exc
        messages = obj.get("messages") if isinstance(obj, dict) else obj
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise SftDataError(f"{path}:{n}: expected {{'messages': [{{'role': ..., 'content': ...}}, ...]}}")
        if not any(m["role"] == "assistant" for m in messages):
            raise SftDataError(f"{path}:{n}: the conversation has no assistant turn to learn from")
        out.append(messages)
    return out


def _ids(tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=generation_prompt, return_dict=False
    )
    return list(ids)


def render_conversation(tokenizer: Any, messages: list[dict[str, Any]]) -> RenderedConversation:
    """Token ids of the whole conversation; each assistant turn's tokens up to and including EOS are targets.

    Each turn's span is found by rendering the conversation up to it with and without the generation prompt,
    so it works for any template whose renderings extend each other (ChatML does).
    """
    full = _ids(tokenizer, messages, False)
    target = [False] * len(full)
    eos = tokenizer.eos_token_id
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = _ids(tokenizer, messages[:i], True)
        upto = _ids(tokenizer, messages[: i + 1], False)
        if full[: len(upto)] != upto or upto[: len(prefix)] != prefix:
            raise SftDataError(
                f"the chat template does not render turn {i} as an extension of the turns before it; "
                "cannot locate the assistant tokens"
            )
        end = len(upto)
        if eos is not None and eos in upto[len(prefix) :]:
            end = len(prefix) + upto[len(prefix) :].index(eos) + 1  # stop after EOS: what follows is format
        for j in range(len(prefix), end):
            target[j] = True
    return RenderedConversation(ids=full, target=target)


@dataclass
class _Node:
    token: int
    target: bool = False
    children: dict[int, _Node] = field(default_factory=dict)


def _subtree_sizes(root: _Node) -> dict[int, int]:
    sizes: dict[int, int] = {}
    stack: list[tuple[_Node, bool]] = [(root, False)]
    while stack:  # iterative post-order: conversations are chains thousands of tokens deep
        node, done = stack.pop()
        if done:
            sizes[id(node)] = 1 + sum(sizes[id(c)] for c in node.children.values())
            continue
        stack.append((node, True))
        stack.extend((c, False) for c in node.children.values())
    return sizes


_Packed = tuple[list[int], list[int], list[int], list[int], list[int]]  # ids, depth, ends, target, pred


def _dfs(path: list[tuple[_Node, bool]], root: _Node) -> _Packed:
    """Pack a subtree in pre-order after its ancestor path (context; a path target only where flagged)."""
    ids: list[int] = []
    depth: list[int] = []
    ends: list[int] = []
    tpos: list[int] = []
    ppos: list[int] = []
    for d, (node, is_target) in enumerate(path):
        ids.append(node.token)
        depth.append(d)
        ends.append(-1)  # set below: the path is an ancestor of the whole piece
        if is_target and d > 0:
            tpos.append(d)
            ppos.append(d - 1)
    stack: list[tuple[_Node, int, int, bool]] = [(root, len(path), len(path) - 1, False)]
    open_pos: list[int] = []
    while stack:
        node, d, parent, closing = stack.pop()
        if closing:
            ends[open_pos.pop()] = len(ids)
            continue
        pos = len(ids)
        ids.append(node.token)
        depth.append(d)
        ends.append(-1)
        if node.target and parent >= 0:
            tpos.append(pos)
            ppos.append(parent)
        open_pos.append(pos)
        stack.append((node, d, parent, True))
        for tok in sorted(node.children, reverse=True):
            stack.append((node.children[tok], d + 1, pos, False))
    for d in range(len(path)):
        ends[d] = len(ids)
    return ids, depth, ends, tpos, ppos


def _pieces(root: _Node, budget: int) -> list[_Packed]:
    """Split a tree larger than the budget into subtrees that carry their ancestor path as context.

    An ancestor's own target is kept only along the first child's line, so every target is trained once.
    """
    sizes = _subtree_sizes(root)
    out: list[_Packed] = []
    stack: list[tuple[_Node, list[tuple[_Node, bool]]]] = [(root, [])]
    while stack:
        node, path = stack.pop()
        if sizes[id(node)] + len(path) <= budget or not node.children:
            out.append(_dfs(path, node))
            continue
        kids = [node.children[t] for t in sorted(node.children)]
        first_path = [*path, (node, node.target)]
        other_path = [(n, False) for n, _ in first_path]
        for i in range(len(kids) - 1, -1, -1):
            stack.append((kids[i], first_path if i == 0 else other_path))
    return out


def pack_sequences(seqs: Sequence[RenderedConversation], micro_batch_tokens: int) -> list[MicroBatch]:
    """Insert sequences into prefix tries (one per first token), DFS-pack each tree, and fill micro-batches
    up to `micro_batch_tokens`. A tree over the budget is split into subtrees carrying their ancestor path;
    a single chain longer than the budget gets a micro-batch of its own."""
    roots: dict[int, _Node] = {}
    order: list[int] = []
    for s in seqs:
        if not s.ids:
            continue
        if s.ids[0] not in roots:
            roots[s.ids[0]] = _Node(s.ids[0])
            order.append(s.ids[0])
        node = roots[s.ids[0]]
        for tok, tgt in zip(s.ids[1:], s.target[1:], strict=True):
            child = node.children.get(tok)
            if child is None:
                child = node.children[tok] = _Node(tok)
            child.target = child.target or tgt
            node = child
    trees = [piece for t in order for piece in _pieces(roots[t], micro_batch_tokens)]
    groups: list[list[_Packed]] = []
    size = 0
    for tree in trees:
        n = len(tree[0])
        if not groups or size + n > micro_batch_tokens:
            groups.append([])
            size = 0
        groups[-1].append(tree)
        size += n
    out = []
    for group in groups:
        ids: list[int] = []
        depth: list[int] = []
        ends: list[int] = []
        tpos: list[int] = []
        ppos: list[int] = []
        for t_ids, t_depth, t_ends, t_tpos, t_ppos in group:
            off = len(ids)
            ids += t_ids
            depth += t_depth
            ends += [e + off for e in t_ends]
            tpos += [p + off for p in t_tpos]
            ppos += [p + off for p in t_ppos]
        out.append(
            MicroBatch.from_lists(
                input_ids=ids, position_ids=depth, subtree_end=ends, target_pos=tpos, pred_pos=ppos
            )
        )
    return out
