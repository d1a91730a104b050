"""The CUDA paths a user needs to trust before a long run on GPUs, as `deploy/gpu-check.sh` runs them (with the
vLLM tests it names, which take the GPU when the engine's platform is CUDA). Without a CUDA device every test
here is skipped; with one GPU, those that need two are."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="no CUDA device on this machine (CI has none; deploy/gpu-check.sh runs these on a GPU)"),
]
if TYPE_CHECKING:
    from services.trainer.weights_stream import StreamServer
    from shared.weights_stream import StreamPull

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="fewer than two CUDA devices on this machine")


def test_tree_packing_with_flex_attention_on_cuda_equals_dense() -> None:
    """One packed forward over branched trees with flex attention's block mask, on the GPU, gives the logprobs of
    the dense ancestor mask (the CPU suite checks both against flat forwards)."""
    from services.trainer.packed_forward import packed_logprobs, to_tensors
    from tests.trainer.trainer_trees import pack, random_trajectories, tiny_model

    model = tiny_model("qwen3").to("cuda")
    mb, _ = pack(random_trajectories(np.random.default_rng(1), executions=3, branches=4, vocab=97))
    batch = to_tensors(mb, "cuda")
    with torch.no_grad():
        flex = packed_logprobs(model, batch, attention="flex")
        dense = packed_logprobs(model, batch, attention="dense")
    assert flex.device.type == "cuda"
    assert (flex - dense).abs().max().item() <= 1e-4


@two_gpus
def test_a_two_rank_nccl_fsdp2_step_equals_one_rank(tmp_path: Path) -> None:
    from tests.trainer.trainer_dist import run_phases
    from tests.trainer.trainer_trees import tiny_model

    model_dir = tmp_path / "model"
    tiny_model("qwen3", seed=11).save_pretrained(model_dir)
    one = run_phases([(1, 2)], model_dir, tmp_path / "one")
    two = run_phases([(2, 2)], model_dir, tmp_path / "two")
    assert one["losses"] == pytest.approx(two["losses"], rel=1e-4, abs=1e-5)
    for name, tensor in one["weights"].items():
        assert (tensor - two["weights"][name]).abs().max().item() <= 1e-4, name


def _publication(server: StreamServer) -> tuple[StreamPull | None, dict[str, torch.Tensor]]:
    from shared.blobs import blob_ref
    from shared.weights import encode_shards, manifest_for
    from shared.weights_stream import StreamPull

    g = torch.Generator().manual_seed(0)
    sd = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(512, 512, generator=g) for i in range(4)}
    encoded = list(encode_shards(sd, torch.bfloat16, 600_000))
    refs = [(blob_ref(data), n) for data, n in encoded]
    server.offer({ref.digest: data for (ref, _), (data, _) in zip(refs, encoded, strict=True)})
    manifest = manifest_for(refs, "bfloat16", stream=server.address, stream_backend=server.backend)
    return StreamPull.of(manifest, timeout_s=60), {k: v.to(torch.bfloat16) for k, v in sd.items()}


def test_the_weights_stream_lands_on_a_cuda_engine_device() -> None:
    """Gloo from rank 0's host memory into a receiver whose engine serves from the GPU: the tensors arrive on it."""
    _stream_round_trip("gloo", "cpu", "cuda:0")


@two_gpus
def test_the_weights_stream_over_nccl_goes_gpu_to_gpu() -> None:
    """Rank 0 on GPU 0 sends over NCCL to a receiver on GPU 1 (two ranks may not share one GPU under NCCL)."""
    torch.cuda.set_device(0)
    _stream_round_trip("nccl", "cuda:0", "cuda:1")


def _stream_round_trip(backend: str, sender: str, receiver: str) -> None:
    from services.trainer.weights_stream import StreamServer

    server = StreamServer("127.0.0.1", backend=backend, device=sender, timeout_s=60)  # type: ignore[arg-type]
    try:
        pull, sd = _publication(server)
        with mp.get_context("spawn").Pool(1) as pool:
            sums = pool.apply(_receive_sums, (pull, receiver))
    finally:
        server.close()
    assert sums == {k: float(v.float().sum()) for k, v in sd.items()}


def _receive_sums(pull: StreamPull, device: str) -> dict[str, float]:
    from shared.weights_stream import receive

    torch.cuda.set_device(torch.device(device))
    tensors = receive(pull, device)
    assert all(t.device == torch.device(device) for _, t in tensors)
    return {k: float(t.float().sum()) for k, t in tensors}
