"""Resume a live session on another worker by moving its KV over NATS, against recomputing it there.

Two rollout workers (real vLLM engines, each with its own KV folder: nothing shared but the bus) serve one
session per prompt length. At each length the session moves A → B by KV (saved by A's connector, packed,
sent through the bus's Object Store, staged and loaded by B's connector), then back B → A by recompute (A's
prefix cache emptied first, so A prefills the whole history), each through the worker's own move path
(`RolloutWorker.move_execution`), after one unmeasured round at 1K tokens (a running worker has moved KV
before). Then a drain of a cell holding several sessions, both ways. The next call
after each move says how much of its prompt the engine took from cache (the re-prefill avoided).

    python bench/kv_migration.py [--lengths 4096,16384,65536] [--model-size tiny|wide] [--drain-sessions 4]
    python bench/kv_migration.py --connector nixl --dtype bfloat16 --model-dir …   # a node with two GPUs

Last line: JSON with `speedup_<n>k` (recompute seconds ÷ transfer seconds) at each length and
`shared_folder: false`; the line before it has the details.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._infra import servers  # noqa: E402


class _Peers:
    """The two workers as each other's peers, in this process (the KV itself goes through NATS)."""

    def __init__(self) -> None:
        self.workers: dict[str, Any] = {}

    def candidates(self, exclude: str) -> list[Any]:
        return [w.status() for wid, w in sorted(self.workers.items()) if wid != exclude]

    async def adopt(self, target: str, request: Any, history: np.ndarray) -> Any:
        return await self.workers[target].adopt(request, history)


def _greedy(tokens: int) -> Any:
    from services.rollout.protocol import SamplingSpec

    return SamplingSpec(max_tokens=tokens, temperature=0.0)


async def _call(worker: Any, execution_id: str, history: np.ndarray, delta: np.ndarray,
                request_id: str) -> tuple[Any, float]:
    """One call of the session on `worker`: its history as the base (the worker holds it), `delta` new."""
    from services.rollout.protocol import GenerateRequest, TokenPayload, tokens_digest

    request = GenerateRequest(request_id=request_id, execution_id=execution_id, base_len=len(history),
                              base_digest=tokens_digest(history) if len(history) else "",
                              delta=TokenPayload(count=len(delta)), sampling=_greedy(1))
    started = time.perf_counter()
    reply = await worker.generate(request, delta)
    if reply.status != "ok":
        raise RuntimeError(f"call {request_id} on {worker.worker_id}: {reply.status} {reply.detail}")
    return reply, time.perf_counter() - started


async def _session_round(wa: Any, wb: Any, length: int, rep: int, rng: np.random.Generator) -> dict[str, Any]:
    """Start a session of `length` tokens on A, move it to B by KV, call; move it back by recompute, call."""
    eid = f"s{length}-{rep}"
    history = rng.integers(10, 4000, size=length).astype(np.int32)
    await wa.engine.reset_prefix_cache()
    await wb.engine.reset_prefix_cache()
    first, first_s = await _call(wa, eid, history[:0], history, f"{eid}-first")
    held = wa.sessions[(eid, "main")].history

    [kv] = await wa.move_execution(eid, wb.cell_id, method="kv")
    if kv.method != "kv":
        raise RuntimeError(f"the KV move fell back to recompute: {kv.fallback}")
    delta = rng.integers(10, 4000, size=16).astype(np.int32)
    after_kv, after_kv_s = await _call(wb, eid, held, delta, f"{eid}-after-kv")
    held = wb.sessions[(eid, "main")].history

    await wa.engine.reset_prefix_cache()  # A prefills it all again: what a target without the KV does
    [rc] = await wb.move_execution(eid, wa.cell_id, method="recompute")
    delta = rng.integers(10, 4000, size=16).astype(np.int32)
    after_rc, after_rc_s = await _call(wa, eid, held, delta, f"{eid}-after-recompute")
    wa.end_sessions(eid)
    wb.end_sessions(eid)
    return {
        "tokens": len(held),
        "first_call_s": round(first_s, 4),
        "kv_s": round(kv.seconds, 4),
        "kv_bytes": kv.bytes,
        "kv_loaded_tokens": kv.cached_tokens,  # prefill the target skipped when adopting it
        "kv_phases": kv.phases,
        "recompute_s": round(rc.seconds, 4),
        "next_call_after_kv": {"s": round(after_kv_s, 4), "prompt_tokens": after_kv.prompt_tokens,
                               "cached_tokens": after_kv.cached_tokens},
        "next_call_after_recompute": {"s": round(after_rc_s, 4), "prompt_tokens": after_rc.prompt_tokens,
                                      "cached_tokens": after_rc.cached_tokens},
    }


