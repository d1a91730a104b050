"""Many live executions through one gateway process: how many sessions it holds, how many calls a core serves,
and the latency it adds at a steady 100 calls/s. Prints JSON last.

    .venv/bin/python bench/gateway_load.py [--sessions 1000 --long-share 0.1 --rate 100 --seconds 20]

Real processes, as a run starts them: the rollout gateway (`python -m services.rollout gateway`: uvicorn,
token-in/token-out over the tiny model's tokenizer, the router over NATS, every call recorded in PostgreSQL before
it is answered) and, in a second process, rollout workers (the real `RolloutWorker` and its NATS endpoints) over
a stand-in engine that answers at once with a fixed reply: what is measured is everything but generation. This
process is the agents: each of `--sessions` executions keeps its own conversation and sends all of it with every
call, as an agent does (a tenth of them start from a long prompt, `--long-tokens`, the size of Claude Code's;
the rest from a short one; one in four speaks the OpenAI API, the rest Anthropic's), and adds a tool result of
`--result-words` words after each reply.

Phases: every session opens with its first call (then all are live: the gateway holds each one's token state,
the router its placement, the recorder its log), and `memory_per_session_kb` is the gateway's resident memory
grown per session. Then one call at a time on 30 of them (the baseline, `idle_p50_ms`), and for `--seconds`
each: `saturated`, `--concurrency` callers calling back to back (`calls_per_s_per_core`: calls answered per CPU
second the gateway process used); `steady`, calls arriving at
`--rate` per second (Poisson, each on a random live session not already in a call), whose latency as the agent
sees it is `p50_added_ms` / `p99_added_ms`: all of it is the gateway's (HTTP, tokenizing, routing over NATS,
recording), as the engine's own time is zero; `p99_over_idle_p50` compares it with the baseline.

The gateway runs on a core of its own (`--no-pin`: every process on every core); each run uses a database schema
and a subject prefix of its own and drops them, and `recorded_calls == answered_calls` checks that every answered
call is in the log. `--profile PATH` samples the gateway through the saturated phase with py-spy, where installed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._infra import rss_bytes, servers, tree_cpu_s  # noqa: E402

WORDS = ("alpha", "beta", "gamma", "delta", "file", "line", "error", "test", "def", "return", "import", "class",
         "build", "passed", "failed", "src/main.py", "assert", "value", "None", "self")
REPLY = ('I will look at the failing test first.\n<tool_call>\n{"name": "bash", "arguments": '
         '{"command": "pytest -x tests/test_main.py"}}\n</tool_call>')
BASH = {"name": "bash", "description": "Run a shell command in the task's workspace.",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}


# ---- the stand-in workers (a child process) ----

class InstantEngine:
    """An engine that answers every prompt at once with the same reply (cut to the call's max_tokens)."""

    block_size = 16
    kv_transfer = False
    kv_fingerprint = "stand-in"

    def __init__(self, reply: list[int], max_model_len: int) -> None:
        self.reply = reply
        self.max_model_len = max_model_len

    async def generate(self, prompt: list[int], sampling: Any, request_id: str) -> Any:
        from services.rollout.engine_port import EngineOutput

        n = min(len(self.reply), sampling.max_tokens)
        return EngineOutput(token_ids=self.reply[:n], logprobs=[-0.5] * n, finish_reason="stop",
                            stop_sequence=None, prompt_tokens=len(prompt), cached_tokens=0)

    async def load_weights(self, state_dict: Mapping[str, Any]) -> None: ...
    async def load_weight_files(self, paths: Sequence[Path]) -> None: ...
    async def reset_prefix_cache(self) -> None: ...
    async def sleep(self) -> None: ...
    async def wake(self) -> None: ...

    def kv_bytes(self, prompt: list[int]) -> int:
        return 0

    def export_kv(self, prompt: list[int]) -> bytes:
        raise NotImplementedError("the stand-in engine keeps no KV")

    def import_kv(self, prompt: list[int], bundle: bytes) -> int:
        raise NotImplementedError("the stand-in engine keeps no KV")

    def drop_kv(self, prompt: list[int]) -> None: ...
    async def close(self) -> None: ...


async def serve_workers(nats_url: str, prefix: str, workers: int, capacity: int, reply: list[int],
                        max_model_len: int) -> None:
    from services.rollout.transport import WorkerServer
    from services.rollout.worker import RolloutWorker
    from shared.bus import Bus

    bus = await Bus.connect(nats_url, prefix=prefix, name="bench-workers")
    started = []
    for i in range(workers):
        worker = RolloutWorker(InstantEngine(reply, max_model_len), worker_id=f"stand-in-{i}", cell_id=f"cell-{i}",
                               capacity=capacity)
        started.append(await WorkerServer(worker, bus).start())
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print("ready", flush=True)
    await stop.wait()
    for server in started:
        await server.stop()
    await bus.close()


# ---- the agents (this process) ----

@dataclass
class Session:
    execution_id: str
    token: str
    api: str  # "anthropic" | "openai"
    system: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    long: bool = False
    busy: bool = False
    calls: int = 0


def _words(rnd: random.Random, n: int) -> str:
    return " ".join(rnd.choice(WORDS) for _ in range(n))


def _body(session: Session) -> dict[str, Any]:
    if session.api == "anthropic":
        return {"model": "gyre-tiny", "max_tokens": 256, "system": session.system, "tools": [BASH],
                "messages": session.messages}
    tools = [{"type": "function", "function": {"name": BASH["name"], "description": BASH["description"],
                                               "parameters": BASH["input_schema"]}}]
    return {"model": "gyre-tiny", "max_tokens": 256, "tools": tools,
            "messages": [{"role": "system", "content": session.system}, *session.messages]}


def _follow_up(session: Session, answer: dict[str, Any], result: str) -> None:
    """Add the reply as the agent got it and the tool's result, as an agent's next call sends them."""
    if session.api == "anthropic":
        session.messages.append({"role": "assistant", "content": answer["content"]})
        uses = [b for b in answer["content"] if b["type"] == "tool_use"]
        if uses:
            session.messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": u["id"], "content": result} for u in uses]})
        else:
            session.messages.append({"role": "user", "content": result})
        return
    message = answer["choices"][0]["message"]
    session.messages.append({k: v for k, v in message.items() if k in ("role", "content", "tool_calls") and v})
    for call in message.get("tool_calls") or []:
        session.messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    if not message.get("tool_calls"):
        session.messages.append({"role": "user", "content": result})


class Agents:
    def __init__(self, base_url: str, sessions: list[Session], rnd: random.Random, result_words: int) -> None:
        import httpx

        self.client = httpx.AsyncClient(base_url=base_url, timeout=120.0,
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=2048,
                                                            # below the server's 5 s: a connection idle that
                                                            # long is not reused as the server closes it
                                                            keepalive_expiry=4.0))
        self.sessions = sessions
        self.rnd = rnd
        self.result_words = result_words
        self.errors: dict[str, int] = {}

    async def call(self, session: Session) -> float | None:
        """One call of `session`: its latency in seconds, or None when it was refused (counted by status)."""
        path = "/v1/messages" if session.api == "anthropic" else "/v1/chat/completions"
        content = json.dumps(_body(session)).encode()
        session.busy = True
        started = time.perf_counter()
        try:
            response = await self.client.post(path, content=content, headers={
                "content-type": "application/json", "authorization": f"Bearer {session.token}"})
            latency = time.perf_counter() - started
        except Exception as exc:  # counted, not fatal: the figure says how many failed
            self.errors[type(exc).__name__] = self.errors.get(type(exc).__name__, 0) + 1
            return None
        finally:
            session.busy = False
        if response.status_code != 200:
            key = f"http_{response.status_code}"
            self.errors[key] = self.errors.get(key, 0) + 1
            return None
        session.calls += 1
        _follow_up(session, response.json(), _words(self.rnd, self.result_words))
        return latency

    async def close(self) -> None:
        await self.client.aclose()


