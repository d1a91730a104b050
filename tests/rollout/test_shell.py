"""The rollout shell against real servers: workers over NATS request/reply, calls recorded in Postgres."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import numpy as np
import pytest

from services.rollout.protocol import DrainRequest, GenerateRequest, SamplingSpec, TokenPayload
from services.rollout.recording import CompletedCall, StoreCallRecorder
from services.rollout.router import Router, WorkerDirectory
from services.rollout.transport import NatsPeers, NatsWorkerClient, WorkerServer, watch_statuses
from services.rollout.worker import RolloutWorker
from shared.calls import CallRecord, CallTokens, ExecutionSequences
from shared.events import CallCompleted, ExecutionBranched, ExecutionStarted, ExecutionTimedOut, new_event
from tests.rollout.fakes import CharCodec, ScriptedEngine

CODEC = CharCodec()


async def _wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


async def test_router_reaches_workers_over_nats_with_large_deltas_and_drains(bus) -> None:
    directory = WorkerDirectory()
    watcher = await watch_statuses(bus, directory)
    engines = [ScriptedEngine(CODEC, max_model_len=1 << 20), ScriptedEngine(CODEC, max_model_len=1 << 20)]
    servers = []
    for i, engine in enumerate(engines):
        worker = RolloutWorker(engine, worker_id=f"w{i}", cell_id=f"c{i}", peers=NatsPeers(bus, directory))
        servers.append(await WorkerServer(worker, bus, heartbeat_s=0.2).start())
    try:
        await _wait_for(lambda: len(directory.live()) == 2)
        client = NatsWorkerClient(bus, inline_limit=4096)
        router = Router(directory, client)
        # 300k random ids do not compress below the inline limit: the delta goes through the object store.
        prompt = np.random.default_rng(0).integers(100, 4000, size=300_000).astype(np.int32)
        reply = await router.generate(execution_id="e", chain_id="main", prompt=prompt,
                                      sampling=SamplingSpec(max_tokens=20), request_id="r1")
        assert reply.status == "ok"
        home = router.worker_of("e")
        home_engine = engines[int(home[1])]
        assert home_engine.prompts[-1] == list(prompt)
        history = np.concatenate([prompt, reply.completion])
        drained = await client.drain(home, DrainRequest())
        assert drained.ok and drained.migrated[0].tokens == len(history)
        await _wait_for(lambda: directory.get(home).state == "drained")
        nxt = np.concatenate([history, np.arange(100, 110, dtype=np.int32)])
        reply2 = await router.generate(execution_id="e", chain_id="main", prompt=nxt,
                                       sampling=SamplingSpec(max_tokens=20), request_id="r2")
        assert reply2.status == "ok" and router.worker_of("e") != home
        other = engines[1 - int(home[1])]
        assert other.prompts[-1] == list(nxt)
    finally:
        for s in servers:
            await s.stop()
        await watcher.unsubscribe()


async def test_worker_over_nats_answers_resync_for_unknown_sessions(bus) -> None:
    worker = RolloutWorker(ScriptedEngine(CODEC), worker_id="solo", cell_id="c")
    server = await WorkerServer(worker, bus).start()
    try:
        client = NatsWorkerClient(bus)
        req = GenerateRequest(request_id="x", execution_id="nobody", base_len=5, base_digest="sha256:" + "0" * 64,
                              delta=TokenPayload(count=1), sampling=SamplingSpec(max_tokens=5))
        reply = await client.generate("solo", req, np.array([7], dtype=np.int32))
        assert reply.status == "resync"
    finally:
        await server.stop()


async def test_an_announced_end_reaches_every_worker_over_nats(bus) -> None:
    """The gateway announces an execution's end to all workers (not only the one it knows as holder): each
    drops its sessions and refuses a late call."""
    workers = [RolloutWorker(ScriptedEngine(CODEC), worker_id=f"a{i}", cell_id=f"c{i}") for i in range(2)]
    servers = [await WorkerServer(w, bus).start() for w in workers]
    try:
        client = NatsWorkerClient(bus)
        prompt = np.arange(100, 120, dtype=np.int32)
        for w in workers:  # a session on each: where the router placed it, and where a migration left one
            req = GenerateRequest(request_id="x", execution_id="gone", base_len=0,
                                  delta=TokenPayload(count=len(prompt)), sampling=SamplingSpec(max_tokens=5))
            assert (await client.generate(w.worker_id, req, prompt)).status == "ok"
        await client.announce_end("gone")
        await _wait_for(lambda: all(not w.sessions and "gone" in w.ended for w in workers))
        late = await client.generate("a1", req, prompt)
        assert late.status == "ended"
    finally:
        for server in servers:
            await server.stop()


def _call(i: int, prompt: np.ndarray, completion: np.ndarray) -> CompletedCall:
    return CompletedCall(execution_id="exec-pg", call_id=f"c{i}", chain_id="main", new_chain=False, prompt=prompt,
                         completion=completion, logprobs=-np.arange(len(completion), dtype=np.float32) / 10,
                         policy_version=2, cell_id="cell-x", finish_reason="stop", api="anthropic", latency_s=0.01)


async def test_store_recorder_writes_deltas_that_replay_and_resumes_after_restart(store) -> None:
    recorder = StoreCallRecorder(store, run_id="run-t")
    p0 = np.arange(10, 60, dtype=np.int32)
    c0 = np.arange(500, 510, dtype=np.int32)
    await recorder.record(_call(0, p0, c0))
    p1 = np.concatenate([p0, c0, np.arange(70, 80, dtype=np.int32)])
    await recorder.record(_call(1, p1, np.arange(600, 605, dtype=np.int32)))
    # A new recorder (a restarted gateway) continues the execution's indices and parents from the store, and
    # recalls what the gateway needs to go on: the execution's start, calls so far, latest cell, no end yet.
    started = ExecutionStarted(execution_id="exec-pg", query_id="q", task_id="t", group_size=1, sample_index=0,
                               seed=11, call_budget=9, cell_id="cell-a")
    async with store.transaction() as tx:
        tx.append([new_event(started, run_id="run-t", stream_id="execution-exec-pg", version=1,
                             occurred_at=datetime.now(UTC))], expected_version="any")
    restarted = StoreCallRecorder(store, run_id="run-t")
    so_far = await restarted.recall("exec-pg")
    assert so_far.started == started and so_far.calls == 2 and so_far.last_cell_id == "cell-x"
    assert not so_far.ended
    p2 = np.concatenate([p0[:20], np.arange(900, 910, dtype=np.int32)])
    await restarted.record(_call(2, p2, np.arange(700, 703, dtype=np.int32)))
    stored = await store.read_stream("execution-exec-pg")
    kinds = [s.event.type for s in stored]
    assert kinds == ["call.completed", "call.completed", "execution.started", "execution.branched",
                     "call.completed"]
    calls = [s.event.data for s in stored if isinstance(s.event.data, CallCompleted)]
    assert [c.call_index for c in calls] == [0, 1, 2]
    assert [c.branch_hint for c in calls] == [None, "continuation", "fork"]
    assert calls[1].new_prompt_tokens == 10 and calls[2].parent_prefix_len == 20
    branched = [s.event.data for s in stored if isinstance(s.event.data, ExecutionBranched)]
    assert branched[0].at_call_index == 2 and branched[0].from_call_index == 1
    seqs = ExecutionSequences()
    prompts = [p0, p1, p2]
    for c in calls:
        tokens = CallTokens.decode(await store.blobs.get(c.record))
        seq = seqs.add(CallRecord(execution_id=c.execution_id, call_id=c.call_id, call_index=c.call_index,
                                  parent_call_index=c.parent_call_index, parent_prefix_len=c.parent_prefix_len,
                                  tokens=tokens, policy_version=c.policy_version))
        assert np.array_equal(seq[: c.prompt_tokens], prompts[c.call_index])
        assert np.allclose(tokens.logprobs, -np.arange(len(tokens.completion)) / 10)
    timed_out = ExecutionTimedOut(execution_id="exec-pg", budget="wall_clock", elapsed_s=5.0, calls=3)
    async with store.transaction() as tx:
        tx.append([new_event(timed_out, run_id="run-t", stream_id="execution-exec-pg", version=1,
                             occurred_at=datetime.now(UTC))], expected_version="any")
    so_far = await StoreCallRecorder(store, run_id="run-t").recall("exec-pg")
    assert so_far.ended and so_far.calls == 3


async def test_a_prefetched_log_spares_the_first_call_its_read_and_a_failed_one_is_read_again(store) -> None:
    """Registration starts reading the execution's log; the first call then uses what was read (one read in
    all, indices continuing the log's). A prefetch that failed is not trusted: the call reads the log itself."""
    first = StoreCallRecorder(store, run_id="run-t")
    p0, c0 = np.arange(10, 40, dtype=np.int32), np.arange(500, 505, dtype=np.int32)
    await first.record(_call(0, p0, c0))

    reads: list[str] = []
    restarted = StoreCallRecorder(store, run_id="run-t")
    load = restarted._load

    async def counted(execution_id: str):
        reads.append(execution_id)
        return await load(execution_id)

    restarted._load = counted  # type: ignore[method-assign]
    restarted.prefetch("exec-pg")
    restarted.prefetch("exec-pg")  # already being read: no second read
    await asyncio.sleep(0.2)
    assert reads == ["exec-pg"]
    p1 = np.concatenate([p0, c0, np.arange(70, 75, dtype=np.int32)])
    recorded = await restarted.record(_call(1, p1, np.arange(600, 603, dtype=np.int32)))
    assert reads == ["exec-pg"] and recorded.placement.call_index == 1 and recorded.placement.parent_call_index == 0

    failing = StoreCallRecorder(store, run_id="run-t")
    attempts: list[str] = []

    async def flaky(execution_id: str):
        attempts.append(execution_id)
        if len(attempts) == 1:
            raise ConnectionError("postgres went away")
        return await load(execution_id)

    failing._load = flaky  # type: ignore[method-assign]
    failing.prefetch("exec-pg")
    await asyncio.sleep(0.05)
    p2 = np.concatenate([p1, np.arange(600, 603, dtype=np.int32), np.arange(80, 84, dtype=np.int32)])
    recorded = await failing.record(_call(2, p2, np.arange(700, 702, dtype=np.int32)))
    assert len(attempts) == 2 and recorded.placement.call_index == 2

    # An execution that ends before its first call drops its prefetch.
    ended = StoreCallRecorder(store, run_id="run-t")
    ended.prefetch("exec-gone")
    ended.forget("exec-gone")
    assert ended._lines == {}


