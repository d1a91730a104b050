"""Per-execution API tokens: the bearer token / x-api-key a harness presents identifies its execution.

Two ways to get one, both unguessable and scoped to one execution:
- registered: the harness asks the gateway (`POST /internal/executions`) and receives a random token;
- derived: `shared.execution_tokens.derive_execution_token(secret, execution_id)`, checked statelessly by
  any gateway sharing the secret, so a restarted gateway still recognises live executions.
"""

from __future__ import annotations

import hashlib
import secrets

from shared.execution_tokens import execution_of_token


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
        if self._secret is not None:
            execution_id = execution_of_token(self._secret, token)
            if execution_id is not None and execution_id not in self._revoked:
                return execution_id
        return None
