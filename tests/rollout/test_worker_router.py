"""Worker sessions, deltas, weight reload, drain/migration and router placement, over a scripted engine."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.rollout.kv_handoff import kv_prompt
from services.rollout.protocol import (
    DrainRequest,
    GenerateRequest,
    SamplingSpec,
    TokenPayload,
    tokens_digest,
)
from services.rollout.router import NoCapacity, Router, WorkerDirectory
from services.rollout.worker import RolloutWorker
from shared.events import KvMigrated, KvMigrationRefused
from tests.rollout.fakes import CharCodec, LocalWorkers, MemoryKvTransport, ScriptedEngine, build_stack

CODEC = CharCodec()
USER = [{"role": "user", "content": "hello"}]


def request(execution_id: str, base: np.ndarray, delta: np.ndarray, **kw) -> GenerateRequest:
    return GenerateRequest(
        request_id="r", execution_id=execution_id, base_len=len(base),
        base_digest=tokens_digest(base) if len(base) else "", delta=TokenPayload(count=len(delta)),
        sampling=SamplingSpec(max_tokens=50), **kw)


async def test_worker_keeps_history_and_accepts_deltas() -> None:
    engine = ScriptedEngine(CODEC)
    worker = RolloutWorker(engine, worker_id="w", cell_id="c")
    first = np.arange(100, 140, dtype=np.int32)
    r1 = await worker.generate(request("e", first[:0], first), first)
    assert r1.status == "ok"
    history = np.concatenate([first, r1.completion])
    more = np.arange(200, 210, dtype=np.int32)
    r2 = await worker.generate(request("e", history, more), more)
    assert r2.status == "ok"
    assert engine.prompts[1] == list(np.concatenate([history, more]))
    # A base the worker does not hold asks the router to resend everything.
    wrong = history.copy()
    wrong[3] += 1
    r3 = await worker.generate(request("e", wrong, more), more)
    assert r3.status == "resync"


async def test_weight_reload_waits_for_in_flight_calls_and_stamps_the_new_version() -> None:
    stack = build_stack([ScriptedEngine(CODEC)], CODEC)
    client = stack.anthropic(stack.token("exec-w"))
    before = await client.messages.create(model="tiny", max_tokens=100, messages=USER)
    await stack.local.workers["w0"].apply_weights(3, {"version": 3})
    after = await client.messages.create(model="tiny", max_tokens=100, messages=USER)
    assert before.content[0].text != after.content[0].text
    assert [c.policy_version for c in stack.recorder.calls("exec-w")] == [0, 3]


async def test_drain_moves_sessions_and_the_next_call_continues_on_the_target() -> None:
    events: list = []

    async def emit(data):
        events.extend(data)

    stack = build_stack([ScriptedEngine(CODEC), ScriptedEngine(CODEC)], CODEC, emit=emit)
    stack.local.workers["w1"].state = "draining"  # force placement on w0 first
    stack.refresh()
    client = stack.anthropic(stack.token("exec-m"))
    msg = await client.messages.create(model="tiny", max_tokens=100, messages=USER)
    assert stack.core.router.worker_of("exec-m") == "w0"
    stack.local.workers["w1"].state = "active"
    stack.refresh()
    reply = await stack.local.workers["w0"].drain(DrainRequest())
    assert reply.ok and [m.to_worker for m in reply.migrated] == ["w1"]
    assert reply.migrated[0].method == "recompute"  # the scripted engine has no KV connector
    assert [type(e) for e in events] == [KvMigrated] and events[0].to_cell == "cell-1"
    stack.refresh()
    follow = USER + [{"role": "assistant", "content": msg.content[0].text}, {"role": "user", "content": "more"}]
    await client.messages.create(model="tiny", max_tokens=100, messages=follow)
    assert stack.core.router.worker_of("exec-m") == "w1"
    calls = stack.recorder.calls("exec-m")
    assert [c.cell_id for c in calls] == ["cell-0", "cell-1"]
    assert calls[1].branch_hint == "continuation"
    # The target got only the delta: its prefill of the adopted history was the one extra prompt.
    assert len(stack.engines[1].prompts) == 2
    # New executions avoid the drained worker.
    await stack.anthropic(stack.token("exec-n")).messages.create(model="tiny", max_tokens=50,
                                                                           messages=USER)
    assert stack.core.router.worker_of("exec-n") == "w1"


async def test_an_execution_that_ends_after_its_session_moved_is_ended_where_the_session_is() -> None:
    """It finished before its next call, so the router never learned of the move; the holders follow the
    drained worker's `moved` and the session does not stay on the target for good."""
    stack = build_stack([ScriptedEngine(CODEC), ScriptedEngine(CODEC)], CODEC)
    stack.local.workers["w1"].state = "draining"
    stack.refresh()
    await stack.anthropic(stack.token("exec-z")).messages.create(model="tiny", max_tokens=50,
                                                                           messages=USER)
    stack.local.workers["w1"].state = "active"
    stack.refresh()
    assert (await stack.local.workers["w0"].drain(DrainRequest())).ok
    stack.refresh()
    holders = stack.core.router.holders("exec-z")
    assert holders == ["w0", "w1"]
    for worker in holders:  # what the rollout service does on execution.finished / timed_out
        stack.local.workers[worker].end_sessions("exec-z")
    assert stack.local.workers["w1"].executions() == set() and stack.local.workers["w0"].moved == {}