async def test_an_execution_forgotten_while_its_first_call_waits_for_the_log_does_not_keep_it() -> None:
    from services.rollout.recording import ExecutionLog, InMemoryCallRecorder

    release = asyncio.Event()

    class SlowLog(InMemoryCallRecorder):
        async def _load(self, execution_id: str) -> ExecutionLog:
            await release.wait()
            return ExecutionLog()

    recorder = SlowLog()
    recorder.prefetch("exec-pg")
    call = asyncio.create_task(recorder.record(_call(0, np.arange(10, 20, dtype=np.int32),
                                                     np.arange(500, 503, dtype=np.int32))))
    await asyncio.sleep(0.05)
    recorder.forget("exec-pg")  # the execution ends while its first call waits for the read
    release.set()
    await call  # the call itself is recorded (it was answered) ...
    assert recorder._lines == {} and recorder._ending == {}  # ... but the ended execution keeps nothing


def _successive_calls(n: int) -> list[CompletedCall]:
    """Calls 0..n-1 of exec-pg, each continuing the previous one's prompt and completion."""
    calls, prompt = [], np.arange(10, 40, dtype=np.int32)
    for i in range(n):
        completion = np.arange(500 + 100 * i, 505 + 100 * i, dtype=np.int32)
        calls.append(_call(i, prompt, completion))
        prompt = np.concatenate([prompt, completion, np.arange(70 + 10 * i, 75 + 10 * i, dtype=np.int32)])
    return calls


