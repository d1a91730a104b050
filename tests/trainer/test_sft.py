"""Supervised warm-start: assistant turns are the targets, shared prefixes are packed once, loss goes down."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from services.trainer.cli import train_app
from services.trainer.checkpoints import latest_checkpoint, read_trainer_state
from services.trainer.distributed import free_port
from services.trainer.packed_forward import packed_logprobs, to_tensors
from services.trainer.sft import SftDataError, load_conversations, pack_sequences, render_conversation
from gyre.tinymodel import create_tiny_model
from tests.trainer.trainer_trees import flat_logprobs, make_batch

SYSTEM = {"role": "system", "content": "You add numbers."}


def _conv(a: int, b: int) -> list[dict[str, str]]:
    return [SYSTEM, {"role": "user", "content": f"{a}+{b}?"}, {"role": "assistant", "content": str(a + b)}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=5)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def test_targets_are_exactly_the_assistant_turns_through_eos(tokenizer) -> None:  # type: ignore[no-untyped-def]
    messages = [*_conv(2, 3), {"role": "user", "content": "and 1+1?"}, {"role": "assistant", "content": "2"}]
    r = render_conversation(tokenizer, messages)
    spans: list[list[int]] = []
    prev = False
    for tok, t in zip(r.ids, r.target, strict=True):
        if t and not prev:
            spans.append([])
        if t:
            spans[-1].append(tok)
        prev = t
    assert [tokenizer.decode(s) for s in spans] == ["5<|im_end|>", "2<|im_end|>"]


def test_conversations_sharing_a_prefix_are_packed_once_and_match_flat_forwards(
    tokenizer, model_dir: Path  # type: ignore[no-untyped-def]
) -> None:
    from transformers import AutoModelForCausalLM

    rendered = [render_conversation(tokenizer, _conv(a, b)) for a, b in [(2, 3), (2, 4), (7, 1)]]
    mbs = pack_sequences(rendered, micro_batch_tokens=10_000)
    assert len(mbs) == 1
    assert mbs[0].num_tokens < sum(len(r.ids) for r in rendered)
    assert mbs[0].num_targets == sum(sum(r.target) for r in rendered)  # distinct answers: no shared target
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        packed = sorted(packed_logprobs(model, to_tensors(mbs[0])).tolist())
        flat = sorted(
            v
            for r in rendered
            for v, t in zip(flat_logprobs(model, r.ids).tolist(), r.target[1:], strict=True)
            if t
        )
    assert packed == pytest.approx(flat, abs=1e-5)


def test_micro_batch_budget_splits_trees(tokenizer) -> None:  # type: ignore[no-untyped-def]
    rendered = [render_conversation(tokenizer, [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]) for i in range(4)]
    # All ChatML conversations share their first tokens: one tree, split into path-carrying subtrees.
    budget = len(rendered[0].ids) + 1
    mbs = pack_sequences(rendered, micro_batch_tokens=budget)
    assert len(mbs) >= 2
    assert all(mb.num_tokens <= budget for mb in mbs)
    assert sum(mb.num_targets for mb in mbs) == sum(sum(r.target) for r in rendered)
    whole = pack_sequences(rendered, micro_batch_tokens=10_000)
    assert len(whole) == 1
    labels = sorted(int(x) for mb in mbs for x in mb.input_ids[mb.target_pos])
    assert labels == sorted(int(x) for x in whole[0].input_ids[whole[0].target_pos])


def test_bad_jsonl_is_rejected_with_the_line_number(tmp_path: Path) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"messages": _conv(1, 1)}) + "\n" + json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n")
    with pytest.raises(SftDataError, match=":2:.*no assistant turn"):
        load_conversations(p)


def test_gyre_train_sft_lowers_the_loss_and_writes_a_loadable_model(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM

    data = tmp_path / "convs.jsonl"
    data.write_text("\n".join(json.dumps({"messages": _conv(a, b)}) for a in range(3) for b in range(3)) + "\n")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    out = tmp_path / "sft"
    result = CliRunner().invoke(
        train_app,
        ["sft", "--model", str(model_dir), "--data", str(data), "--out", str(out), "--epochs", "6", "--lr", "3e-3",
         "--conversations-per-step", "9"],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 6
    assert summary["last_loss"] < 0.8 * summary["first_loss"]
    # One progress line a step, as the warm start's progress bar reads them.
    progress = [json.loads(line.split(" ", 1)[1]) for line in result.stdout.splitlines() if line.startswith("sft_step ")]
    assert [(p["step"], p["steps"]) for p in progress] == [(i, 6) for i in range(1, 7)]
    AutoModelForCausalLM.from_pretrained(str(out))


def test_gyre_train_run_step_resumes_from_its_checkpoint(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = tmp_path / "ckpt"
    steps = []
    for step in range(2):
        batch = tmp_path / f"batch{step}.gyb"
        batch.write_bytes(make_batch(seed=2, step=step, vocab=500).encode())
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        result = CliRunner().invoke(
            train_app,
            ["run-step", "--model", str(model_dir), "--batch", str(batch), "--checkpoints", str(ckpt),
             "--weights-out", str(tmp_path / "w.safetensors"), "--eps-low", "0.2", "--eps-high", "0.28"],
        )
        assert result.exit_code == 0, result.output
        steps.append(json.loads(result.stdout.strip().splitlines()[-1]))
    assert [s["step"] for s in steps] == [0, 1]
    assert [s["policy_version"] for s in steps] == [1, 2]
    latest = latest_checkpoint(ckpt)
    assert latest is not None and read_trainer_state(latest)["step_count"] == 2
    assert (tmp_path / "w.safetensors").stat().st_size > 0