async def test_a_session_that_filled_the_context_can_still_be_drained() -> None:
    """A reply cut at the length limit leaves a history as long as the context, which no engine prefills."""
    stack = build_stack([ScriptedEngine(CODEC, lambda p: "x" * 500, max_model_len=64),
                         ScriptedEngine(CODEC, max_model_len=64)], CODEC)
    w0, w1 = stack.local.workers["w0"], stack.local.workers["w1"]
    w1.state = "draining"
    stack.refresh()
    prompt = np.arange(100, 120, dtype=np.int32)
    reply = await w0.generate(request("e", prompt[:0], prompt).model_copy(
        update={"sampling": SamplingSpec(max_tokens=44)}), prompt)
    assert reply.finish_reason == "length" and len(w0.sessions[("e", "main")].history) == 64
    w1.state = "active"
    stack.refresh()
    drained = await w0.drain(DrainRequest())
    assert drained.ok, drained.detail
    assert len(w1.sessions[("e", "main")].history) == 64 and max(map(len, stack.engines[1].prompts)) == 63


async def test_a_weight_swap_waits_for_a_migration_prefill_and_stale_kv_is_refused() -> None:
    gate = asyncio.Event()
    order: list[str] = []

    class GatedEngine(ScriptedEngine):
        async def generate(self, prompt, sampling, request_id):  # noqa: ANN001, ANN201
            if request_id.startswith("adopt-"):
                order.append("prefill started")
                await gate.wait()
                order.append("prefill done")
            return await super().generate(prompt, sampling, request_id)

        async def load_weights(self, state_dict):  # noqa: ANN001, ANN201
            order.append("weights loaded")
            await super().load_weights(state_dict)

    from services.rollout.protocol import AdoptRequest

    worker = RolloutWorker(GatedEngine(CODEC), worker_id="w", cell_id="c")
    history = np.arange(100, 140, dtype=np.int32)
    adopt = asyncio.create_task(worker.adopt(AdoptRequest(
        execution_id="e", chain_id="main", history=TokenPayload(count=len(history)), from_worker="v"), history))
    await asyncio.sleep(0.05)
    swap = asyncio.create_task(worker.apply_weights(5, {"version": 5}))
    await asyncio.sleep(0.05)
    assert order == ["prefill started"]  # the swap waits: the prefill's KV is the old policy's
    gate.set()
    assert (await adopt).ok
    await swap
    assert order == ["prefill started", "prefill done", "weights loaded"]
    # KV saved by a worker still on version 4 is not loaded into this one, now on 5: it recomputes the history.
    worker.engine.kv_transfer, worker.kv_transport = True, MemoryKvTransport()
    ticket = await worker.kv_transport.send(b"unused", fingerprint=worker.engine.kv_fingerprint, prompt_tokens=33)
    stale = await worker.adopt(AdoptRequest(
        execution_id="f", chain_id="main", history=TokenPayload(count=len(history)), kv=ticket, from_worker="v",
        policy_version=4), history)
    assert stale.ok and stale.method == "recompute" and "stale" in stale.fallback
    assert ("f", "main") in worker.sessions and worker.engine.prompts[-1] == history.tolist()


