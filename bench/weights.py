"""Weight sync: from a step's end (the full state dict in the trainer's hands) to every rollout worker serving
the new version, through the NATS Object Store, against copying the same bytes file to file on this machine.

A model of realistic size for this machine is created here (about 0.5 B parameters, bf16: `tiny_model
size="half"`). Each round perturbs every weight (as a step does, so every shard is new), then times the path a
publication takes in a run, with the code a run uses: encode the layer-aligned shards in the publish dtype
(shared/weights.py), store them and their manifest (services/trainer/rank.py `store_publication`), and on every
worker — a real vLLM engine each — fetch and decode them while it serves (services/rollout/weights_fetch.py),
then swap them in (`RolloutWorker.apply_weights`, the generation pause). The baseline copies one file holding
the same bytes to another (`shutil.copyfile`, the page cache warm, no fsync: the cheapest copy there is).

    python bench/weights.py [--size half] [--workers 1] [--rounds 3] [--shard-mb 256] [--handoff | --stream]

`--handoff`: the same-node handoff (rank 0 also writes the shards to a node-local folder, the worker on that
node hands them to its engine; the Object Store is still written, as the path of record).
`--stream`: the weights stream (rank 0 holds the shards and sends them over gloo to each worker, into the files
its engine loads at the swap; the Object Store is still written, as the path of record).

Last line: JSON with `model_bytes`, `publish_to_served_s`, `raw_copy_s` and `ratio` (the first ÷ the second),
medians over the rounds; the line before it has every round's phases.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._infra import servers  # noqa: E402


async def _serve(worker: Any, blobs: Any, published: Any, stage: Path, node: str,
                 stream: bool) -> dict[str, float]:
    """What a worker does on `weights.published`: fetch while serving (staging the shards as files its engine
    reads, or taking rank 0's own on the same node), then swap (the pause); or with the stream, pull the shards
    into its engine at the swap."""
    from services.rollout.weights_fetch import fetch_weights

    fetched = await fetch_weights(blobs, published, stage_dir=stage, node=node,
                                  stream_timeout_s=60.0 if stream else None)
    assert fetched.handoff == bool(node), "the handoff was asked for and not taken, or the other way round"
    assert (fetched.via == "stream") == stream, "the stream was asked for and not taken, or the other way round"
    try:
        swap = await worker.apply_weights(published.version, fetched.weights)
    finally:
        fetched.discard()
    assert swap is not None, f"{worker.worker_id} did not load version {published.version}"
    return {"fetch_s": fetched.fetch_s, **swap, "served_at": time.perf_counter()}


def _raw_copy_s(data: list[bytes], work: Path) -> float:
    src, dst = work / "weights.bin", work / "weights-copy.bin"
    with open(src, "wb") as f:
        for chunk in data:
            f.write(chunk)
    shutil.copyfile(src, dst)  # once untimed: both files' pages are in the cache, as a trainer's would be
    dst.unlink()
    started = time.perf_counter()
    shutil.copyfile(src, dst)
    seconds = time.perf_counter() - started
    src.unlink()
    dst.unlink()
    return seconds


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file

    from gyre.tinymodel import tiny_model
    from services.rollout.engine import VllmConfig, VllmEngine
    from services.rollout.engine_environment import prepare_cpu_environment
    from services.rollout.worker import RolloutWorker
    from services.trainer.engine import PublishedShards
    from services.trainer.rank import LocalShards, store_publication
    from services.trainer.weights_stream import StreamServer
    from shared.blobs import Blobs
    from shared.bus import Bus
    from shared.events import WeightsPublished
    from shared.objects import ObjectBlobStore
    from shared.weights import WeightsManifest, encode_shards, resolve_dtype

    work = Path(tempfile.mkdtemp(prefix="gyre-bench-weights-"))
    prepare_cpu_environment(work / "vllm")
    made = time.perf_counter()
    model_dir = Path(args.model_dir) if args.model_dir else tiny_model(
        work / "model", seed=0, size=args.size, dtype="bfloat16")
    config = json.loads((model_dir / "config.json").read_text())
    dtype = resolve_dtype("auto", config.get("dtype") or config.get("torch_dtype"))
    state = load_file(str(model_dir / "model.safetensors"))
    params = sum(t.numel() for t in state.values())
    details: dict[str, Any] = {"model": args.model_dir or f"created here, size {args.size}", "params": params,
                               "handoff": args.handoff, "stream": args.stream,
                               "dtype": str(dtype).removeprefix("torch."), "workers": args.workers,
                               "create_s": round(time.perf_counter() - made, 1), "rounds": []}
    print(json.dumps({"params": params, "dtype": details["dtype"]}), flush=True)
    with servers() as infra:
        bus = await Bus.connect(infra.nats_url, prefix=f"bench-w-{os.getpid()}")
        blobs = Blobs(ObjectBlobStore(bus.objects))
        engines = [VllmEngine.start(VllmConfig(model=model_dir, max_model_len=1024, dtype=details["dtype"]))
                   for _ in range(args.workers)]
        try:
            workers = [RolloutWorker(e, worker_id=f"w{i}", cell_id=f"cell-{i}") for i, e in enumerate(engines)]
            for e in engines:
                await e.warm_up()
            previous: WeightsManifest | None = None
            node = "bench-node" if args.handoff else ""
            local = LocalShards(work / "published", node) if args.handoff else None
            server = StreamServer("127.0.0.1") if args.stream else None
            for r in range(1, args.rounds + 1):
                with torch.no_grad():  # a step's worth of change: every tensor moves, so every shard is new
                    for t in state.values():
                        t.add_(1e-3)
                started = time.perf_counter()
                ref = await store_publication(blobs, PublishedShards(state, dtype, args.shard_mb * 2**20), local,
                                              server)
                stored = time.perf_counter()
                manifest = WeightsManifest.from_bytes(await blobs.get(ref))
                published = WeightsPublished(version=r, step=r - 1, weights=ref, format="shards",
                                             dtype=manifest.dtype, bytes=manifest.size)
                served = await asyncio.gather(*(_serve(w, blobs, published, work / "stage" / w.worker_id, node,
                                                       args.stream)
                                                for w in workers))
                done = max(s.pop("served_at") for s in served)
                raw = _raw_copy_s([d for d, _ in encode_shards(state, dtype, args.shard_mb * 2**20)], work)
                row = {"round": r, "model_bytes": manifest.size, "shards": len(manifest.shards),
                       "publish_to_served_s": done - started, "store_s": stored - started,
                       "served_s": done - stored, "workers": served, "raw_copy_s": raw}
                details["rounds"].append(row)
                print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                                  if k != "workers"}), flush=True)
                if previous is not None:  # what retention does in a run: the older version's objects go
                    for shard in previous.shards:
                        await blobs.delete(shard.ref)
                previous = manifest
            for w in workers:
                assert w.policy_version == args.rounds
            if server is not None:
                server.close()
        finally:
            for e in engines:
                await e.close()
            await bus.js.delete_object_store(bus.objects.bucket)
            await bus.close()
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"details": details}, default=float))
    rounds = details["rounds"]

    def median(key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    def median_worker(key: str) -> float:
        return statistics.median(w[key] for r in rounds for w in r["workers"])

    publish_to_served, raw_copy = median("publish_to_served_s"), median("raw_copy_s")
    path = "handoff" if args.handoff else "stream" if args.stream else "object_store"
    return {"bench": "weights", "path": path,
            "model_bytes": rounds[-1]["model_bytes"], "params": params,
            "dtype": details["dtype"], "workers": args.workers, "shards": rounds[-1]["shards"],
            "publish_to_served_s": round(publish_to_served, 3), "raw_copy_s": round(raw_copy, 3),
            "ratio": round(publish_to_served / raw_copy, 2), "store_s": round(median("store_s"), 3),
            "fetch_s": round(median_worker("fetch_s"), 3),
            "pause_s": round(median_worker("pause_s"), 3), "swap_s": round(median_worker("swap_s"), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="half", choices=["tiny", "small", "wide", "half"])
    parser.add_argument("--model-dir", default=None, help="a local bf16 checkpoint instead of creating one")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shard-mb", type=int, default=256)
    paths = parser.add_mutually_exclusive_group()
    paths.add_argument("--handoff", action="store_true",
                       help="the same-node handoff: the worker takes rank 0's files instead of the Object Store")
    paths.add_argument("--stream", action="store_true",
                       help="the weights stream: rank 0 sends the shards into each engine over gloo")
    print(json.dumps(asyncio.run(run(parser.parse_args()))))


if __name__ == "__main__":
    main()
