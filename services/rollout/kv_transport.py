"""The KV transport port: how a session's saved KV (a `kv_bundle`) travels from the worker that saved it to the
worker that adopts the session. Pure: `transport.NatsKvTransport` carries it through the bus's Object Store, so
workers on any node need nothing but NATS; tests use an in-memory fake against the same contract suite.
"""

from __future__ import annotations

from typing import Protocol

from services.rollout.protocol import KvTicket


class KvTransferFailed(Exception):
    """The KV did not arrive whole: missing (its sender died before it finished, or it expired), cut off, or
    not the bytes the ticket names. The message is the reason a migration reports when it recomputes."""


class KvTransport(Protocol):
    name: str

    async def send(self, bundle: bytes, *, fingerprint: str, prompt_tokens: int) -> KvTicket:
        """Make `bundle` available to another worker; the ticket is what that worker needs to fetch it."""
        ...

    async def receive(self, ticket: KvTicket) -> bytes:
        """The bundle a ticket names, exactly as sent (checked against its digest); KvTransferFailed if not."""
        ...

    async def discard(self, ticket: KvTicket) -> None:
        """Forget a sent bundle (the move ended either way); a bundle already gone is no error."""
        ...


__all__ = ["KvTransferFailed", "KvTransport"]
