"""Per-execution API tokens, the contract between the harness (which hands an execution its token) and the
rollout gateway (which recognises it): "gx-<execution_id>.<HMAC-SHA256(secret, execution_id)>".

Both sides hold the same secret, so the gateway checks a token without state: a restarted gateway still
recognises every live execution, and no token ever travels in an event. A sandbox sees only its own token,
which names its execution and no other. Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import hmac

PREFIX = "gx-"


def derive_execution_token(secret: bytes, execution_id: str) -> str:
    """The token of `execution_id` under `secret`."""
    mac = hmac.new(secret, execution_id.encode(), hashlib.sha256).hexdigest()
    return f"{PREFIX}{execution_id}.{mac}"


def execution_named_by(token: str) -> str | None:
    """The execution a token says it is for, unverified (only the gateway's secret proves it), or None when the
    token is not in the derived form."""
    if not token.startswith(PREFIX) or "." not in token:
        return None
    return token[len(PREFIX) :].rsplit(".", 1)[0] or None


def execution_of_token(secret: bytes, token: str) -> str | None:
    """The execution a token was derived for, or None when it was not derived with `secret` (compared in
    constant time)."""
    execution_id = execution_named_by(token)
    if execution_id is None or not hmac.compare_digest(token, derive_execution_token(secret, execution_id)):
        return None
    return execution_id


__all__ = ["PREFIX", "derive_execution_token", "execution_named_by", "execution_of_token"]
