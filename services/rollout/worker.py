"""The rollout worker: one per rollout cell, wrapping an engine; keeps each live session's token history,
serves token-delta generation, reloads weights in place, drains by migrating sessions to other workers, and
sleeps in standby while its cell serves another role.

`RolloutWorker` holds the logic over the `Engine` (engine_port.py) and `WorkerPeers` ports; `transport.py` is its
NATS shell. One cohesive thing past ~450 lines: generation, weight swaps, adoption, drains, ordered moves, sleep
and wake all act on the same sessions under the same per-session locks and the same engine gate; the rules they
apply are pure modules (`routing.py` for targets, `kv_handoff.py` for what KV moves).
"""

from __future__ import annotations

import asyncio
import time
import uuid
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from services.rollout.engine_port import Engine, EngineError, EngineOutput
from services.rollout.kv_bundle import KvBundleError
from services.rollout.kv_handoff import KV_LOAD_PREFIX, KV_SAVE_PREFIX, kv_prompt
from services.rollout.kv_transport import KvTransferFailed, KvTransport
from services.rollout.protocol import (
    AdoptReply,
    AdoptRequest,
    DrainReply,
    DrainRequest,
    GenerateReply,
    GenerateRequest,
    KvTicket,
    MigrationResult,
    SamplingSpec,
    TokenPayload,
    tokens_digest,
)
from services.rollout.routing import migration_target
from shared.events import EventData, KvMigrated, KvMigrationRefused
from shared.logging import get_logger
from shared.weights_stream import StreamPull
from shared.worker_status import WorkerState, WorkerStatus

Emit = Callable[[Sequence[EventData]], Awaitable[None]]

# How long a worker remembers that an execution ended, refusing its late calls and migrations: far longer than
# a request can be on its way (the NATS request timeout is 900 s).
ENDED_KEEP_S = 3600.0
# Targets a migration tries before it gives the session up as failed (each refusal: the next least loaded).
MIGRATION_TARGETS = 3
# KV a worker holds for sessions it is adopting (received, not yet loaded into its engine) before it takes no
# more: a target past it recomputes what it is offered instead.
KV_STAGING_BYTES = 4 << 30
# A migration's prefill: one greedy token, the point is the prefill (which leaves the prompt's KV cached).
PREFILL_ONLY = SamplingSpec(max_tokens=1, temperature=0.0)


class WorkerPeers(Protocol):
    """How a draining worker finds targets and hands sessions over (NATS in the shell, direct in tests)."""

    def candidates(self, exclude: str) -> list[WorkerStatus]: ...

    async def adopt(self, target: str, request: AdoptRequest, history: np.ndarray) -> AdoptReply: ...


class PolicyChanged(Exception):
    """The worker serves another policy version than the one a request's KV was computed under."""


class NoActivePeer(Exception):
    """No other active worker is there to take a session: it stays here (parked), which is no failure of a move."""


class KvNotMoved(Exception):
    """A session's KV could not move (not saved, not sent, not received whole, another model or policy, no room
    on the target); the message is the reason its migration recomputes instead."""


class WorkerStandingBy(Exception):
    """The worker went to standby while a request waited for the engine: its engine sleeps, the request is refused."""


class NotStandingBy(Exception):
    """`wake` on a worker that is not in standby."""


@dataclass(frozen=True)
class SleepReport:
    seconds: float
    dropped: list[str]  # sessions ("execution/chain") still here when the engine went to sleep, now gone


