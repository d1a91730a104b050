"""Which execution a call's API key names: tokens derived from the run's secret
(`shared.execution_tokens`), verified without state, less the executions that have ended (revoked). The harness
derives the same token from the same secret; no token is ever minted here, sent anywhere or written to an event.
"""

from __future__ import annotations

from shared.execution_tokens import execution_of_token


class TokenVerifier:
    """Maps a derived token to its execution, unless the execution has ended (the gateway saw its end)."""

    def __init__(self, secret: bytes) -> None:
        if not secret:
            raise ValueError("a token secret is required to verify execution tokens")
        self._secret = secret
        self._revoked: set[str] = set()

    def revoke(self, execution_id: str) -> None:
        """The execution ended: its token names nothing from now on."""
        self._revoked.add(execution_id)

    def revoked(self, execution_id: str) -> bool:
        return execution_id in self._revoked

    def execution_of(self, token: str | None) -> str | None:
        if not token:
            return None
        execution_id = execution_of_token(self._secret, token)
        if execution_id is None or execution_id in self._revoked:
            return None
        return execution_id


__all__ = ["TokenVerifier"]
