"""Call recording: each model call becomes a delta blob plus a `call.completed` event, stored before the reply.

`ExecutionLog` is the pure part (which earlier call to extend, how many tokens are new, what branch it is);
`CallRecorder` is the port, with an in-memory backend for unit tests and the Postgres event store for real.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Literal, Protocol

import numpy as np

from shared.blobs import blob_ref
from shared.calls import (
    CALL_RECORD_MEDIA_TYPE,
    CallRecord,
    CallTokens,
    ExecutionSequences,
    call_completed,
    call_record,
    longest_prefix_parent,
)
from shared.events import (
    BlobRef,
    BranchKind,
    CallCompleted,
    Event,
    EventData,
    ExecutionBranched,
    ExecutionFinished,
    ExecutionStarted,
    ExecutionTimedOut,
    new_event,
    stream_id_for,
)
from shared.tokens import TokenBuffer, digest_of

Api = Literal["anthropic", "openai", "internal"]


class RecordingFailed(Exception):
    """The call could not be stored; the reply must not reach the harness."""

    def __init__(self, execution_id: str, cause: BaseException) -> None:
        super().__init__(f"recording call of execution {execution_id} failed: {type(cause).__name__}: {cause}")
        self.execution_id = execution_id


@dataclass(frozen=True)
class CompletedCall:
    """Everything the gateway knows about one finished generation, before it is recorded."""

    execution_id: str
    call_id: str
    chain_id: str
    new_chain: bool  # the first call of a chain other than the execution's first
    prompt: np.ndarray
    completion: np.ndarray
    logprobs: np.ndarray
    policy_version: int
    cell_id: str
    finish_reason: str
    api: Api
    latency_s: float


@dataclass(frozen=True)
class Placement:
    """Where a call goes in its execution's log (the delta against the best earlier call)."""

    call_index: int
    parent_call_index: int | None
    parent_prefix_len: int
    new_prompt: np.ndarray
    branch_hint: BranchKind | None


@dataclass
class ExecutionLog:
    """The full sequences of an execution's recorded calls, for choosing each new call's parent (pure).

    A call that extends the whole of its parent's sequence shares the parent's buffer, so an execution's log
    holds about as many ids as its longest sequence (times its forks), not the sum over its calls.
    """

    seqs: ExecutionSequences = field(default_factory=ExecutionSequences)
    prompt_lens: list[int] = field(default_factory=list)

    @property
    def sequences(self) -> list[np.ndarray]:
        return self.seqs.sequences

    @property
    def buffers(self) -> list[TokenBuffer]:
        return self.seqs.buffers

    def place(self, prompt: np.ndarray, *, new_chain: bool = False) -> Placement:
        prompt = np.asarray(prompt, dtype=np.int32)
        parent, shared = longest_prefix_parent(self.sequences, prompt)
        hint: BranchKind | None
        if not self.sequences:
            hint = None
        elif new_chain:
            hint = "delegation"
        elif parent is None:
            hint = "fork"
        elif shared == len(self.sequences[parent]):
            hint = "continuation"
        elif shared == len(prompt) == self.prompt_lens[parent]:
            hint = "retry"
        else:
            hint = "fork"
        return Placement(
            call_index=len(self.sequences),
            parent_call_index=parent,
            parent_prefix_len=shared if parent is not None else 0,
            new_prompt=prompt[shared:] if parent is not None else prompt,
            branch_hint=hint,
        )

    def add(self, placement: Placement, prompt: np.ndarray, completion: np.ndarray) -> None:
        if placement.call_index != len(self.sequences):
            raise ValueError(f"expected call_index {len(self.sequences)}, got {placement.call_index}")
        shared = placement.parent_prefix_len
        self.seqs.extend(placement.parent_call_index, shared, np.asarray(prompt[shared:], dtype=np.int32),
                         np.asarray(completion, dtype=np.int32))
        self.prompt_lens.append(len(prompt))

    @classmethod
    def from_records(cls, records: list[CallRecord]) -> ExecutionLog:
        """Rebuild from stored records (a restarted gateway continues an execution's indices and parents)."""
        log = cls()
        for record in sorted(records, key=lambda r: r.call_index):
            log.seqs.add(record)
            log.prompt_lens.append(record.prompt_len)
        return log


@dataclass
class ExecutionSoFar:
    """What the log holds of an execution: how a gateway that did not see it start (it restarted since) picks
    up its seed, call budget and placement, and learns whether it has already ended."""

    started: ExecutionStarted | None = None
    calls: int = 0  # call.completed events: the calls answered so far
    last_cell_id: str | None = None  # the cell of the latest answered call (where its KV most likely is)
    ended: bool = False

    @classmethod
    def of(cls, events: list[Event]) -> ExecutionSoFar:
        so_far = cls()
        for event in events:
            data = event.data
            if isinstance(data, ExecutionStarted) and so_far.started is None:
                so_far.started = data
            elif isinstance(data, CallCompleted):
                so_far.calls += 1
                so_far.last_cell_id = data.cell_id or so_far.last_cell_id
            elif isinstance(data, ExecutionFinished | ExecutionTimedOut):
                so_far.ended = True
        return so_far


