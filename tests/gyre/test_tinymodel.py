"""Tests for gyre.tinymodel: determinism, loading in transformers and vLLM, the template it installs.

The chat format's parser is tested in tests/shared/test_chat.py."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from gyre.tinymodel import ModelDirError, create_tiny_model, model_digest, model_info, tiny_model
from shared.chat import ADDED_TOKENS

EXPECTED_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
}

BASH_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    },
}


def _digests(model_dir: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(model_dir.iterdir())}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=7)


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_dir))


# ---------------------------------------------------------------------------------------------------
# Determinism


def test_creates_exactly_the_documented_files(tiny_dir: Path) -> None:
    assert {p.name for p in tiny_dir.iterdir()} == EXPECTED_FILES


def test_same_seed_gives_byte_identical_files(tiny_dir: Path, tmp_path: Path) -> None:
    again = create_tiny_model(tmp_path / "again", seed=7)
    assert _digests(again) == _digests(tiny_dir)


def test_same_seed_is_byte_identical_across_processes_and_thread_counts(tiny_dir: Path, tmp_path: Path) -> None:
    # Hash seeds and rayon thread counts differ between processes; the BPE training must not care.
    out = tmp_path / "other-process"
    env = {**os.environ, "RAYON_NUM_THREADS": "1", "PYTHONHASHSEED": "12345"}
    code = f"from pathlib import Path; from gyre.tinymodel import create_tiny_model; create_tiny_model(Path({str(out)!r}), seed=7)"
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)
    assert _digests(out) == _digests(tiny_dir)


def test_a_cached_model_is_the_created_one_built_once_per_digest(tiny_dir: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs and tests take their tiny model from a cache keyed by what its files depend on: the first builds it,
    the others copy the same bytes; another seed is another entry; a busy folder is refused as create refuses it."""
    import gyre.tinymodel as tinymodel

    cache = tmp_path / "cache"
    first = tiny_model(tmp_path / "first", seed=7, cache=cache)
    assert _digests(first) == _digests(tiny_dir)
    assert [p.name for p in cache.iterdir()] == [model_digest(seed=7)]  # no staging folder left behind

    def built_again(*args: object, **kwargs: object) -> Path:
        raise AssertionError("the cached model was built again")

    monkeypatch.setattr(tinymodel, "create_tiny_model", built_again)
    monkeypatch.setenv(tinymodel.MODEL_CACHE_ENV, str(cache))
    assert _digests(tiny_model(tmp_path / "second", seed=7)) == _digests(tiny_dir)  # the cache the environment names
    assert model_digest(seed=8) != model_digest(seed=7) != model_digest(seed=7, size="small")
    with pytest.raises(AssertionError, match="built again"):
        tiny_model(tmp_path / "third", seed=8)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    with pytest.raises(ModelDirError, match="empty"):
        tiny_model(tmp_path / "busy", seed=7)


def test_different_seed_changes_weights_but_not_tokenizer(tiny_dir: Path, tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    other = create_tiny_model(tmp_path / "other", seed=8)
    a, b = _digests(tiny_dir), _digests(other)
    assert a["model.safetensors"] != b["model.safetensors"]
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"):
        assert a[name] == b[name], name
    wa, wb = load_file(tiny_dir / "model.safetensors"), load_file(other / "model.safetensors")
    assert sorted(wa) == sorted(wb)
    assert not (wa["model.embed_tokens.weight"] == wb["model.embed_tokens.weight"]).all()


def test_refuses_to_write_into_a_non_empty_directory_unless_overwriting(tiny_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "busy"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(ModelDirError, match="empty"):
        create_tiny_model(target, seed=7)
    create_tiny_model(target, seed=7, overwrite=True)
    written = _digests(target)
    assert written.pop("keep.txt") == hashlib.sha256(b"mine").hexdigest()
    assert written == _digests(tiny_dir)


def test_refuses_a_path_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelDirError, match="is a file"):
        create_tiny_model(tmp_path / "file", seed=1)


@pytest.mark.parametrize("seed", [-1, 1.5, True, "3"])
def test_rejects_seeds_that_are_not_non_negative_integers(seed: Any, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="seed"):
        create_tiny_model(tmp_path / "m", seed=seed)


def test_rejects_unknown_size(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="size"):
        create_tiny_model(tmp_path / "m", seed=1, size="huge")  # type: ignore[arg-type]


def test_a_bf16_model_holds_the_fp32_draws_rounded_and_says_so(tiny_dir: Path, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    bf16 = create_tiny_model(tmp_path / "bf16", seed=7, dtype="bfloat16")
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    ours, theirs = load_file(str(bf16 / "model.safetensors")), load_file(str(tiny_dir / "model.safetensors"))
    assert ours.keys() == theirs.keys()
    assert all(ours[k].dtype == torch.bfloat16 and torch.equal(ours[k], theirs[k].to(torch.bfloat16)) for k in ours)
    assert AutoModelForCausalLM.from_pretrained(str(bf16)).dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------------
# transformers


def test_loads_in_transformers_with_every_weight_matched_and_runs_a_forward(tiny_dir: Path, tokenizer: Any) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model, loading = AutoModelForCausalLM.from_pretrained(str(tiny_dir), output_loading_info=True)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert loading["missing_keys"] == set() and loading["unexpected_keys"] == set()
    assert loading["mismatched_keys"] == set()
    assert model.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) == model_info(tiny_dir)["parameters"]

    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "List the files in /app"}],
        tools=[BASH_TOOL],
        add_generation_prompt=True,
        return_dict=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, inputs["input_ids"].shape[1], 4096)
    assert torch.isfinite(logits).all()
    # Random N(0, 0.02) weights: a near-uniform next-token distribution, not a degenerate one.
    probs = logits[0, -1].softmax(-1)
    assert probs.max() < 0.05


