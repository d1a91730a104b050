"""Creates Gyre's tiny Hugging Face–format causal LMs (Qwen3, random weights, local BPE tokenizer, ChatML
template with tool calls) deterministically from a seed, and describes any local model directory.

Files written by `create_tiny_model(out_dir, seed=..., size=...)`:
  config.json             Qwen3ForCausalLM, fp32, head_dim 32 (vLLM's CPU attention supports it),
                          max_position_embeddings = 131072, untied input/output embeddings.
  model.safetensors       fp32 weights ~ N(0, 0.02) from numpy PCG64(seed), norms 1; metadata {"format": "pt"}.
  tokenizer.json          byte-level BPE trained here on a corpus generated in code (the same for every
                          seed and size, so all tiny models share token ids); len(tokenizer) == vocab_size.
  tokenizer_config.json   PreTrainedTokenizerFast; eos `<|im_end|>`, pad `<|endoftext|>`, no BOS; chat_template.
  generation_config.json  eos [<|im_end|>, <|endoftext|>], plain sampling at temperature 1 (what RL wants).
Every file is byte-identical for the same seed and size (same library versions).

The chat format (template, marker tokens, tool-call parsing) is `shared/chat.py`: every service reads it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any, Literal

from gyre.tokenizer_corpus import tokenizer_corpus
from shared.chat import ADDED_TOKENS, EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS, chat_template

__all__ = [
    "MODEL_CACHE_ENV",
    "ModelDirError",
    "TinyModelError",
    "create_tiny_model",
    "model_digest",
    "model_info",
    "tiny_model",
]

Size = Literal["tiny", "small", "wide", "half"]
Dtype = Literal["float32", "bfloat16"]

# The one vocabulary size for every tiny model: small enough for fast CPU softmax, large enough that a
# 50 KB Claude Code request stays well inside the context.
VOCAB_SIZE = 4096
MAX_POSITION_EMBEDDINGS = 131072
HEAD_DIM = 32
INITIALIZER_RANGE = 0.02
ROPE_THETA = 1_000_000.0

_SIZES: dict[str, dict[str, int]] = {
    "tiny": {
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 384,
    },
    "small": {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "intermediate_size": 768,
    },
    # For benchmarks that weigh compute against KV bytes (bench/kv_migration.py): wide layers over a narrow KV
    # (32 query heads share 2 KV heads), so prefilling a token costs ~45 kFLOP per byte of its KV — still about
    # 5× less than a 7B model with GQA in bf16 (~230 kFLOP/B), where the tiny model's is ~1 kFLOP/B.
    "wide": {
        "hidden_size": 1024,
        "num_hidden_layers": 2,
        "num_attention_heads": 32,
        "num_key_value_heads": 2,
        "intermediate_size": 3072,
    },
    # For the weight-sync benchmark (bench/weights.py): a model of realistic size for this machine, about 0.5 B
    # parameters (1.0 GB in bf16), shaped like a small Qwen (GQA, wide MLP) with the shared vocabulary.
    "half": {
        "hidden_size": 1024,
        "num_hidden_layers": 33,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 4096,
    },
}


class TinyModelError(Exception):
    """Base class for errors raised while creating or describing a model directory."""


class ModelDirError(TinyModelError):
    """The directory is not usable: missing files, or not empty when a new model should go there."""


# ----------------------------------------------------------------------------------------------------
# Shell: building the files


def _train_tokenizer() -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    n_added = len(SPECIAL_TOKENS) + len(ADDED_TOKENS)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - n_added,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(tokenizer_corpus(), trainer=trainer)
    # If the corpus ran out of merges, fill with reserved tokens so len(tokenizer) == vocab_size and a
    # random model can never sample an id the tokenizer cannot decode.
    reserved = VOCAB_SIZE - n_added - tokenizer.get_vocab_size(with_added_tokens=True)
    tokenizer.add_special_tokens(
        [AddedToken(f"<|reserved_{i}|>", special=True, normalized=False) for i in range(reserved)]
    )
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    if tokenizer.get_vocab_size(with_added_tokens=True) != VOCAB_SIZE:
        raise TinyModelError(
            f"tokenizer has {tokenizer.get_vocab_size(with_added_tokens=True)} tokens, expected {VOCAB_SIZE}"
        )
    return tokenizer


def _qwen3_config(size: Size, *, eos_id: int, pad_id: int, dtype: Dtype = "float32") -> dict[str, Any]:
    # Written by hand (in the format transformers 5 saves) so creation needs neither a transformers import
    # nor its version string, which would make the bytes depend on the installed release.
    if size not in _SIZES:
        raise ValueError(f"size must be one of {sorted(_SIZES)}, got {size!r}")
    dims = _SIZES[size]
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "dtype": dtype,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "initializer_range": INITIALIZER_RANGE,
        "layer_types": ["full_attention"] * dims["num_hidden_layers"],
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "max_window_layers": dims["num_hidden_layers"],
        # A large base keeps rotary phases distinct across the whole 128K context.
        "rope_parameters": {"rope_theta": ROPE_THETA, "rope_type": "default"},
        "rms_norm_eps": 1e-6,
        "sliding_window": None,
        # Untied so every weight has exactly one name in state dicts, FSDP shards and vLLM reloads.
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": VOCAB_SIZE,
        **dims,
    }


def _parameter_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Qwen3ForCausalLM's state-dict names and shapes (the transformers test checks they match)."""
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    inter, head_dim, vocab = config["intermediate_size"], config["head_dim"], config["vocab_size"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}"
        shapes |= {
            f"{layer}.input_layernorm.weight": (hidden,),
            f"{layer}.post_attention_layernorm.weight": (hidden,),
            f"{layer}.self_attn.q_proj.weight": (heads * head_dim, hidden),
            f"{layer}.self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            f"{layer}.self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            f"{layer}.self_attn.o_proj.weight": (hidden, heads * head_dim),
            f"{layer}.self_attn.q_norm.weight": (head_dim,),
            f"{layer}.self_attn.k_norm.weight": (head_dim,),
            f"{layer}.mlp.gate_proj.weight": (inter, hidden),
            f"{layer}.mlp.up_proj.weight": (inter, hidden),
            f"{layer}.mlp.down_proj.weight": (hidden, inter),
        }
    return shapes


