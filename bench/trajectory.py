"""Benchmark: build the trajectory tree of a synthetic ~1M-unique-token, 300-call execution and measure
delta storage against storing every call in full. Prints one JSON object as the last line of stdout.

    nice .venv/bin/python bench/trajectory.py [--calls 300] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.trajectory.tree_builder import build_tree  # noqa: E402
from shared.calls import CallRecord, CallTokens, longest_prefix_parent  # noqa: E402
from shared.packing import pack_trees  # noqa: E402

VOCAB = 151_000
COMPACT_AT = 320_000  # tokens of context that trigger a compaction (the harness's context budget)


class Writer:
    """Writes delta call records the way the gateway does (longest shared prefix over recent calls)."""

    def __init__(self) -> None:
        self.records: list[CallRecord] = []
        self.sequences: list[np.ndarray] = []
        self.recent: dict[str, list[int]] = {}
        self.stored_bytes = 0
        self.naive_bytes = 0

    def call(self, prompt: np.ndarray, completion: np.ndarray, chain: str, rng: np.random.Generator) -> np.ndarray:
        # The gateway compares against each chain's recent calls; comparing against all 300 full sequences
        # would make this writer O(calls² × context) and is never needed for a parent that shares anything.
        candidates = sorted({i for ids in self.recent.values() for i in ids[-4:]})
        best, shared = longest_prefix_parent([self.sequences[i] for i in candidates], prompt)
        parent = candidates[best] if best is not None and shared > 0 else None
        shared = shared if parent is not None else 0
        logprobs = -rng.exponential(0.5, completion.shape[0]).astype(np.float32)
        tokens = CallTokens(new_prompt=prompt[shared:].copy(), completion=completion, logprobs=logprobs)
        self.stored_bytes += len(tokens.encode())
        self.naive_bytes += len(CallTokens(new_prompt=prompt, completion=completion, logprobs=logprobs).encode())
        index = len(self.records)
        self.records.append(
            CallRecord("bench", f"call-{index}", index, parent, shared, tokens, policy_version=0, chain_id=chain)
        )
        seq = np.concatenate([prompt, completion])
        self.sequences.append(seq)
        self.recent.setdefault(chain, []).append(index)
        return seq


def text(rng: np.random.Generator, n: int) -> np.ndarray:
    # Zipf-distributed ids look like real text to the compressor.
    return np.minimum(rng.zipf(1.15, n), VOCAB - 1).astype(np.int32)


def synthesize(calls: int, seed: int, compact_at: int = COMPACT_AT) -> Writer:
    rng = np.random.default_rng(seed)
    w = Writer()
    system, task = text(rng, 2000), text(rng, 1000)
    context = np.concatenate([system, task])
    made = 0
    main_calls = 0
    while made < calls:
        roll = rng.random()
        if context.shape[0] > compact_at:
            # compaction: the context passed the harness's budget; restart from system, task and a summary
            context = np.concatenate([system, task, text(rng, 2500)])
            main_calls += 1
        elif made and roll < 0.05:
            # delegation: a sub-agent chain with its own context, then its result goes back to main
            chain = f"agent-{made}"
            sub = np.concatenate([system, text(rng, 600)])
            for _ in range(min(6, calls - made - 1)):
                sub = np.concatenate([w.call(sub, text(rng, int(rng.integers(200, 800))), chain, rng),
                                      text(rng, int(rng.integers(800, 3000)))])
                made += 1
            context = np.concatenate([context, text(rng, 400)])
            if made >= calls:
                break
        elif made and roll < 0.10:
            # retry: re-sample the previous main prompt, continue from the new sample
            prev = w.records[w.recent["main"][-1]]
            prompt = w.sequences[prev.call_index][: prev.prompt_len]
            seq = w.call(prompt, text(rng, int(rng.integers(200, 1200))), "main", rng)
            made += 1
            context = np.concatenate([seq, text(rng, int(rng.integers(600, 4800)))])
            continue
        elif made and roll < 0.12:
            # drift: the harness re-rendered a generated token of the last completion
            last = w.sequences[w.recent["main"][-1]].copy()
            last[-3] = (last[-3] + 1) % VOCAB
            context = np.concatenate([last, text(rng, int(rng.integers(600, 4800)))])
        seq = w.call(context, text(rng, int(rng.integers(200, 1200))), "main", rng)
        made += 1
        main_calls += 1
        context = np.concatenate([seq, text(rng, int(rng.integers(600, 4800)))])
    return w


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compact-at", type=int, default=COMPACT_AT, help="context tokens that trigger compaction")
    args = parser.parse_args()

    writer = synthesize(args.calls, args.seed, args.compact_at)
    times = []
    tree = None
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        tree = build_tree("bench", writer.records)
        times.append(time.perf_counter() - t0)
    assert tree is not None
    stats = tree.stats()
    # correctness spot check: every call's sequence is a root path of the tree
    for i in range(0, len(writer.records), 37):
        assert np.array_equal(tree.tokens[tree.call_positions(i)], writer.sequences[i])
    t0 = time.perf_counter()
    budget = max(65_536, stats.max_depth + 1)
    micro_batches = pack_trees([(tree.token_tree(), 0)], budget)
    pack_s = time.perf_counter() - t0
    build_s = min(times)
    result = {
        "calls": stats.calls,
        "trajectories": stats.trajectories,
        "branches": dict(Counter(c.kind for c in tree.calls)),
        "target_tokens": stats.target_tokens,
        "call_tokens": stats.call_tokens,
        "build_s_per_1m_unique": round(build_s / (stats.unique_tokens / 1e6), 4),
        "pack_s": round(pack_s, 4),
        "micro_batches": len(micro_batches),
        "micro_batch_budget": budget,
        "compact_at": args.compact_at,
        "bench": "trajectory",
        "unique_tokens": stats.unique_tokens,
        "flat_tokens": stats.flat_tokens,
        "dedup_factor": round(stats.flat_tokens / stats.unique_tokens, 3),
        "build_s": round(build_s, 4),
        "stored_bytes": writer.stored_bytes,
        "naive_bytes": writer.naive_bytes,
        "storage_ratio": round(writer.stored_bytes / writer.naive_bytes, 5),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
