"""The gateway's core: for every model call, which execution it belongs to, the prompt by token-in/token-out,
the worker that generates it, the reply's tool calls, and the call's record, written before the answer; for
every refused call, its `call.refused`, written before the error. The HTTP shell (`gateway.py`) only parses and
shapes; the rules are `executions.py`, `tito.py`, `call_log.py` and `routing.py`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

import numpy as np

from services.rollout.api_types import Completion, ParsedRequest
from services.rollout.call_log import Api, CompletedCall
from services.rollout.codec import TokenizerCodec, reply_message
from services.rollout.credentials import TokenVerifier
from services.rollout.errors import ApiError, invalid
from services.rollout.metrics import GatewayMetrics
from services.rollout.executions import (
    ExecutionState,
    check_budget,
    refusal,
    sampling_seed,
    settle,
)
from services.rollout.protocol import SamplingSpec
from services.rollout.recorder import CallRecorder, RecordingFailed
from services.rollout.router import NoCapacity, Router, WorkerFailed
from services.rollout.tito import PromptPlan
from shared.events import ExecutionStarted
from shared.logging import get_logger


class GatewayCore:
    """Token-in/token-out, routing and recording for every call; the HTTP layer only parses and shapes."""

    def __init__(
        self,
        *,
        codec: TokenizerCodec,
        router: Router,
        recorder: CallRecorder,
        tokens: TokenVerifier,
        max_model_len: int,
        model_name: str = "gyre",
        max_reply_tokens: int | None = None,
        clock: Callable[[], float] = time.time,
        timer: Callable[[], float] = time.perf_counter,
        call_ids: Callable[[], str] = lambda: uuid.uuid4().hex,
    ) -> None:
        self.codec = codec
        self.router = router
        self.recorder = recorder
        self.tokens = tokens
        self.max_model_len = max_model_len
        self.model_name = model_name
        self.max_reply_tokens = max_reply_tokens  # the run's tokens-per-reply budget, whatever a request asks
        self.clock = clock  # wall time (the OpenAI response's `created`)
        self.timer = timer  # a call's latency
        self.call_ids = call_ids
        self.executions: dict[str, ExecutionState] = {}
        self.metrics = GatewayMetrics()
        self.metrics.watch(executions=lambda: len(self.executions), workers=lambda: len(self.router.directory.live()))
        # One call at a time per execution keeps call order, anchors and worker histories consistent.
        self._locks: dict[str, asyncio.Lock] = {}
        self.log = get_logger(component="gateway")

    def execution_of(self, token: str | None) -> str:
        """The live execution a call's API key names (401 when it names none)."""
        execution_id = self.tokens.execution_of(token)
        if execution_id is None:
            raise ApiError("authentication_error", "invalid x-api-key or bearer token: it names no live execution")
        return execution_id

    def context_limit(self) -> int:
        """The configured context, or less when the live workers serve a shorter one."""
        lengths = [s.max_model_len for s in self.router.directory.live()]
        return min([self.max_model_len, *lengths])

    def _state(self, execution_id: str) -> ExecutionState:
        self._locks.setdefault(execution_id, asyncio.Lock())
        return self.executions.setdefault(execution_id, ExecutionState())

    def count_tokens(self, execution_id: str, parsed: ParsedRequest) -> int:
        return self._state(execution_id).tito.prompt_len(parsed.conversation, self.codec)

    def take_up(self, started: ExecutionStarted) -> None:
        """An execution started (its `execution.started`): read its log in the background and place it first on
        the cell the scheduler chose, so its first call waits for neither. Idempotent; nothing for an execution
        a first call has already taken up, or one that has ended. Its first call settles it from the log read."""
        execution_id = started.execution_id
        if self.tokens.revoked(execution_id):
            return
        state = self.executions.get(execution_id)
        if state is not None and state.settled:
            return
        self._state(execution_id)
        if started.cell_id is not None and self.router.worker_of(execution_id) is None:
            self.router.prefer(execution_id, started.cell_id)
        self.recorder.prefetch(execution_id)

    async def _settle(self, execution_id: str, state: ExecutionState) -> None:
        """Take an execution up from its log at its first call here: its seed, call budget and calls answered so
        far, and the cell of its latest call (its KV is most likely there). One that has ended is refused and
        its token revoked: a restarted gateway verifies a derived token without knowing it ended."""
        try:
            so_far = await self.recorder.recall(execution_id)
        except Exception as exc:
            raise ApiError("api_error", f"the execution's log could not be read: {exc}") from exc
        if so_far.ended:
            self.end_execution(execution_id)
            raise ApiError("authentication_error", f"execution {execution_id} has ended; its token is revoked")
        taken = settle(state, so_far)
        if taken.unusable_seed is not None:
            self.log.warning("seed_not_usable", execution_id=execution_id, seed=taken.unusable_seed)
        if taken.cell_id is not None and self.router.worker_of(execution_id) is None:
            self.router.prefer(execution_id, taken.cell_id)
        if so_far.calls or so_far.started is not None:
            self.log.info("execution_taken_up", execution_id=execution_id, calls=so_far.calls, seed=state.seed,
                          max_calls=state.max_calls, cell_id=taken.cell_id)

    def end_execution(self, execution_id: str) -> None:
        """The execution ended: revoke its token and drop what the gateway, the router and the recorder hold."""
        self.tokens.revoke(execution_id)
        self.executions.pop(execution_id, None)
        self._locks.pop(execution_id, None)
        self.router.forget(execution_id)
        self.recorder.forget(execution_id)

    async def refuse(self, execution_id: str, exc: ApiError, *, api: Api) -> None:
        """A call of `execution_id` is answered with `exc`: log it and write its `call.refused` first (as a
        reply's record is written before the reply). A failure to write it is logged; the error is still
        answered. After the execution's end nothing is written: its log is closed."""
        self.metrics.refused(api, kind=exc.kind, status=exc.status)
        level = self.log.warning if exc.status >= 429 else self.log.info  # capacity and server trouble stand out
        level("call_refused", execution_id=execution_id, api=api, kind=exc.kind, status=exc.status, error=exc.message)
        if self.tokens.revoked(execution_id):
            return
        state = self.executions.get(execution_id)
        try:
            await self.recorder.refuse(refusal(execution_id, exc, api=api, answered=state.answered if state else 0))
        except Exception as error:
            self.log.error("refusal_not_recorded", execution_id=execution_id, error=str(error))

    async def complete(self, execution_id: str, parsed: ParsedRequest, *, api: Api,
                       replay_of: int | None = None) -> Completion:
        """Answer one call: generated and recorded, or, for a resumed agent's call `replay_of`, from the log."""
        state = self._state(execution_id)
        async with self._locks[execution_id]:
            if not state.settled:
                await self._settle(execution_id, state)
            started = self.timer()
            plan = state.tito.plan(parsed.conversation, self.codec)
            if replay_of is not None and (replayed := await self._replay(execution_id, state, plan, parsed,
                                                                         replay_of)) is not None:
                self.metrics.replayed.labels(api=api).inc()
                return replayed
            check_budget(state)
            prompt_len = len(plan.prompt)
            context = self.context_limit()
            room = context - prompt_len
            if room < 1:
                raise invalid(f"prompt is too long: {prompt_len} tokens > {context - 1} maximum")
            # Harnesses (Claude Code asks for 32000) get what the context and the run's reply budget leave rather
            # than an error.
            max_tokens = min(x for x in (parsed.sampling.max_tokens, self.max_reply_tokens, room) if x is not None)
            tools = parsed.conversation.tools
            sampling = SamplingSpec(
                max_tokens=max_tokens,
                temperature=parsed.sampling.temperature,
                top_p=parsed.sampling.top_p,
                top_k=parsed.sampling.top_k,
                seed=sampling_seed(state, parsed.sampling.seed),
                stop=parsed.sampling.stop,
                regex=(self.codec.tool_format.regex([(t.name, t.parameters) for t in tools],
                                                       parsed.sampling.forced_tools)
                       if parsed.sampling.forced_tools else None),
            )
            call_id = self.call_ids()
            try:
                reply = await self.router.generate(execution_id=execution_id, chain_id=plan.chain_id,
                                                   prompt=plan.prompt, sampling=sampling, request_id=f"call-{call_id}")
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
            message = reply_message(text, self.codec.tool_format)
            call = CompletedCall(
                execution_id=execution_id,
                call_id=call_id,
                chain_id=plan.chain_id,
                prompt=plan.prompt,
                completion=completion,
                logprobs=np.asarray(reply.logprobs, dtype=np.float32),
                policy_version=reply.policy_version,
                cell_id=reply.cell_id,
                finish_reason=reply.finish_reason or "stop",
                api=api,
                latency_s=self.timer() - started,
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
        seconds = self.timer() - started
        self.metrics.answered(api, seconds=seconds, prompt=prompt_len, cached=min(reply.cached_tokens, prompt_len),
                              completion=len(completion))
        self.log.info("call_completed", execution_id=execution_id, call_id=call_id, cell_id=reply.cell_id,
                      prompt_tokens=prompt_len, completion_tokens=len(completion),
                      policy_version=reply.policy_version, latency_s=round(seconds, 3))
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


    async def _replay(self, execution_id: str, state: ExecutionState, plan: PromptPlan, parsed: ParsedRequest,
                      call_index: int) -> Completion | None:
        """A resumed agent's call `call_index`, answered as the log recorded it when its prompt is the recorded
        one (the agent, deterministic, redoes what it did before its harness stopped): nothing is generated or
        recorded and the call budget is not charged again. None, to serve it live, when the log holds no such
        call or the prompt differs (a tool answered otherwise this time); the live call is then a fork."""
        try:
            past = await self.recorder.past_call(execution_id, call_index)
        except Exception as exc:
            raise ApiError("api_error", f"the execution's log could not be read: {exc}") from exc
        if past is None or not np.array_equal(past.prompt, plan.prompt):
            self.log.info("replay_diverged", execution_id=execution_id, call_index=call_index,
                          recorded=past is not None)
            return None
        text = self.codec.decode(past.completion.tolist())
        # The engine stopped at the first stop string it generated; the reply's text ends before it, as live.
        found = [(text.index(s), s) for s in (parsed.sampling.stop or ()) if s in text]
        stop_sequence = min(found)[1] if found and past.finish_reason == "stop" else None
        if stop_sequence is not None:
            text = text[: text.index(stop_sequence)]
        message = reply_message(text, self.codec.tool_format)
        state.tito.commit(plan, completion=past.completion, reply=message, codec=self.codec)
        self.log.info("call_replayed", execution_id=execution_id, call_index=call_index, call_id=past.call_id)
        return Completion(
            call_id=past.call_id,
            model=parsed.model,
            reply=message,
            tool_ids=tuple(f"toolu_{past.call_id[:20]}{i:02d}" for i in range(len(message.tool_calls))),
            finish_reason=past.finish_reason,
            stop_sequence=stop_sequence,
            prompt_tokens=len(plan.prompt),
            cached_tokens=0,
            completion_tokens=len(past.completion),
            policy_version=past.policy_version,
            call_index=call_index,
        )


__all__ = ["GatewayCore"]