@dataclass
class Session:
    execution_id: str
    chain_id: str
    history: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class RolloutWorker:
    def __init__(
        self,
        engine: Engine,
        *,
        worker_id: str,
        cell_id: str,
        capacity: int = 64,
        policy_version: int = 0,
        emit: Emit | None = None,
        peers: WorkerPeers | None = None,
        on_change: Callable[[], None] | None = None,
        kv_transport: KvTransport | None = None,
        kv_staging_bytes: int = KV_STAGING_BYTES,
    ) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.cell_id = cell_id
        self.capacity = capacity
        self.policy_version = policy_version
        self.state: WorkerState = "active"
        self.sessions: dict[tuple[str, str], Session] = {}
        self.moved: dict[str, str] = {}  # execution_id -> worker that now holds it
        # Executions ended here (monotonic time of the end): a call or a migration that arrives after the end
        # must not create a session nobody would end again.
        self.ended: dict[str, float] = {}
        self.in_flight = 0
        self._emit = emit
        self.peers = peers
        self.kv_transport = kv_transport
        self.kv_staging_bytes = kv_staging_bytes
        self._kv_staged = 0  # bytes of KV received for adoptions and not yet loaded
        self._cleanups: set[asyncio.Future[None]] = set()
        # One KV save or load at a time per connector key (see `_kv_lock`); a lock lives while it is held.
        self._kv_locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self._on_change = on_change or (lambda: None)
        self._open = asyncio.Event()  # closed while weights are swapped or the engine sleeps or wakes
        self._open.set()
        self._serves_published = False  # whether it has loaded a publication (else it serves the model's own)
        self._idle = asyncio.Condition()
        self.log = get_logger(worker_id=worker_id, cell_id=cell_id)

    # ---- status ----

    def executions(self) -> set[str]:
        return {e for e, _ in self.sessions}

    def status(self) -> WorkerStatus:
        return WorkerStatus(
            worker_id=self.worker_id,
            cell_id=self.cell_id,
            state=self.state,
            live_sessions=len(self.executions()),
            capacity=self.capacity,
            in_flight=self.in_flight,
            policy_version=self.policy_version,
            max_model_len=self.engine.max_model_len,
            moved=dict(self.moved),
        )

    # ---- generation ----

    async def generate(self, request: GenerateRequest, delta: np.ndarray) -> GenerateReply:
        ids: dict[str, Any] = {"worker_id": self.worker_id, "cell_id": self.cell_id}
        if request.execution_id in self.ended:
            return GenerateReply(status="ended", detail=f"execution {request.execution_id} has ended", **ids)
        key = (request.execution_id, request.chain_id)
        session = self.sessions.get(key)
        if session is None:
            moved_to = self.moved.get(request.execution_id)  # per execution: its chains move together
            if moved_to is not None and request.reclaim and request.base_len == 0:
                self.log.info("moved_session_reclaimed", execution_id=request.execution_id, moved_to=moved_to)
                self.moved.pop(request.execution_id)  # its target is gone: it starts here again, recomputed
            elif moved_to is not None:
                return GenerateReply(status="moved", moved_to=moved_to, detail="session migrated", **ids)
            if self.state != "active":
                return self._not_serving(ids)
            if request.base_len > 0:
                return GenerateReply(status="resync", detail="no such session on this worker", **ids)
            session = Session(request.execution_id, request.chain_id)
            self.sessions[key] = session
            self._on_change()
        async with session.lock:
            if self.state == "standby":  # asleep while this request waited behind an in-flight one
                return self._not_serving(ids)
            if self.sessions.get(key) is not session:
                # Migrated or ended while this request waited behind an in-flight one.
                if self.moved.get(request.execution_id) is not None:
                    return GenerateReply(status="moved", moved_to=self.moved[request.execution_id], **ids)
                return GenerateReply(status="ended", detail=f"execution {request.execution_id} has ended", **ids)
            if request.base_len > len(session.history) or (
                request.base_len > 0 and tokens_digest(session.history[: request.base_len]) != request.base_digest
            ):
                return GenerateReply(
                    status="resync",
                    detail=f"session holds {len(session.history)} tokens; base of {request.base_len} does not match",
                    **ids,
                )
            prompt = np.concatenate([session.history[: request.base_len], delta], dtype=np.int32)
            if len(prompt) + request.sampling.max_tokens > self.engine.max_model_len:
                return GenerateReply(
                    status="error",
                    detail=f"prompt of {len(prompt)} tokens plus max_tokens {request.sampling.max_tokens} exceeds "
                    f"the context of {self.engine.max_model_len}",
                    **ids,
                )
            try:
                out, version = await self._engine_call(prompt, request.sampling, request.request_id)
            except WorkerStandingBy:
                return self._not_serving(ids)
            session.history = np.concatenate([prompt, np.asarray(out.token_ids, dtype=np.int32)], dtype=np.int32)
        return GenerateReply(
            status="ok",
            completion=out.token_ids,
            logprobs=out.logprobs,
            finish_reason=out.finish_reason,
            stop_sequence=out.stop_sequence,
            prompt_tokens=out.prompt_tokens,
            cached_tokens=out.cached_tokens,
            policy_version=version,
            **ids,
        )

    def _not_serving(self, ids: dict[str, Any]) -> GenerateReply:
        """The refusal of a worker that takes no session (draining, drained, standby): the router places the
        execution elsewhere and resends its whole prompt there."""
        reason = " (asleep while its cell serves another role)" if self.state == "standby" else ""
        return GenerateReply(status="draining", detail=f"worker {self.worker_id} is {self.state}{reason}", **ids)

    async def _engine_call(
        self, prompt: np.ndarray, sampling: SamplingSpec, request_id: str, *, policy_version: int | None = None
    ) -> tuple[EngineOutput, int]:
        """One engine request kept apart from a weight swap (a call, or a migration's prefill): it waits while
        weights are swapped and a swap waits for it. Returns the output and the policy version that made it;
        with `policy_version`, raises PolicyChanged rather than run under another one. Raises WorkerStandingBy when
        the worker went to standby meanwhile: its engine sleeps and would hold the request until a wake."""
        await self._open.wait()
        if self.state == "standby":
            raise WorkerStandingBy(f"worker {self.worker_id} is in standby")
        if policy_version is not None and policy_version != self.policy_version:
            raise PolicyChanged(f"expected policy {policy_version}, this worker serves {self.policy_version}")
        self.in_flight += 1
        version = self.policy_version
        try:
            # tolist(): a million-id prompt converts in ~20 ms, element by element it took ~110 ms.
            return await self.engine.generate(np.asarray(prompt).tolist(), sampling, request_id), version
        finally:
            self.in_flight -= 1
            async with self._idle:
                self._idle.notify_all()

    def _prefill_limit(self, history: np.ndarray) -> np.ndarray:
        """The longest prefix of a history an engine prefills: one token short of the context, which a session
        that generated up to its length limit fills entirely (the engine refuses a prompt that long)."""
        return history[: self.engine.max_model_len - 1]

    def end_sessions(self, execution_id: str) -> int:
        keys = [k for k in self.sessions if k[0] == execution_id]
        for k in keys:
            del self.sessions[k]
        self.moved.pop(execution_id, None)
        now = time.monotonic()
        self.ended.pop(execution_id, None)
        self.ended[execution_id] = now  # insertion order is end order: the oldest come first
        while now - next(iter(self.ended.values())) > ENDED_KEEP_S:
            del self.ended[next(iter(self.ended))]
        if keys:
            self._on_change()
        return len(keys)

    # ---- weights ----

    def wants(self, version: int) -> bool:
        """Whether a publication of `version` is news: newer than what it serves, or the initial weights (version
        0) while it still serves the model's own. A late or replayed publication never takes it back."""
        return version > self.policy_version or (version == 0 and not self._serves_published)

    async def apply_weights(
        self, version: int, weights: Mapping[str, Any] | Sequence[Path] | StreamPull
    ) -> dict[str, float] | None:
        """Swap weights between calls: new calls wait, in-flight calls finish on the old policy first. `weights`:
        a state dict, safetensors files on this node the engine reads itself, or a pull the engine makes over
        the weights stream (StreamRefused when it fails: the engine still serves the old weights). Returns the
        swap's times when it loaded them — `pause_s`, how long new calls were held (the wait for in-flight ones
        included), `swap_s`, the engine's load, and for a pull `stream_s`, its transfer — or None (not newer than
        what it serves)."""
        if not self.wants(version):
            self.log.info("weights_skipped", version=version, current=self.policy_version)
            return None
        paused = time.perf_counter()
        self._open.clear()
        try:
            async with self._idle:
                await self._idle.wait_for(lambda: self.in_flight == 0)
            started = time.perf_counter()
            extra: dict[str, float] = {}
            if isinstance(weights, StreamPull):
                extra["stream_s"] = await self.engine.receive_weights(weights)
            elif isinstance(weights, Mapping):
                await self.engine.load_weights(weights)
            else:
                await self.engine.load_weight_files(weights)
            self.policy_version = version
            self._serves_published = True
            swap_s = time.perf_counter() - started
        finally:
            self._open.set()
            self._on_change()
        times = {"pause_s": time.perf_counter() - paused, "swap_s": swap_s, **extra}
        self.log.info("weights_loaded", version=version, **{k: round(v, 4) for k, v in times.items()})
        return times

    # ---- standby ----

    async def sleep(self) -> SleepReport:
        """Go to standby: refuse new work, let the engine calls in flight finish, drop every session still here
        (a drain's parked ones: their next call is refused and the router resends it whole elsewhere) and put
        the engine to sleep. `moved` and `ended` stay: a late call of a moved execution is still sent on."""
        started = time.perf_counter()
        self.state = "standby"
        self._on_change()
        self._open.clear()
        try:
            async with self._idle:
                await self._idle.wait_for(lambda: self.in_flight == 0)
            dropped = [f"{e}/{c}" for e, c in sorted(self.sessions)]
            self.sessions.clear()
            await self.engine.sleep()
        finally:
            # Requests that waited at the gate now see the standby and are refused instead of waiting for a wake.
            self._open.set()
        seconds = time.perf_counter() - started
        self.log.info("worker_standing_by", seconds=round(seconds, 4), dropped_sessions=len(dropped))
        self._on_change()
        return SleepReport(seconds=seconds, dropped=dropped)

    async def wake(self, load_newest: Callable[[], Awaitable[object]]) -> dict[str, float]:
        """Leave standby: wake the engine, run `load_newest` (loads the newest published weights through
        `apply_weights`; the worker still refuses work meanwhile), then serve. Returns the phases (`wake_s`,
        `load_s`). A failure leaves it in standby, to be woken again (a woken engine is not woken twice)."""
        if self.state != "standby":
            raise NotStandingBy(f"worker {self.worker_id} is {self.state}, not in standby")
        started = time.perf_counter()
        await self.engine.wake()
        woken = time.perf_counter()
        await load_newest()
        loaded = time.perf_counter()
        self.sessions.clear()  # none can have come in standby; a woken worker starts with none all the same
        self.state = "active"
        self._on_change()
        phases = {"wake_s": woken - started, "load_s": loaded - woken}
        self.log.info("worker_woken", version=self.policy_version, **{k: round(v, 4) for k, v in phases.items()})
        return phases

    # ---- migration ----

    @property
    def moves_kv(self) -> bool:
        """Whether this worker can save and load KV (a connector in its engine and a transport to carry it)."""
        return self.engine.kv_transfer and self.kv_transport is not None

    async def adopt(self, request: AdoptRequest, history: np.ndarray) -> AdoptReply:
        """Take over a session from a draining worker and prefill its history now: from the KV the request's
        ticket names when that arrives whole and fits this engine, else by recomputing it (the reply says which,
        and why it fell back)."""
        if request.execution_id in self.ended:
            return AdoptReply(ok=False, ended=True, detail=f"execution {request.execution_id} has ended")
        if self.state != "active":
            reason = " (asleep while its cell serves another role)" if self.state == "standby" else ""
            return AdoptReply(ok=False, detail=f"worker {self.worker_id} is {self.state}{reason}")
        started = time.perf_counter()
        key = (request.execution_id, request.chain_id)
        session = self.sessions.get(key) or Session(request.execution_id, request.chain_id)
        async with session.lock:
            if request.execution_id in self.ended:  # ended while this waited for the lock
                return AdoptReply(ok=False, ended=True, detail=f"execution {request.execution_id} has ended")
            session.history = np.asarray(history, dtype=np.int32)
            self.sessions[key] = session
            self.moved.pop(request.execution_id, None)
            method: Literal["kv", "recompute"] = "recompute"
            fallback, cached = request.fallback, 0
            phases: dict[str, float] = {}
            try:
                if request.kv is not None:
                    try:
                        cached = await self._load_kv(session.history, request.kv, request.policy_version, phases)
                        method = "kv"
                    except KvNotMoved as exc:
                        fallback = str(exc)
                        self.log.warning("kv_load_refused", execution_id=request.execution_id,
                                         from_worker=request.from_worker, reason=fallback)
                if method == "recompute":
                    prompt = self._prefill_limit(session.history)
                    if len(prompt) > 1:
                        at = time.perf_counter()
                        out, _ = await self._engine_call(prompt, PREFILL_ONLY, f"adopt-{uuid.uuid4().hex}")
                        cached = out.cached_tokens
                        phases["recompute_s"] = time.perf_counter() - at
            except WorkerStandingBy as exc:  # went to sleep while this waited: the source tries another
                self.sessions.pop(key, None)
                return AdoptReply(ok=False, detail=str(exc))
            except BaseException:
                # The source keeps the session (its adopt failed): no copy stays here that no move points to.
                if self.sessions.get(key) is session:
                    del self.sessions[key]
                raise
        self._on_change()
        return AdoptReply(ok=True, method=method, fallback=fallback, cached_tokens=cached,
                          seconds=time.perf_counter() - started, phases=phases)

    async def _load_kv(
        self, history: np.ndarray, ticket: KvTicket, policy_version: int, phases: dict[str, float]
    ) -> int:
        """Receive a session's KV, stage it for the engine and prefill its prompt from it; returns the prompt
        tokens the engine took from it. KvNotMoved (with the reason) when anything keeps it from loading whole:
        the caller recomputes. The bundle is checked before the engine sees it (digest, model, prompt), so a
        wrong prefix never enters the cache."""
        if not self.moves_kv:
            raise KvNotMoved(f"worker {self.worker_id} has no KV connector or transport")
        if ticket.fingerprint != self.engine.kv_fingerprint:
            raise KvNotMoved(f"model mismatch: KV of model {ticket.fingerprint[:16]}…, this worker serves "
                             f"{self.engine.kv_fingerprint[:16]}…")
        if policy_version != self.policy_version:  # the version policy (docs/rollout.md): recompute under ours
            raise KvNotMoved(f"saved KV is stale: computed by policy {policy_version}, this worker serves "
                             f"{self.policy_version}")
        if ticket.prompt_tokens > len(history):
            raise KvNotMoved(f"KV of {ticket.prompt_tokens} tokens for a history of {len(history)}")
        if self._kv_staged + ticket.bytes > self.kv_staging_bytes:
            raise KvNotMoved(f"target full: {self._kv_staged} B of KV staged, {ticket.bytes} B more would pass "
                             f"its limit of {self.kv_staging_bytes} B")
        assert self.kv_transport is not None
        prompt = history[: ticket.prompt_tokens]
        ids = prompt.tolist()
        self._kv_staged += ticket.bytes
        try:
            at = time.perf_counter()
            try:
                bundle = await self.kv_transport.receive(ticket)
            except KvTransferFailed as exc:
                raise KvNotMoved(str(exc)) from exc
            phases["receive_s"] = time.perf_counter() - at
            async with self._kv_lock(prompt):
                at = time.perf_counter()
                try:
                    self.engine.import_kv(ids, bundle)
                    del bundle
                    out, _ = await self._engine_call(prompt, PREFILL_ONLY, f"{KV_LOAD_PREFIX}{uuid.uuid4().hex}",
                                                     policy_version=policy_version)
                except KvBundleError as exc:
                    raise KvNotMoved(str(exc)) from exc
                except PolicyChanged as exc:  # weights swapped while it arrived: KV of another policy stays out
                    raise KvNotMoved(f"saved KV is stale: {exc}") from exc
                finally:
                    self.engine.drop_kv(ids)
                phases["load_s"] = time.perf_counter() - at  # staged on disk, then loaded by the connector
        finally:
            self._kv_staged -= ticket.bytes
        if out.cached_tokens <= 0:
            raise KvNotMoved("the engine loaded none of the moved KV")
        return out.cached_tokens

    async def drain(self, request: DrainRequest) -> DrainReply:
        """Stop taking new sessions and move every live session to other workers (KV, else recompute).

        A session no active worker can take stays here, parked (`DrainReply.parked`); one whose move failed
        stays too (`failed`). Either leaves the worker draining rather than drained. A worker in standby holds
        nothing and stays as it is."""
        started = time.perf_counter()
        if self.state == "standby":
            return DrainReply(ok=True, detail="in standby: nothing to drain", seconds=time.perf_counter() - started)
        self.state = "draining"
        self._on_change()
        results: list[MigrationResult] = []
        parked: list[str] = []
        failed: list[str] = []

        async def move(key: tuple[str, str], session: Session) -> None:
            try:
                result = await self._migrate(session, request)
            except NoActivePeer as exc:
                self.log.warning("session_parked", execution_id=key[0], chain_id=key[1], reason=str(exc))
                parked.append(f"{key[0]}/{key[1]}: {exc}")
                return
            except Exception as exc:  # keep draining the others; report what failed
                self.log.exception("migration_failed", execution_id=key[0], chain_id=key[1])
                failed.append(f"{key[0]}/{key[1]}: {type(exc).__name__}: {exc}")
                return
            if result is not None:
                results.append(result)

        # Every session at once: each waits for its own in-flight call (its lock), and the targets' engines
        # batch the prefills of the sessions they adopt, so the drain takes about its slowest move, not the sum.
        await asyncio.gather(*(move(key, session) for key, session in sorted(self.sessions.items())))
        results.sort(key=lambda r: (r.execution_id, r.chain_id))
        self.state = "drained" if not (parked or failed) else "draining"
        self._on_change()
        detail = "; ".join([*(["parked (no active worker takes them): " + ", ".join(parked)] if parked else []),
                            *(["moves failed: " + ", ".join(failed)] if failed else [])])
        return DrainReply(
            ok=not (parked or failed),
            detail=detail,
            migrated=results,
            parked=parked,
            failed=failed,
            seconds=time.perf_counter() - started,
        )

    async def move_execution(
        self, execution_id: str, to_cell: str, *, method: Literal["kv", "recompute"] | None = None
    ) -> list[MigrationResult]:
        """Move one execution's sessions (every chain) to the worker serving `to_cell`, as the scheduler ordered.

        An order is a placement choice, not a must: when this worker drains (its drain moves everything), the
        execution has no session here (not started here yet, ended, moved), or the target is not an active
        worker, nothing moves; a target that refuses keeps the session where it is. Each move is reported with
        `kv.migrated`, a move not made with `kv.migration_refused` (so the scheduler knows at once). `method`
        forces KV or recompute (default: KV where this worker moves KV). Returns what moved."""
        log = self.log.bind(execution_id=execution_id, to_cell=to_cell)

        async def refuse(reason: str) -> list[MigrationResult]:
            log.info("ordered_move_refused", reason=reason)
            if self._emit is not None:
                await self._emit([KvMigrationRefused(execution_id=execution_id, from_cell=self.cell_id,
                                                     to_cell=to_cell, reason=reason)])
            return []

        if self.state == "standby":
            return await refuse(f"worker {self.worker_id} is in standby: it holds no session")
        if self.state != "active":
            return await refuse(f"worker {self.worker_id} is {self.state}: its drain moves the session")
        sessions = [s for k, s in sorted(self.sessions.items()) if k[0] == execution_id]
        if not sessions:
            return await refuse(f"worker {self.worker_id} holds no session of the execution")
        peers = [] if self.peers is None else self.peers.candidates(exclude=self.worker_id)
        target = next((p for p in peers if p.cell_id == to_cell and p.state == "active"), None)
        if target is None:
            return await refuse(f"no active worker serves {to_cell}")
        results: list[MigrationResult] = []
        for session in sessions:
            try:
                result = await self._migrate(session, DrainRequest(targets=(target.worker_id,), force_method=method),
                                             only_preferred=True)
            except Exception as exc:  # refused or failed: the rest of the execution stays with it, here
                log.warning("ordered_move_failed", chain_id=session.chain_id, error=f"{type(exc).__name__}: {exc}")
                if not results:
                    return await refuse(f"{type(exc).__name__}: {exc}")
                break  # a chain moved already (its kv.migrated names the target): the rest is served here
            if result is not None:
                results.append(result)
        return results

    def _pick_target(
        self, execution_id: str, preferred: Sequence[str], refused: set[str], *, only_preferred: bool = False
    ) -> WorkerStatus:
        peers = [] if self.peers is None else self.peers.candidates(exclude=self.worker_id)
        target = migration_target(peers, preferred=preferred, refused=refused, only_preferred=only_preferred,
                                  follow=self.moved.get(execution_id))
        if target is None:
            refusals = f"; refused by {sorted(refused)}" if refused else ""
            raise NoActivePeer(f"no active worker to migrate to{refusals}")
        return target

    async def _hand_over(
        self, session: Session, target: WorkerStatus, request: DrainRequest
    ) -> tuple[AdoptReply, int]:
        """Offer the session to `target` (under the session's lock) with its KV when this worker moves KV (saved
        by the engine, sent through the KV transport); the target loads it or recomputes the history. Returns
        the answer and the KV bytes that reached the target's engine."""
        assert self.peers is not None
        history = session.history
        adopt = AdoptRequest(execution_id=session.execution_id, chain_id=session.chain_id,
                             history=TokenPayload(count=len(history)), from_worker=self.worker_id)
        ticket: KvTicket | None = None
        phases: dict[str, float] = {}
        if (request.force_method or ("kv" if self.moves_kv else "recompute")) == "kv":
            try:
                ticket, saved_by = await self._export_kv(history, phases)
            except KvNotMoved as exc:
                self.log.warning("kv_export_failed", execution_id=session.execution_id, reason=str(exc))
                adopt = adopt.model_copy(update={"fallback": str(exc)})
            else:
                adopt = adopt.model_copy(update={"kv": ticket, "policy_version": saved_by})
        try:
            reply = await self.peers.adopt(target.worker_id, adopt, history)
        finally:
            if ticket is not None:  # the bundle is only in transit: gone once the target answered
                self._discard_soon(ticket)
        reply = reply.model_copy(update={"phases": {**phases, **reply.phases}})
        return reply, (ticket.bytes if ticket is not None and reply.method == "kv" else 0)

    def _kv_lock(self, prompt: np.ndarray) -> asyncio.Lock:
        """The lock of a prompt's connector key. The connector keys saved KV by the prompt's whole blocks, so two
        sessions whose histories agree up to their last partial block (a group's samples of one task, early on)
        share one folder: a save or load of one while the other's files are written or removed made the engine
        read or write a file that vanished, and the engine process died with it. Saves and loads of one key
        therefore take turns, on source and target alike."""
        whole = (len(prompt) - 1) // self.engine.block_size * self.engine.block_size
        key = tokens_digest(np.asarray(prompt[:whole]))
        lock = self._kv_locks.get(key)
        if lock is None:
            lock = self._kv_locks[key] = asyncio.Lock()
        return lock

    def _discard_soon(self, ticket: KvTicket) -> None:
        """Delete a sent bundle after the move, off its path (deleting 16 MiB from the Object Store takes ~20 ms the
        session need not wait for); one that fails is left to the bucket's expiry."""
        assert self.kv_transport is not None
        task = asyncio.ensure_future(self.kv_transport.discard(ticket))
        self._cleanups.add(task)

        def done(t: asyncio.Future[None]) -> None:
            self._cleanups.discard(t)
            if not t.cancelled() and t.exception() is not None:
                self.log.warning("kv_discard_failed", object_name=ticket.object_name, error=str(t.exception()))

        task.add_done_callback(done)

    async def settled(self) -> None:
        """Wait for the cleanups still running (sent bundles being deleted)."""
        while self._cleanups:
            await asyncio.gather(*list(self._cleanups), return_exceptions=True)

    async def _export_kv(self, history: np.ndarray, phases: dict[str, float]) -> tuple[KvTicket, int]:
        """Save the session's KV through the engine's connector and send it; returns its ticket and the policy
        version that computed it. KvNotMoved with the reason when it cannot."""
        if not self.moves_kv:
            raise KvNotMoved(f"worker {self.worker_id} has no KV connector or transport")
        assert self.kv_transport is not None
        prompt = kv_prompt(self._prefill_limit(history), self.engine.block_size)
        if prompt is None:
            raise KvNotMoved(f"no whole KV block to move in a history of {len(history)} tokens")
        ids = prompt.tolist()
        at = time.perf_counter()
        async with self._kv_lock(prompt):
            try:
                _, saved_by = await self._engine_call(prompt, PREFILL_ONLY, f"{KV_SAVE_PREFIX}{uuid.uuid4().hex}")
                bundle = self.engine.export_kv(ids)
            except (EngineError, KvBundleError) as exc:
                raise KvNotMoved(f"KV export failed: {exc}") from exc
            finally:
                self.engine.drop_kv(ids)
        sent = time.perf_counter()
        phases["save_s"] = sent - at
        try:
            ticket = await self.kv_transport.send(bundle, fingerprint=self.engine.kv_fingerprint,
                                                  prompt_tokens=len(ids))
        except KvTransferFailed as exc:
            raise KvNotMoved(str(exc)) from exc
        phases["send_s"] = time.perf_counter() - sent
        return ticket, saved_by

    async def _migrate(
        self, session: Session, request: DrainRequest, *, only_preferred: bool = False
    ) -> MigrationResult | None:
        """Move one session to another worker; None when there was nothing to move (it ended or moved while the
        drain waited for its lock, or its execution ended before a target took it). With `only_preferred`, only
        to `request.targets`."""
        assert self.peers is not None
        key = (session.execution_id, session.chain_id)
        async with session.lock:  # an in-flight request on this session completes here first
            if self.sessions.get(key) is not session:
                return None
            started = time.perf_counter()
            history = session.history
            refused: set[str] = set()
            reply: AdoptReply | None = None
            for _ in range(MIGRATION_TARGETS):
                target = self._pick_target(session.execution_id, request.targets, refused,
                                           only_preferred=only_preferred)
                reply, moved_bytes = await self._hand_over(session, target, request)
                if reply.ok or reply.ended:
                    break
                refused.add(target.worker_id)  # draining too, say, and its heartbeat had not told yet
                self.log.warning("migration_refused", execution_id=session.execution_id, to_worker=target.worker_id,
                                 detail=reply.detail)
            assert reply is not None
            if reply.ended or session.execution_id in self.ended:
                # It ended meanwhile; the end reaches every worker, so a target that took it drops it too.
                self.sessions.pop(key, None)
                self._on_change()
                return None
            if not reply.ok:
                raise RuntimeError(f"no worker took the session (refused by {sorted(refused)}): {reply.detail}")
            seconds = time.perf_counter() - started
            self.moved[session.execution_id] = target.worker_id
            self.sessions.pop(key, None)
        result = MigrationResult(
            execution_id=session.execution_id,
            chain_id=session.chain_id,
            to_worker=target.worker_id,
            method=reply.method,
            tokens=len(history),
            bytes=moved_bytes,
            seconds=seconds,
            cached_tokens=reply.cached_tokens,
            fallback=reply.fallback,
            phases={k: round(v, 4) for k, v in reply.phases.items()},
        )
        if self._emit is not None:
            await self._emit(
                [
                    KvMigrated(
                        execution_id=session.execution_id,
                        from_cell=self.cell_id,
                        to_cell=target.cell_id,
                        tokens=len(history) if reply.method == "recompute" else reply.cached_tokens,
                        bytes=moved_bytes,
                        seconds=seconds,
                        method=reply.method,
                        fallback=reply.fallback,
                        phases=result.phases,
                    )
                ]
            )
        self.log.info("session_migrated", **result.model_dump())
        self._on_change()
        return result