async def test_request_in_flight_during_drain_completes_then_migrates() -> None:
    gate = asyncio.Event()

    class SlowEngine(ScriptedEngine):
        async def generate(self, prompt, sampling, request_id):
            if request_id.startswith("call-"):
                await gate.wait()
            return await super().generate(prompt, sampling, request_id)

    stack = build_stack([SlowEngine(CODEC), ScriptedEngine(CODEC)], CODEC)
    stack.local.workers["w1"].state = "draining"
    stack.refresh()
    client = stack.anthropic(stack.token("exec-f"))
    call = asyncio.create_task(client.messages.create(model="tiny", max_tokens=100, messages=USER))
    await asyncio.sleep(0.05)
    stack.local.workers["w1"].state = "active"
    stack.refresh()
    drain = asyncio.create_task(stack.local.workers["w0"].drain(DrainRequest()))
    await asyncio.sleep(0.05)
    assert not drain.done()  # waits for the in-flight call on the session
    gate.set()
    msg = await call
    reply = await drain
    assert msg.stop_reason == "end_turn" and reply.ok
    # The migrated history includes the completion that finished during the drain.
    assert reply.migrated[0].tokens == stack.recorder.calls("exec-f")[0].prompt_tokens + msg.usage.output_tokens


async def test_unreachable_worker_is_routed_around() -> None:
    stack = build_stack([ScriptedEngine(CODEC), ScriptedEngine(CODEC)], CODEC)
    client = stack.anthropic(stack.token("exec-u"))
    await client.messages.create(model="tiny", max_tokens=50, messages=USER)
    first = stack.core.router.worker_of("exec-u")
    stack.local.down.add(first)
    await client.messages.create(model="tiny", max_tokens=50, messages=USER)
    assert stack.core.router.worker_of("exec-u") != first


async def test_a_worker_that_stops_beating_mid_call_loses_the_call_to_another_worker_which_recomputes() -> None:
    """A worker that died (or hung) with a call in flight answers nothing, and its transport would wait minutes:
    once it misses its status beats the router places the execution elsewhere and sends the whole prompt."""
    hung = asyncio.Event()

    class DyingEngine(ScriptedEngine):
        async def generate(self, prompt, sampling, request_id):
            if request_id == "call-1":
                hung.set()
                await asyncio.Event().wait()  # never answers
            return await super().generate(prompt, sampling, request_id)

    now = [0.0]
    local, directory = LocalWorkers(), WorkerDirectory(stale_after_s=5.0, clock=lambda: now[0])
    workers = [local.add(RolloutWorker(e, worker_id=f"w{i}", cell_id=f"c{i}"))
               for i, e in enumerate([DyingEngine(CODEC), ScriptedEngine(CODEC)])]
    for w in workers:
        directory.update(w.status())
    router = Router(directory, local, watch_s=0.01)
    router.prefer("e", "c0")
    prompt = np.arange(100, 140, dtype=np.int32)
    first = await router.generate(execution_id="e", chain_id="main", prompt=prompt,
                                  sampling=SamplingSpec(max_tokens=8), request_id="call-0")
    assert first.worker_id == "w0"
    prompt = np.concatenate([prompt, first.completion, np.arange(200, 210, dtype=np.int32)]).astype(np.int32)
    call = asyncio.create_task(router.generate(execution_id="e", chain_id="main", prompt=prompt,
                                               sampling=SamplingSpec(max_tokens=8), request_id="call-1"))
    await hung.wait()
    await asyncio.sleep(0.05)
    assert not call.done()  # still beating: the request waits
    now[0] = 6.0
    directory.update(workers[1].status())  # w1 beats on, w0 has gone silent
    reply = await asyncio.wait_for(call, timeout=5)
    assert reply.status == "ok" and reply.worker_id == "w1" and router.worker_of("e") == "w1"
    assert workers[1].engine.prompts == [prompt.tolist()]  # recomputed from the whole prompt


