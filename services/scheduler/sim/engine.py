"""Discrete-event cluster model that drives a scheduling policy: fluid per-cell decode, fluid trainer.

Every session on a rollout cell advances at the cell's rate (nominal seconds per second), which falls
as the cell's resident context grows (decode reads every session's KV each step). Rates are piecewise
constant between events; the trainer drains a token backlog at `train cells × tokens/cell/s`.

One cohesive thing, over the usual file size: the event loop, the per-cell virtual clocks and the trainer
advance one shared state, and splitting them would spread every event's handling over several files.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from services.scheduler.policies import (
    Action,
    AssignCell,
    CellState,
    CellView,
    DispatchQuery,
    DrainCell,
    FinishedExecution,
    LiveExecution,
    MigrateSession,
    Policy,
    QueuedQuery,
    Role,
    Snapshot,
    SwitchCosts,
    TrainerView,
    apply_actions,
)
from services.scheduler.sim.workload import HOUR, Preset, Workload

# Event kinds, ordered so that simultaneous events resolve deterministically: finishes first, then
# budget deadlines (a session finishing at its deadline finished), and the policy last, so it never acts on a
# session that ends at the same instant.
_CELL, _DEADLINE, _SWITCH, _MIGRATED, _TRAIN, _STEP, _DECIDE = range(7)


def session_reserve_tokens(preset: Preset) -> int:
    """KV tokens admission reserves for each session: what an average session grows to, so growth does
    not overflow a full cell. The engine's concurrency limit is expressed as the same reserve, so one
    number admits; a preset may state the reserve instead (the live scheduler's, for a fitted one)."""
    per_seq = preset.session_reserve_tokens or preset.kv_capacity_tokens / preset.max_sessions_per_cell
    return int(max(preset.mean_context_tokens, per_seq))


class SimulationError(RuntimeError):
    """The model reached a state it cannot continue from (e.g. a policy that never trains)."""


@dataclass(slots=True)
class _Session:
    sid: int
    query: int
    batch: int
    version: int
    duration: float  # nominal seconds
    l0: float
    slope: float  # context tokens per nominal second
    final_tokens: int
    cell: int = -1
    vstart: float = 0.0
    done: float = 0.0  # nominal seconds done while detached
    epoch: int = 0
    migrating: bool = False


@dataclass(slots=True)
class _Cell:
    idx: int
    cell_id: str
    cap: float
    role: Role = Role.IDLE
    state: CellState = CellState.ACTIVE
    role_since: float = 0.0
    v: float = 0.0  # virtual clock: nominal seconds of progress every resident session received
    vt: float = 0.0
    rate: float = 0.0
    a: float = 0.0  # resident context = a + k * v
    k: float = 0.0
    heap: list[tuple[float, int, int]] = field(default_factory=list)
    sessions: set[int] = field(default_factory=set)
    stamp: int = 0
    prefill_until: float = 0.0  # sessions moved here by recompute are prefilled until then; decode waits
    seg_start: float = 0.0
    seg_label: str = "idle"
    segments: list[tuple[float, float, str]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class SimOptions:
    decide_interval_s: float = 600.0  # shortest gap between policy calls triggered by finishes
    tick_s: float = 1_800.0  # a policy call at least this often (KV growth, consolidation)
    validate: bool = True  # check every decision with apply_actions
    record_timeline: bool = True
    horizon_s: float = 5_000 * 3600.0


class Simulation:
    """One run of one policy over one sampled workload."""

    def __init__(self, preset: Preset, workload: Workload, policy: Policy, options: SimOptions | None = None):
        self.p = preset
        self.w = workload
        self.policy = policy
        self.o = options or SimOptions()
        self.t = 0.0
        self.events: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        nominal_c = preset.nominal_fill * preset.kv_capacity_tokens
        self.c_half = preset.kv_half_fill * preset.kv_capacity_tokens
        self.sigma_norm = 1.0 + nominal_c / self.c_half
        self.cells = [
            _Cell(idx=i, cell_id=f"c{i:04d}", cap=float(preset.kv_capacity_tokens)) for i in range(preset.cells)
        ]
        self.sessions: dict[int, _Session] = {}
        self.finished: dict[int, FinishedExecution] = {}
        self.dispatched = 0
        self.batch_done_count: dict[int, int] = {}
        self.batch_tokens: dict[int, float] = {}
        self.version = 0
        self.backlog = 0.0
        self.train_rate = 0.0
        self.train_t = 0.0
        self.train_stamp = 0
        self.in_overhead = False
        self.per_batch = preset.batch_queries * preset.group_size
        self.reserve_tokens = session_reserve_tokens(preset)
        self.next_decide = math.inf
        self.last_decide = -math.inf
        self.n_train_active = 0
        # accounting
        self.acc_t = 0.0
        self.area: dict[str, float] = {
            "rollout_busy": 0.0, "rollout_empty": 0.0, "train_busy": 0.0, "train_waiting": 0.0,
            "switching": 0.0, "idle": 0.0,
        }  # fmt: skip
        self.cat_count = {"rollout_busy": 0, "rollout_empty": 0, "train": 0, "switching": 0, "idle": preset.cells}
        self.cat_of = ["idle"] * preset.cells
        self.switches = 0
        self.switch_cell_s = 0.0
        self.migrations = 0
        self.migrated_bytes = 0.0
        self.migration_s = 0.0
        self.recomputes = 0  # moves by abort and prefill again (the peer policy's)
        self.recomputed_tokens = 0.0
        self.prefill_stall_cell_s = 0.0  # cell-seconds a target's decode waited on those prefills
        # The trainer's wait for its batch, and the executions it waited for: the peer gate's measured cost.
        self.sample_wait_s = 0.0
        self.samples_waited = 0
        self.staleness: list[int] = []
        self.step_times: list[float] = []
        self.decisions = 0
        self.view_cache: dict[int, tuple[tuple[int, int, bool], LiveExecution]] = {}
        self.last_refresh = -math.inf
        self.cell_views: dict[int, tuple[tuple[Role, CellState, float], CellView]] = {}
        self.budget_cuts = 0  # executions a wall-clock budget ended before their work was done
        self.trained_tokens = 0
        self.peak_fill = 0.0

    # ---------------- event plumbing ----------------
    def _push(self, t: float, kind: int, a: int = 0, b: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, kind, self.seq, a, b))

    def _request_decide(self, t: float) -> None:
        if t < self.next_decide:
            self.next_decide = t
            self._push(t, _DECIDE)

    def _account(self, t: float) -> None:
        dt = t - self.acc_t
        if dt <= 0:
            return
        c = self.cat_count
        self.area["rollout_busy"] += dt * c["rollout_busy"]
        self.area["rollout_empty"] += dt * c["rollout_empty"]
        busy = self.in_overhead or (self.backlog > 1e-9 and self.train_rate > 0)
        self.area["train_busy" if busy else "train_waiting"] += dt * c["train"]
        if self._trainer_waits():
            self.sample_wait_s += dt
        self.area["switching"] += dt * c["switching"]
        self.area["idle"] += dt * c["idle"]
        self.acc_t = t

    def _trainer_waits(self) -> bool:
        """Train cells stand ready while the batch they are to train is not complete."""
        return self.cat_count["train"] > 0 and not self.in_overhead and not self._batch_complete() \
            and self.backlog <= 1e-9 and self.version < self.p.steps

    def _recat(self, cell: _Cell) -> None:
        if cell.state is CellState.SWITCHING:
            cat = "switching"
        elif cell.role is Role.ROLLOUT:
            cat = "rollout_busy" if cell.sessions or cell.prefill_until > self.t else "rollout_empty"
        elif cell.role is Role.TRAIN:
            cat = "train"
        else:
            cat = "idle"
        old = self.cat_of[cell.idx]
        if old != cat:
            self.cat_count[old] -= 1
            self.cat_count[cat] += 1
            self.cat_of[cell.idx] = cat
        label = "switching" if cat == "switching" else ("rollout" if cat.startswith("rollout") else cat)
        if self.o.record_timeline and label != cell.seg_label:
            if self.t > cell.seg_start:
                cell.segments.append((cell.seg_start, self.t, cell.seg_label))
            cell.seg_start = self.t
            cell.seg_label = label

    # ---------------- rollout cells ----------------
    def _advance(self, cell: _Cell) -> None:
        if self.t > cell.vt:
            cell.v += cell.rate * (self.t - cell.vt)
            cell.vt = self.t

    def _rate(self, cell: _Cell) -> float:
        if cell.role is not Role.ROLLOUT or cell.state is CellState.SWITCHING or not cell.sessions:
            return 0.0
        if self.t < cell.prefill_until:
            return 0.0
        ctx = max(0.0, cell.a + cell.k * cell.v)
        fill = ctx / cell.cap
        if fill > self.peak_fill:
            self.peak_fill = fill
        # Decode step time = weight reads + KV reads of every resident session; past capacity the
        # engine preempts and recomputes, which costs in proportion to the overflow.
        sigma = (1.0 + ctx / self.c_half) / self.sigma_norm * max(1.0, fill)
        g = self.p.gen_fraction
        return 1.0 / ((1.0 - g) + g * sigma)

    def _reschedule(self, cell: _Cell) -> None:
        self._advance(cell)
        cell.rate = self._rate(cell)
        cell.stamp += 1
        while cell.heap and self.sessions.get(cell.heap[0][2]) is None:
            heapq.heappop(cell.heap)
        if cell.heap and cell.rate > 0:
            vfin = cell.heap[0][0]
            dt = max(0.0, vfin - cell.v) / cell.rate
            self._push(self.t + dt, _CELL, cell.idx, cell.stamp)

    def _attach(self, s: _Session, cell: _Cell) -> None:
        self._advance(cell)
        s.cell = cell.idx
        s.vstart = cell.v - s.done
        s.epoch += 1
        heapq.heappush(cell.heap, (s.vstart + s.duration, s.epoch, s.sid))
        cell.a += s.l0 - s.slope * s.vstart
        cell.k += s.slope
        cell.sessions.add(s.sid)
        self._recat(cell)
        self._reschedule(cell)

    def _detach(self, s: _Session) -> None:
        cell = self.cells[s.cell]
        self._advance(cell)
        s.done = cell.v - s.vstart
        cell.a -= s.l0 - s.slope * s.vstart
        cell.k -= s.slope
        cell.sessions.discard(s.sid)
        s.epoch += 1
        if not cell.sessions:
            cell.a = cell.k = 0.0  # drop accumulated rounding
        self._recat(cell)
        self._reschedule(cell)

    def _context(self, s: _Session) -> float:
        if s.migrating or s.cell < 0:
            return s.l0 + s.slope * s.done
        cell = self.cells[s.cell]
        v = cell.v + cell.rate * (self.t - cell.vt)
        return s.l0 + s.slope * (v - s.vstart)

    def _on_cell_event(self, idx: int, stamp: int) -> None:
        cell = self.cells[idx]
        if stamp != cell.stamp:
            return
        self._advance(cell)
        finished: list[_Session] = []
        while cell.heap:
            vfin, epoch, sid = cell.heap[0]
            s = self.sessions.get(sid)
            if s is None or s.epoch != epoch or s.cell != idx or s.migrating:
                heapq.heappop(cell.heap)
                continue
            if vfin > cell.v + 1e-6:
                break
            heapq.heappop(cell.heap)
            finished.append(s)
        for s in finished:
            cell.a -= s.l0 - s.slope * s.vstart
            cell.k -= s.slope
            cell.sessions.discard(s.sid)
            del self.sessions[s.sid]
            self.view_cache.pop(s.sid, None)
            self._finish(s)
        if not cell.sessions:
            cell.a = cell.k = 0.0
        self._recat(cell)
        self._reschedule(cell)

    def _on_deadline(self, sid: int) -> None:
        """A wall-clock budget ran out: the execution ends with the work it has done (graded as preserved)."""
        s = self.sessions.pop(sid, None)
        if s is None:
            return  # finished in time
        self.view_cache.pop(sid, None)
        if not s.migrating:  # a session in flight was detached (its progress kept) when it left its cell
            self._detach(s)
        s.final_tokens = int(s.l0 + s.slope * min(max(0.0, s.done), s.duration))
        self.budget_cuts += 1
        self._finish(s)

    def _finish(self, s: _Session) -> None:
        eid = f"s{s.sid}"
        if s.batch == self.version and self._trainer_waits():
            self.samples_waited += 1
        tokens = s.final_tokens
        self.trained_tokens += tokens
        self.finished[s.sid] = FinishedExecution(eid, f"q{s.query}", s.batch, tokens)
        self.batch_done_count[s.batch] = self.batch_done_count.get(s.batch, 0) + 1
        self.batch_tokens[s.batch] = self.batch_tokens.get(s.batch, 0.0) + tokens
        if s.batch == self.version:
            self._release_batch()
        if self.batch_done_count[s.batch] == self.per_batch and s.batch == self.version:
            self._request_decide(self.t)
        else:
            self._request_decide(max(self.t, self.last_decide + self.o.decide_interval_s))

    def _release_batch(self) -> None:
        """Hand the current batch's finished tokens to the trainer: as they come when it streams,
        otherwise all at once when the batch is complete (tree packing spans the whole batch)."""
        if self.p.stream_training or self._batch_complete():
            tokens = self.batch_tokens.pop(self.version, 0.0)
            if tokens > 0 or self._batch_complete():
                self._train_update()
                self.backlog += tokens
                self._train_schedule()

    # ---------------- trainer ----------------
    def _train_update(self) -> None:
        if self.t > self.train_t:
            if not self.in_overhead:
                self.backlog = max(0.0, self.backlog - self.train_rate * (self.t - self.train_t))
            self.train_t = self.t

    def _train_schedule(self) -> None:
        self.train_rate = self.n_train_active * self.p.train_tokens_per_cell_s
        self.train_stamp += 1
        if self.in_overhead:
            return
        if self.backlog > 1e-9 and self.train_rate > 0:
            self._push(self.t + self.backlog / self.train_rate, _TRAIN, self.train_stamp)
        elif self.backlog <= 1e-9 and self._batch_complete() and self.n_train_active > 0:
            self._push(self.t, _TRAIN, self.train_stamp)

    def _batch_complete(self) -> bool:
        return self.batch_done_count.get(self.version, 0) >= self.per_batch

    def _on_train_event(self, stamp: int) -> None:
        if stamp != self.train_stamp or self.in_overhead:
            return
        self._train_update()
        self.backlog = 0.0
        if self._batch_complete():
            self.in_overhead = True
            self._push(self.t + self.p.step_overhead_s, _STEP)
        self._request_decide(self.t)

    def _on_step(self) -> None:
        self._account(self.t)
        self.in_overhead = False
        for sid in [sid for sid, f in self.finished.items() if f.batch == self.version]:
            del self.finished[sid]
        self.version += 1
        self.step_times.append(self.t)
        self.train_t = self.t
        self.backlog = 0.0
        self._release_batch()
        self._train_schedule()
        self._request_decide(self.t)

    def _set_train_cells(self) -> None:
        n = sum(1 for c in self.cells if c.role is Role.TRAIN and c.state is CellState.ACTIVE)
        if n != self.n_train_active:
            self._train_update()
            self.n_train_active = n
            self._train_schedule()

    # ---------------- the policy boundary ----------------
    def snapshot(self) -> Snapshot:
        """The policies' view of the model. The model's own physics counts KV in bytes (migration bandwidth,
        migrated volume); the snapshot counts it in tokens, as the live scheduler does, so bytes are
        converted here and nowhere else."""
        cells = tuple(self._cell_view(c) for c in self.cells)
        # Contexts are reported in quanta of 1/64 of the context cap: the policy's decisions do not
        # turn on finer detail, and unchanged sessions reuse their view (the snapshot dominates cost).
        quantum = max(1.0, self.p.max_context_tokens / 64)
        cache = self.view_cache
        live = []
        for s in self.sessions.values():
            q = int(self._context(s) / quantum)
            key = (q, s.cell, s.migrating)
            hit = cache.get(s.sid)
            if hit is None or hit[0] != key:
                ctx = int(q * quantum)
                view = LiveExecution(
                    f"s{s.sid}", f"q{s.query}", self.cells[s.cell].cell_id, ctx, ctx,
                    s.version, s.batch, s.migrating,
                )  # fmt: skip
                cache[s.sid] = (key, view)
            else:
                view = hit[1]
            live.append(view)
        room = max(0, (self.version + self.p.max_staleness + 1) * self.p.batch_queries - self.dispatched)
        total_q = self.p.steps * self.p.batch_queries
        queued = tuple(
            QueuedQuery(f"q{q}", self.p.group_size) for q in range(self.dispatched, min(total_q, self.dispatched + room))
        )
        self._train_update()
        trainer = TrainerView(
            policy_version=self.version,
            backlog_tokens=int(math.ceil(self.backlog)) if not self.in_overhead else 0,
            batch_complete=self._batch_complete(),
            steps_total=self.p.steps,
            tokens_per_cell_s=self.p.train_tokens_per_cell_s,
            sample_wait_s=self.sample_wait_s / self.samples_waited if self.samples_waited else 0.0,
        )
        return Snapshot(
            now_s=self.t,
            cells=cells,
            live=tuple(live),
            queued=queued,
            finished_untrained=tuple(self.finished.values()),
            trainer=trainer,
            max_staleness=self.p.max_staleness,
            budget_cells=self.p.cells,
            batch_queries=self.p.batch_queries,
            queries_dispatched=self.dispatched,
            session_kv_reserve_tokens=self.reserve_tokens,
            switch_costs=SwitchCosts(self.p.to_train_s, self.p.to_rollout_s,
                                     self.p.migration_bytes_per_s / self.p.kv_bytes_per_token,
                                     self.p.prefill_rate()),
        )

    def _cell_view(self, c: _Cell) -> CellView:
        key = (c.role, c.state, c.role_since)
        hit = self.cell_views.get(c.idx)
        if hit is None or hit[0] != key:
            hit = (key, CellView(c.cell_id, c.role, c.state, int(c.cap), c.role_since))
            self.cell_views[c.idx] = hit
        return hit[1]

    def _decide(self) -> None:
        self.next_decide = math.inf
        self.last_decide = self.t
        self.decisions += 1
        if self.t - self.last_refresh >= self.o.decide_interval_s:
            self.last_refresh = self.t
            for c in self.cells:
                if c.sessions and c.role is Role.ROLLOUT:
                    self._reschedule(c)  # contexts grew since the last event: refresh decode speed
        snap = self.snapshot()
        actions = self.policy.decide(snap)
        if self.o.validate:
            apply_actions(snap, actions, allow_parking=self.policy.allows_parking)
        for action in actions:
            self._apply(action)
        self._set_train_cells()
        self._request_decide(self.t + self.o.tick_s)

    def _apply(self, action: Action) -> None:
        by_id = self._cell_index
        match action:
            case AssignCell(cell_id=cid, role=role):
                cell = self.cells[by_id(cid)]
                if role is cell.role:
                    if cell.state is CellState.DRAINING:
                        cell.state = CellState.ACTIVE
                    return
                cost = self.p.to_train_s if role is Role.TRAIN else self.p.to_rollout_s
                if role is Role.ROLLOUT and cell.sessions:
                    # Parked sessions (colocate) lost their KV with the engine: recompute it.
                    self._advance(cell)
                    cost += (cell.a + cell.k * cell.v) / self.p.prefill_rate()
                self._advance(cell)
                cell.role = role
                cell.state = CellState.SWITCHING
                cell.role_since = self.t
                self.switches += 1
                self.switch_cell_s += cost
                self._recat(cell)
                self._reschedule(cell)
                self._push(self.t + cost, _SWITCH, cell.idx)
            case DrainCell(cell_id=cid):
                cell = self.cells[by_id(cid)]
                cell.state = CellState.DRAINING
                self._recat(cell)
            case MigrateSession(execution_id=eid, to_cell=dst, method=method):
                s = self.sessions[int(eid[1:])]
                self._detach(s)
                s.migrating = True
                s.cell = by_id(dst)
                self.migrations += 1
                if method == "recompute":
                    self._recompute_on(s, self.cells[s.cell])
                    return
                nbytes = (s.l0 + s.slope * s.done) * self.p.kv_bytes_per_token
                dt = nbytes / self.p.migration_bytes_per_s
                self.migrated_bytes += nbytes
                self.migration_s += dt
                self._push(self.t + dt, _MIGRATED, s.sid)
            case DispatchQuery(query_id=qid, policy_version=version, placements=places):
                q = int(qid[1:])
                batch = self.dispatched // self.p.batch_queries
                self.dispatched += 1
                self.staleness.append(batch - version)
                g = self.p.group_size
                for j, cid in enumerate(places):
                    row = q * g + j
                    dur = float(self.w.duration_s[row])
                    final = int(self.w.context_tokens[row])
                    l0 = float(self.p.prompt_tokens)
                    s = _Session(
                        sid=row, query=q, batch=batch, version=version, duration=dur, l0=l0,
                        slope=(final - l0) / dur, final_tokens=final,
                    )  # fmt: skip
                    self.sessions[row] = s
                    self._attach(s, self.cells[by_id(cid)])
                    if self.p.budget == "wall_clock":
                        self._push(self.t + self.p.timeout_h * HOUR, _DEADLINE, row)

    def _recompute_on(self, s: _Session, target: _Cell) -> None:
        """An aborted session resubmitted on `target` with prompt and partial output (nothing generated is lost):
        the target prefills its history after any prefills queued before it, and decodes nothing meanwhile."""
        tokens = s.l0 + s.slope * s.done
        self._advance(target)
        start = max(self.t, target.prefill_until)
        target.prefill_until = start + tokens / self.p.prefill_rate()
        self.recomputes += 1
        self.recomputed_tokens += tokens
        self.prefill_stall_cell_s += target.prefill_until - start
        self.migration_s += target.prefill_until - self.t
        self._recat(target)
        self._reschedule(target)
        self._push(target.prefill_until, _MIGRATED, s.sid, target.idx + 1)

    def _cell_index(self, cell_id: str) -> int:
        return int(cell_id[1:])

    # ---------------- main loop ----------------
    def run(self) -> float:
        self._request_decide(0.0)
        while self.version < self.p.steps:
            if not self.events:
                raise SimulationError(f"{self.policy.name}: nothing left to happen at step {self.version}")
            t, kind, _, a, b = heapq.heappop(self.events)
            if t > self.o.horizon_s:
                raise SimulationError(f"{self.policy.name}: passed the horizon at step {self.version}")
            self._account(t)
            self.t = t
            if kind == _CELL:
                self._on_cell_event(a, b)
            elif kind == _DEADLINE:
                self._on_deadline(a)
            elif kind == _SWITCH:
                cell = self.cells[a]
                cell.state = CellState.ACTIVE
                self._recat(cell)
                self._reschedule(cell)
                self._set_train_cells()
                # Cells that become ready within a minute of each other are decided on together.
                self._request_decide(max(self.t, self.last_decide + 60.0))
            elif kind == _MIGRATED:
                s = self.sessions.get(a)
                if s is not None:  # None: its budget ran out while its KV was in flight
                    s.migrating = False
                    self._attach(s, self.cells[s.cell])
                elif b:  # a recompute whose session ended: its target's prefill is over all the same
                    self._reschedule(self.cells[b - 1])
            elif kind == _TRAIN:
                self._on_train_event(a)
            elif kind == _STEP:
                self._on_step()
            elif kind == _DECIDE and t == self.next_decide:
                self._decide()
        self._account(self.t)
        for c in self.cells:
            if self.o.record_timeline:
                c.segments.append((c.seg_start, self.t, c.seg_label))
        return self.t
