"""Switch benchmark: a cell moves rollout → train → rollout while live sessions run on it, over several rounds, on
the warm path (the cell's worker and trainer rank both stay running; a switch wakes one and puts the other to
sleep) and on the restart path (the old role's process is stopped and the new one started), in the same run.
Prints a JSON object as its last line.

    nice .venv/bin/python bench/switch.py [--rounds 3 --sessions 4 --history-words 300 --path warm,restart]

Real processes throughout, as `gyre run` starts them: the outbox relay, the rollout gateway, a cell agent with two
cells (each a vLLM CPU worker and a trainer rank), and the trainer coordinator; the bench plays the scheduler
(it appends `cell.assigned`) and the harness (it appends `execution.started` and runs the agents' calls through
the gateway's Anthropic API). Each round: start `--sessions` executions on cell 0 and let each make a call there;
order cell 0 to train while they keep calling (their sessions move to cell 1: KV, or recompute); when it serves
training, order it back to rollout. Durations and phases are the ones the cell agent reports in `cell.ready`; a
session is lost if any of its calls fails or a call is recorded twice. NATS and Postgres come from
GYRE_NATS_URL / GYRE_DATABASE_URL, or are started embedded.
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
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._infra import servers  # noqa: E402

NODE = "bench"
CELLS = [f"{NODE}-cell0", f"{NODE}-cell1"]
MOVING = CELLS[0]


@dataclass
class Session:
    execution_id: str
    token: str
    calls: int = 0
    errors: list[str] = field(default_factory=list)


@dataclass
class SwitchResult:
    path: str
    direction: str  # rollout_to_train, train_to_rollout
    seconds: float
    warm: bool | None
    phases: dict[str, float]
    sessions_moved: dict[str, int]


async def _events(store: Any, run_id: str, after: int = 0) -> list[Any]:
    return [s for s in await store.read_after(after, run_id=run_id, limit=100_000)]


async def _wait(store: Any, run_id: str, found: Any, what: str, timeout_s: float, procs: list[Any]) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = found([s.event for s in await _events(store, run_id)])
        if value is not None:
            return value
        dead = [p.name for p in procs if not p.alive()]
        if dead:
            raise RuntimeError(f"{', '.join(dead)} exited while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s:.0f} s")
        await asyncio.sleep(0.2)


def _event(data: Any, run_id: str, stream: str) -> Any:
    from shared.events import new_event

    return new_event(data, run_id=run_id, stream_id=stream, version=1, occurred_at=datetime.now(UTC))


async def _assign(store: Any, run_id: str, cell: str, role: str) -> datetime:
    from shared.events import CellAssigned

    event = _event(CellAssigned(cell_id=cell, role=role, policy="bench", reason="bench switch"), run_id, f"cell-{cell}")
    await store.append([event], expected_version="any")
    return event.occurred_at


async def _ready(store: Any, run_id: str, cell: str, role: str, since: datetime, procs: list[Any],
                 timeout_s: float) -> Any:
    def found(events: list[Any]) -> Any:
        for e in events:
            if e.type == "cell.ready" and e.data.cell_id == cell and e.data.role == role and e.occurred_at >= since:
                return e.data
        return None

    return await _wait(store, run_id, found, f"cell.ready of {cell} as {role}", timeout_s, procs)


async def _converse(session: Session, url: str, model: str, history_words: int, max_tokens: int,
                    stop: asyncio.Event, max_calls: int) -> None:
    """One agent: a growing conversation, one call after another, until told to stop or `max_calls` calls in
    (its context then nears the model's length: a longer one would be refused, which is no switch's doing)."""
    import httpx

    words = " ".join(f"word{i % 97}" for i in range(history_words))
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"Remember these: {words}. Now say something."}]
    headers = {"x-api-key": session.token, "anthropic-version": "2023-06-01"}
    async with httpx.AsyncClient(timeout=600.0) as http:
        while not stop.is_set() and session.calls < max_calls:
            body = {"model": model, "max_tokens": max_tokens, "messages": messages, "temperature": 1.0}
            try:
                reply = await http.post(f"{url}/v1/messages", json=body, headers=headers)
            except httpx.HTTPError as exc:
                session.errors.append(f"{type(exc).__name__}: {exc}")
                return
            if reply.status_code != 200:
                session.errors.append(f"{reply.status_code}: {reply.text[:300]}")
                return
            session.calls += 1
            text = "".join(b.get("text", "") for b in reply.json()["content"] if b.get("type") == "text")
            messages += [{"role": "assistant", "content": text or "ok"},
                         {"role": "user", "content": f"Go on ({session.calls})."}]


async def _run_path(path: str, args: argparse.Namespace, infra: Any, work: Path) -> tuple[list[SwitchResult], dict[str, Any]]:
    """One stack (warm or restart path), `args.rounds` rounds of cell 0 out to training and back."""
    from gyre.launcher import loop_environment
    from gyre.local import free_port
    from gyre.processes import Proc, start_all, stop_all
    from gyre.tinymodel import tiny_model
    from shared.events import CallCompleted, ExecutionFinished, ExecutionStarted, stream_id_for
    from shared.execution_tokens import derive_execution_token
    from shared.store import EventStore, run_migrations

    schema = f"bench_switch_{uuid.uuid4().hex[:8]}"
    await asyncio.to_thread(run_migrations, infra.database_url, schema)
    store = await EventStore.connect(infra.database_url, schema=schema)
    run_id = f"bench-switch-{path}-{uuid.uuid4().hex[:6]}"
    run_dir = work / path
    model_dir = tiny_model(run_dir / "model", seed=0, size="tiny")
    port = free_port()
    env = loop_environment(
        run_id=run_id, nats_url=infra.nats_url, database_url=infra.database_url, model_dir=model_dir,
        run_dir=run_dir, mode="async", steps=1, group_size=1, max_staleness=1, seed=0, task_ids=["none"],
        gateway_port=port, cells=len(CELLS),
        extra={"GYRE_DB_SCHEMA": schema, "GYRE_SUBJECT_PREFIX": f"bs{uuid.uuid4().hex[:8]}", "GYRE_NODE_ID": NODE,
               "GYRE_CELL_NODE_ID": NODE, "GYRE_CELL_WARM": "1" if path == "warm" else "0",
               "GYRE_ROLLOUT_MAX_MODEL_LEN": "8192", "GYRE_ACK_WAIT_S": "10"},
    )
    python = sys.executable
    procs = [Proc("relay", [python, "-m", "gyre", "relay"]), Proc("trainer", [python, "-m", "services.trainer"]),
             Proc("gateway", [python, "-m", "services.rollout", "gateway"]),
             Proc("cells", [python, "-m", "services.scheduler", "cell"])]
    secret = env["GYRE_ROLLOUT_TOKEN_SECRET"].encode()
    url = f"http://127.0.0.1:{port}"
    results: list[SwitchResult] = []
    sessions: list[Session] = []
    try:
        start_all(procs, env, run_dir / "logs")
        first = datetime.now(UTC)
        for cell in CELLS:
            await _assign(store, run_id, cell, "rollout")
        for cell in CELLS:
            await _ready(store, run_id, cell, "rollout", first, procs, 900)
        for round_ in range(args.rounds):
            live = [Session(f"execution-bench-{path}-{round_}-{i}", "") for i in range(args.sessions)]
            for s in live:
                s.token = derive_execution_token(secret, s.execution_id)
                started = ExecutionStarted(execution_id=s.execution_id, query_id=f"q{round_}", task_id="bench",
                                           group_size=args.sessions, sample_index=0, seed=round_ * 100 + len(sessions),
                                           call_budget=100_000, cell_id=MOVING)
                await store.append([_event(started, run_id, stream_id_for("execution", s.execution_id))],
                                   expected_version="any")
            sessions += live
            stop = asyncio.Event()
            clients = [asyncio.create_task(_converse(s, url, "gyre-tiny", args.history_words, args.max_tokens, stop,
                                                     args.max_calls))
                       for s in live]
            await _wait(store, run_id, lambda evs, live=live: True if all(
                any(e.type == "call.completed" and e.data.execution_id == s.execution_id and e.data.cell_id == MOVING
                    for e in evs) for s in live) else None, "a call of every session on the moving cell", 600, procs)
            for direction, role in (("rollout_to_train", "train"), ("train_to_rollout", "rollout")):
                since = await _assign(store, run_id, MOVING, role)
                ready = await _ready(store, run_id, MOVING, role, since, procs, 900)
                moved: dict[str, int] = {}
                for e in await _events(store, run_id):
                    if e.event.type == "kv.migrated" and e.event.data.from_cell == MOVING and e.event.occurred_at >= since:
                        moved[e.event.data.method] = moved.get(e.event.data.method, 0) + 1
                results.append(SwitchResult(path, direction, ready.switch_seconds, ready.warm, dict(ready.phases),
                                            moved))
                print(f"{path} round {round_} {direction}: {ready.switch_seconds:.2f} s warm={ready.warm} "
                      f"phases={ready.phases} moved={moved}", file=sys.stderr, flush=True)
            stop.set()
            await asyncio.gather(*clients)
            for s in live:
                await store.append([_event(ExecutionFinished(execution_id=s.execution_id, elapsed_s=0.0, calls=s.calls),
                                           run_id, stream_id_for("execution", s.execution_id))],
                                   expected_version="any")
        # Lost sessions: a failed call, or the log disagreeing with what the agent saw (missing or doubled calls).
        lost: list[str] = []
        for s in sessions:
            stream = stream_id_for("execution", s.execution_id)
            indices = [e.data.call_index for e in (x.event for x in await store.read_stream(stream))
                       if isinstance(e.data, CallCompleted)]
            if s.errors or sorted(indices) != list(range(s.calls)):
                lost.append(f"{s.execution_id}: {s.errors[:1]} calls {s.calls} recorded {len(indices)}")
        summary = {"sessions": len(sessions), "calls": sum(s.calls for s in sessions), "lost": lost}
    finally:
        stop_all(procs, run_id)
        await store.close()
    return results, summary


def _stats(results: list[SwitchResult], path: str, direction: str) -> dict[str, Any]:
    picked = [r for r in results if r.path == path and r.direction == direction]
    if not picked:
        return {}
    phases: dict[str, list[float]] = {}
    for r in picked:
        for k, v in r.phases.items():
            phases.setdefault(k, []).append(v)
    moved: dict[str, int] = {}
    for r in picked:
        for k, v in r.sessions_moved.items():
            moved[k] = moved.get(k, 0) + v
    return {
        "median_s": round(statistics.median(r.seconds for r in picked), 3),
        "max_s": round(max(r.seconds for r in picked), 3),
        "rounds": len(picked),
        "warm": [r.warm for r in picked],
        "phases_median_s": {k: round(statistics.median(v), 3) for k, v in sorted(phases.items())},
        "sessions_moved": moved,
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    results: list[SwitchResult] = []
    checks: dict[str, Any] = {}
    work = Path(tempfile.mkdtemp(prefix="gyre-bench-switch-"))
    try:
        with servers() as infra:
            for path in args.path.split(","):
                got, summary = await _run_path(path, args, infra, work)
                results += got
                checks[path] = summary
    except BaseException:
        print(f"logs kept in {work}", file=sys.stderr)
        raise
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    out: dict[str, Any] = {"bench": "switch"}
    detail = {p: {d: _stats(results, p, d) for d in ("rollout_to_train", "train_to_rollout")}
              for p in args.path.split(",")}
    warm, restart = detail.get("warm", {}), detail.get("restart", {})
    if warm:
        out["rollout_to_train_s"] = warm["rollout_to_train"].get("median_s")
        out["train_to_rollout_s"] = warm["train_to_rollout"].get("median_s")
    if restart:
        out["restart_rollout_to_train_s"] = restart["rollout_to_train"].get("median_s")
        out["restart_train_to_rollout_s"] = restart["train_to_rollout"].get("median_s")
    if warm and restart:
        ratios = [restart[d]["median_s"] / warm[d]["median_s"] for d in ("rollout_to_train", "train_to_rollout")
                  if warm[d].get("median_s") and restart[d].get("median_s")]
        out["restart_over_warm"] = round(min(ratios), 2) if ratios else None
    out["published_s"] = {"rollout_to_train": 8.52, "train_to_rollout": 3.46}
    out["sessions_lost"] = sum(len(c["lost"]) for c in checks.values())
    out["details"] = {"paths": detail, "checks": checks,
                      "config": {"rounds": args.rounds, "sessions": args.sessions,
                                 "history_words": args.history_words, "max_tokens": args.max_tokens,
                                 "max_calls": args.max_calls}}
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--history-words", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-calls", type=int, default=150, help="calls per session at most (context bound)")
    parser.add_argument("--path", default="warm,restart", help="warm, restart, or both (comma-separated)")
    parser.add_argument("--keep", action="store_true", help="keep the processes' logs and state (printed where)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    result = asyncio.run(main(parser.parse_args()))
    print(json.dumps(result))