async def test_an_execution_whose_target_died_after_a_move_is_served_again_where_it_came_from() -> None:
    """The worker a session moved to is gone: the worker it left would answer `moved` for ever, so the router
    asks it to reclaim the execution, and it serves the whole prompt (a recompute)."""
    stack = build_stack([ScriptedEngine(CODEC), ScriptedEngine(CODEC)], CODEC)
    client = stack.anthropic(stack.token("exec-d"))
    stack.local.workers["w1"].state = "draining"
    stack.refresh()
    await client.messages.create(model="tiny", max_tokens=50, messages=USER)
    stack.local.workers["w1"].state = "active"
    stack.refresh()
    [moved] = await stack.local.workers["w0"].move_execution("exec-d", "cell-1")
    assert moved.to_worker == "w1"
    stack.local.down.add("w1")  # it dies
    turn2 = USER + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    await client.messages.create(model="tiny", max_tokens=50, messages=turn2)
    calls = stack.recorder.calls("exec-d")
    assert [c.cell_id for c in calls] == ["cell-0", "cell-0"]
    assert stack.core.router.worker_of("exec-d") == "w0" and "exec-d" not in stack.local.workers["w0"].moved
    assert stack.engines[0].prompts[-1][: len(stack.engines[0].prompts[0])] == stack.engines[0].prompts[0]


def test_router_places_least_loaded_and_sticks() -> None:
    directory = WorkerDirectory(stale_after_s=1e9)
    workers = LocalWorkers()
    for wid, cap in (("a", 2), ("b", 4)):
        w = RolloutWorker(ScriptedEngine(CODEC), worker_id=wid, cell_id=wid, capacity=cap)
        workers.add(w)
        directory.update(w.status())
    router = Router(directory, workers)
    placed = [router.place(f"e{i}") for i in range(6)]
    assert sorted(placed) == ["a", "a", "b", "b", "b", "b"]
    with pytest.raises(NoCapacity):
        router.place("e6")


def test_router_starts_an_execution_on_the_cell_the_scheduler_placed_it_on_when_it_can() -> None:
    directory = WorkerDirectory(stale_after_s=1e9)
    workers = LocalWorkers()
    for wid in ("a", "b", "c"):
        w = RolloutWorker(ScriptedEngine(CODEC), worker_id=f"w-{wid}", cell_id=wid, capacity=2)
        workers.add(w)
        directory.update(w.status())
    router = Router(directory, workers)
    router.prefer("e0", "c")
    router.prefer("e1", "c")
    router.prefer("e2", "c")  # c is full by then: least loaded instead
    router.prefer("e3", "gone")  # no such worker (its cell left rollout): least loaded
    assert [router.place(f"e{i}") for i in range(4)] == ["w-c", "w-c", "w-a", "w-b"]
    router.forget("e0")
    assert router.place("e0") == "w-a"  # a preference is used once: a later placement goes least loaded


def test_kv_prompt_length_matches_the_connector_key_rule() -> None:
    block = 16
    for n in range(1, 100):
        p = kv_prompt(np.arange(n), block)
        if p is None:
            assert n <= block + 1
            continue
        assert (len(p) - 1) % block != 0 and len(p) in (n, n - 1) and (len(p) - 1) // block >= 1


@settings(deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1), st.lists(st.integers(100, 120), min_size=1, max_size=12)),
                min_size=1, max_size=10))
def test_deltas_always_rebuild_the_intended_prompt_on_the_worker(steps) -> None:
    """Whatever the next prompt (continuation, fork at any point, retry), the engine sees exactly that prompt."""

    async def scenario() -> None:
        engine = ScriptedEngine(CODEC, lambda p: "r" * (len(p) % 5))
        workers = LocalWorkers()
        worker = workers.add(RolloutWorker(engine, worker_id="w", cell_id="c"))
        directory = WorkerDirectory(stale_after_s=1e9)
        directory.update(worker.status())
        router = Router(directory, workers)
        sent: list[int] = []
        send = workers.generate

        async def generate(worker_id, request, delta):  # type: ignore[no-untyped-def]
            sent.append(request.base_len)
            return await send(worker_id, request, delta)

        workers.generate = generate  # type: ignore[method-assign]
        history = np.zeros(0, dtype=np.int32)
        for k, (cut, extra) in enumerate(steps):
            keep = int(cut * len(history))  # 1.0 = continue the full history; less = fork inside it
            prompt = np.concatenate([history[:keep], np.asarray(extra, dtype=np.int32)])
            prompt.flags.writeable = False  # as the gateway's prompts are: the router keeps it without a copy
            reply = await router.generate(execution_id="e", chain_id="main", prompt=prompt,
                                          sampling=SamplingSpec(max_tokens=8), request_id=f"r{k}")
            assert reply.status == "ok"
            assert engine.prompts[-1] == [int(t) for t in prompt]
            # Only what the worker does not hold is sent: the base is everything shared with its history
            # (prompt and completion), less the one id the engine must compute.
            shared = next((i for i, (a, b) in enumerate(zip(history, prompt, strict=False)) if a != b),
                          min(len(history), len(prompt)))
            assert sent[-1] == min(shared, len(prompt) - 1)
            history = np.concatenate([prompt, np.asarray(reply.completion, dtype=np.int32)])

    asyncio.run(scenario())


