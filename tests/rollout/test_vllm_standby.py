"""A real vLLM engine (tiny model) through a worker's standby: it sleeps, wakes, reloads weights on waking and then
samples exactly what it sampled before the sleep. On CPU the sleep is vLLM's paused scheduler with the prefix
cache dropped; on a CUDA machine the same test runs vLLM's sleep mode (level 1)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import pytest_asyncio
import torch
from safetensors.torch import load_file

from gyre.tinymodel import create_tiny_model
from services.rollout.protocol import GenerateRequest, SamplingSpec, TokenPayload
from services.rollout.worker import RolloutWorker

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]

PROMPT = [200 + (7 * i) % 1500 for i in range(300)]  # over two of the CPU engine's 128-token blocks
SAMPLED = SamplingSpec(max_tokens=24, temperature=1.0, seed=1234)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return create_tiny_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(model_dir, tmp_path_factory):
    from services.rollout.engine import VllmConfig, VllmEngine
    from services.rollout.engine_environment import prepare_cpu_environment

    prepare_cpu_environment(tmp_path_factory.mktemp("vllm"))
    # A cell's KV sized as an accelerator's memory would bound it: 6,000 tokens, in whole blocks.
    eng = VllmEngine.start(VllmConfig(model=model_dir, max_model_len=1024, kv_capacity_tokens=6000))
    await eng.warm_up()
    yield eng
    await eng.close()


def _request(execution_id: str) -> GenerateRequest:
    return GenerateRequest(request_id=f"r-{execution_id}", execution_id=execution_id, base_len=0,
                           delta=TokenPayload(count=len(PROMPT)), sampling=SAMPLED)


async def test_the_engine_holds_the_kv_it_was_sized_for_and_says_so(engine) -> None:
    # The blocks allocated are the capacity asked for, rounded up to a whole block; the worker reports this.
    assert engine.kv_capacity_tokens == -(-6000 // engine.block_size) * engine.block_size
    assert engine._llm.vllm_config.cache_config.num_gpu_blocks == engine.kv_capacity_tokens // engine.block_size + 1


async def test_an_engine_that_slept_and_woke_with_its_weights_reloaded_samples_as_before(engine, model_dir) -> None:
    from services.rollout.engine import sleep_mode_available

    assert engine.sleep_mode == sleep_mode_available()  # CPU: False, so the sleep is a pause
    worker = RolloutWorker(engine, worker_id="w", cell_id="c")
    original = load_file(str(model_dir / "model.safetensors"))
    noise = torch.Generator().manual_seed(0)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=noise, dtype=v.dtype) for k, v in original.items()}
    ids = np.asarray(PROMPT, dtype=np.int32)

    before = await worker.generate(_request("before"), ids)
    assert before.status == "ok" and len(before.completion) > 0
    cached = await engine.generate(PROMPT, SamplingSpec(max_tokens=1, temperature=0.0), "cached-before-sleep")
    assert cached.cached_tokens > 0  # the prompt's blocks sit in the prefix cache

    t0 = time.perf_counter()
    report = await worker.sleep()
    sleep_s = time.perf_counter() - t0
    assert engine.asleep and await engine._llm.is_sleeping()
    assert worker.state == "standby" and report.dropped == ["before/main"]
    refused = await worker.generate(_request("while-asleep"), ids)
    assert refused.status == "draining" and "standby" in refused.detail

    # Woken with other weights (a newer policy, as published while the cell trained): they are what it serves.
    async def load_perturbed() -> None:
        assert await worker.apply_weights(1, perturbed)

    phases = await worker.wake(load_perturbed)
    assert worker.state == "active" and not engine.asleep and not await engine._llm.is_sleeping()
    changed = await worker.generate(_request("perturbed"), ids)
    assert changed.policy_version == 1 and changed.logprobs != before.logprobs

    # Asleep again, woken with the original weights back: the same seed samples the same tokens as before.
    await worker.sleep()
    t1 = time.perf_counter()

    async def load_original() -> None:
        assert await worker.apply_weights(2, original)

    phases_back = await worker.wake(load_original)
    wake_total_s = time.perf_counter() - t1
    after = await worker.generate(_request("after"), ids)
    assert after.status == "ok" and after.policy_version == 2
    assert after.completion == before.completion
    assert after.logprobs == pytest.approx(before.logprobs, abs=1e-5)
    # The sleep dropped the prefix cache: the prompt was computed afresh under the reloaded weights.
    assert after.cached_tokens == 0
    print(f"\nvllm_standby sleep_s={sleep_s:.4f} wake_s={phases['wake_s']:.4f} load_s={phases['load_s']:.4f} "
          f"second: wake_s={phases_back['wake_s']:.4f} load_s={phases_back['load_s']:.4f} "
          f"wake_total_s={wake_total_s:.4f}")


async def test_concurrent_seeded_long_prompts_are_not_split_across_steps_on_cpu(engine) -> None:
    """Several seeded requests whose prompts together exceed one step's token budget (a drain moving long
    sessions onto a worker at once): on CPU none is prefilled in chunks, since vLLM rewinds a chunked seeded
    request's generator, which a CPU generator cannot do and which kills the engine core. They all complete."""
    from services.rollout.engine_port import EngineOutput

    prompts = [[300 + (11 * i + 5 * k) % 1500 for i in range(900)] for k in range(6)]  # 5,400 tokens > 2,048
    outs = await asyncio.gather(*(
        engine.generate(p, SamplingSpec(max_tokens=8, temperature=1.0, seed=100 + k), request_id=f"long-{k}")
        for k, p in enumerate(prompts)))
    assert all(isinstance(o, EngineOutput) and o.token_ids for o in outs)
    again = await engine.generate(prompts[0], SamplingSpec(max_tokens=8, temperature=1.0, seed=100), "long-again")
    assert again.token_ids == outs[0].token_ids  # the engine still serves, and a seed still fixes the sample


