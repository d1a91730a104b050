"""Benchmark: one GSPO training step tree-packed vs flat-padded on the same branched batch, same run.

Timing: both variants in one process with their steps interleaved (the machine's load hits both alike);
peak memory: each variant in a process of its own. The last stdout line is the JSON result.
    python bench/trainer.py [--executions 4 --prefix 384 --branches 6 --branch-len 64 --steps 3]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.trainer.loss import GspoConfig, gspo_loss  # noqa: E402
from services.trainer.packed_forward import packed_logprobs, to_tensors  # noqa: E402
from shared.batch import MicroBatch  # noqa: E402
from shared.packing import pack_trees  # noqa: E402
from shared.token_tree import tree_from_sequences  # noqa: E402

VOCAB = 4096


def make_model(seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg).float()


def make_data(args: argparse.Namespace) -> dict[str, Any]:
    """Per execution: a shared prefix (context, then policy output) and branches (retries) after it."""
    rng = np.random.default_rng(0)
    trajectories = []  # (execution, tokens, target flags, mu)
    for e in range(args.executions):
        prefix = rng.integers(0, VOCAB, args.prefix).tolist()
        prefix_target = [i >= args.prefix // 2 for i in range(args.prefix)]  # second half: generated turns
        prefix_mu = (-rng.random(args.prefix) * 3).tolist()
        for _ in range(args.branches):
            tail = rng.integers(0, VOCAB, args.branch_len).tolist()
            trajectories.append(
                (
                    e,
                    prefix + tail,
                    prefix_target + [True] * args.branch_len,
                    prefix_mu + (-rng.random(args.branch_len) * 3).tolist(),
                )
            )
    return {"trajectories": trajectories, "executions": args.executions}


def tree_micro_batches(data: dict[str, Any], budget: int) -> list[MicroBatch]:
    """Each execution's branches merged into one token tree, packed by the shared packer (first-fit-decreasing
    into micro-batches of at most `budget` tokens), as the trajectory service packs its batches."""
    by_exec: dict[int, list[Any]] = {}
    for e, toks, tgt, mu in data["trajectories"]:
        by_exec.setdefault(e, []).append((toks, tgt, mu))
    trees = [
        (tree_from_sequences([t[0] for t in trajs], [t[1] for t in trajs], logprobs=[t[2] for t in trajs]).tree, e)
        for e, trajs in sorted(by_exec.items())
    ]
    return pack_trees(trees, budget)


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _tree_logprobs(model: torch.nn.Module, mbs: list[MicroBatch]) -> list[torch.Tensor]:
    return [packed_logprobs(model, to_tensors(mb)) for mb in mbs]


def _flat_logprobs(model: torch.nn.Module, data: dict[str, Any], per_mb: int) -> list[tuple[torch.Tensor, list[int]]]:
    """Padded [B, Lmax] causal forwards, lm_head only at the target rows. Returns (logprobs, execution per row)."""
    trajs = data["trajectories"]
    out = []
    for start in range(0, len(trajs), per_mb):
        chunk = trajs[start : start + per_mb]
        lmax = max(len(t[1]) for t in chunk)
        ids = torch.zeros(len(chunk), lmax, dtype=torch.long)
        attn = torch.zeros(len(chunk), lmax, dtype=torch.long)
        for b, (_, toks, _, _) in enumerate(chunk):
            ids[b, : len(toks)] = torch.tensor(toks)
            attn[b, : len(toks)] = 1
        rows, cols, execs = [], [], []
        for b, (e, toks, tgt, _) in enumerate(chunk):
            for j in range(1, len(toks)):
                if tgt[j]:
                    rows.append(b); cols.append(j); execs.append(e)  # noqa: E702
        model.config._attn_implementation = "sdpa"
        hidden = model.model(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state
        r, c = torch.tensor(rows), torch.tensor(cols)
        logits = model.lm_head(hidden[r, c - 1]).float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[r, c][:, None]).squeeze(-1)
        out.append((lp, execs))
    return out


class _Variant:
    """One model + optimiser training on the batch either tree-packed or flat-padded."""

    def __init__(self, kind: str, args: argparse.Namespace) -> None:
        self.kind = kind
        self.args = args
        self.model = make_model()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-6)
        self.data = make_data(args)
        self.mbs = tree_micro_batches(self.data, args.micro_batch_tokens)
        # Flat rows per micro-batch: the same token budget, in padded sequences.
        self.rows = max(1, args.micro_batch_tokens // max(len(t[1]) for t in self.data["trajectories"]))
        self.num_exec = self.data["executions"]
        self.adv = torch.linspace(-1, 1, self.num_exec)

    def step(self) -> None:
        cfg = GspoConfig()
        n = self.num_exec
        if self.kind == "tree":
            counts = torch.zeros(n, dtype=torch.long)
            for mb in self.mbs:
                counts += torch.bincount(torch.from_numpy(mb.target_exec.astype(np.int64)), minlength=n)
            for mb in self.mbs:
                t = to_tensors(mb)
                lp = packed_logprobs(self.model, t)
                mu = t.behaviour_logprob
                gspo_loss(lp, mu, mu, t.target_exec, self.adv, counts, num_executions=n, config=cfg).loss.backward()
        else:
            # Flat: every trajectory's targets, shared ones repeated, as flat training computes them.
            for lp, execs in _flat_logprobs(self.model, self.data, self.rows):
                e = torch.tensor(execs)
                counts = torch.bincount(e, minlength=n)
                d = lp.detach()
                gspo_loss(lp, d, d, e, self.adv, counts, num_executions=n, config=cfg).loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    @torch.no_grad()
    def logprobs(self) -> list[list[float]]:
        if self.kind == "tree":
            return [v.tolist() for v in _tree_logprobs(self.model, self.mbs)]
        return [v[0].tolist() for v in _flat_logprobs(self.model, self.data, self.rows)]


def _timing(args: argparse.Namespace, conn: Any) -> None:
    """Both variants in one process, steps interleaved, so both see the same machine load."""
    tree, flat = _Variant("tree", args), _Variant("flat", args)
    values = {"tree": tree.logprobs(), "flat": flat.logprobs()}
    tree.step()  # warm-up (allocator, first-call costs)
    flat.step()
    wall: dict[str, list[float]] = {"tree": [], "flat": []}
    cpu: dict[str, list[float]] = {"tree": [], "flat": []}
    for _ in range(args.steps):
        for v in (tree, flat):
            t0, c0 = time.perf_counter(), time.process_time()
            v.step()
            wall[v.kind].append(time.perf_counter() - t0)
            cpu[v.kind].append(time.process_time() - c0)
    conn.send({"wall": wall, "cpu": cpu, "logprobs": values})
    conn.close()


def _memory(kind: str, args: argparse.Namespace, conn: Any) -> None:
    """Peak resident memory one step adds, in a process of its own."""
    v = _Variant(kind, args)
    base = _peak_mb()
    v.step()
    conn.send({"peak_mb": max(_peak_mb() - base, 0.0)})
    conn.close()


def _run(target: Any, *args: Any) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=target, args=(*args, child))
    p.start()
    result = parent.recv()
    p.join()
    return result  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--executions", type=int, default=4)
    ap.add_argument("--prefix", type=int, default=384)
    ap.add_argument("--branches", type=int, default=6)
    ap.add_argument("--branch-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--micro-batch-tokens", type=int, default=4096)
    args = ap.parse_args()

    data = make_data(args)
    mbs = tree_micro_batches(data, args.micro_batch_tokens)
    unique = sum(mb.num_tokens for mb in mbs)
    flat = sum(len(t[1]) for t in data["trajectories"])
    timing = _run(_timing, args)
    tree_mem = _run(_memory, "tree", args)
    flat_mem = _run(_memory, "flat", args)
    tree = {"step_s": statistics.median(timing["wall"]["tree"]), "logprobs": timing["logprobs"]["tree"]}
    flat_res = {"step_s": statistics.median(timing["wall"]["flat"]), "logprobs": timing["logprobs"]["flat"]}
    tree_cpu = statistics.median(timing["cpu"]["tree"])
    flat_cpu = statistics.median(timing["cpu"]["flat"])

    # Logprob agreement: the flat value of each target (first trajectory holding it) vs the packed one.
    packed_by_key: dict[tuple[int, tuple[int, ...]], float] = {}
    for mb, values in zip(mbs, tree["logprobs"], strict=True):
        # Recover each target's path (its ancestors-or-self) from subtree_end.
        ids = mb.input_ids.tolist()
        ends = mb.subtree_end.tolist()
        for tpos, e, v in zip(mb.target_pos.tolist(), mb.target_exec.tolist(), values, strict=True):
            path = [k for k in range(tpos + 1) if tpos < ends[k]]
            packed_by_key[(e, tuple(ids[k] for k in path))] = v
    diff = 0.0
    trajs = data["trajectories"]
    rows = iter(v for chunk in flat_res["logprobs"] for v in chunk)
    for e, toks, tgt, _ in trajs:
        for j in range(1, len(toks)):
            if tgt[j]:
                diff = max(diff, abs(next(rows) - packed_by_key[(e, tuple(toks[: j + 1]))]))
    print(
        f"tree step {tree['step_s']:.3f}s, flat step {flat_res['step_s']:.3f}s, dedup {flat / unique:.2f}",
        file=sys.stderr,
    )
    result = {
        "bench": "trainer",
        "dedup_factor": round(flat / unique, 3),
        "flat_step_s": round(flat_res["step_s"], 4),
        "tree_step_s": round(tree["step_s"], 4),
        "speedup": round(flat_res["step_s"] / tree["step_s"], 3),
        "flat_peak_mb": round(flat_mem["peak_mb"], 1),
        "tree_peak_mb": round(tree_mem["peak_mb"], 1),
        "logprob_max_abs_diff": diff,
        "flat_cpu_s": round(flat_cpu, 4),
        "tree_cpu_s": round(tree_cpu, 4),
        "cpu_speedup": round(flat_cpu / tree_cpu, 3),
        "unique_tokens": unique,
        "flat_tokens": flat,
        "config": vars(args),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
