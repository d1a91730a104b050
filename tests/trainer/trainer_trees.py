"""Test helpers: hand-made branched trajectories packed into shared/batch.py MicroBatches with the shared tree
builder and packer (shared/token_tree.py, shared/packing.py), plus tiny Qwen3/Qwen2/Llama models. The tests'
oracle stays independent of both: flat per-trajectory forwards (`flat_logprobs`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from shared.batch import ExecutionEntry, MicroBatch, TrainingBatch
from shared.packing import Piece, assemble, pack_trees, split_tree
from shared.token_tree import SequenceTree, tree_from_sequences


@dataclass
class Step:
    """One token on a trajectory: id, whether the policy generated it, and its behaviour logprob."""

    token: int
    target: bool
    mu: float = -1.0
    version: int = 0


@dataclass(frozen=True)
class Trajectory:
    execution: int
    steps: list[Step]


def execution_trees(trajs: list[Trajectory]) -> list[tuple[SequenceTree, int]]:
    """One token tree per execution (in order of first appearance), built by the shared builder."""
    by_exec: dict[int, list[Trajectory]] = {}
    for tr in trajs:
        by_exec.setdefault(tr.execution, []).append(tr)
    return [
        (
            tree_from_sequences(
                [[s.token for s in tr.steps] for tr in group],
                [[s.target for s in tr.steps] for tr in group],
                logprobs=[[s.mu for s in tr.steps] for tr in group],
                policy_versions=[[s.version for s in tr.steps] for tr in group],
                name=f"execution {execution}",
            ),
            execution,
        )
        for execution, group in by_exec.items()
    ]


def pack(trajs: list[Trajectory]) -> tuple[MicroBatch, list[list[int]]]:
    """Pack trajectories (merged into one tree per execution) into one micro-batch, whole trees side by side.

    Returns the micro-batch and, per trajectory, the packed position of each of its tokens.
    """
    pieces: list[Piece] = []
    positions_of: dict[int, Iterator[np.ndarray]] = {}
    offset = 0
    for built, execution in execution_trees(trajs):
        n = built.tree.num_tokens
        pieces += split_tree(built.tree, execution, max(n, 1))  # the whole tree, as one piece
        positions_of[execution] = iter([p + offset for p in built.positions])
        offset += n
    return assemble(pieces), [next(positions_of[tr.execution]).tolist() for tr in trajs]


def random_trajectories(
    rng: np.random.Generator, *, executions: int, branches: int, vocab: int, prefix: int = 12, suffix: int = 8
) -> list[Trajectory]:
    """Executions that branch: a shared prefix, then retries/continuations that diverge at random points."""
    out = []
    for e in range(executions):
        base = [Step(int(rng.integers(vocab)), bool(rng.random() < 0.5), float(-rng.random() * 3)) for _ in range(prefix)]
        base[0].target = False
        trajs = [base]
        for _ in range(branches - 1):
            parent = trajs[int(rng.integers(len(trajs)))]
            cut = int(rng.integers(1, len(parent)))
            tail = [Step(int(rng.integers(vocab)), bool(rng.random() < 0.7), float(-rng.random() * 3)) for _ in range(suffix)]
            trajs.append(parent[:cut] + tail)
        out.extend(Trajectory(e, t) for t in trajs)
    return out


def training_batch(mbs: list[MicroBatch], advantages: list[float], step: int = 0) -> TrainingBatch:
    counts = np.zeros(len(advantages), dtype=np.int64)
    for mb in mbs:
        np.add.at(counts, mb.target_exec, 1)
    executions = [
        ExecutionEntry(execution_id=f"e{i}", query_id="q0", reward=a, advantage=a, num_targets=int(counts[i]))
        for i, a in enumerate(advantages)
    ]
    return TrainingBatch(step=step, executions=executions, micro_batches=mbs)


def tiny_model(arch: str = "qwen3", *, vocab: int = 97, seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    match arch:
        case "qwen3":
            model = Qwen3ForCausalLM(Qwen3Config(head_dim=32, **common))
        case "qwen2":
            model = Qwen2ForCausalLM(Qwen2Config(**common))
        case "llama":
            model = LlamaForCausalLM(LlamaConfig(head_dim=32, **common))
        case _:
            raise ValueError(f"unknown arch {arch!r}")
    return model.float()


def flat_logprobs(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """logprob of tokens[i] given tokens[:i], for i >= 1, from a plain causal forward: [len - 1]."""
    ids = torch.tensor([tokens])
    model.config._attn_implementation = "sdpa"
    logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)


def make_batch(seed: int, step: int, *, executions: int = 4, branches: int = 4, vocab: int = 97) -> TrainingBatch:
    """A deterministic batch whose executions span several micro-batches of uneven size: the shared packer with
    a budget just above the longest trajectory, so trees are cut into ranges that carry their ancestors."""
    rng = np.random.default_rng([seed, step])
    trajs = random_trajectories(rng, executions=executions, branches=branches, vocab=vocab)
    budget = max(len(tr.steps) for tr in trajs) + 8
    mbs = pack_trees([(built.tree, execution) for built, execution in execution_trees(trajs)], budget)
    adv = rng.standard_normal(executions).round(3).tolist()
    return training_batch(mbs, adv, step=step)
