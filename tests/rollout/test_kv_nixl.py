"""The NIXL mode of the vLLM engine, as far as it can run without a GPU: what it asks vLLM for. A save request
keeps its blocks for a peer (`do_remote_decode`), the block descriptor vLLM returns travels as the bundle, and
the target's load request pulls from exactly that descriptor (`do_remote_prefill`). vLLM's AsyncLLM is replaced
by a recorder of requests here; the NixlConnector itself runs only on GPU nodes (docs/rollout.md, "KV
transport": how to run bench/kv_migration.py --connector nixl there)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm")

from services.rollout.engine import VllmConfig, VllmEngine  # noqa: E402
from services.rollout.kv_bundle import KvBundleError  # noqa: E402
from services.rollout.protocol import DrainRequest, GenerateRequest, SamplingSpec, TokenPayload  # noqa: E402
from services.rollout.worker import RolloutWorker  # noqa: E402
from tests.rollout.fakes import LocalWorkers, MemoryKvTransport  # noqa: E402

pytestmark = pytest.mark.asyncio


class RecordingLLM:
    """What VllmEngine needs of AsyncLLM: its config, and `generate`, which records each request's KV transfer
    parameters and answers as a NIXL engine would (a save returns where its blocks are; a load that pulls them
    reports them cached)."""

    def __init__(self, name: str, model_dir: Path) -> None:
        self.name = name
        self.requests: list[tuple[str, dict[str, Any] | None]] = []
        hf_config = SimpleNamespace(to_dict=lambda: {"model_type": "qwen3", "hidden_size": 128})
        self.vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(max_model_len=4096, enable_sleep_mode=False, model=str(model_dir),
                                         hf_config=hf_config, dtype="float32"),
            cache_config=SimpleNamespace(block_size=16, cache_dtype="auto", num_gpu_blocks=65),
        )

    async def generate(self, prompt: dict[str, Any], params: Any, request_id: str) -> Any:
        kv = (params.extra_args or {}).get("kv_transfer_params")
        self.requests.append((request_id, kv))
        ids = prompt["prompt_token_ids"]
        cached, returned = 0, None
        if kv and kv.get("do_remote_decode"):
            returned = {"remote_block_ids": [3, 4], "remote_engine_id": self.name, "remote_request_id": request_id,
                        "remote_host": "10.0.0.7", "remote_port": 5600, "tp_size": 1}
        if kv and kv.get("do_remote_prefill"):
            cached = (len(ids) - 1) // 16 * 16
        token = 7
        yield SimpleNamespace(
            outputs=[SimpleNamespace(token_ids=[token], logprobs=[{token: SimpleNamespace(logprob=-0.5)}],
                                     finish_reason="length", stop_reason=None)],
            num_cached_tokens=cached, kv_transfer_params=returned)

    def shutdown(self) -> None:
        return None


def nixl_engine(name: str, tmp_path: Path) -> tuple[VllmEngine, RecordingLLM]:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    llm = RecordingLLM(name, model)
    return VllmEngine(llm, VllmConfig(model=model, kv_connector="nixl")), llm


async def test_a_moved_session_is_pulled_by_the_target_from_the_descriptor_the_source_saved(tmp_path) -> None:
    (a, llm_a), (b, llm_b) = nixl_engine("engine-a", tmp_path), nixl_engine("engine-b", tmp_path)
    assert a.kv_transfer and a.kv_fingerprint == b.kv_fingerprint
    local, transport = LocalWorkers(), MemoryKvTransport()
    wa = local.add(RolloutWorker(a, worker_id="wa", cell_id="ca", kv_transport=transport))
    wb = local.add(RolloutWorker(b, worker_id="wb", cell_id="cb", kv_transport=transport))
    history = np.arange(100, 180, dtype=np.int32)
    reply = await wa.generate(GenerateRequest(request_id="call-0", execution_id="e", base_len=0,
                                              delta=TokenPayload(count=len(history)),
                                              sampling=SamplingSpec(max_tokens=1)), history)
    assert reply.status == "ok" and llm_a.requests == [("call-0", None)]  # ordinary traffic asks for nothing

    drained = await wa.drain(DrainRequest(targets=("wb",)))
    [moved] = drained.migrated
    assert (moved.method, moved.fallback) == ("kv", "") and moved.cached_tokens == 64  # whole blocks of 80
    [(save_id, save_kv)] = llm_a.requests[1:]
    assert save_id.startswith("kvsave-") and save_kv == {"do_remote_decode": True, "do_remote_prefill": False}
    [(load_id, load_kv)] = llm_b.requests
    assert load_id.startswith("kvload-")
    assert load_kv == {"remote_block_ids": [3, 4], "remote_engine_id": "engine-a", "remote_request_id": save_id,
                       "remote_host": "10.0.0.7", "remote_port": 5600, "tp_size": 1,
                       "do_remote_prefill": True, "do_remote_decode": False}
    assert wb.executions() == {"e"} and a._nixl_saved == {} and b._nixl_staged == {}  # nothing left behind


async def test_a_nixl_descriptor_loads_only_into_the_same_model_and_prompt(tmp_path) -> None:
    (a, _), (b, _) = nixl_engine("engine-a", tmp_path), nixl_engine("engine-b", tmp_path)
    prompt = list(range(1, 50))
    await a.generate(prompt, SamplingSpec(max_tokens=1), "kvsave-x")
    bundle = a.export_kv(prompt)
    with pytest.raises(KvBundleError, match="another prompt"):
        b.import_kv(prompt[:-17], bundle)
    b.kv_fingerprint = "another"
    with pytest.raises(KvBundleError, match="another model"):
        b.import_kv(prompt, bundle)
    with pytest.raises(KvBundleError, match="saved no KV"):
        a.export_kv(prompt)  # exported once: the descriptor left with the bundle
