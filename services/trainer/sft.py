"""Supervised warm-start data: conversations rendered with the chat template, assistant turns as targets,
prefix-shared conversations merged into one token tree and packed by the same packer RL batches use.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.batch import MicroBatch
from shared.packing import pack_trees
from shared.token_tree import tree_from_sequences


class SftDataError(Exception):
    pass


@dataclass(frozen=True)
class RenderedConversation:
    """One rendered conversation: token ids and which of them are targets (assistant output)."""

    ids: list[int]
    target: list[bool]


def load_records(path: Path) -> list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]]:
    """Each conversation of a JSONL file, one a line ({"messages": [{"role": ..., "content": ...}, ...]} or a bare
    list), with the tools it is rendered with: a record's optional "tools" (in the chat template's function
    shape) go to the template beside the messages, as the gateway renders a request that carries tools (a
    harness's own tool set, e.g. Claude Code's)."""
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
        tools = obj.get("tools") if isinstance(obj, dict) else None
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise SftDataError(f"{path}:{n}: tools: expected a list of tool objects")
        out.append((messages, tools))
    return out


def load_conversations(path: Path) -> list[list[dict[str, Any]]]:
    """The conversations of a JSONL file (`load_records` without their tools)."""
    return [messages for messages, _ in load_records(path)]


def _ids(tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool,
         tools: list[dict[str, Any]] | None = None) -> list[int]:
    ids = tokenizer.apply_chat_template(
        messages, tools=tools or None, tokenize=True, add_generation_prompt=generation_prompt, return_dict=False
    )
    return list(ids)


def render_conversation(tokenizer: Any, messages: list[dict[str, Any]],
                        tools: list[dict[str, Any]] | None = None) -> RenderedConversation:
    """Token ids of the whole conversation; each assistant turn's tokens up to and including EOS are targets.

    Each turn's span is found by rendering the conversation up to it with and without the generation prompt,
    so it works for any template whose renderings extend each other (ChatML does).
    """
    full = _ids(tokenizer, messages, False, tools)
    target = [False] * len(full)
    eos = tokenizer.eos_token_id
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = _ids(tokenizer, messages[:i], True, tools)
        upto = _ids(tokenizer, messages[: i + 1], False, tools)
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


def pack_sequences(seqs: Sequence[RenderedConversation], micro_batch_tokens: int) -> list[MicroBatch]:
    """Merge the conversations into one prefix tree (shared prefixes once; a target where any conversation has
    one) and pack it with the shared tree packer (shared/packing.py): micro-batches of at most
    `micro_batch_tokens`, a tree over the budget cut into ranges that carry their ancestor path, every target
    once. A conversation longer than the budget cannot keep its whole context: `PackingError`."""
    merged = tree_from_sequences([s.ids for s in seqs], [s.target for s in seqs], name="SFT conversations")
    return pack_trees([(merged.tree, 0)], micro_batch_tokens)
