"""The gateway: Anthropic Messages and OpenAI Chat Completions over HTTP (FastAPI) in front of the router.

Per call: authenticate the execution, build the prompt by token-in/token-out, route it to the execution's
worker, parse tool calls, record the call (blob + `call.completed`), and only then answer the harness.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from services.rollout import anthropic_api, openai_api
from services.rollout.anthropic_api import Completion, ParsedRequest
from services.rollout.codec import TokenizerCodec, reply_message
from services.rollout.credentials import ExecutionRegistry
from services.rollout.errors import ApiError, invalid
from services.rollout.protocol import SamplingSpec
from services.rollout.recording import Api, CallRecorder, CompletedCall, RecordingFailed
from services.rollout.router import NoCapacity, Router, WorkerFailed
from services.rollout.tito import TitoState
from shared.chat import tool_call_regex
from shared.calls import CALL_INDEX_HEADER, call_seed
from shared.logging import get_logger

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
REFUSAL_CHARS = 500  # a refusal's reason as kept for the harness (the message may quote a database error)


def is_infra_refusal(exc: ApiError) -> bool:
    """A refusal that is the infrastructure's, not the request's own: no capacity (429) or a server-side failure."""
    return exc.status == 429 or exc.status >= 500


@dataclass
class ExecutionState:
    tito: TitoState = field(default_factory=TitoState)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    answered: int = 0  # model calls answered with a completion
    infra_refusals: int = 0  # calls refused by the infrastructure (429, 5xx)
    # Why the execution's latest model call was refused, when the infrastructure refused it; None after an
    # answered call or a refusal of the request itself (400, 413...). Lets the harness tell an external agent
    # that exits because the model API failed it from one that exits on its own.
    last_infra_refusal: str | None = None
    # From the harness's registration: the execution's seed (a call that brings none samples with
    # `call_seed(seed, answered)`) and its call budget (calls past it are refused, 400). A gateway that did not
    # see the registration (it restarted since) recalls both, and the calls answered so far, from the log.
    seed: int | None = None
    max_calls: int | None = None
    budget_refusals: int = 0
    settled: bool = False  # registered here, or recalled from the log


def seed_problem(seed: object) -> str | None:
    """Why `seed` cannot seed an execution's calls (a call seed is seed × 100003 + the call index, below 2^63)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**46:
        return (f"seed: expected an integer in [0, 2^46) (a call seed is seed × 100003 + the call index, "
                f"below 2^63), got {seed!r}")
    return None