def _profile(pid: int, out: str, seconds: float) -> subprocess.Popen[bytes]:
    """Sample the gateway's stacks through the saturated phase with py-spy (installed separately; not a
    dependency of the project), as raw folded stacks in `out`."""
    return subprocess.Popen(["py-spy", "record", "-p", str(pid), "-d", str(int(seconds)), "-r", "50", "-f", "raw",
                             "-o", out, "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _recorded_calls(database_url: str, schema: str, run_id: str) -> int:
    """The `call.completed` events the run's log holds (every answered call must have one)."""
    import psycopg

    with psycopg.connect(database_url) as conn:
        row = conn.execute(f'SELECT count(*) FROM "{schema}".events WHERE run_id = %s AND type = %s',
                           (run_id, "call.completed")).fetchone()
    return int(row[0]) if row else 0


def _drop_schema(database_url: str, schema: str) -> None:
    import psycopg

    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def _wait_healthy(base_url: str, workers: int, proc: subprocess.Popen[bytes], timeout_s: float = 120) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=base_url, timeout=2.0) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the gateway exited with {proc.returncode} before it served")
            try:
                health = (await client.get("/healthz")).json()
                if len(health.get("workers", [])) >= workers:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.25)
    raise RuntimeError(f"the gateway did not see {workers} workers within {timeout_s} s")