class _GatedEngine(ScriptedEngine):
    """Requests whose id starts with `prefix` wait for `gate`; `entered` is set when the first one arrives."""

    def __init__(self, codec, prefix: str) -> None:
        super().__init__(codec)
        self.prefix, self.gate, self.entered = prefix, asyncio.Event(), asyncio.Event()

    async def generate(self, prompt, sampling, request_id):
        if request_id.startswith(self.prefix):
            self.entered.set()
            await self.gate.wait()
        return await super().generate(prompt, sampling, request_id)


def _pool(engines) -> tuple[LocalWorkers, list[RolloutWorker], Router, WorkerDirectory]:
    local, directory = LocalWorkers(), WorkerDirectory(stale_after_s=1e9)
    workers = [local.add(RolloutWorker(e, worker_id=f"w{i}", cell_id=f"c{i}", capacity=8))
               for i, e in enumerate(engines)]

    def refresh() -> None:
        for w in workers:
            directory.update(w.status())

    for w in workers:
        w._on_change = refresh
    refresh()
    return local, workers, Router(directory, local), directory


def _end_everywhere(workers: list[RolloutWorker], execution_id: str) -> None:
    """What the gateway's end does: every worker hears it (ended_subject), holder or not."""
    for w in workers:
        w.end_sessions(execution_id)


async def _start_on(router: Router, workers: list[RolloutWorker], target: int, execution_id: str, **kw):
    """Place an execution on workers[target]: every other worker looks busy draining while it is placed."""
    for i, w in enumerate(workers):
        w.state = "active" if i == target else "draining"
        w._on_change()
    reply = await router.generate(execution_id=execution_id, chain_id=kw.get("chain_id", "main"),
                                  prompt=kw.get("prompt", np.arange(100, 140, dtype=np.int32)),
                                  sampling=SamplingSpec(max_tokens=20), request_id="call-0")
    for w in workers:
        w.state = "active"
        w._on_change()
    return reply


class LaggingPeers:
    """Peers as a worker sees them through heartbeats taken earlier (`stale`), adopting for real."""

    def __init__(self, stale: dict, local: LocalWorkers) -> None:
        self.stale, self.adopt = stale, local.adopt

    def candidates(self, exclude):
        return [s for k, s in sorted(self.stale.items()) if k != exclude]


def _recording_pool(n: int) -> tuple[LocalWorkers, list[RolloutWorker], Router, list]:
    """`_pool` of n scripted workers whose first records the events it emits."""
    events: list = []

    async def emit(data):
        events.extend(data)

    local, workers, router, _ = _pool([ScriptedEngine(CODEC) for _ in range(n)])
    workers[0]._emit = emit
    return local, workers, router, events


async def test_an_execution_ended_while_its_session_migrates_leaves_no_session_anywhere() -> None:
    """The end arrives while the target is prefilling the adopted history (the router knows only the source as
    holder). The source records no move, and the target, which hears every end, keeps nothing."""
    target_engine = _GatedEngine(CODEC, "adopt-")
    local, workers, router, _ = _pool([ScriptedEngine(CODEC), target_engine])
    await _start_on(router, workers, 0, "X")
    drain = asyncio.create_task(workers[0].drain(DrainRequest()))
    await target_engine.entered.wait()
    _end_everywhere(workers, "X")
    target_engine.gate.set()
    reply = await drain
    assert reply.ok and reply.migrated == []
    assert workers[0].moved == {} and all(not w.sessions for w in workers)
    # A call still on its way is refused rather than start a session again.
    late = await workers[1].generate(request("X", np.zeros(0, np.int32), np.arange(5, dtype=np.int32)),
                                     np.arange(5, dtype=np.int32))
    assert late.status == "ended" and not workers[1].sessions


