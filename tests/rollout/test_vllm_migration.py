"""KV migration between two real vLLM engines, each with its own KV folder (nothing shared between them): the
source's connector saves the session's KV, the NATS transport carries it through the Object Store, the target's
connector loads it."""

from __future__ import annotations

import asyncio

import pytest
import pytest_asyncio

from gyre.tinymodel import create_tiny_model
from services.rollout import anthropic_api
from services.rollout.codec import TokenizerCodec
from services.rollout.kv_bundle import KvBundleError, pack_bundle, unpack_bundle
from services.rollout.kv_handoff import KV_LOAD_PREFIX, KV_SAVE_PREFIX
from services.rollout.protocol import DrainRequest, SamplingSpec
from shared.calls import CallTokens
from shared.events import KvMigrated
from services.rollout.transport import NatsKvTransport
from tests.conftest import drop_bus, make_bus
from tests.rollout.fakes import build_stack

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]
# The current Messages API has no sampling fields; the gateway still reads `temperature` from the body.
GREEDY = {"temperature": 0.0}

SYSTEM = "You are an agent working in a repository. " * 20  # a prompt of several 128-token blocks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return create_tiny_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines(model_dir, tmp_path_factory):
    from services.rollout.engine import VllmConfig, VllmEngine
    from services.rollout.engine_environment import prepare_cpu_environment

    prepare_cpu_environment(tmp_path_factory.mktemp("vllm"))
    a = VllmEngine.start(VllmConfig(model=model_dir, max_model_len=2048, kv_storage=tmp_path_factory.mktemp("kv-a")))
    b = VllmEngine.start(VllmConfig(model=model_dir, max_model_len=2048, kv_storage=tmp_path_factory.mktemp("kv-b")))
    await b.warm_up()  # as a rollout worker does before it reports ready: the migration must not mind
    yield a, b
    await a.close()
    await b.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def kv_transport(infra):
    bus = await make_bus(infra.nats_url)
    yield NatsKvTransport(bus.kv_objects)
    await drop_bus(bus)


def two_workers(engines, model_dir, kv_transport):
    """A gateway stack over both engines whose new executions start on w0 (w1 looks busy draining until the test
    lets it take sessions); returns it, the codec and the events its workers emit."""
    events: list = []

    async def emit(data):
        events.extend(data)

    codec = TokenizerCodec.from_model_dir(model_dir)
    stack = build_stack(list(engines), codec, emit=emit, kv_transport=kv_transport)
    stack.local.workers["w1"].state = "draining"
    stack.refresh()
    return stack, codec, events


