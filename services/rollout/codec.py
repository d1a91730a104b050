"""The model's tokenizer and chat template (shared/chat.py) behind the ChatCodec port, and generations read
back into assistant messages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.rollout.conversation import ChatMessage, Conversation
from shared.chat import EOS_TOKEN, chat_template
from shared.tool_formats import FORMATS, ToolCallFormat, detect_format, get_format


class TokenizerCodec:
    """Renders with the tokenizer's chat template (Gyre's ChatML template when it has none), and knows the format
    the template writes tool calls in (`tool_format`: given, or detected from the template; ToolFormatError when
    none of shared/tool_formats.py's formats reads it)."""

    def __init__(self, tokenizer: Any, *, end_of_turn: str | None = None, tool_format: str = "auto") -> None:
        self.tokenizer = tokenizer
        if not getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = chat_template()
        vocab = tokenizer.get_vocab()
        self.end_of_turn = end_of_turn or (EOS_TOKEN if EOS_TOKEN in vocab else tokenizer.eos_token)
        self.end_of_turn_id = int(vocab[self.end_of_turn])
        self.tool_format: ToolCallFormat = (self.detect_tool_format() if tool_format == "auto"
                                            else get_format(tool_format))

    @classmethod
    def from_model_dir(cls, model_dir: Path, *, tool_format: str = "auto") -> TokenizerCodec:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(model_dir)), tool_format=tool_format)

    def detect_tool_format(self) -> ToolCallFormat:
        """The tool-call format the chat template writes (ToolFormatError when none of the formats reads it)."""
        return detect_format(self._render_dicts)

    def _render_dicts(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
        return str(self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                      add_generation_prompt=False))

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


def reply_message(text: str, tool_format: ToolCallFormat = FORMATS["hermes"]) -> ChatMessage:
    """The assistant message a generation stands for: its text and its well-formed tool calls, read in the model's
    tool-call format.

    Malformed tool-call blocks stay in the text, so the harness sees what the model really wrote.
    """
    parsed = tool_format.parse(text)
    content = parsed.content
    if parsed.malformed:
        content = "\n".join([content, *parsed.malformed]).strip()
    return ChatMessage(role="assistant", content=content, tool_calls=parsed.tool_calls)