class GatewayCore:
    """Token-in/token-out, routing and recording for every call; the HTTP layer only parses and shapes."""

    def __init__(
        self,
        *,
        codec: TokenizerCodec,
        router: Router,
        recorder: CallRecorder,
        max_model_len: int,
        model_name: str = "gyre",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.codec = codec
        self.router = router
        self.recorder = recorder
        self.max_model_len = max_model_len
        self.model_name = model_name
        self.clock = clock
        self.executions: dict[str, ExecutionState] = {}
        self.log = get_logger(component="gateway")

    def context_limit(self) -> int:
        """The configured context, or less when the live workers serve a shorter one."""
        lengths = [s.max_model_len for s in self.router.directory.live()]
        return min([self.max_model_len, *lengths])

    def _state(self, execution_id: str) -> ExecutionState:
        return self.executions.setdefault(execution_id, ExecutionState())

    def count_tokens(self, execution_id: str, parsed: ParsedRequest) -> int:
        return self._state(execution_id).tito.prompt_len(parsed.conversation, self.codec)

    def note_refusal(self, execution_id: str, exc: ApiError) -> None:
        """Remember a refused call (the HTTP layer calls this for every error answer it sends).

        Only for an execution the gateway holds state for: every call creates it first, and an execution that
        has ended must not come back (a call still in flight at its end can fail afterwards)."""
        state = self.executions.get(execution_id)
        if state is None:
            return
        if is_infra_refusal(exc):
            state.infra_refusals += 1
            state.last_infra_refusal = f"{exc.status} {exc.kind}: {exc.message}"[:REFUSAL_CHARS]
        else:
            state.last_infra_refusal = None

    def start_execution(
        self, execution_id: str, *, seed: int | None = None, max_calls: int | None = None, cell_id: str | None = None
    ) -> None:
        state = self._state(execution_id)
        state.seed, state.max_calls, state.settled = seed, max_calls, True
        if cell_id is not None:
            self.router.prefer(execution_id, cell_id)
        self.recorder.prefetch(execution_id)  # the log is read while the agent starts, not at its first call

    def call_status(self, execution_id: str) -> dict[str, Any]:
        """What the gateway saw of an execution's calls, from its registration or first call until its end
        (`known` is False before either, after the end and across a gateway restart)."""
        state = self.executions.get(execution_id)
        return {
            "execution_id": execution_id,
            "known": state is not None,
            "answered": state.answered if state else 0,
            "infra_refusals": state.infra_refusals if state else 0,
            "last_infra_refusal": state.last_infra_refusal if state else None,
            "call_budget_spent": bool(state and state.budget_refusals),
        }

    async def _settle(self, execution_id: str, state: ExecutionState) -> None:
        """Take up an execution whose registration this gateway did not see (a restart since) from its log: its
        seed, call budget and calls answered so far, and the cell of its latest call (its KV is most likely
        there). One that has ended is refused: its token, which a restart no longer knows as revoked (derived
        tokens verify statelessly), must not call the model again."""
        try:
            so_far = await self.recorder.recall(execution_id)
        except Exception as exc:
            raise ApiError("api_error", f"the execution's log could not be read: {exc}") from exc
        if so_far.ended:
            self.end_execution(execution_id)
            raise ApiError("authentication_error", f"execution {execution_id} has ended; its token is revoked")
        started = so_far.started
        if started is not None:
            if seed_problem(started.seed) is None:
                state.seed = started.seed
            else:
                self.log.warning("seed_not_usable", execution_id=execution_id, seed=started.seed)
            state.max_calls = started.call_budget
        state.answered = max(state.answered, so_far.calls)
        cell_id = so_far.last_cell_id or (started.cell_id if started else None)
        if cell_id is not None:
            self.router.prefer(execution_id, cell_id)
        state.settled = True
        if so_far.calls or started is not None:
            self.log.info("execution_recalled", execution_id=execution_id, calls=so_far.calls,
                          seed=state.seed, max_calls=state.max_calls, cell_id=cell_id)

    def end_execution(self, execution_id: str) -> None:
        self.executions.pop(execution_id, None)
        self.router.forget(execution_id)
        forget = getattr(self.recorder, "forget", None)
        if forget is not None:
            forget(execution_id)

    async def complete(self, execution_id: str, parsed: ParsedRequest, *, api: Api) -> Completion:
        state = self._state(execution_id)
        # One call at a time per execution keeps call order, anchors and worker histories consistent.
        async with state.lock:
            if not state.settled:
                await self._settle(execution_id, state)
            if state.max_calls is not None and state.answered >= state.max_calls:
                state.budget_refusals += 1
                raise invalid(f"the execution's call budget is spent: {state.answered} of {state.max_calls} calls made")
            started = time.perf_counter()
            plan = state.tito.plan(parsed.conversation, self.codec)
            prompt_len = len(plan.prompt)
            context = self.context_limit()
            room = context - prompt_len
            if room < 1:
                raise invalid(f"prompt is too long: {prompt_len} tokens > {context - 1} maximum")
            requested = parsed.sampling.max_tokens
            # Harnesses (Claude Code asks for 32000) get what the context leaves rather than an error.
            max_tokens = room if requested is None else min(requested, room)
            sampling = SamplingSpec(
                max_tokens=max_tokens,
                temperature=parsed.sampling.temperature,
                top_p=parsed.sampling.top_p,
                top_k=parsed.sampling.top_k,
                seed=parsed.sampling.seed if parsed.sampling.seed is not None or state.seed is None
                else call_seed(state.seed, state.answered),
                stop=parsed.sampling.stop,
                regex=(
                    tool_call_regex([(t.name, t.parameters) for t in parsed.conversation.tools],
                                    parsed.sampling.forced_tools)
                    if parsed.sampling.forced_tools
                    else None
                ),
            )
            call_id = uuid.uuid4().hex
            try:
                reply = await self.router.generate(
                    execution_id=execution_id,
                    chain_id=plan.chain_id,
                    prompt=plan.prompt,
                    sampling=sampling,
                    request_id=f"call-{call_id}",
                )
            except NoCapacity as exc:
                raise ApiError("rate_limit_error", str(exc), retry_after_s=exc.retry_after_s) from exc
            except WorkerFailed as exc:
                raise ApiError("api_error", str(exc)) from exc
            completion = np.asarray(reply.completion, dtype=np.int32)
            text = self.codec.decode(reply.completion)
            if reply.stop_sequence and reply.stop_sequence in text:
                # The engine keeps the tokens up to the one holding the stop string (they are trained), but a
                # reply's text ends before it, as both APIs define.
                text = text[: text.index(reply.stop_sequence)]
            message = reply_message(text)
            new_chain = plan.reused is None and bool(state.tito.chains) and plan.chain_key not in state.tito.chains
            call = CompletedCall(
                execution_id=execution_id,
                call_id=call_id,
                chain_id=plan.chain_id,
                new_chain=new_chain,
                prompt=plan.prompt,
                completion=completion,
                logprobs=np.asarray(reply.logprobs, dtype=np.float32),
                policy_version=reply.policy_version,
                cell_id=reply.cell_id,
                finish_reason=reply.finish_reason or "stop",
                api=api,
                latency_s=time.perf_counter() - started,
            )
            try:
                recorded = await self.recorder.record(call)
            except RecordingFailed as exc:
                self.log.error("recording_failed", execution_id=execution_id, error=str(exc))
                raise ApiError("api_error", f"the call could not be recorded, so it is not returned: {exc}") from exc
            finally:
                if execution_id not in self.executions:
                    # It ended while this call was generating (a timeout): what the call set up again for it
                    # in the router and the recorder goes too, or it would stay for the life of the process.
                    self.end_execution(execution_id)
            state.tito.commit(plan, completion=completion, reply=message, codec=self.codec)
            state.answered += 1
            state.last_infra_refusal = None
        self.log.info("call_completed", execution_id=execution_id, call_id=call_id, cell_id=reply.cell_id,
                      prompt_tokens=prompt_len, completion_tokens=len(completion),
                      policy_version=reply.policy_version, latency_s=round(time.perf_counter() - started, 3))
        return Completion(
            call_id=call_id,
            model=parsed.model,
            reply=message,
            tool_ids=tuple(f"toolu_{call_id[:20]}{i:02d}" for i in range(len(message.tool_calls))),
            finish_reason=reply.finish_reason or "stop",
            stop_sequence=reply.stop_sequence,
            prompt_tokens=prompt_len,
            cached_tokens=min(reply.cached_tokens, prompt_len),
            completion_tokens=len(completion),
            policy_version=reply.policy_version,
            logprobs=tuple(reply.logprobs),
            # Only the OpenAI API shows tokens (its logprobs); decoding each token alone costs ~10 µs a token.
            token_texts=tuple(self.codec.token_texts(reply.completion)) if api == "openai" else (),
            call_index=recorded.placement.call_index,
        )


# ---- HTTP ----------------------------------------------------------------------------------------


def _token(request: Request) -> str | None:
    key = request.headers.get("x-api-key")
    if key:
        return key.strip()
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return None


async def _read_json(request: Request, max_body_bytes: int) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
        raise ApiError("request_too_large", f"request body of {declared} bytes exceeds the {max_body_bytes}-byte limit")
    body = bytearray()
    async for chunk in request.stream():
        body.extend(chunk)
        if len(body) > max_body_bytes:
            raise ApiError("request_too_large", f"request body exceeds the {max_body_bytes}-byte limit")
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise invalid(f"request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise invalid("request body is nested too deeply") from exc


def create_app(
    core: GatewayCore,
    registry: ExecutionRegistry,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    admin_token: str | None = None,
) -> FastAPI:
    app = FastAPI(title="Gyre rollout gateway", docs_url=None, redoc_url=None, openapi_url=None)
    log = get_logger(component="gateway_http")

    def anthropic_error(exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.anthropic_body(), status_code=exc.status, headers=exc.headers())

    def openai_error(exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.openai_body(), status_code=exc.status, headers=exc.headers())

    def execution_of(request: Request) -> str:
        execution_id = registry.resolve(_token(request))
        if execution_id is None:
            raise ApiError("authentication_error", "invalid x-api-key or bearer token: it names no live execution")
        return execution_id

    def call_headers(result: Completion) -> dict[str, str]:
        return {} if result.call_index is None else {CALL_INDEX_HEADER: str(result.call_index)}

    def stream(events: Iterator[bytes], result: Completion) -> StreamingResponse:
        return StreamingResponse(
            events, media_type="text/event-stream", headers={"cache-control": "no-cache", **call_headers(result)}
        )

    def refused(execution_id: str | None, exc: ApiError) -> None:
        if execution_id is not None:  # a call that named no live execution has no one to account to
            core.note_refusal(execution_id, exc)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        execution_id: str | None = None
        try:
            execution_id = execution_of(request)
            body = await _read_json(request, max_body_bytes)
            parsed = anthropic_api.parse_request(body)
            result = await core.complete(execution_id, parsed, api="anthropic")
        except ApiError as exc:
            _log_refusal(log, exc, api="anthropic")
            refused(execution_id, exc)
            return anthropic_error(exc)
        except Exception as exc:  # an answer in the API's shape, never a bare 500 page
            log.exception("messages_failed")
            error = ApiError("api_error", f"{type(exc).__name__}: {exc}")
            if not isinstance(exc, ClientDisconnect):  # the client went away: nobody refused it
                refused(execution_id, error)
            return anthropic_error(error)
        if parsed.stream:
            return stream(anthropic_api.sse_events(result), result)
        return JSONResponse(
            anthropic_api.message(result), headers={"request-id": f"req_{result.call_id}", **call_headers(result)}
        )

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        try:
            execution_id = execution_of(request)
            body = await _read_json(request, max_body_bytes)
            parsed = anthropic_api.parse_request(body, count_only=True)
            return JSONResponse({"input_tokens": core.count_tokens(execution_id, parsed)})
        except ApiError as exc:
            return anthropic_error(exc)
        except Exception as exc:  # an answer in the API's shape, never a bare 500 page
            log.exception("count_tokens_failed")
            return anthropic_error(ApiError("api_error", f"{type(exc).__name__}: {exc}"))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        execution_id: str | None = None
        try:
            execution_id = execution_of(request)
            body = await _read_json(request, max_body_bytes)
            parsed = openai_api.parse_request(body)
            result = await core.complete(execution_id, parsed, api="openai")
        except ApiError as exc:
            _log_refusal(log, exc, api="openai")
            refused(execution_id, exc)
            return openai_error(exc)
        except Exception as exc:
            log.exception("chat_completions_failed")
            error = ApiError("api_error", f"{type(exc).__name__}: {exc}")
            if not isinstance(exc, ClientDisconnect):
                refused(execution_id, error)
            return openai_error(error)
        created = int(core.clock())
        if parsed.stream:
            return stream(openai_api.sse_chunks(result, created=created,
                                                include_usage=openai_api.wants_usage_chunk(body)), result)
        return JSONResponse(openai_api.completion(result, created=created, logprobs=openai_api.wants_logprobs(body)),
                            headers=call_headers(result))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": core.model_name, "object": "model", "type": "model",
                                            "display_name": core.model_name, "owned_by": "gyre"}]}

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"ok": True, "workers": [s.model_dump() for s in core.router.directory.live()]}

    def check_admin(request: Request) -> None:
        if admin_token is not None and _token(request) != admin_token:
            raise ApiError("authentication_error", "internal API needs the gateway's admin token")

    @app.post("/internal/executions")
    async def register_execution(request: Request) -> Response:
        """The harness mints an execution's token here when the execution starts."""
        try:
            check_admin(request)
            body = await _read_json(request, 64 * 1024)
            if not isinstance(body, dict) or not isinstance(body.get("execution_id"), str):
                raise invalid("execution_id: Field required")
            token = body.get("token")
            if token is not None and (not isinstance(token, str) or len(token) < 16):
                raise invalid("token: expected a string of at least 16 characters")
            seed, max_calls, cell_id = body.get("seed"), body.get("max_calls"), body.get("cell_id")
            if seed is not None and (problem := seed_problem(seed)) is not None:
                raise invalid(problem)
            if max_calls is not None and (isinstance(max_calls, bool) or not isinstance(max_calls, int) or max_calls < 1):
                raise invalid(f"max_calls: expected an integer ≥ 1, got {max_calls!r}")
            if cell_id is not None and not isinstance(cell_id, str):
                raise invalid(f"cell_id: expected a string, got {cell_id!r}")
            core.start_execution(body["execution_id"], seed=seed, max_calls=max_calls, cell_id=cell_id)
            return JSONResponse({"execution_id": body["execution_id"],
                                 "token": registry.register(body["execution_id"], token)})
        except ApiError as exc:
            return anthropic_error(exc)

    def admin_refusal(request: Request) -> Response | None:
        try:
            check_admin(request)
        except ApiError as exc:
            return anthropic_error(exc)
        return None

    @app.get("/internal/executions/{execution_id}")
    async def execution_status(execution_id: str, request: Request) -> Response:
        """The harness asks why an external agent's last call failed before it grades the agent's exit."""
        if (refusal := admin_refusal(request)) is not None:
            return refusal
        return JSONResponse(core.call_status(execution_id))

    @app.delete("/internal/executions/{execution_id}")
    async def end_execution(execution_id: str, request: Request) -> Response:
        if (refusal := admin_refusal(request)) is not None:
            return refusal
        registry.revoke(execution_id)
        core.end_execution(execution_id)
        return JSONResponse({"execution_id": execution_id, "ended": True})

    return app


def _log_refusal(log: Any, exc: ApiError, *, api: str) -> None:
    """A model call answered with an error: the client's fault at info, capacity and server trouble (429, 5xx)
    as a warning, so a run whose executions time out waiting shows why in the gateway's log."""
    level = log.warning if exc.status >= 429 else log.info
    level("call_refused", api=api, kind=exc.kind, status=exc.status, error=exc.message)
