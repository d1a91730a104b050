"""Generated hostile input at both HTTP APIs: whatever arrives, the answer is a 200 or a 4xx in the API's own error
shape with a message, never a 5xx; a refused request records no call (only its `call.refused`, and nothing at all
for a key that names no execution); the gateway stays healthy; and an execution calling beside it goes on as if
nothing had happened (same chain, its prompts extending its own generated ids)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.rollout.gateway import create_app
from shared.calls import call_record
from shared.chat import format_tool_call
from shared.events import CallCompleted, CallRefused
from shared.execution_tokens import derive_execution_token
from tests.hostile import DELETE, json_values, replaced
from tests.rollout.fakes import CharCodec, ScriptedEngine, Stack, build_stack

CODEC = CharCodec()
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                derandomize=True)
ANTHROPIC_KINDS = {"invalid_request_error", "authentication_error", "not_found_error", "request_too_large",
                   "rate_limit_error"}
BASH = {"name": "bash", "description": "Run a command",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}
PIXEL = base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(16)).decode()

# A rich valid request of each API: every part of it is something a mutation can break.
ANTHROPIC_BASE: dict[str, Any] = {
    "model": "tiny", "max_tokens": 40, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "stop_sequences": ["STOP"],
    "system": [{"type": "text", "text": "You are careful."}],
    "tools": [BASH], "tool_choice": {"type": "auto"}, "metadata": {"user_id": "u"},
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "look at this"},
                                     {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                  "data": PIXEL}}]},
        {"role": "assistant", "content": [{"type": "text", "text": "running"},
                                          {"type": "tool_use", "id": "toolu_1", "name": "bash",
                                           "input": {"command": "ls"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.txt"}]},
    ],
}
OPENAI_BASE: dict[str, Any] = {
    "model": "tiny", "max_tokens": 40, "temperature": 0.7, "top_p": 0.9, "stop": ["STOP"], "seed": 3,
    "tools": [{"type": "function", "function": {"name": "bash", "description": "Run a command",
                                                "parameters": BASH["input_schema"]}}],
    "tool_choice": "auto",
    "messages": [
        {"role": "system", "content": "You are careful."},
        {"role": "user", "content": [{"type": "text", "text": "look"},
                                     {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PIXEL}"}}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a.txt"},
    ],
}
API_PATHS = {"anthropic": "/v1/messages", "openai": "/v1/chat/completions"}
BASES = {"anthropic": ANTHROPIC_BASE, "openai": OPENAI_BASE}
# Fields either API reads, and some it does not: added to a request with arbitrary values.
FIELD_NAMES = ["model", "max_tokens", "max_completion_tokens", "messages", "system", "tools", "tool_choice",
               "temperature", "top_p", "top_k", "seed", "stop", "stop_sequences", "stream", "n", "logprobs",
               "top_logprobs", "response_format", "metadata", "thinking", "user", "parallel_tool_calls"]

request_values = json_values(
    words=["", "user", "assistant", "tool", "system", "text", "image", "tool_use", "object", "function", "auto",
           "any", "none", "required", "bash", "\x00", "\ud7ff"],
    keys=["type", "role", "content", "text", "name", "id", "input", "arguments", "function", "properties",
          "required", "source", "tool_use_id", "tool_call_id", "tool_calls", "data", "url", "image_url"],
    text_size=30, width=4, max_leaves=12)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, item in value.items():
            out += _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            out += _paths(item, (*prefix, i))
    return out


def _json_bytes(body: Any) -> bytes:
    return json.dumps(body, allow_nan=True).encode()


class Harness:
    """One gateway under fuzz, with a control execution that calls between the hostile requests."""

    def __init__(self, *, max_body_bytes: int = 256 * 1024) -> None:
        self.stack: Stack = build_stack([ScriptedEngine(CODEC, self._script)], CODEC, max_body_bytes=max_body_bytes)
        self.loop = asyncio.new_event_loop()
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.stack.app), base_url="http://gateway",
                                      timeout=30)
        self.control_id = "control-0"
        self.control: list[dict[str, Any]] = [{"role": "user", "content": "control task"}]
        self.control_calls = 0
        self.statuses: Counter[int] = Counter()

    @staticmethod
    def _script(prompt: list[int]) -> str:
        return format_tool_call("bash", {"command": f"echo {len(prompt)}"}, "ok")

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        self.run(self.http.aclose())
        self.loop.close()

    def counts(self) -> tuple[int, int]:
        events = self.stack.recorder.events
        return (sum(isinstance(e.data, CallCompleted) for e in events),
                sum(isinstance(e.data, CallRefused) for e in events))

    async def send(self, api: str, content: bytes, token: str | None, headers: dict[str, str] | None = None
                   ) -> httpx.Response:
        sent = {"content-type": "application/json", **(headers or {})}
        if token is not None:
            sent["authorization"] = f"Bearer {token}"
        return await self.http.post(API_PATHS[api], content=content, headers=sent)

    async def control_call(self) -> None:
        """The control execution's next call: answered, and continuing its one chain on its own generated ids."""
        if self.control_calls == 20:  # a fresh control before its context fills; the old one ends
            self.stack.core.end_execution(self.control_id)
            for worker in self.stack.local.workers.values():
                worker.end_sessions(self.control_id)
            self.stack.refresh()
            self.control_id = f"control-{int(self.control_id.split('-')[1]) + 1}"
            self.control, self.control_calls = [{"role": "user", "content": "control task"}], 0
        token = self.stack.token(self.control_id)
        self.stack.engines[0].prompts.clear()  # the scripted engine's prefix-cache count scans every prompt kept
        r = await self.send("anthropic", _json_bytes({"model": "tiny", "max_tokens": 400, "tools": [BASH],
                                                      "messages": self.control}), token)
        assert r.status_code == 200, r.text
        answer = r.json()
        self.control_calls += 1
        (use,) = [b for b in answer["content"] if b["type"] == "tool_use"]
        self.control += [{"role": "assistant", "content": answer["content"]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"],
                                                       "content": "fine"}]}]
        calls = self.stack.recorder.calls(self.control_id)
        assert len(calls) == self.control_calls
        records = [call_record(c, self.stack.recorder.blobs[c.record.digest]) for c in calls]
        assert {c.chain_id for c in calls} == {"main"}
        if len(records) > 1:  # the new prompt extends the previous call's prompt and generated ids
            assert calls[-1].parent_call_index == calls[-2].call_index and calls[-1].branch_hint == "continuation"

    async def hostile(self, api: str, content: bytes, *, token: str | None, names_live: bool,
                      headers: dict[str, str] | None = None) -> httpx.Response:
        """Send one hostile request and check what it may and may not leave behind."""
        completed, refused = self.counts()
        r = await self.send(api, content, token, headers)
        self.statuses[r.status_code] += 1
        assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, r.text[:500])
        after_completed, after_refused = self.counts()
        if r.status_code == 200:
            assert (after_completed, after_refused) == (completed + 1, refused)
        else:
            error_shape(api, r)
            assert after_completed == completed, "a refused request recorded a call"
            assert after_refused == refused + (1 if names_live else 0)
        health = await self.http.get("/healthz")
        assert health.status_code == 200 and health.json()["ok"] is True
        await self.control_call()
        return r


