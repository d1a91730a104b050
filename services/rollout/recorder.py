"""The call recorder: the port the gateway records through (`CallRecorder`), and the one implementation of it
(`LoggedRecorder`) over a small storage port (`CallStorage`), with a Postgres backend (`recorder_postgres.py`)
and an in-memory one for tests (`recorder_memory.py`).

`LoggedRecorder` is the concurrency protocol: per execution, one line of calls placed one at a time against the
execution's call log, read from storage once (by a prefetch when the gateway took the execution up before its
first call); a call that may have been written without its answer makes the next read the log again; and an
execution forgotten while its calls are written and taken up again reads its log only after those writes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Protocol

from services.rollout.call_log import (
    CallLog,
    CompletedCall,
    ExecutionSoFar,
    PastCall,
    Placement,
    RecordedCall,
    build_events,
    call_tokens,
    refused_event,
)
from shared.blobs import blob_ref
from shared.calls import CALL_RECORD_MEDIA_TYPE, call_record
from shared.events import BlobRef, CallCompleted, CallRefused, Event


class RecordingFailed(Exception):
    """The call could not be stored; the reply must not reach the harness."""

    def __init__(self, execution_id: str, cause: BaseException) -> None:
        super().__init__(f"recording call of execution {execution_id} failed: {type(cause).__name__}: {cause}")
        self.execution_id = execution_id


class CallRecorder(Protocol):
    """What the gateway needs from the execution log."""

    async def record(self, call: CompletedCall) -> RecordedCall:
        """Store the call durably (blob, then events) or raise RecordingFailed; nothing is kept on failure."""
        ...

    async def refuse(self, refusal: CallRefused) -> Event:
        """Append a `call.refused` to the execution's stream (raises RecordingFailed when it cannot)."""
        ...

    def prefetch(self, execution_id: str) -> None:
        """Start reading what the log holds of the execution, so that its first call does not wait for it."""
        ...

    async def recall(self, execution_id: str) -> ExecutionSoFar:
        """What the log holds of the execution (raises when the log cannot be read)."""
        ...

    def forget(self, execution_id: str) -> None:
        """The execution ended: drop what is held for it (its calls still being written are written)."""
        ...

    async def past_call(self, execution_id: str, call_index: int) -> PastCall | None:
        """Call `call_index` of the execution as the log holds it (None when it holds no such call)."""
        ...


class CallStorage(Protocol):
    """Where a recorder keeps an execution's log: its events in stream order and the blobs they refer to."""

    async def read_execution(self, execution_id: str) -> list[Event]:
        """The events of the execution's stream, in stream order."""
        ...

    async def get_blob(self, ref: BlobRef) -> bytes: ...

    async def append_call(self, events: Sequence[Event], blob: bytes) -> None:
        """Append a call's events (the store assigns their versions) together with its record blob, atomically."""
        ...

    async def append_events(self, events: Sequence[Event]) -> None:
        """Append events the store versions (no blob)."""
        ...


@dataclass
class _Read:
    """What one read of the log gave: the call log calls are placed against, and what the log says of the
    execution (kept up to date with the calls recorded since)."""

    log: CallLog
    so_far: ExecutionSoFar


