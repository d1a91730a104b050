"""Test helpers: a small DFS packer that turns hand-made trajectories into shared/batch.py MicroBatches,
plus tiny Qwen3/Qwen2/Llama models. Independent of services/trajectory on purpose.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from shared.batch import ExecutionEntry, MicroBatch, TrainingBatch


@dataclass
class Step:
    """One token on a trajectory: id, whether the policy generated it, and its behaviour logprob."""

    token: int
    target: bool
    mu: float = -1.0
    version: int = 0


@dataclass
class _Node:
    token: int
    target: bool = False
    mu: float = 0.0
    version: int = 0
    children: dict[int, _Node] = field(default_factory=dict)


@dataclass(frozen=True)
class Trajectory:
    execution: int
    steps: list[Step]


def pack(trajs: list[Trajectory]) -> tuple[MicroBatch, list[list[int]]]:
    """Pack trajectories (grouped into one trie per execution) into one micro-batch.

    Returns the micro-batch and, per trajectory, the packed position of each of its tokens.
    """
    roots: dict[tuple[int, int], _Node] = {}
    order: list[tuple[int, int]] = []
    for tr in trajs:
        first = tr.steps[0]
        key = (tr.execution, first.token)
        if key not in roots:
            roots[key] = _Node(first.token)
            order.append(key)
        node = roots[key]
        for st in tr.steps[1:]:
            child = node.children.get(st.token)
            if child is None:
                child = node.children[st.token] = _Node(st.token)
            if st.target and not child.target:
                child.target, child.mu, child.version = True, st.mu, st.version
            node = child
    ids: list[int] = []
    depth: list[int] = []
    ends: list[int] = []
    tpos: list[int] = []
    ppos: list[int] = []
    mus: list[float] = []
    vers: list[int] = []
    texec: list[int] = []
    where: dict[int, int] = {}  # id(node) -> position

    def visit(node: _Node, d: int, parent: int, execution: int) -> None:
        pos = len(ids)
        where[id(node)] = pos
        ids.append(node.token)
        depth.append(d)
        ends.append(-1)
        if node.target and parent >= 0:
            tpos.append(pos)
            ppos.append(parent)
            mus.append(node.mu)
            vers.append(node.version)
            texec.append(execution)
        for tok in sorted(node.children):
            visit(node.children[tok], d + 1, pos, execution)
        ends[pos] = len(ids)

    for key in order:
        visit(roots[key], 0, -1, key[0])
    positions = []
    for tr in trajs:
        node = roots[(tr.execution, tr.steps[0].token)]
        path = [where[id(node)]]
        for st in tr.steps[1:]:
            node = node.children[st.token]
            path.append(where[id(node)])
        positions.append(path)
    mb = MicroBatch(
        input_ids=np.array(ids, dtype=np.int32),
        position_ids=np.array(depth, dtype=np.int32),
        subtree_end=np.array(ends, dtype=np.int32),
        target_pos=np.array(tpos, dtype=np.int32),
        pred_pos=np.array(ppos, dtype=np.int32),
        behaviour_logprob=np.array(mus, dtype=np.float32),
        policy_version=np.array(vers, dtype=np.int32),
        target_exec=np.array(texec, dtype=np.int32),
    )
    return mb, positions


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


def pack_groups(trajs: list[Trajectory], groups: list[list[int]]) -> list[MicroBatch]:
    """Pack groups of trajectories into separate micro-batches; a target already trained by an earlier
    micro-batch stays as context in later ones (so an execution spans micro-batches, each target once)."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    out = []
    for group in groups:
        sub = [trajs[i] for i in group]
        mb, positions = pack(sub)
        key_of: dict[int, tuple[int, tuple[int, ...]]] = {}
        for tr, path in zip(sub, positions, strict=True):
            toks = tuple(s.token for s in tr.steps)
            for i, p in enumerate(path):
                key_of.setdefault(p, (tr.execution, toks[: i + 1]))
        keep = []
        for j, p in enumerate(mb.target_pos):
            key = key_of[int(p)]
            if key not in seen:
                seen.add(key)
                keep.append(j)
        k = np.array(keep, dtype=np.int64)
        out.append(
            MicroBatch(
                input_ids=mb.input_ids,
                position_ids=mb.position_ids,
                subtree_end=mb.subtree_end,
                target_pos=mb.target_pos[k],
                pred_pos=mb.pred_pos[k],
                behaviour_logprob=mb.behaviour_logprob[k],
                policy_version=mb.policy_version[k],
                target_exec=mb.target_exec[k],
            )
        )
    return out


def make_batch(seed: int, step: int, *, executions: int = 4, branches: int = 4, vocab: int = 97) -> TrainingBatch:
    """A deterministic batch whose executions span several micro-batches of uneven size."""
    rng = np.random.default_rng([seed, step])
    trajs = random_trajectories(rng, executions=executions, branches=branches, vocab=vocab)
    groups: list[list[int]] = [[], [], [], [], []]
    for i in range(len(trajs)):
        groups[int(rng.integers(len(groups)))].append(i)
    groups = [g for g in groups if g]
    mbs = pack_groups(trajs, groups)
    adv = rng.standard_normal(executions).round(3).tolist()
    return training_batch(mbs, adv, step=step)