class _GatedWrites(StoreCallRecorder):
    """Holds the write of each call index in `gates` until its event is set."""

    def __init__(self, store, gates: dict[int, asyncio.Event]) -> None:
        super().__init__(store, run_id="run-t")
        self.gates = gates

    async def _persist(self, call, placement, blob):
        gate = self.gates.get(placement.call_index)
        if gate is not None:
            await gate.wait()
        return await super()._persist(call, placement, blob)


async def test_a_registration_straight_after_an_end_reads_the_log_after_the_write_in_flight(store) -> None:
    """An execution ended (forgotten) while a call of it is being written, then registered again: the new read
    waits for that write, so the next call continues the log instead of reusing its index."""
    calls, release = _successive_calls(2), asyncio.Event()
    recorder = _GatedWrites(store, {0: release})
    first = asyncio.create_task(recorder.record(calls[0]))
    await asyncio.sleep(0.05)
    recorder.forget("exec-pg")  # ended while call 0 is being written ...
    recorder.prefetch("exec-pg")  # ... and registered again at once
    await asyncio.sleep(0.1)
    release.set()
    await first
    recorded = await recorder.record(calls[1])
    assert recorded.placement.call_index == 1 and recorded.placement.parent_call_index == 0
    assert recorder._ending == {}


async def test_calls_queued_when_their_execution_ends_do_not_stall_its_next_registration(store) -> None:
    """Two calls of one execution in the recorder when it ends (the first being written, the second waiting
    for it), then a registration at once: the new registration's read waits for both, the waiting call goes on
    with its own line's log (it does not take the new read, which waits for it), and the next call continues
    after both."""
    calls, release = _successive_calls(3), asyncio.Event()
    recorder = _GatedWrites(store, {0: release, 1: release})
    first = asyncio.create_task(recorder.record(calls[0]))
    second = asyncio.create_task(recorder.record(calls[1]))
    await asyncio.sleep(0.05)
    recorder.forget("exec-pg")
    recorder.prefetch("exec-pg")
    await asyncio.sleep(0.05)
    release.set()
    done = await asyncio.wait_for(asyncio.gather(first, second), timeout=10)
    assert [r.placement.call_index for r in done] == [0, 1]
    recorded = await asyncio.wait_for(recorder.record(calls[2]), 10)
    assert recorded.placement.call_index == 2 and recorded.placement.parent_call_index == 1
    assert recorder._ending == {}