def error_shape(api: str, r: httpx.Response) -> None:
    body = r.json()
    if api == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] in ANTHROPIC_KINDS
    else:
        assert set(body) == {"error"} and isinstance(body["error"]["type"], str)
    assert isinstance(body["error"]["message"], str) and body["error"]["message"].strip()
    assert "\n" not in body["error"]["message"] and "Traceback" not in body["error"]["message"]


@pytest.fixture
def harness() -> Any:
    h = Harness()
    yield h
    h.close()


def test_mutated_requests_are_answered_or_refused_in_the_apis_shape(harness: Harness) -> None:
    token = harness.stack.token("hostile")
    paths = {api: _paths(base) for api, base in BASES.items()}

    @FUZZ
    @given(api=st.sampled_from(sorted(BASES)), data=st.data())
    def check(api: str, data: st.DataObject) -> None:
        base = BASES[api]
        body = base
        for _ in range(data.draw(st.integers(1, 3), label="mutations")):
            path = data.draw(st.sampled_from(_paths(body) or paths[api]), label="path")
            value = data.draw(request_values, label="value")
            body = replaced(body, path, DELETE if data.draw(st.booleans(), label="delete") else value)
        if data.draw(st.booleans(), label="extra field"):
            body[data.draw(st.sampled_from(FIELD_NAMES))] = data.draw(request_values, label="extra")
        harness.run(harness.hostile(api, _json_bytes(body), token=token, names_live=True))

    check()
    # The mutations reach past the first check: many are answered, many refused.
    assert harness.statuses[200] >= 5 and harness.statuses[400] >= 20, harness.statuses


