"""An execution's agent for the tests that drive the gateway themselves: a growing conversation through the
Messages API, with the execution's token."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

WORDS = " ".join(f"word{i % 89}" for i in range(400))  # a first prompt of several KV blocks


class Agent:
    def __init__(self, url: str, token: str, model: str = "gyre-tiny") -> None:
        self.url, self.token, self.model = url, token, model
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": f"Remember these: {WORDS}. Go."}]
        self.usages: list[dict[str, Any]] = []

    async def call(self) -> None:
        body = {"model": self.model, "max_tokens": 24, "messages": self.messages, "temperature": 1.0}
        headers = {"x-api-key": self.token, "anthropic-version": "2023-06-01"}
        async with httpx.AsyncClient(timeout=300.0) as http:
            reply = await http.post(f"{self.url}/v1/messages", json=body, headers=headers)
        assert reply.status_code == 200, reply.text[:500]
        message = reply.json()
        self.usages.append(message["usage"])
        text = "".join(b.get("text", "") for b in message["content"] if b.get("type") == "text")
        self.messages += [{"role": "assistant", "content": text or "ok"},
                          {"role": "user", "content": f"Go on ({len(self.usages)})."}]

    async def call_when_taken_up(self, timeout_s: float = 60.0) -> None:
        """The gateway takes an execution up from its `execution.started` (relayed over the bus): until then it
        answers 401, so the first call retries briefly."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                await self.call()
                return
            except AssertionError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)


async def until_the_gateway_routes_to(url: str, workers: set[str], timeout_s: float = 120.0) -> None:
    """Until the gateway at `url` lists every one of `workers` among the live ones it routes to (its `/healthz`:
    it learns of a worker from the worker's status beats, a second or so after the worker serves)."""
    deadline = time.monotonic() + timeout_s
    seen: set[str] = set()
    async with httpx.AsyncClient(timeout=5.0) as http:
        while True:
            try:
                seen = {w["worker_id"] for w in (await http.get(f"{url}/healthz")).json()["workers"]}
            except (httpx.HTTPError, ValueError, KeyError):
                seen = set()
            if workers <= seen:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"the gateway at {url} routes to {sorted(seen)} after {timeout_s:.0f} s, "
                                     f"not yet to {sorted(workers - seen)}")
            await asyncio.sleep(0.25)

