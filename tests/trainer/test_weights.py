"""Published weights: safetensors bytes from the sharded trainer load in transformers and in vLLM (in place)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from services.trainer.distributed import GroupSpec, free_port
from services.trainer.engine import PublishedShards, Trainer, TrainerConfig
from services.trainer.loss import GspoConfig
from services.trainer.weights import load_weights, write_model_dir
from gyre.tinymodel import create_tiny_model
from shared.blobs import blob_ref
from shared.weights import decode_shard, manifest_for
from tests.trainer.trainer_trees import make_batch

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = create_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=3)
    config = TrainerConfig(lr=1e-3, loss=GspoConfig(eps_low=0.2, eps_high=0.28), recompute_old_logprobs=True)
    trainer, _ = Trainer.start(base, GroupSpec(rank=0, world_size=1, master_port=free_port()), config)
    try:
        trainer.step(make_batch(seed=1, step=0, vocab=500))
        tokens = np.random.default_rng(0).integers(0, 500, size=40).tolist()
        with torch.no_grad():
            trainer.model.config._attn_implementation = "sdpa"
            logits = trainer.model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0].float()
        data = trainer.weights_bytes()
        shards = trainer.weights_shards()
        trainer.config = dataclasses.replace(trainer.config, publish_dtype="bfloat16", shard_bytes=20_000)
        bf16 = trainer.weights_shards()
    finally:
        trainer.close()
    assert data is not None and shards is not None and bf16 is not None
    return {"base": base, "bytes": data, "tokens": tokens, "logits": logits, "shards": shards, "bf16": bf16}


def _decoded(published: PublishedShards) -> dict[str, torch.Tensor]:
    encoded = list(published.shards())
    manifest = manifest_for([(blob_ref(data), n) for data, n in encoded], published.dtype_name)
    out: dict[str, torch.Tensor] = {}
    for (data, _), shard in zip(encoded, manifest.shards, strict=True):
        out.update(decode_shard(data, shard, manifest.dtype))
    return out


def test_the_publication_holds_the_same_tensors_as_the_model_file_in_the_publish_dtype(published: dict) -> None:
    whole = load_weights(published["bytes"])
    assert published["shards"].dtype_name == "float32", "auto: the tiny model's own dtype"
    assert {k: v for k, v in _decoded(published["shards"]).items()}.keys() == whole.keys()
    assert all(torch.equal(_decoded(published["shards"])[k], whole[k]) for k in whole)
    bf16 = _decoded(published["bf16"])
    assert published["bf16"].dtype_name == "bfloat16" and len(list(published["bf16"].shards())) > 1
    assert all(bf16[k].dtype == torch.bfloat16 and torch.equal(bf16[k], whole[k].to(torch.bfloat16)) for k in whole)


def test_published_weights_have_the_base_model_names_and_changed_values(published: dict) -> None:
    from safetensors.torch import load_file

    base_sd = load_file(str(published["base"] / "model.safetensors"))
    new_sd = load_weights(published["bytes"])
    assert new_sd.keys() == base_sd.keys()
    assert all(new_sd[k].dtype == base_sd[k].dtype and new_sd[k].shape == base_sd[k].shape for k in base_sd)
    assert max((new_sd[k] - base_sd[k]).abs().max().item() for k in base_sd) > 1e-4


def test_published_weights_load_in_transformers_with_identical_logits(published: dict, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    out = write_model_dir(published["bytes"], published["base"], tmp_path / "published")
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([published["tokens"]]), use_cache=False).logits[0].float()
    assert (logits - published["logits"]).abs().max().item() <= 1e-5


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_published_weights_reload_in_place_in_vllm(published: dict, tmp_path: Path) -> None:
    weights = tmp_path / "weights.safetensors"
    weights.write_bytes(published["bytes"])
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(published["tokens"]))
    out = tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run(
        ["nice", sys.executable, "-m", "tests.trainer.vllm_reload_check", str(published["base"]), str(weights),
         str(tokens), str(out), str(tmp_path / "vllm")],
        cwd=REPO, env=env, check=True, timeout=600,
    )
    result = json.loads(out.read_text())
    ids = torch.tensor(published["tokens"])
    expected = torch.log_softmax(published["logits"][:-1], -1).gather(-1, ids[1:, None]).squeeze(-1)
    after = torch.tensor(result["after"])
    before = torch.tensor(result["before"])
    assert (after - expected).abs().max().item() <= 1e-4
    # Before the reload the engine served the base weights, which differ measurably.
    assert (before - expected).abs().max().item() > 1e-4
