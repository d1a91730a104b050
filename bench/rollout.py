"""Rollout benchmark: the full gateway path vs the same requests sent to the engine directly, and moving a
long session's KV to another worker vs recomputing its prefill there. Prints a JSON object as its last line.

    nice .venv/bin/python bench/rollout.py [--executions 8 --turns 4 --rounds 5 --max-tokens 64 --history-tokens 12000]

Gateway path: anthropic SDK → real HTTP (uvicorn) → token-in/token-out → NATS request/reply → worker →
vLLM, and every call recorded in PostgreSQL before it returns. Direct path: the exact prompt token ids the
gateway produced, sent to the same engine with the same sampling and concurrency. Each round times one window
of each (fresh executions, empty prefix cache); the figures sum the rounds. NATS and Postgres come from
GYRE_NATS_URL / GYRE_DATABASE_URL, or are started embedded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np


async def _recorded_calls(store: Any, execution_ids: list[str]) -> tuple[dict[str, list[np.ndarray]], dict[str, list[list[int]]]]:
    """Each execution's prompts exactly as the gateway sent them (rebuilt from the recorded deltas) and what the
    gateway path generated, call by call."""
    from shared.calls import ExecutionSequences, call_record
    from shared.events import CallCompleted

    prompts: dict[str, list[np.ndarray]] = {}
    recorded: dict[str, list[list[int]]] = {}
    for execution_id in execution_ids:
        seqs = ExecutionSequences()
        for item in await store.read_stream(f"execution-{execution_id}"):
            c = item.event.data
            if not isinstance(c, CallCompleted):
                continue
            record = call_record(c, await store.blobs.get(c.record))
            seq = seqs.add(record)
            prompts.setdefault(c.execution_id, []).append(seq[: c.prompt_tokens])
            recorded.setdefault(c.execution_id, []).append([int(t) for t in record.tokens.completion])
    return prompts, recorded


async def _direct(engine: Any, prompts: list[np.ndarray], recorded: list[list[int]], max_tokens: int,
                  prefix: str) -> tuple[int, int]:
    """One execution's prompts straight to the engine, one after the other: (tokens generated, calls that
    generated what the gateway path did)."""
    from services.rollout.protocol import SamplingSpec

    produced = same = 0
    for k, prompt in enumerate(prompts):
        out = await engine.generate([int(t) for t in prompt], SamplingSpec(max_tokens=max_tokens, temperature=0.0),
                                    f"{prefix}-{k}")
        produced += len(out.token_ids)
        same += list(out.token_ids) == recorded[k]
    return produced, same


async def _throughput(args: argparse.Namespace, engine: Any, model_dir: Path, nats_url: str, db_url: str,
                      log: dict[str, Any]) -> tuple[float, float]:
    import anthropic
    import httpx2
    import sqlalchemy as sa
    import uvicorn

    from services.rollout.codec import TokenizerCodec
    from services.rollout.credentials import TokenVerifier
    from services.rollout.gateway import create_app
    from services.rollout.gateway_core import GatewayCore
    from services.rollout.protocol import SamplingSpec
    from services.rollout.recorder_postgres import PostgresCallRecorder
    from services.rollout.router import Router, WorkerDirectory
    from services.rollout.transport import (
        NatsWorkerClient,
        WorkerServer,
        watch_statuses,
    )
    from services.rollout.worker import RolloutWorker
    from shared.bus import Bus
    from shared.events import ExecutionStarted
    from shared.execution_tokens import derive_execution_token
    from shared.ports import free_port
    from shared.runtime import freeze_startup_heap
    from shared.store import EventStore, run_migrations

    schema = "bench_" + uuid.uuid4().hex[:8]
    await asyncio.to_thread(run_migrations, db_url, schema)
    store = await EventStore.connect(db_url, schema=schema)
    bus = await Bus.connect(nats_url, prefix="bench" + uuid.uuid4().hex[:6])
    directory = WorkerDirectory()
    watcher = await watch_statuses(bus, directory)
    # Room for a round's sessions while the worker's status still counts the previous round's (ended).
    worker = RolloutWorker(engine, worker_id="bench-a", cell_id="cell-a", capacity=2 * args.executions)
    server = await WorkerServer(worker, bus).start()
    while not directory.live():
        await asyncio.sleep(0.02)
    recorder = PostgresCallRecorder(store, run_id="bench")
    secret = uuid.uuid4().hex.encode()
    core = GatewayCore(codec=TokenizerCodec.from_model_dir(model_dir), router=Router(directory, NatsWorkerClient(bus)),
                       recorder=recorder, tokens=TokenVerifier(secret), max_model_len=engine.max_model_len,
                       model_name="tiny")
    port = free_port()
    http = uvicorn.Server(uvicorn.Config(create_app(core), host="127.0.0.1", port=port,
                                         log_level="warning", lifespan="off"))
    http_task = asyncio.create_task(http.serve())
    while not http.started:
        await asyncio.sleep(0.02)
    try:
        def client_for(i: int | str) -> Any:
            # Taken up as the gateway takes up an execution.started (its log read before its first call).
            core.take_up(ExecutionStarted(execution_id=f"bench-{i}", query_id="q", task_id="t", group_size=1,
                                          sample_index=0, seed=0))
            # Built before the clock starts: a client's TLS context alone costs ~18 ms of CPU, and in a
            # deployment the client lives in the agent's sandbox, not in the gateway.
            return anthropic.AsyncAnthropic(api_key=derive_execution_token(secret, f"bench-{i}"),
                                            base_url=f"http://127.0.0.1:{port}", max_retries=0,
                                            http_client=httpx2.AsyncClient(timeout=600))

        async def agent(i: int | str, client: Any, turns: int) -> int:
            messages: list[dict[str, Any]] = [{"role": "user", "content": f"Task {i}: inspect the repository."}]
            produced = 0
            for turn in range(turns):
                msg = await client.messages.create(model="tiny", max_tokens=args.max_tokens, extra_body={"temperature": 0.0},
                                                   system="You are a careful agent.", messages=messages)
                produced += msg.usage.output_tokens
                messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
                             {"role": "user", "content": f"Result of step {turn}: ok. Continue."}]
            return produced

        # Warm-up: a fresh engine's first batches are slow (allocation, kernel selection); neither path pays it.
        warm = SamplingSpec(max_tokens=args.max_tokens, temperature=0.0)
        for rnd in range(2):
            await asyncio.gather(*(engine.generate(list(range(100 + i, 400 + i + 37 * rnd)), warm, f"warm-{rnd}-{i}")
                                   for i in range(args.executions)))
        # And the gateway path's own first-use costs (HTTP connections, NATS, PostgreSQL's connection pool grown
        # to the concurrency), which the direct path lacks: one untimed turn of as many executions.
        await asyncio.gather(*(agent(f"warm-{i}", client_for(f"warm-{i}"), 1) for i in range(args.executions)))

        def end(names: list[str]) -> None:  # as an execution's end event does: the gateway and the worker forget it
            for name in names:
                core.end_execution(f"bench-{name}")
                worker.end_sessions(f"bench-{name}")

        end([f"warm-{i}" for i in range(args.executions)])
        freeze_startup_heap()  # as the gateway and worker processes do once set up (shared.runtime)
        gateway_s = direct_s = 0.0
        gateway_tokens = direct_tokens = calls = same = 0
        rounds: list[dict[str, Any]] = []
        # Rounds alternate the two paths so that both see the same drift in the machine's speed (on a shared
        # machine a 2-second window's engine speed varies by ±10% from one minute to the next).
        for rnd in range(args.rounds):
            names = [f"r{rnd}-{i}" for i in range(args.executions)]
            clients = [client_for(name) for name in names]
            await engine.reset_prefix_cache()
            started = time.perf_counter()
            g_tokens = sum(await asyncio.gather(*(agent(name, client, args.turns) for name, client in zip(names, clients))))
            g_s = time.perf_counter() - started
            prompts, recorded = await _recorded_calls(store, [f"bench-{name}" for name in names])
            await engine.reset_prefix_cache()
            started = time.perf_counter()
            outcomes = await asyncio.gather(*(_direct(engine, prompts[e], recorded[e], args.max_tokens, f"direct-{e}")
                                              for e in sorted(prompts)))
            d_s = time.perf_counter() - started
            d_tokens = sum(produced for produced, _ in outcomes)
            rounds.append({"gateway_s": round(g_s, 3), "direct_s": round(d_s, 3), "ratio": round(g_s / d_s * d_tokens / g_tokens, 3)})
            gateway_s, direct_s = gateway_s + g_s, direct_s + d_s
            gateway_tokens, direct_tokens = gateway_tokens + g_tokens, direct_tokens + d_tokens
            calls += sum(len(p) for p in prompts.values())
            same += sum(matched for _, matched in outcomes)
            end(names)
            await asyncio.gather(*(client.close() for client in clients))
        # Greedy decoding of the same prompts: the two paths should generate the same tokens (batch composition
        # can flip a near-tie on CPU); a gap here would make the token rates incomparable.
        log.update(gateway_tokens=gateway_tokens, gateway_s=round(gateway_s, 3), direct_tokens=direct_tokens,
                   direct_s=round(direct_s, 3), calls=calls, same_completions=round(same / max(calls, 1), 3),
                   rounds=rounds,
                   # What the gateway path adds to each turn of every execution (they run concurrently): unlike
                   # the ratio, this does not shrink or grow with the engine's speed.
                   added_s_per_turn=round((gateway_s - direct_s) / (args.turns * args.rounds), 4))
        return direct_tokens / direct_s, gateway_tokens / gateway_s
    finally:
        http.should_exit = True
        await http_task
        await server.stop()
        await watcher.unsubscribe()
        if bus.nc.is_connected:
            try:
                await bus.js.delete_object_store(f"{bus._stream_prefix}-blobs".lower())
            except Exception:
                pass
        await bus.close()
        async with store.engine.connect() as conn:
            await conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
            await conn.commit()
        await store.close()


async def _migration(args: argparse.Namespace, a: Any, b: Any, log: dict[str, Any]) -> tuple[float, float]:
    """A live session of `history_tokens` on A; move it to B by KV (save on A, load on B) or by recompute."""
    from services.rollout.kv_handoff import KV_LOAD_PREFIX, KV_SAVE_PREFIX, kv_prompt
    from services.rollout.protocol import SamplingSpec

    one = SamplingSpec(max_tokens=1, temperature=0.0)
    rng = np.random.default_rng(0)
    history = [int(t) for t in rng.integers(10, 4000, size=args.history_tokens)]
    await a.generate(history, one, "session-life")  # the session's KV lives on A
    recompute, migrate, cached = [], [], 0
    for rep in range(args.repeats):
        await b.reset_prefix_cache()
        started = time.perf_counter()
        await b.generate(history, one, f"adopt-recompute-{rep}")
        recompute.append(time.perf_counter() - started)

        await b.reset_prefix_cache()
        prompt = [int(t) for t in kv_prompt(np.asarray(history), a.block_size)]
        started = time.perf_counter()
        await a.generate(prompt, one, f"{KV_SAVE_PREFIX}{rep}")
        out = await b.generate(prompt, one, f"{KV_LOAD_PREFIX}{rep}")
        migrate.append(time.perf_counter() - started)
        cached = out.cached_tokens
        log["kv_bytes"] = a.kv_bytes(prompt)
        a.drop_kv(prompt)
    log.update(history_tokens=args.history_tokens, migrated_cached_tokens=cached,
               recompute_runs=[round(x, 4) for x in recompute], migrate_runs=[round(x, 4) for x in migrate])
    return float(np.median(migrate)), float(np.median(recompute))


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from gyre.local import EmbeddedNats, EmbeddedPostgres
    from gyre.tinymodel import tiny_model
    from services.rollout.engine import VllmConfig, VllmEngine
    from services.rollout.engine_environment import prepare_cpu_environment

    work = Path(tempfile.mkdtemp(prefix="gyre-bench-rollout-"))
    prepare_cpu_environment(work / "vllm")
    model_dir = Path(args.model_dir) if args.model_dir else tiny_model(work / "model", seed=0)
    nats_url, db_url = os.environ.get("GYRE_NATS_URL", ""), os.environ.get("GYRE_DATABASE_URL", "")
    embedded: list[Any] = []
    if not nats_url:
        nats = EmbeddedNats(work / "infra")
        nats.start()
        embedded.append(nats)
        nats_url = nats.url
    if not db_url:
        pg = EmbeddedPostgres(work / "infra")
        pg.start()
        embedded.append(pg)
        db_url = pg.url
    log: dict[str, Any] = {}
    max_len = max(args.history_tokens + 256, 4096)
    # vLLM on CPU pins its OpenMP threads to every core, and a decode step waits for its slowest thread: any
    # work of this process (the gateway, the SDK client) on those cores then stalls every step, which on a
    # small machine measures core sharing, not the gateway. Deployed, the gateway runs beside the engines,
    # not on their cores; so by default the engines get the upper half of the cores and this process the rest.
    cores = sorted(os.sched_getaffinity(0))
    own_cores = cores
    if args.split_cores and len(cores) >= 2 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        own_cores, engine_cores = cores[: len(cores) // 2], cores[len(cores) // 2 :]
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, engine_cores))
        log.update(engine_cores=engine_cores, gateway_cores=own_cores)
    a = VllmEngine.start(VllmConfig(model=model_dir, max_model_len=max_len, kv_storage=work / "kv"))
    b = VllmEngine.start(VllmConfig(model=model_dir, max_model_len=max_len, kv_storage=work / "kv"))
    os.sched_setaffinity(0, own_cores)
    try:
        direct_tps, gateway_tps = await _throughput(args, a, model_dir, nats_url, db_url, log)
        migrate_s, recompute_s = await _migration(args, a, b, log)
    finally:
        await a.close()
        await b.close()
        for server in embedded:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"details": log}))
    return {
        "bench": "rollout",
        "direct_tokens_per_s": round(direct_tps, 1),
        "gateway_tokens_per_s": round(gateway_tps, 1),
        "overhead_ratio": round(direct_tps / gateway_tps, 3),
        "same_completions": log["same_completions"],
        "added_s_per_turn": log["added_s_per_turn"],
        "migrate_s": round(migrate_s, 4),
        "recompute_s": round(recompute_s, 4),
        "migrate_speedup": round(recompute_s / migrate_s, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--executions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5, help="gateway and direct windows, alternating")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--history-tokens", type=int, default=12000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--no-split-cores", dest="split_cores", action="store_false",
                        help="let the engines' threads and the gateway share every core")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