def test_tokenizer_covers_the_whole_vocabulary_with_chatml_eos_and_pad(tiny_dir: Path, tokenizer: Any) -> None:
    config = json.loads((tiny_dir / "config.json").read_text())
    generation = json.loads((tiny_dir / "generation_config.json").read_text())
    assert len(tokenizer) == config["vocab_size"]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None
    assert config["eos_token_id"] == tokenizer.eos_token_id
    assert generation["eos_token_id"] == [tokenizer.eos_token_id, tokenizer.pad_token_id]
    assert config["max_position_embeddings"] >= 65536
    assert config["head_dim"] == 32


def test_tool_markers_are_single_tokens_that_survive_skipping_special_tokens(tokenizer: Any) -> None:
    for marker in ADDED_TOKENS:
        assert len(tokenizer.encode(marker, add_special_tokens=False)) == 1, marker
    text = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>'
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text.removesuffix("<|im_end|>")


def test_tokenizer_round_trips_arbitrary_text(tokenizer: Any) -> None:
    text = "héllo wörld ✓ 漢字 🙂\tindent\n  {\"k\": [1, 2.5e-3, null]} $ ls -la /app | grep '.py'"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_chat_template_renders_the_documented_tool_call_format(tokenizer: Any) -> None:
    messages = [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "List files"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "bash", "arguments": {"command": "ls"}}}],
        },
        {"role": "tool", "content": "a.txt"},
        {"role": "tool", "content": [{"type": "text", "text": "b.txt"}]},
        {"role": "assistant", "content": "Two files.", "tool_calls": [{"name": "submit", "arguments": "{}"}]},
    ]
    rendered = tokenizer.apply_chat_template(messages, tools=[BASH_TOOL], tokenize=False, add_generation_prompt=True)
    tool_json = json.dumps(BASH_TOOL["function"])
    assert rendered == (
        "<|im_start|>system\nYou are an agent.\n\n# Tools\n\nYou may call one or more functions. "
        "Function signatures are within <tools></tools>:\n<tools>\n"
        f"{tool_json}\n</tools>\n\nTo call a function, reply with a JSON object within <tool_call></tool_call>:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nList files<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\na.txt\n</tool_response>\n<tool_response>\nb.txt\n</tool_response><|im_end|>\n"
        '<|im_start|>assistant\nTwo files.\n<tool_call>\n{"name": "submit", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>assistant\n"
    )