def test_bodies_that_are_not_requests_are_refused(harness: Harness) -> None:
    token = harness.stack.token("hostile")
    bodies = (
        st.binary(max_size=300)  # anything, bad UTF-8 included
        | request_values.map(_json_bytes)  # any JSON at all
        | st.sampled_from([ANTHROPIC_BASE, OPENAI_BASE]).map(lambda b: _json_bytes(b)[: len(_json_bytes(b)) // 2])
        | st.sampled_from([ANTHROPIC_BASE, OPENAI_BASE]).map(  # bad UTF-8 inside a string
            lambda b: _json_bytes(b).replace(b'"tiny"', b'"ti\xffny"'))
        | st.sampled_from([ANTHROPIC_BASE, OPENAI_BASE]).map(  # a lone surrogate
            lambda b: _json_bytes(b).replace(b'"ls"', b'"l\\ud800s"'))
    )

    @FUZZ
    @given(api=st.sampled_from(sorted(BASES)), content=bodies)
    def check(api: str, content: bytes) -> None:
        r = harness.run(harness.hostile(api, content, token=token, names_live=True))
        if not content.lstrip().startswith(b"{"):
            assert r.status_code != 200  # only an object can be a request

    check()


def test_deep_huge_and_not_a_schema_are_refused_not_crashed(harness: Harness) -> None:
    """Deep JSON where the adapters, the digest of a message or the template would recurse; numbers past every
    integer type; tool schemas that are not schemas."""
    token = harness.stack.token("hostile")
    not_schemas = st.sampled_from([
        {"type": "object", "properties": 5}, {"type": "object", "properties": {"a": "string"}},
        {"type": "object", "required": "a"}, {"type": "object", "required": [5]}, {"type": ["object"]},
        {"type": "object", "properties": {"a": {"type": "object", "properties": []}}}, [], "object", None,
        {"$ref": "#/definitions/x"}, {"type": "object", "properties": {"a": {"enum": 7}}},
    ]) | request_values

    @FUZZ
    @given(api=st.sampled_from(sorted(BASES)), depth=st.integers(20, 3000),
           where=st.sampled_from(["input", "schema", "metadata", "content", "top"]),
           schema=not_schemas, big=st.sampled_from([2**63, 2**64 + 1, 10**400, -(2**63) - 1, 1e308]),
           big_at=st.sampled_from(["max_tokens", "seed", "top_k", "temperature"]))
    def check(api: str, depth: int, where: str, schema: Any, big: Any, big_at: str) -> None:
        # Written out by hand: deeper than Python's own encoder will go.
        deep = ('{"a": [' * (depth // 2) + '"x"' + "]}" * (depth // 2))
        body = json.loads(json.dumps(BASES[api]))
        if where == "top":
            content = deep.encode()
        else:
            if where == "input":
                if api == "anthropic":
                    body["messages"][1]["content"][1]["input"] = {"command": "ls", "deep": "DEEP"}
                else:
                    body["messages"][2]["tool_calls"][0]["function"]["arguments"] = json.dumps({"deep": "DEEP"})
            elif where == "schema":
                tool = body["tools"][0] if api == "anthropic" else body["tools"][0]["function"]
                tool["input_schema" if api == "anthropic" else "parameters"] = (
                    {"type": "object", "properties": {"a": "DEEP"}} if depth % 2 else schema)
            elif where == "metadata":
                body["metadata"] = {"deep": "DEEP"}
            else:
                body["messages"].append({"role": "user", "content": "DEEP"})
            body[big_at] = big
            # Python writes integers past any JSON parser's limits; what a client could send.
            text = json.dumps(body, allow_nan=True)
            inside_string = where == "input" and api == "openai"  # arguments are a JSON string
            content = text.replace('\\"DEEP\\"' if inside_string else '"DEEP"',
                                   json.dumps(deep)[1:-1] if inside_string else deep).encode()
        harness.run(harness.hostile(api, content, token=token, names_live=True))

    check()


def test_keys_that_name_no_live_execution_are_401_and_leave_no_trace(harness: Harness) -> None:
    harness.run(harness.control_call())
    harness.stack.core.end_execution("ended")  # what its `execution.finished` does
    other_secret = derive_execution_token(b"another-runs-secret", "hostile")
    live = harness.stack.token("hostile")
    tokens = (st.text(max_size=80) | st.sampled_from([
        other_secret, live[:-1], live + "x", live.upper(), harness.stack.token("ended"), "Bearer " + live,
        live.replace(".", ""), "gyre-" + "A" * 5000]))

    @FUZZ
    @given(api=st.sampled_from(sorted(BASES)), token=tokens, header=st.sampled_from(["bearer", "x-api-key", "none"]))
    def check(api: str, token: str, header: str) -> None:
        if token.strip() == live:
            return
        if not token.isascii() or any(c in token for c in "\r\n\x00"):
            return  # not sendable as an HTTP header
        headers = {"x-api-key": token} if header == "x-api-key" else {}
        bearer = token if header == "bearer" else None
        r = harness.run(harness.hostile(api, _json_bytes(BASES[api]), token=bearer, names_live=False,
                                        headers=headers))
        assert r.status_code == 401
        assert harness.stack.recorder.refusals("ended") == [] and harness.stack.recorder.calls("ended") == []

    check()


def test_a_call_under_another_executions_key_is_that_executions_and_harms_neither(harness: Harness) -> None:
    """A key is the execution: the control's conversation sent under another execution's key is recorded in that
    one (its own first call), and the control goes on as before."""
    for _ in range(2):
        harness.run(harness.control_call())
    stolen = json.loads(json.dumps(harness.control))
    r = harness.run(harness.hostile("anthropic", _json_bytes({"model": "tiny", "max_tokens": 30, "tools": [BASH],
                                                              "messages": stolen}),
                                    token=harness.stack.token("victim"), names_live=True))
    assert r.status_code == 200
    (call,) = harness.stack.recorder.calls("victim")
    assert call.call_index == 0 and call.branch_hint is None


def test_oversized_bodies_are_413_declared_or_streamed() -> None:
    h = Harness(max_body_bytes=20_000)
    try:
        token = h.stack.token("hostile")
        big = _json_bytes({**ANTHROPIC_BASE, "messages": [{"role": "user", "content": "x" * 50_000}]})
        r = h.run(h.hostile("anthropic", big, token=token, names_live=True))
        assert r.status_code == 413

        async def chunks() -> Any:  # no content-length: the limit holds while the body streams in
            for _ in range(100):
                yield b" " * 1000

        async def streamed() -> httpx.Response:
            return await h.http.post("/v1/chat/completions", content=chunks(),
                                      headers={"authorization": f"Bearer {token}"})

        r = h.run(streamed())
        assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
        assert h.stack.recorder.calls("hostile") == []
    finally:
        h.close()


async def test_slow_and_vanishing_clients_hold_up_no_one(unused_tcp_port_factory: Callable[[], int]) -> None:
    """A real server: clients that send half a body and stall, and one that disconnects mid-body, while other
    executions' calls are answered. A stalled body is refused with a 408 once the body timeout passes (the
    refusal in its execution's log, as any); the one that vanished leaves nothing."""
    import uvicorn

    stack = build_stack([ScriptedEngine(CODEC)], CODEC)
    port = unused_tcp_port_factory()
    server = uvicorn.Server(uvicorn.Config(create_app(stack.core, body_timeout_s=1.0), host="127.0.0.1", port=port,
                                           log_level="error", lifespan="off"))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    body = _json_bytes({"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})

    async def partial(execution_id: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/messages HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     + f"x-api-key: {stack.token(execution_id)}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
                     + body[: len(body) // 2])
        await writer.drain()
        return reader, writer

    try:
        stalled = [await partial(f"slow-{i}") for i in range(20)]
        _, vanishing = await partial("gone")
        vanishing.transport.abort()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            for i in range(3):
                r = await client.post("/v1/messages", content=body,
                                      headers={"x-api-key": stack.token(f"fast-{i}")})
                assert r.status_code == 200, r.text
            assert (await client.get("/healthz")).status_code == 200
        for reader, writer in stalled:
            head = await asyncio.wait_for(reader.readline(), timeout=10)
            assert head.startswith(b"HTTP/1.1 408"), head
            writer.transport.abort()
        assert [c.execution_id for c in stack.recorder.calls()] == ["fast-0", "fast-1", "fast-2"]
        refused = stack.recorder.refusals()
        assert sorted(r.execution_id for r in refused) == sorted(f"slow-{i}" for i in range(20))
        assert {(r.status, r.infra) for r in refused} == {(408, False)}
    finally:
        server.should_exit = True
        await serving
