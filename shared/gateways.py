"""Which gateway serves an execution when a run has several (pure): each execution sticks to one, chosen by
rendezvous hashing of its id over the run's gateway URLs, so every process that knows the list picks the same
one with no coordination, and adding or removing a gateway moves only the executions it gains or loses.

Every gateway can serve any execution (each settles an execution from its log at its first call there), so a
gateway that is gone costs its executions a re-read of their logs, not their work.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


class GatewayListError(ValueError):
    """A gateway list that names no gateway, or a URL that is not one."""


def gateway_urls(value: str) -> list[str]:
    """The run's gateways from a setting: one URL, or several separated by commas (each http(s)://host:port)."""
    urls = [part.strip().rstrip("/") for part in value.split(",") if part.strip()]
    if not urls:
        raise GatewayListError("expected at least one gateway URL, got an empty list")
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise GatewayListError(f"expected gateway URLs like http://host:port, got {url!r}")
    if len(set(urls)) != len(urls):
        raise GatewayListError(f"a gateway is listed twice in {value!r}")
    return urls


def _weight(url: str, execution_id: str) -> bytes:
    return hashlib.sha256(f"{url}\0{execution_id}".encode()).digest()


def gateway_for(execution_id: str, urls: Sequence[str]) -> str:
    """The gateway `execution_id` sticks to: the URL with the highest hash weight for it."""
    if not urls:
        raise GatewayListError("no gateway to choose from")
    return max(urls, key=lambda url: _weight(url, execution_id))


__all__ = ["GatewayListError", "gateway_for", "gateway_urls"]
