"""Per-execution API tokens: the bearer token / x-api-key a harness presents identifies its execution.

Two ways to get one, both unguessable and scoped to one execution:
- registered: the harness asks the gateway (`POST /internal/executions`) and receives a random token;
- derived: `derive_token(secret, execution_id)` = "gx-<execution_id>.<HMAC-SHA256>", checked statelessly
  by any gateway sharing the secret, so a restarted gateway still recognises live executions.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets


def derive_token(secret: bytes, execution_id: str) -> str:
    mac = hmac.new(secret, execution_id.encode(), hashlib.sha256).hexdigest()
    return f"gx-{execution_id}.{mac}"


class ExecutionRegistry:
    """Maps tokens to execution ids; stores only token digests."""

    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret
        self._by_digest: dict[str, str] = {}
        self._revoked: set[str] = set()

    @staticmethod
    def _digest(token: str) -> str:
        return hashlib.sha256(token.encode()).hexdigest()

    def register(self, execution_id: str, token: str | None = None) -> str:
        token = token or "gyre-" + secrets.token_urlsafe(32)
        self._by_digest[self._digest(token)] = execution_id
        self._revoked.discard(execution_id)
        return token

    def revoke(self, execution_id: str) -> None:
        for digest in [d for d, e in self._by_digest.items() if e == execution_id]:
            del self._by_digest[digest]
        self._revoked.add(execution_id)

    def resolve(self, token: str | None) -> str | None:
        if not token:
            return None
        found = self._by_digest.get(self._digest(token))
        if found is not None:
            return found
        if self._secret is not None and token.startswith("gx-") and "." in token:
            execution_id = token[3:].rsplit(".", 1)[0]
            if execution_id not in self._revoked and hmac.compare_digest(
                token, derive_token(self._secret, execution_id)
            ):
                return execution_id
        return None
