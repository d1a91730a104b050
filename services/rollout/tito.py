"""Token-in/token-out: builds each prompt from the exact token ids an execution already produced (pure core).

When a request's messages extend an earlier request's messages (plus the reply we generated), the prompt
reuses those ids, including the model's own generated ids, and only the new messages are rendered and
tokenized. Anything else is rendered afresh, so a divergence shows up as a fork in the record, never as a
silently misaligned prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np

from services.rollout.conversation import ChatMessage, Conversation, next_prefix_key
from shared.tokens import TokenBuffer

AnchorKind = Literal["request", "response"]


class ChatCodec(Protocol):
    """Renders conversations with the model's chat template and tokenizes text (both deterministic)."""

    end_of_turn: str  # the text that closes a turn, e.g. "<|im_end|>"
    end_of_turn_id: int  # its token id (the EOS the model generates)

    def render(self, conversation: Conversation, *, add_generation_prompt: bool) -> str: ...

    def encode(self, text: str) -> list[int]: ...


class TemplateNotIncremental(Exception):
    """The chat template rendered a longer conversation that does not start with the shorter one's text."""

    def __init__(self, what: str) -> None:
        super().__init__(f"chat template is not incremental: {what}")


@dataclass(frozen=True)
class Anchor:
    """A conversation state whose exact token ids are known: `tokens` stands for the rendered `text`."""

    key: str  # Conversation.prefix_keys()[n_messages]
    n_messages: int
    text: str
    buffer: TokenBuffer  # `tokens` is a view of its start; a prompt that extends all of it shares it
    n_tokens: int
    chain_id: str
    kind: AnchorKind

    @property
    def tokens(self) -> np.ndarray:
        return self.buffer.view(self.n_tokens)


@dataclass(frozen=True)
class PromptPlan:
    """The prompt for one request and what it reused; `commit` turns it into anchors after generation."""

    conversation: Conversation
    prompt: np.ndarray  # int32 ids: anchor tokens ⊕ rendered new messages ⊕ generation prompt (read-only)
    buffer: TokenBuffer  # `prompt` is a view of its start
    prompt_text: str  # render(conversation, add_generation_prompt=True)
    conversation_text: str  # render(conversation, add_generation_prompt=False)
    conversation_len: int  # ids standing for conversation_text (prompt minus the generation prompt)
    reused: Anchor | None
    chain_id: str
    chain_key: str

    @property
    def reused_tokens(self) -> int:
        return 0 if self.reused is None else len(self.reused.tokens)