async def test_weights_streamed_from_rank_0_swap_in_and_a_refused_stream_keeps_the_old_ones(
        engine, model_dir) -> None:
    """The weights stream into a real engine: rank 0's server (in this process) sends a publication's shards and
    the engine process receives them over gloo and reloads from views into them. The swapped-in weights are
    what it serves; a stream that no longer holds a publication is refused and the old weights stay."""
    from services.trainer.weights_stream import StreamServer
    from shared.blobs import blob_ref
    from shared.weights import encode_shards, manifest_for
    from shared.weights_stream import StreamPull, StreamRefused

    worker = RolloutWorker(engine, worker_id="w-stream", cell_id="c")
    original = load_file(str(model_dir / "model.safetensors"))
    noise = torch.Generator().manual_seed(1)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=noise, dtype=v.dtype) for k, v in original.items()}
    server = StreamServer("127.0.0.1", timeout_s=30)

    def offered(sd: dict[str, torch.Tensor]) -> StreamPull:
        encoded = list(encode_shards(sd, torch.float32, 200_000))
        refs = [(blob_ref(data), n) for data, n in encoded]
        server.offer({ref.digest: data for (ref, _), (data, _) in zip(refs, encoded, strict=True)})
        manifest = manifest_for(refs, "float32", stream=server.address, stream_backend="gloo")
        assert len(manifest.shards) > 1
        pull = StreamPull.of(manifest, timeout_s=30)
        assert pull is not None
        return pull

    ids = np.asarray(PROMPT, dtype=np.int32)
    try:
        base = await worker.generate(_request("stream-base"), ids)
        times = await worker.apply_weights(1, offered(perturbed))
        assert times is not None and times["stream_s"] > 0
        changed = await worker.generate(_request("stream-perturbed"), ids)
        assert changed.policy_version == 1 and changed.logprobs != base.logprobs
        times = await worker.apply_weights(2, offered(original))
        back = await worker.generate(_request("stream-back"), ids)
        assert back.policy_version == 2 and back.completion == base.completion
        assert back.logprobs == pytest.approx(base.logprobs, abs=1e-5)
        assert server.served == 2

        newer = offered(perturbed)
        server.offer({})  # a newer publication replaced it before the worker pulled
        with pytest.raises(StreamRefused, match="not held"):
            await worker.apply_weights(3, newer)
        kept = await worker.generate(_request("stream-kept"), ids)
        assert kept.policy_version == 2 and kept.completion == base.completion
    finally:
        await asyncio.to_thread(server.close)
