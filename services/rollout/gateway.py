"""The gateway's HTTP shell (FastAPI): the Anthropic Messages and OpenAI Chat Completions endpoints, one handler
for both over their adapters (`anthropic_api.ANTHROPIC`, `openai_api.OPENAI`), in front of `GatewayCore`.

Per call: the API key names the execution, the body is read (bounded) and parsed by the API's adapter, the core
answers it, and the adapter shapes the answer; an error is answered in the API's own shape after the core has
written its `call.refused`.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from services.rollout.anthropic_api import ANTHROPIC, parse_request
from services.rollout.api_common import MAX_JSON_DEPTH, nesting_problem
from services.rollout.api_types import ApiAdapter
from services.rollout.errors import ApiError, invalid
from services.rollout.gateway_core import GatewayCore
from services.rollout.openai_api import OPENAI
from shared.calls import CALL_INDEX_HEADER, REPLAY_HEADER
from shared.logging import get_logger

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
DEFAULT_BODY_TIMEOUT_S = 60.0  # a body that has not arrived by then is refused (408)


def _token(request: Request) -> str | None:
    key = request.headers.get("x-api-key")
    if key:
        return key.strip()
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return None


async def _read_body(request: Request, max_body_bytes: int) -> bytearray:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
        raise ApiError("request_too_large", f"request body of {declared} bytes exceeds the {max_body_bytes}-byte limit")
    body = bytearray()
    async for chunk in request.stream():
        body.extend(chunk)
        if len(body) > max_body_bytes:
            raise ApiError("request_too_large", f"request body exceeds the {max_body_bytes}-byte limit")
    return body


async def _read_json(request: Request, max_body_bytes: int, body_timeout_s: float) -> Any:
    """The request's JSON body: at most `max_body_bytes` (413), arrived within `body_timeout_s` (408: a client
    that stalls mid-body holds nothing of the gateway's past that), nested at most `MAX_JSON_DEPTH` deep."""
    try:
        async with asyncio.timeout(body_timeout_s):
            body = await _read_body(request, max_body_bytes)
    except TimeoutError as exc:
        raise ApiError("invalid_request_error", f"request body did not arrive within {body_timeout_s:g} s",
                       status=408) from exc
    try:
        parsed = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise invalid(f"request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # deeper than the parser goes: past the limit below too
        raise invalid(f"request body nests deeper than {MAX_JSON_DEPTH} levels") from exc
    if problem := nesting_problem(parsed):
        raise invalid(problem)
    return parsed


def _replay_of(request: Request) -> int | None:
    """The call index a resumed agent's request says it makes again (REPLAY_HEADER), if any."""
    value = request.headers.get(REPLAY_HEADER)
    if value is None:
        return None
    if not value.isdigit() or len(value) > 9:
        raise invalid(f"{REPLAY_HEADER}: expected a call index (a non-negative integer), got {value[:40]!r}")
    return int(value)


def _error(adapter: ApiAdapter, exc: ApiError) -> JSONResponse:
    return JSONResponse(adapter.error_body(exc), status_code=exc.status, headers=exc.headers())


def create_app(core: GatewayCore, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> FastAPI:
    app = FastAPI(title="Gyre rollout gateway", docs_url=None, redoc_url=None, openapi_url=None)
    log = get_logger(component="gateway_http")

    async def serve_call(request: Request, adapter: ApiAdapter) -> Response:
        """One model call through `adapter`'s API: answered, or refused with its `call.refused` written first
        (a call that names no live execution, a 401, has no log to write to)."""
        execution_id: str | None = None
        try:
            execution_id = core.execution_of(_token(request))
            body = await _read_json(request, max_body_bytes, body_timeout_s)
            parsed = adapter.parse(body)
            result = await core.complete(execution_id, parsed, api=adapter.api, replay_of=_replay_of(request))
        except ApiError as exc:
            if execution_id is None:
                core.metrics.refused(adapter.api, kind=exc.kind, status=exc.status)
                log.info("call_refused", api=adapter.api, kind=exc.kind, status=exc.status, error=exc.message)
            else:
                await core.refuse(execution_id, exc, api=adapter.api)
            return _error(adapter, exc)
        except Exception as exc:  # an answer in the API's shape, never a bare 500 page
            log.exception("call_failed", api=adapter.api, execution_id=execution_id)
            error = ApiError("api_error", f"{type(exc).__name__}: {exc}")
            if execution_id is not None and not isinstance(exc, ClientDisconnect):  # gone: nobody was refused
                await core.refuse(execution_id, error, api=adapter.api)
            elif execution_id is None:
                core.metrics.refused(adapter.api, kind=error.kind, status=error.status)
            return _error(adapter, error)
        created = int(core.clock())
        index = {} if result.call_index is None else {CALL_INDEX_HEADER: str(result.call_index)}
        if parsed.stream:
            return StreamingResponse(adapter.stream(result, body, created=created), media_type="text/event-stream",
                                     headers={"cache-control": "no-cache", **index})
        return JSONResponse(adapter.response(result, body, created=created),
                            headers={**adapter.response_headers(result), **index})

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await serve_call(request, ANTHROPIC)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve_call(request, OPENAI)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        """Counts a prompt's tokens; no model call, so nothing is recorded either way."""
        try:
            execution_id = core.execution_of(_token(request))
            body = await _read_json(request, max_body_bytes, body_timeout_s)
            return JSONResponse({"input_tokens": core.count_tokens(execution_id, parse_request(body, count_only=True))})
        except ApiError as exc:
            return _error(ANTHROPIC, exc)
        except Exception as exc:  # an answer in the API's shape, never a bare 500 page
            log.exception("count_tokens_failed")
            return _error(ANTHROPIC, ApiError("api_error", f"{type(exc).__name__}: {exc}"))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": core.model_name, "object": "model", "type": "model",
                                            "display_name": core.model_name, "owned_by": "gyre"}]}

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus metrics (docs/metrics.md)."""
        return Response(core.metrics.exposition(), media_type=core.metrics.content_type)

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"ok": True, "workers": [s.model_dump() for s in core.router.directory.live()]}

    return app


__all__ = ["DEFAULT_BODY_TIMEOUT_S", "DEFAULT_MAX_BODY_BYTES", "create_app"]