@dataclass
class TitoState:
    """Per-execution token-in/token-out memory: recent anchors and the execution's chains.

    Deterministic: the same sequence of plans and commits gives the same anchors and chain ids.
    """

    max_anchors: int = 32
    anchors: OrderedDict[str, Anchor] = field(default_factory=OrderedDict)
    chains: dict[str, str] = field(default_factory=dict)  # chain_key -> chain_id
    # What the chat template appends for the model's turn (learned at the execution's first plan): each later
    # prompt's conversation text is its prompt's text less it, one render fewer a call.
    generation_prompt: str | None = None

    def plan(self, conversation: Conversation, codec: ChatCodec) -> PromptPlan:
        """Build the prompt ids for `conversation`. Changes nothing this state shows: the ids may be appended to
        the anchor's buffer, past every view handed out (a plan never committed makes the next plan copy)."""
        anchor, prompt_text, conversation_text, middle, generation_prompt = self._parts(conversation, codec)
        chain_key = conversation.chain_key()
        if anchor is not None:
            chain_id = anchor.chain_id
            # Appended in place when nothing was planned from the anchor's buffer since (the usual case); the
            # state's views end before what is appended, so this stores nothing they show.
            buffer, prompt = anchor.buffer.extended(anchor.n_tokens, middle, generation_prompt)
        else:
            chain_id = self.chains.get(chain_key) or ("main" if not self.chains else f"chain-{len(self.chains)}")
            buffer = TokenBuffer.of(middle, generation_prompt)
            prompt = buffer.view()
        return PromptPlan(
            conversation=conversation,
            prompt=prompt,
            buffer=buffer,
            prompt_text=prompt_text,
            conversation_text=conversation_text,
            conversation_len=len(prompt) - len(generation_prompt),
            reused=anchor,
            chain_id=chain_id,
            chain_key=chain_key,
        )

    def prompt_len(self, conversation: Conversation, codec: ChatCodec) -> int:
        """How many ids `plan` would give `conversation` (without building them)."""
        anchor, _, _, middle, generation_prompt = self._parts(conversation, codec)
        return (anchor.n_tokens if anchor is not None else 0) + len(middle) + len(generation_prompt)

    def _parts(
        self, conversation: Conversation, codec: ChatCodec
    ) -> tuple[Anchor | None, str, str, np.ndarray, np.ndarray]:
        """The anchor a prompt reuses, the prompt's and the conversation's text, and the ids of what follows the
        anchor: the new messages, then the generation prompt."""
        if not conversation.messages:
            raise ValueError("a conversation needs at least one message")
        prompt_text = codec.render(conversation, add_generation_prompt=True)
        conversation_text = self._conversation_text(conversation, prompt_text, codec)
        anchor = self._longest_anchor(conversation)
        prefix_text = ""
        if anchor is not None and conversation_text.startswith(anchor.text):
            # The usual case, an agent resending what it was sent and answered: the anchor's ids stand for
            # exactly the start of this conversation's text, so the new text is the rest.
            prefix_text = anchor.text
        elif anchor is not None:
            # Messages match the anchor's by value (an echo may differ in surrounding whitespace), so the new
            # text is what this conversation renders after its own first n messages.
            head = Conversation(messages=conversation.messages[: anchor.n_messages], tools=conversation.tools)
            prefix_text = codec.render(head, add_generation_prompt=False)
            if not conversation_text.startswith(prefix_text):
                # The template renders those messages differently in this context; reuse nothing rather
                # than splice mismatched text.
                anchor, prefix_text = None, ""
        middle = _ids(codec.encode(conversation_text[len(prefix_text) :]))
        generation_prompt = _ids(codec.encode(prompt_text[len(conversation_text) :]))
        return anchor, prompt_text, conversation_text, middle, generation_prompt

    def _conversation_text(self, conversation: Conversation, prompt_text: str, codec: ChatCodec) -> str:
        """The prompt's text without the generation prompt: rendered once per execution (which gives the
        template's generation prompt), after that the prompt's text less that generation prompt where it ends
        with it. Either way it is a prefix of the prompt's text, the one thing the ids rely on: every anchor used
        is checked to be a prefix of the text it stands in, so a template whose generation prompt varied would
        cost reuse, never exactness."""
        known = self.generation_prompt
        if known and prompt_text.endswith(known):
            return prompt_text[: -len(known)]
        conversation_text = codec.render(conversation, add_generation_prompt=False)
        if not prompt_text.startswith(conversation_text):
            raise TemplateNotIncremental("the generation prompt does not extend the rendered conversation")
        if known is None:
            self.generation_prompt = prompt_text[len(conversation_text) :]
        return conversation_text

    def commit(
        self,
        plan: PromptPlan,
        *,
        completion: np.ndarray,
        reply: ChatMessage,
        codec: ChatCodec,
    ) -> None:
        """Remember the request and, when the template allows it, the reply as anchors for later calls."""
        self.chains.setdefault(plan.chain_key, plan.chain_id)
        keys = plan.conversation.prefix_keys()
        n = len(plan.conversation.messages)
        self._put(
            Anchor(
                key=keys[n],
                n_messages=n,
                text=plan.conversation_text,
                buffer=plan.buffer,
                n_tokens=plan.conversation_len,
                chain_id=plan.chain_id,
                kind="request",
            )
        )
        extended = Conversation(messages=plan.conversation.messages + (reply,), tools=plan.conversation.tools)
        text = codec.render(extended, add_generation_prompt=False)
        if not text.startswith(plan.prompt_text):
            return
        rendered_reply = text[len(plan.prompt_text) :]
        close_at = rendered_reply.rfind(codec.end_of_turn)
        if close_at < 0:
            return
        # What the template puts after the turn's end marker (ChatML: "\n") is context, not generated.
        glue = rendered_reply[close_at + len(codec.end_of_turn) :]
        completion = np.asarray(completion, dtype=np.int32)
        closing = (
            np.zeros(0, dtype=np.int32)
            if len(completion) and int(completion[-1]) == codec.end_of_turn_id
            else np.array([codec.end_of_turn_id], dtype=np.int32)
        )
        buffer, tokens = plan.buffer.extended(len(plan.prompt), completion, closing, _ids(codec.encode(glue)))
        self._put(
            Anchor(
                key=next_prefix_key(keys[n], reply, plan.conversation.tool_defaults),
                n_messages=n + 1,
                text=text,
                buffer=buffer,
                n_tokens=len(tokens),
                chain_id=plan.chain_id,
                kind="response",
            )
        )

    def _longest_anchor(self, conversation: Conversation) -> Anchor | None:
        keys = conversation.prefix_keys()
        for n in range(len(conversation.messages), 0, -1):
            anchor = self.anchors.get(keys[n])
            if anchor is not None:
                return anchor
        return None

    def _put(self, anchor: Anchor) -> None:
        existing = self.anchors.get(anchor.key)
        # A reply anchor holds generated ids; a later identical request must not replace it with re-rendered ids.
        if existing is not None and existing.kind == "response" and anchor.kind == "request":
            self.anchors.move_to_end(anchor.key)
            return
        self.anchors[anchor.key] = anchor
        self.anchors.move_to_end(anchor.key)
        while len(self.anchors) > self.max_anchors:
            self.anchors.popitem(last=False)


def _ids(ids: list[int]) -> np.ndarray:
    return np.asarray(ids, dtype=np.int32)
