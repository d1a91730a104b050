"""The model's chat template and tokenizer behind the ChatCodec port, plus parsing generations into replies."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from services.rollout.conversation import ChatMessage, Conversation, ToolCall, ToolSpec
from shared.tinymodel import chat_template, parse_tool_calls


class TokenizerCodec:
    """Renders with the tokenizer's chat template (Gyre's ChatML template when it has none)."""

    def __init__(self, tokenizer: Any, *, end_of_turn: str | None = None) -> None:
        self.tokenizer = tokenizer
        if not getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = chat_template()
        vocab = tokenizer.get_vocab()
        self.end_of_turn = end_of_turn or ("<|im_end|>" if "<|im_end|>" in vocab else tokenizer.eos_token)
        self.end_of_turn_id = int(vocab[self.end_of_turn])

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> TokenizerCodec:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(model_dir)))

    def render(self, conversation: Conversation, *, add_generation_prompt: bool) -> str:
        messages = [m.template_dict() for m in conversation.messages]
        tools = [t.template_dict() for t in conversation.tools] or None
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return str(text)

    def encode(self, text: str) -> list[int]:
        if not text:
            return []
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def token_texts(self, ids: list[int]) -> list[str]:
        return [str(self.tokenizer.decode([i], skip_special_tokens=False)) for i in ids]


def reply_message(text: str) -> ChatMessage:
    """The assistant message a generation stands for: its text and its well-formed tool calls.

    Malformed tool-call blocks stay in the text, so the harness sees what the model really wrote.
    """
    parsed = parse_tool_calls(text)
    content = parsed.content
    if parsed.malformed:
        content = "\n".join([content, *parsed.malformed]).strip()
    calls = tuple(ToolCall(name=c.name, arguments=dict(c.arguments)) for c in parsed.tool_calls)
    return ChatMessage(role="assistant", content=content, tool_calls=calls)


def tool_call_regex(tools: tuple[ToolSpec, ...], names: tuple[str, ...]) -> str:
    """A regex for one `<tool_call>` block calling one of `names` (guided decoding for tool_choice any/tool).

    Arguments cover the schema's required scalar properties (all scalar ones when none are required), with
    short safe values; that is enough for a small model to produce a well-formed call.
    """
    alternatives = []
    for tool in tools:
        if tool.name not in names:
            continue
        props = tool.parameters.get("properties") or {}
        required = [k for k in tool.parameters.get("required") or [] if k in props]
        keys = required or list(props)
        fields = []
        for key in keys:
            spec = props.get(key)
            kind = spec.get("type", "string") if isinstance(spec, dict) else "string"  # `true`: any value
            value = _VALUE_PATTERNS.get(kind if isinstance(kind, str) else "string")
            if value is None:
                if key in required:
                    value = _VALUE_PATTERNS["string"]
                else:
                    continue
            fields.append(re.escape(json.dumps(key)) + ": " + value)
        args = r"\{" + ", ".join(fields) + r"\}"
        alternatives.append(r'\{"name": ' + re.escape(json.dumps(tool.name)) + r', "arguments": ' + args + r"\}")
    if not alternatives:
        raise ValueError(f"no tool named any of {list(names)}")
    return "<tool_call>\n(" + "|".join(alternatives) + ")\n</tool_call>"


_VALUE_PATTERNS = {
    "string": r'"[a-zA-Z0-9 ._/-]{1,24}"',
    "integer": r"-?[0-9]{1,6}",
    "number": r"-?[0-9]{1,6}",
    "boolean": r"(true|false)",
}