async def test_a_migration_offered_to_a_worker_that_saw_the_end_is_dropped_not_failed() -> None:
    local, workers, router, _ = _pool([ScriptedEngine(CODEC), ScriptedEngine(CODEC)])
    await _start_on(router, workers, 0, "X")
    workers[1].end_sessions("X")  # the end reached the target first
    reply = await workers[0].drain(DrainRequest())
    assert reply.ok and reply.migrated == [] and workers[0].state == "drained"
    assert not workers[0].sessions and not workers[1].sessions and workers[0].moved == {}


async def test_an_adopt_that_fails_leaves_no_copy_on_the_target() -> None:
    local, workers, router, _ = _pool([ScriptedEngine(CODEC), ScriptedEngine(CODEC)])
    await _start_on(router, workers, 0, "X")
    workers[1].engine.fail_next = RuntimeError("engine hiccup")
    reply = await workers[0].drain(DrainRequest())
    assert not reply.ok and "engine hiccup" in reply.detail
    assert len(reply.failed) == 1 and reply.parked == [] and "moves failed" in reply.detail
    assert list(workers[0].sessions) == [("X", "main")] and not workers[1].sessions


async def test_a_drain_tells_sessions_parked_for_want_of_a_worker_from_moves_that_failed() -> None:
    """No other active worker: the sessions stay here, parked, which is not a failed move (the cell agent may wait
    for a peer); the worker stays draining, as it does when a move fails."""
    _, workers, router, _ = _pool([ScriptedEngine(CODEC), ScriptedEngine(CODEC)])
    await _start_on(router, workers, 0, "X")
    await _start_on(router, workers, 0, "Y")
    workers[1].state = "draining"
    reply = await workers[0].drain(DrainRequest())
    assert not reply.ok and reply.migrated == [] and reply.failed == []
    assert [p.split(":")[0] for p in reply.parked] == ["X/main", "Y/main"]
    assert reply.detail.startswith("parked (no active worker takes them): ") and "failed" not in reply.detail
    assert workers[0].state == "draining" and set(workers[0].sessions) == {("X", "main"), ("Y", "main")}


async def test_a_drain_refused_by_a_target_that_is_draining_too_tries_the_next() -> None:
    """Two cells drain within one heartbeat: each still sees the other as active. A refusal sends the session
    to the next candidate instead of leaving the drain unfinished."""
    local, workers, router, directory = _pool([ScriptedEngine(CODEC) for _ in range(3)])
    await _start_on(router, workers, 0, "X0")
    await _start_on(router, workers, 1, "X1")
    for busy in ("Y0", "Y1"):  # the third worker is the busiest, so each drain first picks the other
        await _start_on(router, workers, 2, busy)
    stale = {w.worker_id: w.status() for w in workers}  # taken before either drain began
    workers[0].peers = workers[1].peers = LaggingPeers(stale, local)  # type: ignore[assignment]
    r0, r1 = await asyncio.gather(workers[0].drain(DrainRequest()), workers[1].drain(DrainRequest()))
    assert r0.ok and r1.ok and workers[0].state == workers[1].state == "drained"
    assert {("X0", "main"), ("X1", "main")} <= set(workers[2].sessions)


async def test_two_drains_of_one_worker_move_each_session_once() -> None:
    """Two drains (a redelivered order) wait behind a call in flight on the session: the first moves it, the
    second finds it gone."""
    events: list = []

    async def emit(data):
        events.extend(data)

    source = _GatedEngine(CODEC, "call-1")
    local, workers, router, _ = _pool([source, ScriptedEngine(CODEC)])
    workers[0]._emit = emit
    first_call = await _start_on(router, workers, 0, "X")
    history = np.concatenate([np.arange(100, 140, dtype=np.int32), np.asarray(first_call.completion, np.int32)])
    more = np.arange(300, 310, dtype=np.int32)
    in_flight = asyncio.create_task(workers[0].generate(
        request("X", history, more).model_copy(update={"request_id": "call-1"}), more))
    await source.entered.wait()
    drains = asyncio.gather(workers[0].drain(DrainRequest()), workers[0].drain(DrainRequest()))
    await asyncio.sleep(0.05)
    source.gate.set()
    assert (await in_flight).status == "ok"
    first, second = await drains
    assert len(first.migrated) + len(second.migrated) == 1 and len(events) == 1
    assert list(workers[1].sessions) == [("X", "main")]


