"""The KV fingerprint (services/rollout/engine.py): the identity two workers' KV must share to move between them.
The same checkpoint read from two folders (two nodes' copies) has one fingerprint; another checkpoint, another
dtype or block size has another."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

from transformers import AutoConfig

from gyre.tinymodel import create_tiny_model
from services.rollout.engine import kv_fingerprint


def served(folder: Path, dtype: str = "torch.float32", block_size: int = 16) -> str:
    config = SimpleNamespace(
        model_config=SimpleNamespace(model=str(folder), hf_config=AutoConfig.from_pretrained(folder), dtype=dtype),
        cache_config=SimpleNamespace(cache_dtype="auto"),
    )
    return kv_fingerprint(config, block_size)


def test_the_same_model_in_two_folders_has_one_fingerprint_and_another_model_another(tmp_path: Path) -> None:
    here = create_tiny_model(tmp_path / "node-b" / "model", seed=0, size="tiny")
    there = tmp_path / "node-c" / "model"
    shutil.copytree(here, there)
    assert AutoConfig.from_pretrained(there).to_dict()["_name_or_path"] != \
        AutoConfig.from_pretrained(here).to_dict()["_name_or_path"]
    assert served(here) == served(there)
    assert served(here) != served(here, dtype="torch.bfloat16")
    assert served(here) != served(here, block_size=32)
    other = create_tiny_model(tmp_path / "other", seed=0, size="small")
    assert served(here) != served(other)