def _random_weights(config: dict[str, Any], seed: int) -> dict[str, Any]:
    import numpy as np

    # One PCG64 stream from the seed, consumed in sorted-name order: the values depend on the seed alone.
    rng = np.random.Generator(np.random.PCG64(seed))
    weights: dict[str, Any] = {}
    shapes = _parameter_shapes(config)
    for name in sorted(shapes):
        if name.endswith("norm.weight"):
            weights[name] = np.ones(shapes[name], dtype=np.float32)
        else:
            values = rng.standard_normal(shapes[name], dtype=np.float32) * np.float32(INITIALIZER_RANGE)
            weights[name] = np.ascontiguousarray(values, dtype=np.float32)
    return weights


def _write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def create_tiny_model(
    out_dir: Path, *, seed: int, size: Size = "tiny", dtype: Dtype = "float32", overwrite: bool = False
) -> Path:
    """Write a tiny Qwen3 model directory (see the module docstring) and return its path. `dtype` bfloat16:
    the same fp32 draws rounded to bf16, and the config says so (what the engines then serve by default).

    Raises ModelDirError when `out_dir` is a file, or exists and is not empty unless `overwrite` is set
    (which replaces the model's files and leaves any others alone).
    """
    from safetensors.numpy import save

    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ModelDirError(f"expected a directory for the new model, {out_dir} is a file")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise ModelDirError(f"expected an empty or missing directory for the new model, {out_dir} has files")
    out_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = _train_tokenizer()
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    pad_id = tokenizer.token_to_id(PAD_TOKEN)
    endoftext_id = tokenizer.token_to_id("<|endoftext|>")
    config = _qwen3_config(size, eos_id=eos_id, pad_id=pad_id, dtype=dtype)

    # "format": "pt" is what transformers and vLLM expect to find in the header of PyTorch checkpoints.
    if dtype == "float32":
        weights = save(_random_weights(config, seed), metadata={"format": "pt"})
    else:  # numpy has no bf16: torch rounds the same draws
        import torch
        from safetensors.torch import save as save_torch

        weights = save_torch({k: torch.from_numpy(v).to(torch.bfloat16) for k, v in
                              _random_weights(config, seed).items()}, metadata={"format": "pt"})
    _write_bytes(out_dir / "model.safetensors", weights)
    _write_bytes(out_dir / "config.json", _json_bytes(config))
    _write_bytes(out_dir / "tokenizer.json", (tokenizer.to_str(pretty=True) + "\n").encode("utf-8"))
    _write_bytes(
        out_dir / "tokenizer_config.json",
        _json_bytes(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": EOS_TOKEN,
                "pad_token": PAD_TOKEN,
                "unk_token": None,
                "add_bos_token": False,
                "add_eos_token": False,
                "clean_up_tokenization_spaces": False,
                "model_max_length": MAX_POSITION_EMBEDDINGS,
                "split_special_tokens": False,
                "chat_template": chat_template(),
            }
        ),
    )
    _write_bytes(
        out_dir / "generation_config.json",
        _json_bytes(
            {
                "bos_token_id": None,
                "eos_token_id": [eos_id, endoftext_id],
                "pad_token_id": pad_id,
                "do_sample": True,
                "temperature": 1.0,
                "top_p": 1.0,
                "top_k": 0,
            }
        ),
    )
    return out_dir


