"""The rollout shell against real servers: workers over NATS request/reply (the recorder's Postgres backend has
its contract suite, test_recorders.py)."""

from __future__ import annotations

import asyncio
import json
import uuid

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.rollout.protocol import (
    DrainRequest,
    GenerateRequest,
    SamplingSpec,
    TokenPayload,
    tokens_digest,
)
from services.rollout.router import Router, WorkerDirectory
from services.rollout.transport import (
    NatsPeers,
    NatsWorkerClient,
    WorkerServer,
    watch_statuses,
)
from services.rollout.worker import RolloutWorker
from shared.worker_status import worker_subject
from tests.hostile import json_values, replaced
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


_GOOD = GenerateRequest(request_id="r", execution_id="hostile", base_len=0,
                        delta=TokenPayload.pack(np.arange(100, 120, dtype=np.int32))[0],
                        sampling=SamplingSpec(max_tokens=8)).model_dump(mode="json")
_values = json_values()


def _generate_mutant(path: tuple[str, ...], value: object) -> bytes:
    return json.dumps(replaced(_GOOD, path, value), allow_nan=True).encode()


_bodies = (
    st.binary(max_size=100)
    | _values.map(lambda v: json.dumps(v, allow_nan=True).encode())
    | st.builds(_generate_mutant, st.sampled_from([
        ("base_len",), ("base_digest",), ("delta",), ("delta", "count"), ("delta", "inline"),
        ("delta", "object_name"), ("sampling",), ("sampling", "max_tokens"), ("sampling", "temperature"),
        ("execution_id",), ("chain_id",), ("reclaim",)]), _values)
)


@settings(max_examples=8, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(requests=st.lists(st.tuples(st.sampled_from(["generate", "adopt", "drain", "end"]), _bodies),
                         min_size=3, max_size=10))
async def test_the_workers_internal_api_answers_whatever_it_is_sent_and_keeps_serving(bus, requests) -> None:
    """Generated malformed requests at a worker's NATS endpoints: each is answered (an error naming what is wrong,
    or a reply when it happens to be valid), never left to time out, and the worker goes on serving a session
    it holds."""
    worker = RolloutWorker(ScriptedEngine(CODEC, max_model_len=1 << 16), worker_id=f"fz{uuid.uuid4().hex[:6]}",
                           cell_id="c0")
    server = await WorkerServer(worker, bus, heartbeat_s=0.2).start()
    client = NatsWorkerClient(bus)
    prompt = np.arange(100, 140, dtype=np.int32)
    try:
        first = await client.generate(worker.worker_id, GenerateRequest(
            request_id="c1", execution_id="control", base_len=0, delta=TokenPayload(count=0),
            sampling=SamplingSpec(max_tokens=5)), prompt)
        assert first.status == "ok"
        for verb, body in requests:
            if verb == "drain" and _validates(DrainRequest, body):
                continue  # a well-formed drain drains: not what this test sends
            subject = worker_subject(bus.prefix, worker.worker_id, verb)
            answer = json.loads(await bus.request(subject, body, timeout=10))
            assert isinstance(answer, dict)
            if set(answer) == {"error"}:
                assert isinstance(answer["error"], str) and answer["error"].strip()
        history = np.concatenate([prompt, np.asarray(first.completion, dtype=np.int32)])
        nxt = await client.generate(worker.worker_id, GenerateRequest(
            request_id="c2", execution_id="control", base_len=len(history), base_digest=tokens_digest(history),
            delta=TokenPayload(count=0), sampling=SamplingSpec(max_tokens=5)), np.arange(200, 210, dtype=np.int32))
        assert nxt.status == "ok", nxt.detail
    finally:
        await server.stop()


def _validates(model: type, body: bytes) -> bool:
    try:
        model.model_validate_json(body)
    except ValueError:
        return False
    return True
