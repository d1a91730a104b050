"""Gateway errors: one exception type carrying an HTTP status, rendered in each API's own error shape, and which
refusals are the infrastructure's rather than the request's (pure)."""

from __future__ import annotations

from typing import Any, Literal

ErrorKind = Literal[
    "invalid_request_error",
    "authentication_error",
    "not_found_error",
    "request_too_large",
    "rate_limit_error",
    "api_error",
    "overloaded_error",
]

_STATUS: dict[str, int] = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "not_found_error": 404,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "api_error": 500,
    "overloaded_error": 529,
}

# OpenAI's `error.type` / `error.code` for the same conditions.
_OPENAI: dict[str, tuple[str, str | None]] = {
    "invalid_request_error": ("invalid_request_error", None),
    "authentication_error": ("invalid_request_error", "invalid_api_key"),
    "not_found_error": ("invalid_request_error", "not_found"),
    "request_too_large": ("invalid_request_error", "request_too_large"),
    "rate_limit_error": ("rate_limit_exceeded", "rate_limit_exceeded"),
    "api_error": ("server_error", None),
    "overloaded_error": ("server_error", "overloaded"),
}


class ApiError(Exception):
    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        *,
        param: str | None = None,
        retry_after_s: float | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s
        self.status = status or _STATUS[kind]

    def anthropic_body(self) -> dict[str, Any]:
        return {"type": "error", "error": {"type": self.kind, "message": self.message}}

    def openai_body(self) -> dict[str, Any]:
        kind, code = _OPENAI[self.kind]
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": code}}

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"retry-after": str(max(1, round(self.retry_after_s)))}


def invalid(message: str, *, param: str | None = None) -> ApiError:
    return ApiError("invalid_request_error", message, param=param)


class CallBudgetSpent(ApiError):
    """The execution's call budget is spent: every call it was allowed has been answered."""

    def __init__(self, answered: int, budget: int) -> None:
        super().__init__("invalid_request_error",
                         f"the execution's call budget is spent: {answered} of {budget} calls made")


def is_infra_refusal(exc: ApiError) -> bool:
    """A refusal that is the infrastructure's, not the request's own: no capacity (429) or a server-side failure."""
    return exc.status == 429 or exc.status >= 500


__all__ = ["ApiError", "CallBudgetSpent", "ErrorKind", "invalid", "is_infra_refusal"]
