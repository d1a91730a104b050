"""Contract suite for the call recorder: what `LoggedRecorder` promises over any `CallStorage`. Subclasses provide
the `storage` fixture (the Postgres backend over a real database, the in-memory fake); every behaviour runs
against each, so the fake the gateway tests use cannot drift from the real backend. Faults and delays are
injected by wrapping the storage port (`Wrapped`), the same way for both."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import UTC, datetime

import numpy as np
import pytest

from services.rollout.call_log import CompletedCall
from services.rollout.recorder import CallStorage, LoggedRecorder, RecordingFailed
from shared.calls import ExecutionSequences, call_record
from shared.events import (
    BlobRef,
    CallCompleted,
    CallRefused,
    Event,
    EventData,
    ExecutionBranched,
    ExecutionStarted,
    ExecutionTimedOut,
    new_event,
)

RUN = "run-t"
EXECUTION = "exec-pg"
STREAM = f"execution-{EXECUTION}"


def _call(i: int, prompt: np.ndarray, completion: np.ndarray, *, chain_id: str = "main") -> CompletedCall:
    return CompletedCall(execution_id=EXECUTION, call_id=f"c{i}", chain_id=chain_id, prompt=prompt,
                         completion=completion, logprobs=-np.arange(len(completion), dtype=np.float32) / 10,
                         policy_version=2, cell_id="cell-x", finish_reason="stop", api="anthropic", latency_s=0.01)


def successive_calls(n: int) -> list[CompletedCall]:
    """Calls 0..n-1, each continuing the previous one's prompt and completion."""
    calls, prompt = [], np.arange(10, 40, dtype=np.int32)
    for i in range(n):
        completion = np.arange(500 + 100 * i, 505 + 100 * i, dtype=np.int32)
        calls.append(_call(i, prompt, completion))
        prompt = np.concatenate([prompt, completion, np.arange(70 + 10 * i, 75 + 10 * i, dtype=np.int32)])
    return calls


def _index_of(events: Sequence[Event]) -> int:
    data = events[-1].data
    assert isinstance(data, CallCompleted)
    return data.call_index


class Wrapped:
    """A storage port around another, with hooks to delay or fail its reads and writes."""

    def __init__(self, inner: CallStorage) -> None:
        self.inner = inner
        self.reads: list[str] = []
        self.before_read: Callable[[str], Awaitable[None]] | None = None
        self.before_write: Callable[[Sequence[Event]], Awaitable[None]] | None = None
        self.after_write: Callable[[Sequence[Event]], Awaitable[None]] | None = None

    async def read_execution(self, execution_id: str) -> list[Event]:
        self.reads.append(execution_id)
        if self.before_read is not None:
            await self.before_read(execution_id)
        return await self.inner.read_execution(execution_id)

    async def get_blob(self, ref: BlobRef) -> bytes:
        return await self.inner.get_blob(ref)

    async def append_call(self, events: Sequence[Event], blob: bytes) -> None:
        if self.before_write is not None:
            await self.before_write(events)
        await self.inner.append_call(events, blob)
        if self.after_write is not None:
            await self.after_write(events)

    async def append_events(self, events: Sequence[Event]) -> None:
        await self.inner.append_events(events)


