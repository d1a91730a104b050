"""The full state dict as one safetensors file, and a loadable model directory built around it (the runner's and
`bench/learning.py`'s output). What is published to rollout workers is the sharded format of shared/weights.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

# Files of a Hugging Face model directory that are not weights; copied next to published weights.
_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


class WeightsError(Exception):
    pass


def safetensors_bytes(state_dict: dict[str, torch.Tensor], config: Any | None = None) -> bytes:
    """Serialise a full state dict deterministically (sorted names, contiguous CPU tensors)."""
    if not state_dict:
        raise WeightsError("expected a full state dict with tensors, got an empty one (not rank 0?)")
    tied = bool(getattr(config, "tie_word_embeddings", False))
    out = {}
    for name in sorted(state_dict):
        if tied and name == "lm_head.weight":
            continue  # tied to embed_tokens; HF and vLLM rebuild it (safetensors refuses shared storage)
        out[name] = state_dict[name].detach().to("cpu").contiguous()
    return save_safetensors(out, metadata={"format": "pt"})


def load_weights(data: bytes) -> dict[str, torch.Tensor]:
    return load_safetensors(data)


def write_model_dir(data: bytes, base_model_dir: Path, out_dir: Path) -> Path:
    """A model directory transformers (and vLLM) can open: base config/tokenizer + the published weights."""
    base, out = Path(base_model_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in _MODEL_FILES:
        if (base / name).is_file():
            shutil.copyfile(base / name, out / name)
    if not (out / "config.json").is_file():
        raise WeightsError(f"{base} has no config.json; expected a Hugging Face model directory")
    tmp = out / "model.safetensors.tmp"
    tmp.write_bytes(data)
    tmp.replace(out / "model.safetensors")
    return out
