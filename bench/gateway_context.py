"""Gateway CPU per model call as an execution's context grows, against rendering and tokenizing the whole
conversation afresh on every call (what a gateway without token-in/token-out does). Prints JSON last.

    .venv/bin/python bench/gateway_context.py [--turns 400 --user-words 2000 --at 50,100,200,400]

One execution converses through the real HTTP app (FastAPI, in process), the real chat template and tokenizer
(the tiny model's), token-in/token-out, the router and the recorder's bookkeeping; the model replies with a
fixed 50-word message (no engine: what is measured is the gateway's own work). At each of `--at` turns the
CPU of a call is timed (this process's, client included: the median over `--repeats` consecutive turns, each
adding one reply and one user message) beside the baseline: render the whole conversation with the chat
template and tokenize all of it, as a gateway without token-in/token-out would for every call. `held_mb` is the
token memory the gateway holds for the execution; `as_copies_mb` what it would hold with every prompt and call
sequence a copy of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._infra import rss_bytes  # noqa: E402

WORDS = ("alpha", "beta", "gamma", "delta", "file", "line", "error", "test", "def", "return", "import", "class")


class _FixedReplies:
    """A worker client answering every call with the same reply (the engine is not what is measured)."""

    def __init__(self, completion: list[int]) -> None:
        self.completion = completion

    async def generate(self, worker_id: str, request: Any, delta: np.ndarray) -> Any:
        from services.rollout.protocol import GenerateReply

        return GenerateReply(status="ok", worker_id=worker_id, cell_id="cell-0", completion=self.completion,
                             logprobs=[-0.5] * len(self.completion), finish_reason="stop",
                             prompt_tokens=request.base_len + request.delta.count, cached_tokens=request.base_len)


def _held_mb(core: Any, execution_id: str) -> tuple[float, float]:
    """Token memory the gateway holds for one execution (its token-in/token-out anchors, its recorder's log of
    call sequences and the router's mirror of the worker's history): every array their views keep alive, the
    ones a buffer outgrew included. And what the same would take with every sequence a copy of its own."""
    anchors = [a.tokens for a in core.executions[execution_id].tito.anchors.values()]
    sequences = list(core.recorder._lines[execution_id].read.log.sequences)
    mirrors = [a for (e, _), m in core.router._mirrors.items() if e == execution_id for a in (m.prompt, m.completion)]
    owners = {}
    for view in [*anchors, *sequences, *mirrors]:
        owner = view if view.base is None else view.base
        owners[id(owner)] = owner
    held = sum(o.nbytes for o in owners.values())
    copies = sum(v.nbytes for v in [*anchors, *sequences, *mirrors])
    return round(held / 2**20, 3), round(copies / 2**20, 3)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    from gyre.tinymodel import tiny_model
    from services.rollout import anthropic_api
    from services.rollout.codec import TokenizerCodec
    from services.rollout.credentials import TokenVerifier
    from services.rollout.gateway import create_app
    from services.rollout.gateway_core import GatewayCore
    from services.rollout.recorder_memory import InMemoryCallRecorder
    from services.rollout.router import Router, WorkerDirectory
    from shared.events import ExecutionStarted
    from shared.execution_tokens import derive_execution_token
    from shared.worker_status import WorkerStatus

    rnd = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="gyre-bench-gw-") as work:
        codec = TokenizerCodec.from_model_dir(tiny_model(Path(work) / "model", seed=0))
    reply_text = " ".join(rnd.choice(WORDS) for _ in range(50))
    directory = WorkerDirectory(stale_after_s=1e9)
    directory.update(WorkerStatus(worker_id="w0", cell_id="cell-0", state="active", live_sessions=0, capacity=8,
                                  in_flight=0, policy_version=0, max_model_len=1 << 30))
    replies = _FixedReplies(codec.encode(reply_text) + [codec.end_of_turn_id])
    secret = b"bench-secret"
    core = GatewayCore(codec=codec, router=Router(directory, replies), recorder=InMemoryCallRecorder(),
                       tokens=TokenVerifier(secret), max_model_len=1 << 30, model_name="tiny")
    # Taken up as the gateway takes up an execution.started: its (empty) log read before its first call.
    core.take_up(ExecutionStarted(execution_id="bench", query_id="q", task_id="t", group_size=1, sample_index=0,
                                  seed=0))
    token = derive_execution_token(secret, "bench")
    at = sorted(int(x) for x in args.at.split(","))
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Task: build the repository."}]
    points = []
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(core)),
                                 base_url="http://gateway", headers={"x-api-key": token}) as client:

        def request() -> dict[str, Any]:
            return {"model": "tiny", "max_tokens": 64, "system": "You are a careful agent.", "messages": messages}

        async def call() -> tuple[float, int, dict[str, Any]]:
            body = json.dumps(request())
            started = time.process_time()
            response = await client.post("/v1/messages", content=body, headers={"content-type": "application/json"})
            spent = time.process_time() - started
            response.raise_for_status()
            out = response.json()
            usage = out["usage"]
            return spent, int(usage["input_tokens"]) + int(usage.get("cache_read_input_tokens") or 0), out

        spent: list[float] = []
        for turn in range(1, at[-1] + args.repeats):
            s, prompt_tokens, out = await call()
            # A point times the calls of `repeats` consecutive turns starting at it, each with one new message.
            if any(t <= turn < t + args.repeats for t in at):
                spent.append(s)
            if turn + 1 - args.repeats in at:
                conversation = anthropic_api.parse_request(request()).conversation  # the last timed call's
                naive = []
                for _ in range(args.repeats):
                    started = time.process_time()
                    codec.encode(codec.render(conversation, add_generation_prompt=True))
                    naive.append(time.process_time() - started)
                held_mb, as_copies_mb = _held_mb(core, "bench")
                points.append({"turn": turn + 1 - args.repeats, "prompt_tokens": prompt_tokens,
                               "body_mb": round(len(json.dumps(messages)) / 1e6, 2),
                               "gateway_ms": round(1000 * statistics.median(spent), 1),
                               "held_mb": held_mb, "as_copies_mb": as_copies_mb,
                               "rss_mb": round(rss_bytes(os.getpid()) / 2**20),
                               "render_and_tokenize_ms": round(1000 * statistics.median(naive), 1)})
                spent = []
                print(json.dumps(points[-1]), flush=True)
            messages += [{"role": "assistant", "content": out["content"]},
                         {"role": "user", "content": " ".join(rnd.choice(WORDS) for _ in range(args.user_words))}]
    last = points[-1]
    return {"bench": "gateway_context", "prompt_tokens": last["prompt_tokens"], "gateway_ms": last["gateway_ms"],
            "render_and_tokenize_ms": last["render_and_tokenize_ms"],
            "speedup": round(last["render_and_tokenize_ms"] / last["gateway_ms"], 2), "held_mb": last["held_mb"],
            "as_copies_mb": last["as_copies_mb"], "points": points}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--user-words", type=int, default=2000, help="words in each user (tool result) message")
    parser.add_argument("--at", default="25,50,100,200,400", help="turns at which a call is timed")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