async def _drain_round(wa: Any, wb: Any, sessions: int, tokens: int, rng: np.random.Generator) -> dict[str, Any]:
    """A cell holding `sessions` sessions drains to the other by KV; the other drains them back by recompute."""
    from services.rollout.protocol import DrainRequest

    await wa.engine.reset_prefix_cache()
    await wb.engine.reset_prefix_cache()
    ids = [f"drain-{i}" for i in range(sessions)]
    await asyncio.gather(*(_call(wa, eid, np.zeros(0, dtype=np.int32),
                                 rng.integers(10, 4000, size=tokens).astype(np.int32), f"{eid}-first")
                           for eid in ids))
    wb.state = "active"
    kv = await wa.drain(DrainRequest(targets=(wb.worker_id,), force_method="kv"))
    await wa.engine.reset_prefix_cache()
    wa.state = "active"
    rc = await wb.drain(DrainRequest(targets=(wa.worker_id,), force_method="recompute"))
    wb.state = "active"
    for eid in ids:
        wa.end_sessions(eid)
        wb.end_sessions(eid)
    if not (kv.ok and rc.ok):
        raise RuntimeError(f"a drain left sessions behind: {kv.detail} {rc.detail}")
    return {
        "sessions": sessions,
        "tokens_each": tokens,
        "kv_s": round(kv.seconds, 4),
        "kv_methods": sorted({m.method for m in kv.migrated}),
        "kv_bytes": sum(m.bytes for m in kv.migrated),
        "kv_loaded_tokens": sum(m.cached_tokens for m in kv.migrated),
        "recompute_s": round(rc.seconds, 4),
        "speedup": round(rc.seconds / kv.seconds, 3),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from gyre.tinymodel import tiny_model
    from services.rollout.engine import VllmConfig, VllmEngine
    from services.rollout.engine_environment import default_kv_storage, prepare_cpu_environment
    from services.rollout.transport import NatsKvTransport
    from services.rollout.worker import RolloutWorker
    from shared.bus import Bus

    lengths = [int(n) for n in args.lengths.split(",")]
    work = Path(tempfile.mkdtemp(prefix="gyre-bench-kv-"))
    prepare_cpu_environment(work / "vllm")
    model_dir = Path(args.model_dir) if args.model_dir else tiny_model(work / "model", seed=0,
                                                                             size=args.model_size)
    max_len = max(lengths) + 512
    details: dict[str, Any] = {"lengths": {}, "model": args.model_dir or f"created here, size {args.model_size}",
                               "max_model_len": max_len}
    with servers() as infra:
        bus = await Bus.connect(infra.nats_url, prefix=f"bench-kv-{os.getpid()}")
        engines = []
        for i, name in enumerate("ab"):
            if args.connector == "nixl":
                # GPU nodes: one GPU and one NIXL side channel per engine (the engine process inherits these).
                os.environ["CUDA_VISIBLE_DEVICES"] = str(i)
                os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(args.nixl_port + i)
            engines.append(VllmEngine.start(VllmConfig(
                model=model_dir, max_model_len=max_len, dtype=args.dtype, kv_connector=args.connector,
                # Each worker's own folder, where a worker puts it by default (shared memory where the node has
                # room: services.rollout.engine.default_kv_storage).
                kv_storage=default_kv_storage(work, f"bench-kv-{os.getpid()}", f"w-{name}")
                if args.connector == "gyre" else None)))
        try:
            peers = _Peers()
            transport = NatsKvTransport(bus.kv_objects)
            wa, wb = (RolloutWorker(e, worker_id=f"w-{n}", cell_id=f"cell-{n}", peers=peers, kv_transport=transport)
                      for e, n in zip(engines, "ab", strict=True))
            peers.workers = {wa.worker_id: wa, wb.worker_id: wb}
            details["shared_folder"] = engines[0].config.kv_storage is not None and \
                engines[0].config.kv_storage == engines[1].config.kv_storage
            details["connector"] = args.connector
            details["kv_storage"] = [str(e.config.kv_storage) for e in engines]  # each worker's own
            for e in engines:
                await e.warm_up()
            # One unmeasured round first, as a worker that has run a while has moved KV before: the first move
            # pays once for the KV bucket, its consumers and each engine's first save and load (0.23-0.25 s of
            # a 16K move's 0.16-0.20 s steady state on this machine).
            details["warm_up"] = await _session_round(wa, wb, 1024, -1, np.random.default_rng(args.seed + 1))
            rng = np.random.default_rng(args.seed)
            for length in lengths:
                rounds = [await _session_round(wa, wb, length, rep, rng)
                          for rep in range(args.repeats if length <= 16384 else 1)]
                kv_s = float(np.median([r["kv_s"] for r in rounds]))
                rc_s = float(np.median([r["recompute_s"] for r in rounds]))
                details["lengths"][str(length)] = {"kv_s": kv_s, "recompute_s": rc_s, "rounds": rounds}
                print(json.dumps({"length": length, "kv_s": kv_s, "recompute_s": rc_s,
                                  "speedup": round(rc_s / kv_s, 3)}), flush=True)
            if args.drain_sessions:
                details["drain"] = await _drain_round(wa, wb, args.drain_sessions, args.drain_tokens, rng)
        finally:
            for e in engines:
                await e.close()
            await bus.js.delete_object_store(bus.kv_objects.bucket)
            await bus.close()
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"details": details}))
    out: dict[str, Any] = {"bench": "kv_migration", "model": args.model_dir or args.model_size,
                           "connector": args.connector, "shared_folder": details["shared_folder"]}
    for length in lengths:
        d = details["lengths"][str(length)]
        key = f"{length // 1024}k" if length % 1024 == 0 else str(length)
        out[f"speedup_{key}"] = round(d["recompute_s"] / d["kv_s"], 3)
        out[f"kv_s_{key}"] = round(d["kv_s"], 4)
        out[f"recompute_s_{key}"] = round(d["recompute_s"], 4)
        out[f"bytes_{key}"] = d["rounds"][0]["kv_bytes"]
        out[f"prefill_avoided_{key}"] = d["rounds"][0]["kv_loaded_tokens"]
    if "drain" in details:
        out["drain_speedup"] = details["drain"]["speedup"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096,16384,65536", help="session lengths in tokens, comma-separated")
    parser.add_argument("--repeats", type=int, default=5, help="rounds at each length up to 16K (one above)")
    parser.add_argument("--drain-sessions", type=int, default=4)
    parser.add_argument("--drain-tokens", type=int, default=4096)
    parser.add_argument("--model-dir", default="", help="a local model (default: one created here, --model-size)")
    parser.add_argument("--model-size", default="tiny", choices=["tiny", "small", "wide"],
                        help="the created model: tiny (the demo's) or wide (a real model's compute per KV byte, "
                             "within 5×)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", help="the engines' dtype (fp32 on CPU; bfloat16 on GPUs)")
    parser.add_argument("--connector", default="gyre", choices=["gyre", "nixl"],
                        help="gyre: the KV itself over NATS; nixl (two GPUs): blocks device to device, only their "
                             "descriptor over NATS")
    parser.add_argument("--nixl-port", type=int, default=5600, help="first NIXL side-channel port (nixl only)")
    print(json.dumps(asyncio.run(run(parser.parse_args()))))


if __name__ == "__main__":
    main()