async def _open_all(agents: Agents, concurrency: int) -> list[float]:
    """Every session's first call, `concurrency` at a time."""
    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = []

    async def first(session: Session) -> None:
        async with gate:
            latency = await agents.call(session)
            if latency is not None:
                latencies.append(latency)

    await asyncio.gather(*(first(s) for s in agents.sessions))
    return latencies


async def _saturated(agents: Agents, concurrency: int, seconds: float) -> tuple[int, float]:
    """Callers calling back to back on random idle sessions: (calls answered, seconds)."""
    end = time.perf_counter() + seconds
    answered = 0

    async def caller() -> None:
        nonlocal answered
        while time.perf_counter() < end:
            idle = [s for s in agents.rnd.sample(agents.sessions, 16) if not s.busy]
            if not idle:
                await asyncio.sleep(0)
                continue
            if await agents.call(idle[0]) is not None:
                answered += 1

    started = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    return answered, time.perf_counter() - started


async def _steady(agents: Agents, rate: float, seconds: float) -> tuple[list[float], list[float], int]:
    """Calls arriving at `rate` a second (Poisson) on random idle sessions: (latencies, those of the sessions with
    a long prompt, arrivals skipped because the session drawn was in a call)."""
    latencies: list[float] = []
    long: list[float] = []
    tasks: list[asyncio.Task[None]] = []
    skipped = 0

    async def one(session: Session) -> None:
        latency = await agents.call(session)
        if latency is not None:
            latencies.append(latency)
            if session.long:
                long.append(latency)

    loop = asyncio.get_running_loop()
    start = loop.time()
    at = start
    while at - start < seconds:
        at += agents.rnd.expovariate(rate)
        await asyncio.sleep(max(0.0, at - loop.time()))
        session = agents.rnd.choice(agents.sessions)
        if session.busy:
            skipped += 1
            continue
        session.busy = True  # taken now, so that the next arrival does not draw it too
        tasks.append(asyncio.create_task(one(session)))
    await asyncio.gather(*tasks)
    return latencies, long, skipped


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from gyre.local import free_port
    from gyre.tinymodel import tiny_model
    from services.rollout.codec import TokenizerCodec
    from shared.bus import Bus
    from shared.execution_tokens import derive_execution_token
    from shared.store import run_migrations

    rnd = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="gyre-bench-load-"))
    model_dir = tiny_model(work / "model", seed=0)
    codec = TokenizerCodec.from_model_dir(model_dir)
    reply = codec.encode(REPLY) + [codec.end_of_turn_id]
    long_system = codec.decode(codec.encode(_words(rnd, args.long_tokens))[: args.long_tokens])
    print(f"long prompt: {len(codec.encode(long_system))} tokens; reply: {len(reply)} tokens", file=sys.stderr)
    secret = uuid.uuid4().hex
    run_id = f"load-{uuid.uuid4().hex[:8]}"
    prefix = f"load{uuid.uuid4().hex[:6]}"
    max_model_len = 1 << 17
    with servers() as srv:
        # A schema and a subject prefix of its own: nothing of an earlier run is read, and nothing is left.
        schema = prefix
        run_migrations(srv.database_url, schema)
        bus = await Bus.connect(srv.nats_url, prefix=prefix)
        await bus.ensure_streams()
        port = free_port()
        env = {**os.environ, "GYRE_NATS_URL": srv.nats_url, "GYRE_DATABASE_URL": srv.database_url,
               "GYRE_RUN_ID": run_id, "GYRE_SUBJECT_PREFIX": prefix, "GYRE_DB_SCHEMA": schema,
               "GYRE_MODEL_DIR": str(model_dir),
               "GYRE_STATE_DIR": str(work / "state"), "GYRE_ROLLOUT_TOKEN_SECRET": secret,
               "GYRE_ROLLOUT_PORT": str(port), "GYRE_ROLLOUT_MAX_MODEL_LEN": str(max_model_len),
               "GYRE_ROLLOUT_MODEL_NAME": "gyre-tiny", "GYRE_LOG_LEVEL": args.log_level,
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        capacity = args.sessions // args.workers + 64
        workers = subprocess.Popen(
            [sys.executable, __file__, "--serve-workers", "--nats-url", srv.nats_url, "--prefix", prefix,
             "--workers", str(args.workers), "--capacity", str(capacity), "--reply", json.dumps(reply),
             "--max-model-len", str(max_model_len)], stdout=subprocess.PIPE, env=env)
        gateway_log = open(work / "gateway.log", "wb")
        gateway = subprocess.Popen([sys.executable, "-m", "services.rollout", "gateway"], env=env,
                                   stdout=gateway_log, stderr=subprocess.STDOUT)
        base_url = f"http://127.0.0.1:{port}"
        agents = None
        try:
            assert workers.stdout is not None
            line = await asyncio.to_thread(workers.stdout.readline)
            if line.strip() != b"ready":
                raise RuntimeError("the stand-in workers did not start")
            await _wait_healthy(base_url, args.workers, gateway)
            if args.pin and (cores := sorted(os.sched_getaffinity(0))) and len(cores) > 1:
                # The gateway on a core of its own, the agents and the stand-in workers on the rest (NATS and
                # Postgres go where the system puts them): its CPU per call is not its neighbours'.
                os.sched_setaffinity(gateway.pid, {cores[-1]})
                for pid in (os.getpid(), workers.pid):
                    os.sched_setaffinity(pid, set(cores[:-1]))
            sessions = []
            for i in range(args.sessions):
                execution_id = f"load-{i:05d}"
                long = i % round(1 / args.long_share) == 0 if args.long_share > 0 else False
                session = Session(execution_id, derive_execution_token(secret.encode(), execution_id),
                                  api="openai" if i % 4 == 3 else "anthropic",
                                  system=long_system if long else "You are a careful software agent.",
                                  long=long)
                session.messages.append({"role": "user", "content": f"Task {i}: make the tests pass. "
                                         + _words(rnd, args.result_words)})
                sessions.append(session)
            agents = Agents(base_url, sessions, rnd, args.result_words)

            # Warm up (the first calls of a fresh process open its database connections, compile the template).
            for s in sessions[:20]:
                await agents.call(s)
            rss_before = rss_bytes(gateway.pid) // 1024
            t0 = time.perf_counter()
            opened = await _open_all(agents, args.concurrency)
            open_s = time.perf_counter() - t0
            live = sum(1 for s in sessions if s.calls > 0)
            rss_after = rss_bytes(gateway.pid) // 1024
            print(f"opened {live} sessions in {open_s:.1f} s; gateway RSS {rss_before // 1024} → "
                  f"{rss_after // 1024} MB", file=sys.stderr)

            # Baseline: one call at a time on live sessions.
            idle = [x for s in rnd.sample(sessions, 30) for x in [await agents.call(s)] if x is not None]
            profiler = _profile(gateway.pid, args.profile, args.seconds) if args.profile else None
            cpu0 = tree_cpu_s(gateway.pid) or 0.0
            answered, wall = await _saturated(agents, args.concurrency, args.seconds)
            cpu = (tree_cpu_s(gateway.pid) or 0.0) - cpu0
            if profiler is not None:
                profiler.wait()
            print(f"saturated: {answered} calls in {wall:.1f} s, gateway CPU {cpu:.1f} s", file=sys.stderr)

            cpu0 = tree_cpu_s(gateway.pid) or 0.0
            latencies, long_latencies, skipped = await _steady(agents, args.rate, args.seconds)
            steady_cpu = (tree_cpu_s(gateway.pid) or 0.0) - cpu0
            if gateway.poll() is not None:
                raise RuntimeError(f"the gateway exited with {gateway.returncode} under load")
            recorded = _recorded_calls(srv.database_url, schema, run_id)
            idle_p50 = statistics.median(idle) * 1000
            p99 = _pct(latencies, 0.99) * 1000
            return {
                "bench": "gateway_load",
                "sessions": live,
                "calls_per_s_per_core": round(answered / cpu, 1) if cpu else None,
                "p99_added_ms": round(p99, 1),
                "p50_added_ms": round(_pct(latencies, 0.5) * 1000, 1),
                "p99_long_ms": round(_pct(long_latencies, 0.99) * 1000, 1),
                "rate": args.rate,
                "steady_calls_per_s": round(len(latencies) / args.seconds, 1),
                "steady_gateway_cpu_share": round(steady_cpu / args.seconds, 3),
                "idle_p50_ms": round(idle_p50, 1),
                "p99_over_idle_p50": round(p99 / idle_p50, 2),
                "memory_per_session_kb": round((rss_after - rss_before) / max(1, live - 20), 1),
                "saturated_calls_per_s": round(answered / wall, 1),
                "saturated_gateway_cpu_share": round(cpu / wall, 3),
                "open_p99_ms": round(_pct(opened, 0.99) * 1000, 1),
                "long_prompt_tokens": args.long_tokens,
                "skipped_arrivals": skipped,
                "answered_calls": sum(s.calls for s in sessions),
                "recorded_calls": recorded,
                "errors": agents.errors,
                "cores": os.cpu_count(),
            }
        finally:
            if agents is not None:
                await agents.close()
            for proc in (gateway, workers):
                proc.send_signal(signal.SIGTERM)
            for proc in (gateway, workers):
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
            gateway_log.close()
            await bus.delete_streams()
            await bus.close()
            _drop_schema(srv.database_url, schema)
            if args.keep:
                print(f"kept {work}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--long-share", type=float, default=0.1, help="share of sessions with a long prompt")
    parser.add_argument("--long-tokens", type=int, default=30000, help="a long session's first prompt, in tokens")
    parser.add_argument("--result-words", type=int, default=60, help="words of each tool result")
    parser.add_argument("--rate", type=float, default=100.0, help="calls a second in the steady phase")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each measured phase")
    parser.add_argument("--concurrency", type=int, default=32, help="callers in the saturated phase")
    parser.add_argument("--workers", type=int, default=4, help="stand-in workers")
    parser.add_argument("--log-level", default="INFO", help="the gateway's log level (a run's default: info)")
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="leave every process on every core (default: the gateway gets the last core alone)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the work folder (the gateway's log)")
    parser.add_argument("--profile", metavar="PATH", help="py-spy's folded stacks of the gateway while saturated")
    # The stand-in workers' process.
    parser.add_argument("--serve-workers", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--nats-url", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    parser.add_argument("--capacity", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--reply", help=argparse.SUPPRESS)
    parser.add_argument("--max-model-len", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_workers:
        asyncio.run(serve_workers(args.nats_url, args.prefix, args.workers, args.capacity, json.loads(args.reply),
                                  args.max_model_len))
        return
    print(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