async def test_an_end_while_the_first_call_waits_on_a_failing_prefetch_does_not_stall_it(store) -> None:
    """The first call waits for the registration's read; the execution ends; the read fails. The call reads
    the log itself (not waiting for its own line) and is recorded."""
    from services.rollout.recording import ExecutionLog

    release = asyncio.Event()
    attempts: list[str] = []

    class FailingRead(StoreCallRecorder):
        async def _load(self, execution_id: str) -> ExecutionLog:
            attempts.append(execution_id)
            if len(attempts) == 1:
                await release.wait()
                raise ConnectionError("postgres went away")
            return await super()._load(execution_id)

    recorder = FailingRead(store, run_id="run-t")
    recorder.prefetch("exec-pg")
    call = asyncio.create_task(recorder.record(_successive_calls(1)[0]))
    await asyncio.sleep(0.05)
    recorder.forget("exec-pg")
    release.set()
    recorded = await asyncio.wait_for(call, timeout=10)
    assert recorded.placement.call_index == 0 and len(attempts) == 2
    assert recorder._lines == {} and recorder._ending == {}


async def test_a_registration_as_the_lock_passes_between_two_calls_still_waits_for_the_second(store) -> None:
    """Two calls of an ended execution in the recorder; the registration comes just as the first finishes
    and hands the lock to the second: the new read still waits for the second call's write."""
    calls, gates = _successive_calls(3), {0: asyncio.Event(), 1: asyncio.Event()}
    recorder = _GatedWrites(store, gates)
    first = asyncio.create_task(recorder.record(calls[0]))
    second = asyncio.create_task(recorder.record(calls[1]))
    await asyncio.sleep(0.05)
    recorder.forget("exec-pg")
    gates[0].set()
    await first  # the lock passes to the second call, which has not yet run
    recorder.prefetch("exec-pg")
    await asyncio.sleep(0.05)
    gates[1].set()
    await second
    recorded = await asyncio.wait_for(recorder.record(calls[2]), 10)
    assert recorded.placement.call_index == 2


async def test_a_call_cancelled_while_its_write_goes_on_does_not_let_the_next_reuse_its_index(store) -> None:
    """A call cancelled during its write, whose commit lands anyway: the next call reads the log again and
    continues after it rather than reuse its index."""
    landed = asyncio.Event()

    class CancelledAfterCommit(StoreCallRecorder):
        async def _persist(self, call, placement, blob):
            recorded = await super()._persist(call, placement, blob)
            if placement.call_index == 1 and not landed.is_set():
                landed.set()
                await asyncio.sleep(3600)  # cancelled here: the write has landed, the call never returns
            return recorded

    recorder = CancelledAfterCommit(store, run_id="run-t")
    calls = _successive_calls(3)
    await recorder.record(calls[0])
    doomed = asyncio.create_task(recorder.record(calls[1]))
    await landed.wait()
    doomed.cancel()
    with pytest.raises(asyncio.CancelledError):
        await doomed
    recorded = await recorder.record(calls[2])
    stored = [s.event.data for s in await store.read_stream("execution-exec-pg")]
    assert [c.call_index for c in stored if isinstance(c, CallCompleted)] == [0, 1, 2]
    assert recorded.placement.parent_call_index == 1
