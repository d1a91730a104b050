"""A scripted server speaking the Anthropic Messages API, for deterministic harness tests.

Replies come from a script (one per request, in order); every request is recorded with its headers.
It listens on 127.0.0.1 (an ephemeral port) with uvicorn in a background thread.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from shared.calls import CALL_INDEX_HEADER

Reply = dict[str, Any] | Callable[[dict[str, Any]], dict[str, Any]]
# Told of every error the server answers a call with (request headers, status, error type, message) before the
# client sees it, as the gateway writes each refusal to the execution's log first.
RefusalHook = Callable[[dict[str, str], int, str, str], Awaitable[None]]


def text(value: str, *, stop_reason: str = "end_turn", **usage: int) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": value}], "stop_reason": stop_reason, **({"usage": usage} if usage else {})}


def tool(name: str, tool_input: dict[str, Any], *, text_before: str = "", **usage: int) -> dict[str, Any]:
    content: list[dict[str, Any]] = [{"type": "text", "text": text_before}] if text_before else []
    content.append({"type": "tool_use", "id": f"toolu_{name}_{abs(hash(json.dumps(tool_input, sort_keys=True))) % 10**8}", "name": name, "input": tool_input})
    return {"content": content, "stop_reason": "tool_use", **({"usage": usage} if usage else {})}


def failure(status: int = 500) -> dict[str, Any]:
    return {"error_status": status, "content": []}


def lost() -> dict[str, Any]:
    """A call the server counts (as the gateway records it) whose reply never reaches the client: a 500."""
    return {"error_status": 500, "content": [], "counted": True}


def slow(reply: dict[str, Any], delay_s: float) -> dict[str, Any]:
    return {**reply, "delay_s": delay_s}


def shell(command: str, **usage: int) -> dict[str, Any]:
    return tool("shell", {"command": command}, **usage)


def submit(answer: str = "done", **usage: int) -> dict[str, Any]:
    return tool("submit", {"answer": answer}, **usage)


def _sse(message: dict[str, Any]) -> Iterator[str]:
    """The message as Anthropic's streaming events (one delta per block), for clients that stream."""

    def event(name: str, data: dict[str, Any]) -> str:
        return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n"

    start = {**message, "content": [], "stop_reason": None, "usage": {**message["usage"], "output_tokens": 1}}
    yield event("message_start", {"message": start})
    for index, block in enumerate(message["content"]):
        if block["type"] == "text":
            yield event("content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}})
            yield event("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": block["text"]}})
        else:
            yield event("content_block_start", {"index": index, "content_block": {**block, "input": {}}})
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
            yield event("content_block_delta", {"index": index, "delta": delta})
        yield event("content_block_stop", {"index": index})
    yield event("message_delta", {"delta": {"stop_reason": message["stop_reason"], "stop_sequence": None}, "usage": {"output_tokens": message["usage"]["output_tokens"]}})
    yield event("message_stop", {})


class ScriptedAnthropicServer:
    """Serves scripted replies on POST /v1/messages; `requests` holds what each call sent."""

    def __init__(
        self, script: list[Reply], *, token: str | None = None, model: str = "scripted-model", call_index_header: bool = False,
        on_refused: RefusalHook | None = None,
    ) -> None:
        self.script = list(script)
        self.on_refused = on_refused
        # Like the gateway: every answered (or `lost`) call gets the next index, sent in CALL_INDEX_HEADER.
        self.call_index_header = call_index_header
        self.counted = 0
        self.token = token
        self.model = model
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self._lock = threading.Lock()
        self.app = self._build_app()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/messages")
        async def messages(request: Request) -> JSONResponse:
            headers = {k.lower(): v for k, v in request.headers.items()}
            if self.token is not None:
                bearer = headers.get("authorization", "").removeprefix("Bearer ").strip()
                if self.token not in (bearer, headers.get("x-api-key")):
                    return JSONResponse(
                        {"type": "error", "error": {"type": "authentication_error", "message": "unknown execution token"}},
                        status_code=401,
                    )
            body = await request.json()
            with self._lock:
                self.requests.append(body)
                self.headers.append(headers)
                step = self.script.pop(0) if self.script else None
            if step is None:
                if self.on_refused is not None:
                    await self.on_refused(headers, 400, "invalid_request_error", "script exhausted")
                return JSONResponse(
                    {"type": "error", "error": {"type": "invalid_request_error", "message": "script exhausted"}},
                    status_code=400,
                )
            reply = step(body) if callable(step) else step
            if "delay_s" in reply:
                await asyncio.sleep(float(reply["delay_s"]))
            index = self.counted
            if "counted" in reply or "error_status" not in reply:
                self.counted += 1
            extra = {CALL_INDEX_HEADER: str(index)} if self.call_index_header else {}
            if "error_status" in reply:
                if self.on_refused is not None:
                    await self.on_refused(headers, int(reply["error_status"]), "api_error", "scripted failure")
                return JSONResponse(
                    {"type": "error", "error": {"type": "api_error", "message": "scripted failure"}},
                    status_code=int(reply["error_status"]),
                    headers={"retry-after": "0"},
                )
            prompt_chars = len(json.dumps(body.get("messages", []))) + len(json.dumps(body.get("system", "")))
            out_chars = len(json.dumps(reply["content"]))
            usage = {"input_tokens": prompt_chars // 4, "output_tokens": max(1, out_chars // 4)}
            usage.update(reply.get("usage", {}))
            message = {
                "id": f"msg_{len(self.requests):04d}",
                "type": "message",
                "role": "assistant",
                "model": body.get("model", self.model),
                "content": reply["content"],
                "stop_reason": reply.get("stop_reason", "end_turn"),
                "stop_sequence": None,
                "usage": usage,
            }
            if body.get("stream"):
                return StreamingResponse(_sse(message), media_type="text/event-stream", headers=extra)
            return JSONResponse(message, headers=extra)

        return app

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ScriptedAnthropicServer:
        config = uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not (self._server.started and self._server.servers):
            if time.monotonic() > deadline:
                raise RuntimeError("scripted server did not start within 30 s")
            time.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)

    def __enter__(self) -> ScriptedAnthropicServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