async def test_a_chain_still_here_is_served_here_while_another_chain_of_its_execution_has_moved() -> None:
    """`moved` is kept per execution, sessions per chain: a call for a chain that has not moved yet is served
    where it is (no needless recompute elsewhere)."""
    local, workers, router, _ = _pool([ScriptedEngine(CODEC), ScriptedEngine(CODEC)])
    main = await _start_on(router, workers, 0, "X")
    await _start_on(router, workers, 0, "X", chain_id="chain-1", prompt=np.arange(500, 540, dtype=np.int32))
    workers[0].moved["X"] = "w1"  # chain-1 moved first (the drain goes in key order) ...
    del workers[0].sessions[("X", "chain-1")]
    history = np.concatenate([np.arange(100, 140, dtype=np.int32), np.asarray(main.completion, np.int32)])
    more = np.arange(300, 310, dtype=np.int32)
    reply = await workers[0].generate(request("X", history, more, chain_id="main"), more)  # ... main has not
    assert reply.status == "ok" and reply.worker_id == "w0"


async def test_an_ordered_move_takes_every_chain_of_its_execution_to_the_named_cell_and_calls_follow() -> None:
    local, workers, router, events = _recording_pool(3)
    main = await _start_on(router, workers, 0, "X")
    await _start_on(router, workers, 0, "X", chain_id="sub-1", prompt=np.arange(500, 540, dtype=np.int32))
    await _start_on(router, workers, 0, "Y")
    await _start_on(router, workers, 2, "Z")  # the named cell is the busier one: the order, not the load, decides
    moved = await workers[0].move_execution("X", "c2")
    assert sorted((m.chain_id, m.to_worker) for m in moved) == [("main", "w2"), ("sub-1", "w2")]
    assert set(workers[0].sessions) == {("Y", "main")} and workers[0].moved == {"X": "w2"}
    assert {("X", "main"), ("X", "sub-1")} <= set(workers[2].sessions) and not workers[1].sessions
    assert [(e.execution_id, e.from_cell, e.to_cell) for e in events] == [("X", "c0", "c2")] * 2
    assert workers[0].state == "active"  # an ordered move is not a drain: new sessions still come here
    # The next call of X reaches the source (the router's sticky choice), is told where X went, and follows it.
    history = np.concatenate([np.arange(100, 140, dtype=np.int32), np.asarray(main.completion, np.int32)])
    reply = await router.generate(execution_id="X", chain_id="main",
                                  prompt=np.concatenate([history, np.arange(300, 310, dtype=np.int32)]),
                                  sampling=SamplingSpec(max_tokens=20), request_id="call-1")
    assert reply.status == "ok" and reply.worker_id == "w2"
    assert len(workers[2].engine.prompts) == 1 + 2 + 1  # Z, the two adopted prefills, then only this call


async def test_an_ordered_move_that_cannot_be_made_leaves_the_session_where_it_is_and_says_why() -> None:
    local, workers, router, events = _recording_pool(3)
    await _start_on(router, workers, 0, "X")
    assert await workers[0].move_execution("X", "c9") == []  # no worker serves that cell
    assert await workers[0].move_execution("nobody", "c1") == []  # no session of it here
    workers[1].state = "draining"
    workers[1]._on_change()
    assert await workers[0].move_execution("X", "c1") == []  # the named target does not take sessions
    stale = {w.worker_id: w.status() for w in workers}
    workers[2].state = "draining"  # ... and one whose heartbeat has not said so yet refuses the adopt
    workers[0].peers = LaggingPeers(stale, local)  # type: ignore[assignment]
    assert await workers[0].move_execution("X", "c2") == []  # refused: not sent to another worker instead
    assert list(workers[0].sessions) == [("X", "main")] and workers[0].moved == {}
    assert not workers[1].sessions and not workers[2].sessions
    workers[0].state = "draining"  # a draining worker leaves its sessions to the drain
    workers[2].state = "active"
    assert await workers[0].move_execution("X", "c2") == []
    # Each order not carried out is reported, so the scheduler does not wait for its timeout.
    assert [type(e) for e in events] == [KvMigrationRefused] * 5
    assert [(e.execution_id, e.from_cell, e.to_cell) for e in events][:2] == [("X", "c0", "c9"), ("nobody", "c0", "c1")]
    assert "no active worker serves c9" in events[0].reason and "holds no session" in events[1].reason
    assert "refused" in events[3].reason and "draining" in events[4].reason