@dataclass(frozen=True)
class RecordedCall:
    placement: Placement
    event: Event
    blob: BlobRef


def build_events(
    call: CompletedCall,
    placement: Placement,
    blob: BlobRef,
    *,
    run_id: str,
    occurred_at: datetime,
) -> list[Event]:
    """The `call.completed` event, preceded by `execution.branched` (kind fork) for an unannounced divergence."""
    stream = stream_id_for("execution", call.execution_id)
    data: list[EventData] = []
    if placement.branch_hint == "fork":
        data.append(
            ExecutionBranched(
                execution_id=call.execution_id,
                kind="fork",
                at_call_index=placement.call_index,
                from_call_index=placement.parent_call_index,
                chain_id=call.chain_id,
                reason=f"prompt diverges from call {placement.parent_call_index} "
                f"after {placement.parent_prefix_len} tokens",
            )
        )
    record = CallRecord(
        execution_id=call.execution_id,
        call_id=call.call_id,
        call_index=placement.call_index,
        parent_call_index=placement.parent_call_index,
        parent_prefix_len=placement.parent_prefix_len,
        tokens=call_tokens(call, placement),
        policy_version=call.policy_version,
        cell_id=call.cell_id,
        chain_id=call.chain_id,
        branch_hint=placement.branch_hint,
        finish_reason=call.finish_reason,
    )
    data.append(call_completed(record, blob, api=call.api, latency_s=call.latency_s))
    # Versions are placeholders: the store assigns the stream's next versions (expected_version="any").
    return [
        new_event(d, run_id=run_id, stream_id=stream, version=1, occurred_at=occurred_at) for d in data
    ]


def call_tokens(call: CompletedCall, placement: Placement) -> CallTokens:
    return CallTokens(
        new_prompt=np.asarray(placement.new_prompt, dtype=np.int32),
        completion=np.asarray(call.completion, dtype=np.int32),
        logprobs=np.asarray(call.logprobs, dtype=np.float32),
    )


class CallRecorder(Protocol):
    async def record(self, call: CompletedCall) -> RecordedCall:
        """Store the call durably (blob, then events) or raise RecordingFailed; nothing is kept on failure."""
        ...

    def prefetch(self, execution_id: str) -> None:
        """Start reading what the log holds of the execution, so that its first call does not wait for it."""
        ...

    async def recall(self, execution_id: str) -> ExecutionSoFar:
        """What the log holds of the execution (raises when the log cannot be read)."""
        ...


@dataclass(eq=False)
class _Line:
    """One registration of an execution in a recorder: its calls queue on `lock` and are placed against `log`,
    read from the store once (by the registration's prefetch when there was one). `users` counts the calls
    holding or waiting for the lock."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0
    log: ExecutionLog | None = None
    prefetch: asyncio.Task[ExecutionLog] | None = None


class _LoggedRecorder:
    """Shared logic: one line of calls (lock and ExecutionLog) per execution; subclasses persist."""

    def __init__(self, *, run_id: str, clock: Callable[[], datetime] | None = None) -> None:
        self.run_id = run_id
        self._clock = clock or (lambda: datetime.now(UTC))
        self._lines: dict[str, _Line] = {}
        # Lines of an execution forgotten while calls of theirs were still being recorded: a later
        # registration of the same execution reads the log only after their writes have landed.
        self._ending: dict[str, list[_Line]] = {}

    def prefetch(self, execution_id: str) -> None:
        """Read the execution's log in the background (the gateway calls this when the execution is registered,
        before its agent starts): its first call then finds the log read, not a query to wait for. Outside a
        running event loop, or when the log is already held or being read, nothing happens."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        line = self._lines.setdefault(execution_id, _Line())
        if line.log is not None or line.prefetch is not None:
            return
        task = loop.create_task(self._read(execution_id, line), name=f"prefetch-{execution_id}")
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # a failure is the first call's to see
        line.prefetch = task

    async def _log_for(self, execution_id: str, line: _Line) -> ExecutionLog:
        """The line's log, read once: from the prefetch when one ran (a failed one is read again)."""
        if line.log is not None:
            return line.log
        task, line.prefetch = line.prefetch, None
        log = None
        if task is not None:
            try:
                log = await asyncio.shield(task)  # the read is not cancelled with a call that stops waiting
            except asyncio.CancelledError:
                if not task.cancelled():
                    raise  # this call was cancelled, not the read
            except Exception:
                pass  # read again below: the error, if it persists, is this call's
        if log is None:
            log = await self._read(execution_id, line)
        line.log = log
        return log

    async def _read(self, execution_id: str, line: _Line) -> ExecutionLog:
        """Read the log once the calls of the execution's earlier, forgotten lines are recorded (their lock
        serves waiters in order, so holding it once means every call queued before has written)."""
        for earlier in list(self._ending.get(execution_id, ())):
            if earlier is not line:
                async with earlier.lock:
                    pass
        return await self._load(execution_id)

    async def record(self, call: CompletedCall) -> RecordedCall:
        line = self._lines.setdefault(call.execution_id, _Line())
        line.users += 1
        try:
            async with line.lock:
                placement = None
                try:
                    log = await self._log_for(call.execution_id, line)
                    placement = log.place(call.prompt, new_chain=call.new_chain)
                    blob_bytes = call_tokens(call, placement).encode()
                    recorded = await self._persist(call, placement, blob_bytes)
                except BaseException as exc:
                    if placement is not None:
                        # The write may have landed (a commit whose answer was lost, a cancelled call whose
                        # commit went on): the next call reads the log again rather than reuse this index.
                        line.log = None
                    if isinstance(exc, RecordingFailed) or not isinstance(exc, Exception):
                        raise
                    raise RecordingFailed(call.execution_id, exc) from exc
                log.add(placement, call.prompt, call.completion)
                return recorded
        finally:
            line.users -= 1
            if line.users == 0:
                self._retire(call.execution_id, line)

    def _retire(self, execution_id: str, line: _Line) -> None:
        """Drop a forgotten line whose last call is recorded."""
        lines = self._ending.get(execution_id)
        if lines is not None and line in lines:
            lines.remove(line)
            if not lines:
                del self._ending[execution_id]

    def forget(self, execution_id: str) -> None:
        line = self._lines.pop(execution_id, None)
        if line is None:
            return
        if line.prefetch is not None:
            line.prefetch.cancel()
            line.prefetch = None
        if line.users:
            self._ending.setdefault(execution_id, []).append(line)

    async def recall(self, execution_id: str) -> ExecutionSoFar:
        return ExecutionSoFar.of(await self._events(execution_id))

    async def _events(self, execution_id: str) -> list[Event]:
        return []

    async def _load(self, execution_id: str) -> ExecutionLog:
        return ExecutionLog()

    async def _persist(self, call: CompletedCall, placement: Placement, blob: bytes) -> RecordedCall:
        raise NotImplementedError