def test_chat_template_without_tools_renders_plain_chatml(tokenizer: Any) -> None:
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "system", "content": "a reminder"},
    ]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
        "<|im_start|>system\na reminder<|im_end|>\n"
    )
    with_system = [{"role": "system", "content": "be brief"}, *messages[:1]]
    assert tokenizer.apply_chat_template(with_system, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


# ---------------------------------------------------------------------------------------------------
# Sizes and model_info


def test_model_info_describes_the_tiny_model(tiny_dir: Path) -> None:
    info = model_info(tiny_dir)
    assert info["architecture"] == "Qwen3ForCausalLM"
    assert info["vocab_size"] == info["tokenizer_vocab_size"] == 4096
    assert info["max_context"] >= 65536
    assert info["dtypes"] == ["F32"]
    assert info["layers"] == 2 and info["head_dim"] == 32
    assert 100_000 < info["parameters"] < 5_000_000
    json.dumps(info)  # the CLI prints it


def test_small_size_is_deeper_and_wider_with_the_same_tokenizer(tiny_dir: Path, tmp_path: Path) -> None:
    small = create_tiny_model(tmp_path / "small", seed=7, size="small")
    tiny_info, small_info = model_info(tiny_dir), model_info(small)
    assert small_info["layers"] > tiny_info["layers"]
    assert small_info["parameters"] > tiny_info["parameters"]
    assert small_info["head_dim"] == 32
    assert _digests(small)["tokenizer.json"] == _digests(tiny_dir)["tokenizer.json"]


def test_model_info_of_a_directory_without_config_raises(tmp_path: Path) -> None:
    with pytest.raises(ModelDirError, match="config.json"):
        model_info(tmp_path)


# ---------------------------------------------------------------------------------------------------
# vLLM

_VLLM_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from vllm import LLM, SamplingParams

    if __name__ == "__main__":
        model_dir, prompt_path, out_path = sys.argv[1:4]
        prompt_ids = json.loads(open(prompt_path).read())
        llm = LLM(model=model_dir, dtype="float32", max_model_len=4096, enforce_eager=True, seed=0,
                  enable_prefix_caching=True)
        params = SamplingParams(temperature=1.0, max_tokens=16, logprobs=1, seed=1, ignore_eos=True)
        out = llm.generate([{"prompt_token_ids": prompt_ids}], params)[0].outputs[0]
        logprobs = [entry[tok].logprob for tok, entry in zip(out.token_ids, out.logprobs)]
        chat = llm.get_tokenizer().apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
        with open(out_path, "w") as f:
            json.dump({"token_ids": list(out.token_ids), "logprobs": logprobs, "chat": chat}, f)
        # Written. Stop the engine ourselves and skip the interpreter's teardown, where vLLM's engine
        # client can abort ("terminate called without an active exception"; tests/trainer/vllm_reload_check.py).
        llm.llm_engine.engine_core.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    """
)


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not importable (install the cpu or gpu extra)")
def test_vllm_engine_loads_the_model_and_its_logprobs_match_transformers(
    tiny_dir: Path, tokenizer: Any, tmp_path: Path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    prompt_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Create hello.txt in /app"}], tools=[BASH_TOOL], add_generation_prompt=True,
        return_dict=True,
    )["input_ids"]
    (tmp_path / "prompt.json").write_text(json.dumps(list(prompt_ids)))
    (tmp_path / "engine.py").write_text(_VLLM_SCRIPT)
    # The engine's IPC sockets live under TMPDIR, whose path must leave room for a socket's name (107 characters at
    # most; pytest's tmp_path under a pytest-xdist worker is already about 90): the workers' own choice of folder.
    from services.rollout.engine_environment import ipc_folder, share_inductor_headers

    cache = ipc_folder(tmp_path / "cache")
    share_inductor_headers(cache)  # the caches `make` names, as a run's engines share them
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "TMPDIR": str(cache),
        "VLLM_CACHE_ROOT": os.environ.get("VLLM_CACHE_ROOT") or str(cache),
    }
    try:
        result = subprocess.run(
            [sys.executable, str(tmp_path / "engine.py"), str(tiny_dir), str(tmp_path / "prompt.json"),
             str(tmp_path / "out.json")],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=500,
        )
    finally:
        if cache != tmp_path / "cache":
            shutil.rmtree(cache, ignore_errors=True)
    assert result.returncode == 0, result.stderr[-4000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert len(out["token_ids"]) == 16
    assert out["chat"] == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

    # The sampled tokens' logprobs from vLLM equal transformers' log-softmax over the same sequence.
    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir))
    sequence = torch.tensor([list(prompt_ids) + out["token_ids"]])
    with torch.no_grad():
        logprobs = model(sequence).logits[0].log_softmax(-1)
    n = len(prompt_ids)
    expected = [logprobs[n - 1 + i, tok].item() for i, tok in enumerate(out["token_ids"])]
    assert out["logprobs"] == pytest.approx(expected, abs=1e-4)