@dataclass(eq=False)
class _Line:
    """One take-up of an execution in a recorder: its calls queue on `lock` and are placed against `read.log`,
    read from storage once (by the take-up's prefetch when there was one). `users` counts the calls holding or
    waiting for the lock."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0
    read: _Read | None = None
    prefetch: asyncio.Task[_Read] | None = None


class LoggedRecorder:
    """The `CallRecorder` over any `CallStorage`."""

    def __init__(self, storage: CallStorage, *, run_id: str, clock: Callable[[], datetime] | None = None) -> None:
        self.storage = storage
        self.run_id = run_id
        self._clock = clock or (lambda: datetime.now(UTC))
        self._lines: dict[str, _Line] = {}
        # Lines of an execution forgotten while calls of theirs were still being recorded: a later take-up of
        # the same execution reads the log only after their writes have landed.
        self._ending: dict[str, list[_Line]] = {}

    def prefetch(self, execution_id: str) -> None:
        """Read the execution's log in the background (the gateway calls this when it takes the execution up,
        before its agent starts): its first call then finds the log read, not a query to wait for. Outside a
        running event loop, or when the log is already held or being read, nothing happens."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        line = self._lines.setdefault(execution_id, _Line())
        if line.read is not None or line.prefetch is not None:
            return
        task = loop.create_task(self._load_after_earlier(execution_id, line), name=f"prefetch-{execution_id}")
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # a failure is the first call's to see
        line.prefetch = task

    async def _read_for(self, execution_id: str, line: _Line) -> _Read:
        """The line's read of the log, made once: from the prefetch when one ran (a failed one is read again)."""
        if line.read is not None:
            return line.read
        task, line.prefetch = line.prefetch, None
        read = None
        if task is not None:
            try:
                read = await asyncio.shield(task)  # the read is not cancelled with a call that stops waiting
            except asyncio.CancelledError:
                if not task.cancelled():
                    raise  # this call was cancelled, not the read
            except Exception:
                pass  # read again below: the error, if it persists, is this call's
        if read is None:
            read = await self._load_after_earlier(execution_id, line)
        line.read = read
        return read

    async def _load_after_earlier(self, execution_id: str, line: _Line) -> _Read:
        """Read the log once the calls of the execution's earlier, forgotten lines are recorded (their lock
        serves waiters in order, so holding it once means every call queued before has written)."""
        for earlier in list(self._ending.get(execution_id, ())):
            if earlier is not line:
                async with earlier.lock:
                    pass
        return await self._load(execution_id)

    async def _load(self, execution_id: str) -> _Read:
        """One read of the execution's stream: every backend's log is rebuilt from what it stored, here."""
        events = await self.storage.read_execution(execution_id)
        records = []
        for event in events:
            if isinstance(event.data, CallCompleted):
                records.append(call_record(event.data, await self.storage.get_blob(event.data.record)))
        return _Read(log=CallLog.from_records(records), so_far=ExecutionSoFar.of(events))

    def _enter(self, execution_id: str) -> _Line:
        line = self._lines.setdefault(execution_id, _Line())
        line.users += 1
        return line

    def _leave(self, execution_id: str, line: _Line) -> None:
        line.users -= 1
        if line.users == 0:
            self._retire(execution_id, line)

    async def record(self, call: CompletedCall) -> RecordedCall:
        line = self._enter(call.execution_id)
        try:
            async with line.lock:
                placement = None
                try:
                    read = await self._read_for(call.execution_id, line)
                    placement = read.log.place(call.prompt, chain_id=call.chain_id)
                    blob_bytes = call_tokens(call, placement).encode()
                    recorded = await self._persist(call, placement, blob_bytes)
                except BaseException as exc:
                    if placement is not None:
                        # The write may have landed (a commit whose answer was lost, a cancelled call whose
                        # commit went on): the next call reads the log again rather than reuse this index.
                        line.read = None
                    if isinstance(exc, RecordingFailed) or not isinstance(exc, Exception):
                        raise
                    raise RecordingFailed(call.execution_id, exc) from exc
                read.log.add(placement, call.prompt, call.completion, call_id=call.call_id,
                             finish_reason=call.finish_reason, policy_version=call.policy_version)
                read.so_far.answered(call.cell_id)
                return recorded
        finally:
            self._leave(call.execution_id, line)

    async def _persist(self, call: CompletedCall, placement: Placement, blob: bytes) -> RecordedCall:
        ref = blob_ref(blob, CALL_RECORD_MEDIA_TYPE)
        events = build_events(call, placement, ref, run_id=self.run_id, occurred_at=self._clock())
        await self.storage.append_call(events, blob)
        return RecordedCall(placement=placement, event=events[-1], blob=ref)

    async def refuse(self, refusal: CallRefused) -> Event:
        event = refused_event(refusal, run_id=self.run_id, occurred_at=self._clock())
        try:
            await self.storage.append_events([event])
        except Exception as exc:
            raise RecordingFailed(refusal.execution_id, exc) from exc
        return event

    async def recall(self, execution_id: str) -> ExecutionSoFar:
        """From the line's read when there is one (a prefetch spares the first call this query), else read now;
        the read then serves the execution's first call too."""
        line = self._enter(execution_id)
        try:
            async with line.lock:
                return replace((await self._read_for(execution_id, line)).so_far)
        finally:
            self._leave(execution_id, line)

    async def past_call(self, execution_id: str, call_index: int) -> PastCall | None:
        """From the line's read, which the calls recorded since have kept up to date (a resumed agent replays
        its calls against the log a first call read)."""
        line = self._enter(execution_id)
        try:
            async with line.lock:
                return (await self._read_for(execution_id, line)).log.past(call_index)
        finally:
            self._leave(execution_id, line)

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


__all__ = ["CallRecorder", "CallStorage", "LoggedRecorder", "RecordingFailed"]