class CallRecorderContract:
    @pytest.fixture
    async def storage(self) -> AsyncIterator[CallStorage]:
        raise NotImplementedError
        yield

    @staticmethod
    def recorder(storage: CallStorage) -> LoggedRecorder:
        """A recorder over `storage`; a second one over the same storage is a gateway that restarted."""
        return LoggedRecorder(storage, run_id=RUN)

    @staticmethod
    async def log(storage: CallStorage, data: EventData) -> None:
        """What another service appends to the execution's stream (its start, its end)."""
        await storage.append_events([new_event(data, run_id=RUN, stream_id=STREAM, version=1,
                                               occurred_at=datetime.now(UTC))])

    async def test_deltas_replay_and_a_restarted_recorder_continues_indices_parents_and_chains(self, storage) -> None:
        recorder = self.recorder(storage)
        p0, c0 = np.arange(10, 60, dtype=np.int32), np.arange(500, 510, dtype=np.int32)
        await recorder.record(_call(0, p0, c0))
        p1 = np.concatenate([p0, c0, np.arange(70, 80, dtype=np.int32)])
        await recorder.record(_call(1, p1, np.arange(600, 605, dtype=np.int32)))
        # A new recorder (a restarted gateway) continues the execution's indices, parents and chain heads from the
        # storage, and recalls what the gateway needs to go on: its start, calls so far, latest cell, no end yet.
        started = ExecutionStarted(execution_id=EXECUTION, query_id="q", task_id="t", group_size=1, sample_index=0,
                                   seed=11, call_budget=9, cell_id="cell-a")
        await self.log(storage, started)
        restarted = self.recorder(storage)
        so_far = await restarted.recall(EXECUTION)
        assert so_far.started == started and so_far.calls == 2 and so_far.last_cell_id == "cell-x"
        assert not so_far.ended
        # Call 2 re-renders call 0's reply (it leaves call 1 inside generated text): a fork, announced.
        p2 = np.concatenate([p0, c0[:3], np.arange(900, 910, dtype=np.int32)])
        await restarted.record(_call(2, p2, np.arange(700, 703, dtype=np.int32)))
        # Call 3 replaces the start of the context with something shorter: a compaction, not announced.
        p3 = np.concatenate([p0[:20], np.arange(950, 955, dtype=np.int32)])
        await restarted.record(_call(3, p3, np.arange(800, 802, dtype=np.int32)))
        stored = await storage.read_execution(EXECUTION)
        assert [e.type for e in stored] == ["call.completed", "call.completed", "execution.started",
                                            "execution.branched", "call.completed", "call.completed"]
        assert [e.version for e in stored] == list(range(1, 7))
        calls = [e.data for e in stored if isinstance(e.data, CallCompleted)]
        assert [c.call_index for c in calls] == [0, 1, 2, 3]
        assert [c.branch_hint for c in calls] == [None, "continuation", "fork", "compaction"]
        assert [c.parent_call_index for c in calls] == [None, 0, 1, 2]
        assert calls[1].new_prompt_tokens == 10 and calls[2].parent_prefix_len == 53 and calls[3].parent_prefix_len == 20
        (branched,) = [e.data for e in stored if isinstance(e.data, ExecutionBranched)]
        assert (branched.at_call_index, branched.from_call_index) == (2, 1)
        seqs = ExecutionSequences()
        prompts = [p0, p1, p2, p3]
        for c in calls:
            record = call_record(c, await storage.get_blob(c.record))
            seq = seqs.add(record)
            assert np.array_equal(seq[: c.prompt_tokens], prompts[c.call_index])
            assert np.allclose(record.tokens.logprobs, -np.arange(len(record.tokens.completion)) / 10)
        await self.log(storage, ExecutionTimedOut(execution_id=EXECUTION, budget="wall_clock", elapsed_s=5.0, calls=4))
        so_far = await self.recorder(storage).recall(EXECUTION)
        assert so_far.ended and so_far.calls == 4

    async def test_past_calls_are_read_back_as_recorded_by_the_recorder_and_after_a_restart(self, storage) -> None:
        """What a resumed agent's replay reads: each call's prompt and completion ids, id, finish and version,
        from the recorder that wrote them and from one that restarted over the same log; none past the log."""
        calls = successive_calls(3)
        recorder = self.recorder(storage)
        for call in calls[:2]:
            await recorder.record(call)
        for reader in (recorder, self.recorder(storage)):
            for call in calls[:2]:
                past = await reader.past_call(EXECUTION, int(call.call_id[1:]))
                assert past is not None and past.call_id == call.call_id
                assert np.array_equal(past.prompt, call.prompt) and np.array_equal(past.completion, call.completion)
                assert (past.finish_reason, past.policy_version) == ("stop", 2)
            assert await reader.past_call(EXECUTION, 2) is None and await reader.past_call(EXECUTION, -1) is None
        await recorder.record(calls[2])
        past = await recorder.past_call(EXECUTION, 2)
        assert past is not None and np.array_equal(past.prompt, calls[2].prompt)

    async def test_a_restart_continues_the_indices_and_chain_heads_of_every_chain(self, storage) -> None:
        recorder = self.recorder(storage)
        main0 = _call(0, np.arange(10, 30, dtype=np.int32), np.arange(500, 505, dtype=np.int32))
        sub = _call(1, np.arange(40, 60, dtype=np.int32), np.arange(600, 603, dtype=np.int32), chain_id="chain-1")
        await recorder.record(main0)
        assert (await recorder.record(sub)).placement.branch_hint == "delegation"
        restarted = self.recorder(storage)
        # main continues its own previous call (0), not the latest call of the execution (1).
        follow = np.concatenate([main0.prompt, main0.completion, np.arange(70, 75, dtype=np.int32)])
        recorded = await restarted.record(_call(2, follow, np.arange(700, 702, dtype=np.int32)))
        assert (recorded.placement.call_index, recorded.placement.branch_hint) == (2, "continuation")
        assert recorded.placement.head_call_index == 0 and recorded.placement.parent_call_index == 0

    async def test_a_refusal_is_recorded_on_the_execution_stream_and_read_back_in_order(self, storage) -> None:
        recorder = self.recorder(storage)
        calls = successive_calls(2)
        await recorder.record(calls[0])
        refusal = CallRefused(execution_id=EXECUTION, status=429, kind="rate_limit_error", reason="no capacity",
                              infra=True, answered=1, api="openai")
        event = await recorder.refuse(refusal)
        assert event.stream_id == STREAM and event.run_id == RUN
        stored = await storage.read_execution(EXECUTION)
        assert [e.type for e in stored] == ["call.completed", "call.refused"]
        assert stored[-1].data == refusal and stored[-1].event_id == event.event_id
        # A refusal takes no call index, for this recorder or a restarted one.
        assert (await recorder.record(calls[1])).placement.call_index == 1
        assert (await self.recorder(storage).recall(EXECUTION)).calls == 2

    async def test_a_failed_write_keeps_nothing_and_the_next_call_takes_its_index(self, storage) -> None:
        wrapped = Wrapped(storage)
        failures = [ConnectionError("postgres went away")]

        async def fail_once(events: Sequence[Event]) -> None:
            if failures:
                raise failures.pop()

        wrapped.before_write = fail_once
        recorder = self.recorder(wrapped)
        calls = successive_calls(1)
        with pytest.raises(RecordingFailed, match="postgres went away"):
            await recorder.record(calls[0])
        assert await storage.read_execution(EXECUTION) == []
        assert (await recorder.record(calls[0])).placement.call_index == 0

    async def test_a_prefetched_log_spares_the_first_call_its_read_and_a_failed_one_is_read_again(self, storage) -> None:
        """A take-up starts reading the execution's log; the first call then uses what was read (one read in
        all, indices continuing the log's), and so does a recall. A prefetch that failed is not trusted: the call
        reads the log itself."""
        calls = successive_calls(3)
        await self.recorder(storage).record(calls[0])
        wrapped = Wrapped(storage)
        restarted = self.recorder(wrapped)
        restarted.prefetch(EXECUTION)
        restarted.prefetch(EXECUTION)  # already being read: no second read
        await asyncio.sleep(0.2)
        assert wrapped.reads == [EXECUTION]
        assert (await restarted.recall(EXECUTION)).calls == 1
        recorded = await restarted.record(calls[1])
        assert wrapped.reads == [EXECUTION] and recorded.placement.call_index == 1
        assert recorded.placement.parent_call_index == 0

        flaky = Wrapped(storage)

        async def fail_first(execution_id: str) -> None:
            if len(flaky.reads) == 1:
                raise ConnectionError("postgres went away")

        flaky.before_read = fail_first
        failing = self.recorder(flaky)
        failing.prefetch(EXECUTION)
        await asyncio.sleep(0.05)
        recorded = await failing.record(calls[2])
        assert len(flaky.reads) == 2 and recorded.placement.call_index == 2

        # An execution that ends before its first call drops its prefetch.
        ended = self.recorder(storage)
        ended.prefetch("exec-gone")
        ended.forget("exec-gone")
        assert ended._lines == {}

    async def test_an_execution_forgotten_while_its_first_call_waits_for_the_log_does_not_keep_it(self, storage) -> None:
        release = asyncio.Event()
        wrapped = Wrapped(storage)

        async def slow(execution_id: str) -> None:
            await release.wait()

        wrapped.before_read = slow
        recorder = self.recorder(wrapped)
        recorder.prefetch(EXECUTION)
        call = asyncio.create_task(recorder.record(successive_calls(1)[0]))
        await asyncio.sleep(0.05)
        recorder.forget(EXECUTION)  # the execution ends while its first call waits for the read
        release.set()
        await call  # the call itself is recorded (it was answered) ...
        assert recorder._lines == {} and recorder._ending == {}  # ... but the ended execution keeps nothing

    def _gated(self, storage: CallStorage, gates: dict[int, asyncio.Event]) -> LoggedRecorder:
        """A recorder whose write of each call index in `gates` waits until its event is set."""
        wrapped = Wrapped(storage)

        async def gate(events: Sequence[Event]) -> None:
            if (event := gates.get(_index_of(events))) is not None:
                await event.wait()

        wrapped.before_write = gate
        return self.recorder(wrapped)

    async def test_a_take_up_straight_after_an_end_reads_the_log_after_the_write_in_flight(self, storage) -> None:
        """An execution ended (forgotten) while a call of it is being written, then taken up again: the new read
        waits for that write, so the next call continues the log instead of reusing its index."""
        calls, release = successive_calls(2), asyncio.Event()
        recorder = self._gated(storage, {0: release})
        first = asyncio.create_task(recorder.record(calls[0]))
        await asyncio.sleep(0.05)
        recorder.forget(EXECUTION)  # ended while call 0 is being written ...
        recorder.prefetch(EXECUTION)  # ... and taken up again at once
        await asyncio.sleep(0.1)
        release.set()
        await first
        recorded = await recorder.record(calls[1])
        assert recorded.placement.call_index == 1 and recorded.placement.parent_call_index == 0
        assert recorder._ending == {}

    async def test_calls_queued_when_their_execution_ends_do_not_stall_its_next_take_up(self, storage) -> None:
        """Two calls in the recorder when the execution ends (the first being written, the second waiting for
        it), then a take-up at once: the new read waits for both, the waiting call goes on with its own line's
        log (it does not take the new read, which waits for it), and the next call continues after both."""
        calls, release = successive_calls(3), asyncio.Event()
        recorder = self._gated(storage, {0: release, 1: release})
        first = asyncio.create_task(recorder.record(calls[0]))
        second = asyncio.create_task(recorder.record(calls[1]))
        await asyncio.sleep(0.05)
        recorder.forget(EXECUTION)
        recorder.prefetch(EXECUTION)
        await asyncio.sleep(0.05)
        release.set()
        done = await asyncio.wait_for(asyncio.gather(first, second), timeout=10)
        assert [r.placement.call_index for r in done] == [0, 1]
        recorded = await asyncio.wait_for(recorder.record(calls[2]), 10)
        assert recorded.placement.call_index == 2 and recorded.placement.parent_call_index == 1
        assert recorder._ending == {}

    async def test_an_end_while_the_first_call_waits_on_a_failing_prefetch_does_not_stall_it(self, storage) -> None:
        """The first call waits for the take-up's read; the execution ends; the read fails. The call reads the
        log itself (not waiting for its own line) and is recorded."""
        release = asyncio.Event()
        wrapped = Wrapped(storage)

        async def fail_first(execution_id: str) -> None:
            if len(wrapped.reads) == 1:
                await release.wait()
                raise ConnectionError("postgres went away")

        wrapped.before_read = fail_first
        recorder = self.recorder(wrapped)
        recorder.prefetch(EXECUTION)
        call = asyncio.create_task(recorder.record(successive_calls(1)[0]))
        await asyncio.sleep(0.05)
        recorder.forget(EXECUTION)
        release.set()
        recorded = await asyncio.wait_for(call, timeout=10)
        assert recorded.placement.call_index == 0 and len(wrapped.reads) == 2
        assert recorder._lines == {} and recorder._ending == {}

    async def test_a_take_up_as_the_lock_passes_between_two_calls_still_waits_for_the_second(self, storage) -> None:
        """Two calls of an ended execution in the recorder; the take-up comes just as the first finishes and
        hands the lock to the second: the new read still waits for the second call's write."""
        calls, gates = successive_calls(3), {0: asyncio.Event(), 1: asyncio.Event()}
        recorder = self._gated(storage, gates)
        first = asyncio.create_task(recorder.record(calls[0]))
        second = asyncio.create_task(recorder.record(calls[1]))
        await asyncio.sleep(0.05)
        recorder.forget(EXECUTION)
        gates[0].set()
        await first  # the lock passes to the second call, which has not yet run
        recorder.prefetch(EXECUTION)
        await asyncio.sleep(0.05)
        gates[1].set()
        await second
        recorded = await asyncio.wait_for(recorder.record(calls[2]), 10)
        assert recorded.placement.call_index == 2

    async def test_a_call_cancelled_while_its_write_goes_on_does_not_let_the_next_reuse_its_index(self, storage) -> None:
        """A call cancelled during its write, whose commit lands anyway: the next call reads the log again and
        continues after it rather than reuse its index."""
        landed = asyncio.Event()
        wrapped = Wrapped(storage)

        async def hang_after_call_1(events: Sequence[Event]) -> None:
            if _index_of(events) == 1 and not landed.is_set():
                landed.set()
                await asyncio.sleep(3600)  # cancelled here: the write has landed, the call never returns

        wrapped.after_write = hang_after_call_1
        recorder = self.recorder(wrapped)
        calls = successive_calls(3)
        await recorder.record(calls[0])
        doomed = asyncio.create_task(recorder.record(calls[1]))
        await landed.wait()
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        recorded = await recorder.record(calls[2])
        stored = [e.data for e in await storage.read_execution(EXECUTION)]
        assert [c.call_index for c in stored if isinstance(c, CallCompleted)] == [0, 1, 2]
        assert recorded.placement.parent_call_index == 1


__all__ = ["CallRecorderContract", "Wrapped", "successive_calls"]
