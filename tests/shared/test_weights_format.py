"""The weight publication format (shared/weights.py): layer-aligned shards within their size, cast to the publish
dtype, decoded back exactly, and refused when they are not what the manifest says."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from shared.blobs import blob_ref
from shared.weights import (
    WeightsFormatError,
    WeightsManifest,
    check_shard,
    decode_shard,
    encode_shards,
    layer_group,
    manifest_for,
    plan_shards,
    resolve_dtype,
)


def state_dict(layers: int = 4, width: int = 32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    sd = {"model.embed_tokens.weight": torch.randn(50, width, generator=g),
          "model.norm.weight": torch.ones(width), "lm_head.weight": torch.randn(50, width, generator=g)}
    for i in range(layers):
        for part in ("self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj", "mlp.up_proj"):
            sd[f"model.layers.{i}.{part}.weight"] = torch.randn(width, width, generator=g)
        sd[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(width)
    return sd


def test_a_layer_is_its_decoder_layer_and_other_tensors_their_module() -> None:
    assert layer_group("model.layers.12.self_attn.q_proj.weight") == "model.layers.12"
    assert layer_group("model.layers.1.mlp.up_proj.weight") == "model.layers.1"
    assert layer_group("model.embed_tokens.weight") == "model.embed_tokens"
    assert layer_group("lm_head.weight") == "lm_head"


@given(st.dictionaries(st.sampled_from([f"model.layers.{i}.{p}.weight" for i in range(6) for p in "abc"]
                                       + ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]),
                       st.integers(1, 1000), min_size=1),
       st.integers(1, 3000))
def test_shards_cover_every_tensor_once_never_split_a_layer_and_stay_within_size(sizes: dict[str, int],
                                                                                  limit: int) -> None:
    shards = plan_shards(sizes, limit)
    names = [n for shard in shards for n in shard]
    assert sorted(names) == sorted(sizes)
    owner = {layer_group(n): i for i, shard in enumerate(shards) for n in shard}
    assert all(owner[layer_group(n)] == i for i, shard in enumerate(shards) for n in shard)
    for shard in shards:
        groups = {layer_group(n) for n in shard}
        assert sum(sizes[n] for n in shard) <= limit or len(groups) == 1, "an oversized shard holds one layer"


def test_shards_round_trip_in_the_publish_dtype_with_tied_weights_left_out() -> None:
    sd = state_dict()
    shards = list(encode_shards(sd, torch.bfloat16, max_bytes=8_000, skip=["lm_head.weight"]))
    assert len(shards) > 2
    manifest = manifest_for([(blob_ref(data, store="object"), n) for data, n in shards], "bfloat16")
    assert manifest.tensors == len(sd) - 1 and manifest.size == sum(len(d) for d, _ in shards)
    out: dict[str, torch.Tensor] = {}
    for (data, _), shard in zip(shards, manifest.shards, strict=True):
        out.update(decode_shard(data, shard, manifest.dtype))
    assert out.keys() == sd.keys() - {"lm_head.weight"}
    for name, tensor in out.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, sd[name].to(torch.bfloat16))
    fp32 = sum(len(d) for d, _ in encode_shards(sd, torch.float32, max_bytes=8_000, skip=["lm_head.weight"]))
    assert manifest.size < 0.55 * fp32, "bf16 ships about half the bytes of fp32"


def test_encoding_is_deterministic() -> None:
    sd = state_dict()
    assert list(encode_shards(sd, torch.float32, 10_000)) == list(encode_shards(dict(reversed(sd.items())),
                                                                               torch.float32, 10_000))


def test_a_shard_that_is_not_what_the_manifest_says_is_refused() -> None:
    (data, n), = encode_shards({"model.layers.0.a.weight": torch.ones(3)}, torch.float32, 1 << 20)
    shard = manifest_for([(blob_ref(data), n)], "float32").shards[0]
    with pytest.raises(WeightsFormatError, match="manifest says bfloat16"):
        decode_shard(data, shard, "bfloat16")
    with pytest.raises(WeightsFormatError, match="2 tensors, manifest says|1 tensors, manifest says"):
        decode_shard(data, shard.model_copy(update={"tensors": 2}), "float32")
    with pytest.raises(WeightsFormatError, match="not safetensors"):
        decode_shard(b"\x00" * 20, shard, "float32")
    check_shard(data, shard, "float32")  # the same checks from the header alone
    with pytest.raises(WeightsFormatError, match="manifest says bfloat16"):
        check_shard(data, shard, "bfloat16")
    with pytest.raises(WeightsFormatError, match="manifest says"):
        check_shard(data, shard.model_copy(update={"tensors": 2}), "float32")
    for bad in (b"\x00" * 20, b"\xff" * 20, data[:12]):
        with pytest.raises(WeightsFormatError, match="not safetensors"):
            check_shard(bad, shard, "float32")
    with pytest.raises(WeightsFormatError, match="not a weights manifest"):
        WeightsManifest.from_bytes(b'{"dtype": "float32"}')
    with pytest.raises(WeightsFormatError, match="empty one"):
        list(encode_shards({}, torch.float32))


def test_the_publish_dtype_is_the_models_own_unless_asked() -> None:
    assert resolve_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_dtype("auto", "bfloat16") == torch.bfloat16
    assert resolve_dtype("auto", None) == torch.float32
    assert resolve_dtype("float16", "bfloat16") == torch.float16