async def test_going_to_standby_lets_the_call_in_flight_finish_and_refuses_the_waiting_ones() -> None:
    """Sleep waits for the engine call in flight; a call queued behind it on its session, or waiting at the engine
    gate (closed here by a weight swap) for another session, is refused once the worker stands by, never sent to
    the sleeping engine (which would hold it until a wake), and so is a new session. No session is left."""
    engine = _GatedEngine(CODEC, "slow")
    worker = RolloutWorker(engine, worker_id="w", cell_id="c")
    prompt = np.arange(100, 140, dtype=np.int32)
    first = await worker.generate(request("other", prompt[:0], prompt), prompt)
    other_history = np.concatenate([prompt, first.completion]).astype(np.int32)
    more = np.arange(200, 205, dtype=np.int32)
    slow = asyncio.create_task(worker.generate(request("e", prompt[:0], prompt).model_copy(
        update={"request_id": "slow"}), prompt))
    await engine.entered.wait()
    behind = asyncio.create_task(worker.generate(request("e", prompt[:0], prompt), prompt))
    swap = asyncio.create_task(worker.apply_weights(1, {"version": 1}))  # closes the gate, waits for `slow`
    await asyncio.sleep(0)
    at_gate = asyncio.create_task(worker.generate(request("other", other_history, more), more))
    await asyncio.sleep(0)
    sleep = asyncio.create_task(worker.sleep())
    await asyncio.sleep(0)
    new = await worker.generate(request("new", prompt[:0], prompt), prompt)
    assert new.status == "draining" and "standby" in new.detail
    engine.gate.set()
    assert (await slow).status == "ok"  # in flight before the sleep: finished on the awake engine
    await swap
    report = await sleep
    assert engine.asleep and worker.state == "standby" and worker.sessions == {}
    assert sorted(report.dropped) == ["e/main", "other/main"]
    for task in (behind, at_gate):
        reply = await task
        assert reply.status == "draining" and "standby" in reply.detail
    # (A call sent to the sleeping scripted engine would have raised instead of being refused.)
    assert worker.status().state == "standby"


async def test_waking_loads_before_serving_and_a_late_publication_never_takes_the_worker_back() -> None:
    engine = ScriptedEngine(CODEC)
    worker = RolloutWorker(engine, worker_id="w", cell_id="c")
    assert worker.wants(0)  # the initial weights, while it serves the model's own
    assert await worker.apply_weights(0, {"version": 0})
    await worker.apply_weights(2, {"version": 2})
    await worker.sleep()
    seen: list[tuple[str, bool]] = []

    async def load_newest() -> None:
        seen.append((worker.state, engine.asleep))  # still refusing work, engine already awake
        assert await worker.apply_weights(5, {"version": 5})

    phases = await worker.wake(load_newest)
    assert seen == [("standby", False)] and set(phases) == {"wake_s", "load_s"}
    assert worker.state == "active" and worker.policy_version == 5 and engine.wakes == 1
    # A publication redelivered late, or replayed to a new consumer, is no news: versions only go forward.
    assert not worker.wants(0) and not worker.wants(3) and not await worker.apply_weights(0, {"version": 0})
    assert worker.policy_version == 5 and engine.weights_version == 5
    prompt = np.arange(100, 140, dtype=np.int32)
    reply = await worker.generate(request("e", prompt[:0], prompt), prompt)
    assert reply.status == "ok" and reply.policy_version == 5


async def test_a_wake_that_fails_to_load_leaves_the_worker_in_standby_to_be_woken_again() -> None:
    engine = ScriptedEngine(CODEC)
    worker = RolloutWorker(engine, worker_id="w", cell_id="c")
    await worker.sleep()

    async def broken() -> None:
        raise OSError("blob store unreachable")

    with pytest.raises(OSError):
        await worker.wake(broken)
    assert worker.state == "standby"
    prompt = np.arange(100, 140, dtype=np.int32)
    assert (await worker.generate(request("e", prompt[:0], prompt), prompt)).status == "draining"

    async def fine() -> None:
        await worker.apply_weights(1, {"version": 1})

    await worker.wake(fine)
    assert worker.state == "active" and engine.wakes == 1 and worker.policy_version == 1
    # A drain order that finds it in standby changes nothing there.
    await worker.sleep()
    drained = await worker.drain(DrainRequest())
    assert drained.ok and drained.migrated == [] and worker.state == "standby"