class InMemoryCallRecorder(_LoggedRecorder):
    """For unit tests: keeps events and blobs in lists; `fail_next` simulates a store outage."""

    def __init__(self, *, run_id: str = "test", clock: Callable[[], datetime] | None = None) -> None:
        super().__init__(run_id=run_id, clock=clock)
        self.events: list[Event] = []
        self.blobs: dict[str, bytes] = {}
        self.fail_next: BaseException | None = None

    async def _persist(self, call: CompletedCall, placement: Placement, blob: bytes) -> RecordedCall:
        if self.fail_next is not None:
            exc, self.fail_next = self.fail_next, None
            raise exc
        ref = BlobRef(digest=digest_of(blob), size=len(blob), media_type=CALL_RECORD_MEDIA_TYPE)
        events = build_events(call, placement, ref, run_id=self.run_id, occurred_at=self._clock())
        stream_len = sum(1 for e in self.events if e.stream_id == events[0].stream_id)
        events = [e.model_copy(update={"version": stream_len + i + 1}) for i, e in enumerate(events)]
        self.blobs[ref.digest] = blob
        self.events.extend(events)
        return RecordedCall(placement=placement, event=events[-1], blob=ref)

    async def _events(self, execution_id: str) -> list[Event]:
        stream_id = stream_id_for("execution", execution_id)
        return [e for e in self.events if e.stream_id == stream_id]

    def calls(self, execution_id: str | None = None) -> list[CallCompleted]:
        out = [e.data for e in self.events if isinstance(e.data, CallCompleted)]
        return [c for c in out if execution_id is None or c.execution_id == execution_id]


class StoreCallRecorder(_LoggedRecorder):
    """Records into shared.store.EventStore: blob and events in one transaction, before the reply."""

    def __init__(self, store: object, *, run_id: str, clock: Callable[[], datetime] | None = None) -> None:
        super().__init__(run_id=run_id, clock=clock)
        self.store = store

    async def _events(self, execution_id: str) -> list[Event]:
        stored = await self.store.read_stream(stream_id_for("execution", execution_id))  # type: ignore[attr-defined]
        return [item.event for item in stored]

    async def _load(self, execution_id: str) -> ExecutionLog:
        records = []
        for event in await self._events(execution_id):
            data = event.data
            if isinstance(data, CallCompleted):
                records.append(call_record(data, await self.store.blobs.get(data.record)))  # type: ignore[attr-defined]
        return ExecutionLog.from_records(records)

    async def _persist(self, call: CompletedCall, placement: Placement, blob: bytes) -> RecordedCall:
        # On every call's reply path: one append carries the blob and the events, and concurrent calls' appends
        # commit together (one statement, one commit).
        ref = blob_ref(blob, CALL_RECORD_MEDIA_TYPE)
        events = build_events(call, placement, ref, run_id=self.run_id, occurred_at=self._clock())
        await self.store.append_grouped(events, blobs=[(blob, CALL_RECORD_MEDIA_TYPE)])  # type: ignore[attr-defined]
        return RecordedCall(placement=placement, event=events[-1], blob=ref)