# ----------------------------------------------------------------------------------------------------
# The same files from a cache keyed by what they depend on

MODEL_CACHE_ENV = "GYRE_MODEL_CACHE"  # `make` names .cache/models: runs and tests on the machine share it


def model_digest(*, seed: int, size: Size = "tiny", dtype: Dtype = "float32") -> str:
    """What a tiny model's files depend on: the code that writes them (this module, the tokenizer's corpus, the chat
    format), the libraries that train, draw and serialise them, and the seed, size and dtype."""
    import importlib.metadata

    from gyre import tokenizer_corpus
    from shared import chat

    digest = hashlib.sha256(json.dumps([seed, size, dtype]).encode())
    for source in (Path(__file__), Path(tokenizer_corpus.__file__), Path(chat.__file__)):
        digest.update(source.read_bytes())
    digest.update(chat_template().encode())
    for package in ("tokenizers", "safetensors", "numpy", "torch"):
        try:
            digest.update(f"{package}=={importlib.metadata.version(package)}".encode())
        except importlib.metadata.PackageNotFoundError:
            digest.update(f"{package} absent".encode())
    return digest.hexdigest()[:24]


def tiny_model(
    out_dir: Path, *, seed: int, size: Size = "tiny", dtype: Dtype = "float32", overwrite: bool = False,
    cache: Path | None = None,
) -> Path:
    """`create_tiny_model`, its files copied from `cache` (default: the folder `GYRE_MODEL_CACHE` names, if any)
    where they were built once for the same digest (`model_digest`). The first caller builds them there (in a
    folder of its own, renamed into place: callers at once do not see half a model); without a cache, it creates."""
    if cache is None and os.environ.get(MODEL_CACHE_ENV):
        cache = Path(os.environ[MODEL_CACHE_ENV])
    if cache is None:
        return create_tiny_model(out_dir, seed=seed, size=size, dtype=dtype, overwrite=overwrite)
    built = cache / model_digest(seed=seed, size=size, dtype=dtype)
    if not built.is_dir():
        cache.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{built.name}-", dir=cache))
        create_tiny_model(staging / "model", seed=seed, size=size, dtype=dtype)
        with contextlib.suppress(OSError):  # another caller put the same files there first
            os.rename(staging / "model", built)
        shutil.rmtree(staging, ignore_errors=True)
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or (any(out_dir.iterdir()) and not overwrite)):
        raise ModelDirError(f"expected an empty or missing directory for the new model, {out_dir} has files"
                            if out_dir.is_dir() else f"expected a directory for the new model, {out_dir} is a file")
    out_dir.mkdir(parents=True, exist_ok=True)
    for file in built.iterdir():
        shutil.copyfile(file, out_dir / file.name)
    return out_dir


# ----------------------------------------------------------------------------------------------------
# Describing any model directory


def _safetensors_parameters(path: Path) -> tuple[int, set[str]]:
    # Read only the header (8-byte little-endian length, then JSON) so large models cost nothing.
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    count, dtypes = 0, set()
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        n = 1
        for dim in entry["shape"]:
            n *= dim
        count += n
        dtypes.add(entry["dtype"])
    return count, dtypes


def model_info(model_dir: Path) -> dict[str, Any]:
    """Architecture, parameter count, vocabulary and context of a local Hugging Face model directory."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ModelDirError(f"expected a Hugging Face model directory with config.json, found none in {model_dir}")
    config = json.loads(config_path.read_text(encoding="utf-8"))
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise ModelDirError(f"expected *.safetensors weights in {model_dir}, found none")
    parameters, dtypes = 0, set()
    for shard in shards:
        n, kinds = _safetensors_parameters(shard)
        parameters += n
        dtypes |= kinds
    tokenizer_vocab: int | None = None
    tokenizer_path = model_dir / "tokenizer.json"
    if tokenizer_path.is_file():
        from tokenizers import Tokenizer

        tokenizer_vocab = Tokenizer.from_file(str(tokenizer_path)).get_vocab_size(with_added_tokens=True)
    architectures = config.get("architectures") or [None]
    return {
        "path": str(model_dir),
        "architecture": architectures[0],
        "model_type": config.get("model_type"),
        "parameters": parameters,
        "dtypes": sorted(dtypes),
        "vocab_size": config.get("vocab_size"),
        "tokenizer_vocab_size": tokenizer_vocab,
        "max_context": config.get("max_position_embeddings"),
        "layers": config.get("num_hidden_layers"),
        "hidden_size": config.get("hidden_size"),
        "attention_heads": config.get("num_attention_heads"),
        "kv_heads": config.get("num_key_value_heads"),
        "head_dim": config.get("head_dim"),
    }
