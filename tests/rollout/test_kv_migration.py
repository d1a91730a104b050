"""A session's KV moves between workers through the KV transport, and every way that can go wrong ends in a
recompute that says why, never in a wrong prefix: over the scripted engine (whose saved "KV" is the prompt
itself, so a load of another prefix is caught) and the in-memory transport (the NATS one passes the same
contract, test_kv_transport.py; the real engines move theirs in test_vllm_migration.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from services.rollout.engine_port import EngineError
from services.rollout.protocol import DrainRequest
from shared.events import KvMigrated
from tests.rollout.fakes import CharCodec, MemoryKvTransport, ScriptedEngine, Stack, build_stack

pytestmark = pytest.mark.asyncio

CODEC = CharCodec()
TURN = [{"role": "user", "content": "look at the repository and report " * 4}]


class KvEngine(ScriptedEngine):
    kv_transfer = True


async def started_on_w0(engines: list[Any], **kw: Any) -> tuple[Stack, list[Any], Any]:
    """Two workers; execution "e" makes one call on w0, then w1 takes sessions. Returns the stack, the events
    the workers emit and the client of "e"."""
    events: list[Any] = []

    async def emit(data: list[Any]) -> None:
        events.extend(data)

    stack = build_stack(engines, CODEC, emit=emit, **kw)
    stack.local.workers["w1"].state = "draining"
    stack.refresh()
    client = stack.anthropic(stack.token("e"))
    await client.messages.create(model="tiny", max_tokens=40, messages=TURN)
    stack.local.workers["w1"].state = "active"
    stack.refresh()
    return stack, events, client


async def next_call_served_on_w1(stack: Stack, client: Any) -> int:
    reply = await client.messages.create(model="tiny", max_tokens=40, messages=TURN + [
        {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go on"}])
    assert stack.recorder.calls("e")[-1].cell_id == "cell-1"
    return int(reply.usage.cache_read_input_tokens or 0)


async def test_a_drain_moves_the_session_by_its_kv_and_the_next_call_reuses_it() -> None:
    transport = MemoryKvTransport()
    stack, events, client = await started_on_w0([KvEngine(CODEC), KvEngine(CODEC)], kv_transport=transport)
    history = stack.local.workers["w0"].sessions[("e", "main")].history
    drained = await stack.local.workers["w0"].drain(DrainRequest())
    assert drained.ok, drained.detail
    [moved] = drained.migrated
    assert (moved.method, moved.fallback, moved.to_worker) == ("kv", "", "w1")
    assert moved.bytes > 0 and moved.cached_tokens > 0
    target = stack.engines[1]
    assert target.kv_loads == [moved.cached_tokens] and target.kv_staged == {}
    await stack.local.workers["w0"].settled()
    assert transport.objects == {}  # the bundle was only in transit
    [event] = [e for e in events if isinstance(e, KvMigrated)]
    assert (event.method, event.tokens, event.bytes, event.fallback) == ("kv", moved.cached_tokens, moved.bytes, "")
    # The target's one request was the load of the moved prefix: nothing recomputed it.
    assert len(target.prompts) == 1 and target.prompts[0] == history[: len(target.prompts[0])].tolist()
    assert await next_call_served_on_w1(stack, client) > 0


def flip(transport: MemoryKvTransport) -> None:
    transport.corrupt_next = True


def cut(transport: MemoryKvTransport) -> None:
    transport.truncate_next = True


def lose(transport: MemoryKvTransport) -> None:
    transport.lose_next = True


@pytest.mark.parametrize(
    ("spoil", "reason"),
    [
        pytest.param(flip, "digest", id="corrupted-transfer"),
        pytest.param(cut, "digest", id="truncated-transfer"),
        pytest.param(lose, "missing", id="source-died-mid-transfer"),
    ],
)
async def test_kv_that_does_not_arrive_whole_is_recomputed_and_the_event_says_why(
    spoil: Callable[[MemoryKvTransport], None], reason: str
) -> None:
    transport = MemoryKvTransport()
    stack, events, client = await started_on_w0([KvEngine(CODEC), KvEngine(CODEC)], kv_transport=transport)
    history = stack.local.workers["w0"].sessions[("e", "main")].history
    spoil(transport)
    drained = await stack.local.workers["w0"].drain(DrainRequest())
    assert drained.ok, drained.detail
    [moved] = drained.migrated
    assert moved.method == "recompute" and reason in moved.fallback and moved.bytes == 0
    [event] = [e for e in events if isinstance(e, KvMigrated)]
    assert event.method == "recompute" and reason in event.fallback and event.tokens == len(history)
    target = stack.engines[1]
    assert target.kv_loads == [] and target.kv_staged == {}  # nothing of it reached the engine
    assert target.prompts == [history.tolist()]  # the whole history, recomputed
    await next_call_served_on_w1(stack, client)


async def test_a_target_with_no_room_for_more_kv_recomputes() -> None:
    stack, events, client = await started_on_w0([KvEngine(CODEC), KvEngine(CODEC)])
    stack.local.workers["w1"].kv_staging_bytes = 100  # smaller than the session's bundle
    drained = await stack.local.workers["w0"].drain(DrainRequest())
    [moved] = drained.migrated
    assert moved.method == "recompute" and "target full" in moved.fallback
    assert stack.local.workers["w1"]._kv_staged == 0
    await next_call_served_on_w1(stack, client)


async def test_kv_of_another_model_is_not_loaded() -> None:
    other = KvEngine(CODEC)
    other.kv_fingerprint = "another-model"
    stack, events, client = await started_on_w0([KvEngine(CODEC), other])
    drained = await stack.local.workers["w0"].drain(DrainRequest())
    [moved] = drained.migrated
    assert moved.method == "recompute" and "model mismatch" in moved.fallback
    assert other.kv_loads == [] and other.kv_staged == {}
    await next_call_served_on_w1(stack, client)


async def test_a_bundle_for_another_prefix_is_caught_before_the_engine_loads_it() -> None:
    """A ticket whose digest matches but whose bundle was saved for other tokens (a bug, or a replayed
    ticket): the engine's check of the bundle's prompt refuses it."""
    transport = MemoryKvTransport()
    stack, events, client = await started_on_w0([KvEngine(CODEC), KvEngine(CODEC)], kv_transport=transport)
    source = stack.engines[0]
    real_export = source.export_kv

    def export_of_other_tokens(prompt: list[int]) -> bytes:
        real_export(prompt)
        other = [t + 1 for t in prompt]
        source.kv_saved[tuple(other)] = b"".join(int(t).to_bytes(4, "little") for t in other)
        return real_export(other)

    source.export_kv = export_of_other_tokens  # type: ignore[method-assign]
    drained = await stack.local.workers["w0"].drain(DrainRequest())
    [moved] = drained.migrated
    assert moved.method == "recompute" and "another prompt" in moved.fallback
    assert stack.engines[1].kv_loads == []


async def test_a_source_that_cannot_move_kv_says_why_and_the_target_recomputes() -> None:
    stack, events, client = await started_on_w0([ScriptedEngine(CODEC), KvEngine(CODEC)])
    drained = await stack.local.workers["w0"].drain(DrainRequest(force_method="kv"))
    [moved] = drained.migrated
    assert moved.method == "recompute" and "no KV connector" in moved.fallback
    await next_call_served_on_w1(stack, client)


async def test_an_ordered_move_carries_the_kv_and_a_spoiled_one_still_moves_by_recompute() -> None:
    transport = MemoryKvTransport()
    stack, events, client = await started_on_w0([KvEngine(CODEC), KvEngine(CODEC)], kv_transport=transport)
    transport.corrupt_next = True
    [moved] = await stack.local.workers["w0"].move_execution("e", "cell-1")
    assert moved.method == "recompute" and "digest" in moved.fallback
    await next_call_served_on_w1(stack, client)
    # And back, whole this time.
    stack.local.workers["w0"].state = "active"
    stack.refresh()
    [back] = await stack.local.workers["w1"].move_execution("e", "cell-0")
    assert back.method == "kv" and back.fallback == "" and back.cached_tokens > 0


class SharedKeyEngine(KvEngine):
    """Keys saved and staged KV by the prompt's whole blocks, as vLLM's file connector does, and dies (as the
    engine process did) when one key's files are written or read while another request of that key has them in
    hand: a save or load request of a key takes a few event-loop turns, and the key is busy until its files are
    exported or dropped."""

    def __init__(self, codec: CharCodec) -> None:
        super().__init__(codec)
        self.busy: set[tuple[int, ...]] = set()
        self.dead = False

    def key(self, prompt: list[int]) -> tuple[int, ...]:
        return tuple(prompt[: (len(prompt) - 1) // self.block_size * self.block_size])

    async def generate(self, prompt, sampling, request_id):  # noqa: ANN001, ANN201
        if request_id.startswith(("kvsave-", "kvload-")):
            if self.key(prompt) in self.busy and request_id.startswith("kvsave-"):
                self.dead = True
                raise EngineError("EngineCore died: a file of its KV folder vanished mid-write")
            self.busy.add(self.key(prompt))
            for _ in range(3):
                await asyncio.sleep(0)
        return await super().generate(prompt, sampling, request_id)

    def import_kv(self, prompt: list[int], bundle: bytes) -> int:
        if self.key(prompt) in self.busy:
            self.dead = True
            raise EngineError("EngineCore died: a file of its KV folder vanished mid-read")
        return super().import_kv(prompt, bundle)

    def drop_kv(self, prompt: list[int]) -> None:
        self.busy.discard(self.key(prompt))
        super().drop_kv(prompt)


async def test_sessions_that_share_a_connector_key_move_one_after_another_and_all_by_kv() -> None:
    """A group's samples of one task start from the same prompt: at a drain their histories agree up to the
    last partial block, so the connector keys their KV alike. Each save and load of one key waits for the
    previous one's files to be gone (the bench's engine died when they overlapped)."""
    engines = [SharedKeyEngine(CODEC), SharedKeyEngine(CODEC)]
    stack = build_stack(engines, CODEC)
    stack.local.workers["w1"].state = "draining"
    stack.refresh()
    prompt = [{"role": "user", "content": "the same task for every sample " * 8}]
    for i in range(4):
        await stack.anthropic(stack.token(f"g-{i}")).messages.create(model="tiny", max_tokens=2, messages=prompt)
    keys = {engines[0].key(s.history[: len(s.history) - 1].tolist()) for s in stack.local.workers["w0"].sessions.values()}
    assert len(keys) == 1  # every session has the same connector key
    stack.local.workers["w1"].state = "active"
    stack.refresh()
    drained = await stack.local.workers["w0"].drain(DrainRequest())
    assert drained.ok and not engines[0].dead and not engines[1].dead
    assert [m.method for m in drained.migrated] == ["kv"] * 4, [m.fallback for m in drained.migrated]