async def test_live_session_moves_to_another_worker_with_its_kv_and_continues_identically(engines, model_dir,
                                                                                         kv_transport) -> None:
    a, b = engines
    assert a.config.kv_storage != b.config.kv_storage
    stack, codec, events = two_workers(engines, model_dir, kv_transport)
    w0, w1 = stack.local.workers["w0"], stack.local.workers["w1"]
    client = stack.anthropic(stack.token("m-1"))
    turn1 = [{"role": "user", "content": "Look at the repository and report."}]
    msg = await client.messages.create(model="tiny", system=SYSTEM, max_tokens=16, extra_body=GREEDY, messages=turn1)
    other = stack.anthropic(stack.token("m-2"))
    await other.messages.create(model="tiny", system=SYSTEM, max_tokens=8, messages=turn1)
    assert stack.core.router.worker_of("m-1") == stack.core.router.worker_of("m-2") == "w0"

    turn2 = turn1 + [{"role": "assistant", "content": [c.model_dump(exclude_none=True) for c in msg.content]},
                     {"role": "user", "content": "Now continue."}]
    body = {"model": "tiny", "system": SYSTEM, "max_tokens": 16, "messages": turn2}
    plan = stack.core.executions["m-1"].tito.plan(anthropic_api.parse_request(body).conversation, codec)
    # What worker A would answer, greedy, for the next turn.
    expected = await a.generate([int(t) for t in plan.prompt], SamplingSpec(max_tokens=16, temperature=0.0),
                                "expected-on-a")

    w1.state = "active"
    stack.refresh()
    # A request of m-2 is in flight when the drain starts: it completes on A, then m-2 migrates too.
    in_flight = asyncio.create_task(other.messages.create(
        model="tiny", system=SYSTEM, max_tokens=64, messages=turn1 + [
            {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]))
    await asyncio.sleep(0.01)
    drained = await w0.drain(DrainRequest())
    done = await in_flight
    assert done.usage.output_tokens > 0
    assert drained.ok, drained.detail
    by_exec = {m.execution_id: m for m in drained.migrated}
    assert set(by_exec) == {"m-1", "m-2"}
    moved = by_exec["m-1"]
    assert moved.method == "kv" and moved.to_worker == "w1" and moved.bytes > 0 and moved.cached_tokens > 0
    assert moved.fallback == ""
    # Nothing stays behind: the source's folder, the target's and the bus's bucket only hold KV in transit.
    assert list(a.config.kv_storage.iterdir()) == [] and list(b.config.kv_storage.iterdir()) == []
    kv_events = [e for e in events if isinstance(e, KvMigrated)]
    assert {e.execution_id for e in kv_events} == {"m-1", "m-2"}
    assert all(e.from_cell == "cell-0" and e.to_cell == "cell-1" and e.method == "kv" for e in kv_events)

    stack.refresh()
    msg2 = await client.messages.create(model="tiny", system=SYSTEM, max_tokens=16, extra_body=GREEDY, messages=turn2)
    calls = stack.recorder.calls("m-1")
    assert calls[-1].cell_id == "cell-1" and calls[-1].branch_hint == "continuation"
    assert msg2.usage.cache_read_input_tokens > 0
    assert msg2.content[0].text == codec.decode(expected.token_ids).strip()
    recorded = CallTokens.decode(stack.recorder.blobs[calls[-1].record.digest])
    assert [int(t) for t in recorded.completion] == expected.token_ids  # greedy: what A would have produced
    assert stack.core.router.worker_of("m-1") == "w1"


async def test_warm_up_serves_one_request_and_leaves_no_kv_behind(engines) -> None:
    a, _ = engines
    assert await a.warm_up() > 0
    assert a.kv_bytes(list(range(1, 17))) == 0


async def test_an_ordered_move_takes_one_execution_with_its_kv_and_leaves_the_others(engines, model_dir,
                                                                                    kv_transport) -> None:
    stack, _, events = two_workers(engines, model_dir, kv_transport)
    w0, w1 = stack.local.workers["w0"], stack.local.workers["w1"]
    turn1 = [{"role": "user", "content": "Look at the repository and report."}]
    mover, stayer = stack.anthropic(stack.token("o-1")), stack.anthropic(stack.token("o-2"))
    msg = await mover.messages.create(model="tiny", system=SYSTEM, max_tokens=16, extra_body=GREEDY, messages=turn1)
    await stayer.messages.create(model="tiny", system=SYSTEM, max_tokens=8, messages=turn1)
    w1.state = "active"
    stack.refresh()

    moved = await w0.move_execution("o-1", "cell-1")
    assert [(m.execution_id, m.to_worker, m.method) for m in moved] == [("o-1", "w1", "kv")]
    assert moved[0].cached_tokens > 0
    assert [(e.execution_id, e.to_cell, e.method) for e in events if isinstance(e, KvMigrated)] == [
        ("o-1", "cell-1", "kv")]
    assert w0.executions() == {"o-2"} and w0.state == "active"
    stack.refresh()
    turn2 = turn1 + [{"role": "assistant", "content": [c.model_dump(exclude_none=True) for c in msg.content]},
                     {"role": "user", "content": "Now continue."}]
    again = await mover.messages.create(model="tiny", system=SYSTEM, max_tokens=16, extra_body=GREEDY, messages=turn2)
    assert stack.recorder.calls("o-1")[-1].cell_id == "cell-1" and again.usage.cache_read_input_tokens > 0
    await stayer.messages.create(model="tiny", system=SYSTEM, max_tokens=8, messages=turn1 + [
        {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}])
    assert stack.recorder.calls("o-2")[-1].cell_id == "cell-0"


async def test_an_engine_loads_only_a_bundle_of_its_model_and_prompt(engines) -> None:
    a, b = engines
    prompt = [int(t) for t in (list(range(5, 300)) * 2)[:400]]
    await a.generate(prompt, SamplingSpec(max_tokens=1, temperature=0.0), f"{KV_SAVE_PREFIX}bundle-test")
    bundle = a.export_kv(prompt)
    assert a.kv_bytes(prompt) == 0  # exported: the folder only held it in transit
    manifest, files = unpack_bundle(bundle)
    assert manifest.fingerprint == a.kv_fingerprint == b.kv_fingerprint and manifest.prompt_tokens == len(prompt)
    assert len(files) == a._llm.vllm_config.model_config.hf_config.num_hidden_layers  # one file a layer
    foreign = pack_bundle(manifest.model_copy(update={"fingerprint": "0" * 64}), files)
    with pytest.raises(KvBundleError, match="another model"):
        b.import_kv(prompt, foreign)
    with pytest.raises(KvBundleError, match="another prompt"):
        b.import_kv(prompt[1:], bundle)
    with pytest.raises(KvBundleError, match="truncated"):
        b.import_kv(prompt, bundle[:-100])
    assert b.kv_bytes(prompt) == 0  # nothing refused was staged
    assert b.import_kv(prompt, bundle) == len(bundle)
    out = await b.generate(prompt, SamplingSpec(max_tokens=1, temperature=0.0), f"{KV_LOAD_PREFIX}bundle-test")
    b.drop_kv(prompt)
    assert out.cached_tokens >= len(prompt) // b.block_size * b.block_size - b.block_size
