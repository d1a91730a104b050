"""The API-neutral request and result of one model call, and the port each HTTP API adapter fills (pure):
the Anthropic and OpenAI adapters parse their bodies into a `ParsedRequest` and shape a `Completion` back."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from services.rollout.conversation import ChatMessage, Conversation
from services.rollout.errors import ApiError

HttpApi = Literal["anthropic", "openai"]


@dataclass(frozen=True)
class SamplingRequest:
    """API-neutral sampling options; max_tokens None means "what the context leaves"."""

    max_tokens: int | None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    forced_tools: tuple[str, ...] = ()  # tool_choice any/tool: the reply must call one of these


@dataclass(frozen=True)
class ParsedRequest:
    model: str
    conversation: Conversation
    sampling: SamplingRequest
    stream: bool


@dataclass(frozen=True)
class Completion:
    """What the gateway produced for one call, before it is shaped into an API response."""

    call_id: str
    model: str
    reply: ChatMessage
    tool_ids: tuple[str, ...]
    finish_reason: str  # "stop" | "length"
    stop_sequence: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    policy_version: int
    logprobs: tuple[float, ...] = ()
    token_texts: tuple[str, ...] = ()
    call_index: int | None = None  # the index the call was recorded under in its execution's log


class ApiAdapter(Protocol):
    """One HTTP API's shapes: its request body to a `ParsedRequest`, a `Completion` to its response (plain or
    streamed), an error to its error body. `body` is the request body, for options that shape the response."""

    api: HttpApi

    def parse(self, body: Any) -> ParsedRequest: ...

    def response(self, result: Completion, body: Any, *, created: int) -> dict[str, Any]: ...

    def response_headers(self, result: Completion) -> dict[str, str]: ...

    def stream(self, result: Completion, body: Any, *, created: int) -> Iterator[bytes]: ...

    def error_body(self, exc: ApiError) -> dict[str, Any]: ...


__all__ = ["ApiAdapter", "Completion", "HttpApi", "ParsedRequest", "SamplingRequest"]
