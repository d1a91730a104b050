"""The elastic policy: cells move between rollout and training with demand, sessions migrate, never die."""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Literal

from services.scheduler.policies.actions import Action, AssignCell, DispatchQuery, MigrateSession
from services.scheduler.policies.base import Room, accepting, dispatch_onto, pending_sessions
from services.scheduler.policies.snapshot import CellState, CellView, LiveExecution, Snapshot
from shared.cells import Role


@dataclass(frozen=True, slots=True)
class ElasticTiming:
    """The elastic policy's hysteresis, in the run's own time scale.

    The defaults suit the workloads Gyre is for (executions of minutes to hours, steps of minutes): a cell
    stays in a role at least `min_dwell_s`, the train pool is sized to clear its backlog within
    `train_horizon_s`, and it shrinks only when `margin` cells above that. A run whose steps take seconds
    (the tiny model of `gyre run`) scales them down, or no cell would ever move within it.
    """

    train_horizon_s: float = 1_200.0
    min_dwell_s: float = 300.0
    margin: int = 2


@dataclass(frozen=True, slots=True)
class ElasticPolicy:
    """Demand-driven roles, decided afresh from every snapshot.

    1. Rollout first: queries the staleness bound lets start get room, taken from spare cells, then
       from train cells (the bound already keeps rollouts from running away from the trainer).
    2. The trainer gets the cells its backlog needs to be cleared within `train_horizon_s`; once
       its batch is complete (the backlog is then on the critical path) it gets every cell rollout
       can spare, by consolidating live sessions onto fewer rollout cells up to `pack_fill` of KV.
    3. Cells training does not need go back to rollout, and sessions are spread over them: decode
       is faster on a lightly loaded cell, and the long tail is what the step waits for.
    Hysteresis: the train pool shrinks only when it exceeds its target by `margin` cells, a cell does
    not leave a role within `min_dwell_s`, and a consolidation must buy `payback` times its cost.

    Two options turn it into the closest peer's behaviour (verl's step switching), for comparison:
    `transfer="recompute"` moves sessions by aborting them and prefilling their history again on the target
    instead of carrying their KV over, and `gate="step"` replaces the payback test with verl's gate: a train cell
    returns to rollout only while the trainer's current batch still has unfinished executions and those,
    times the measured wait per execution, times the train pool's share of the budget, outweigh a round trip
    of switches; a cell leaves rollout for the trainer whenever it is wanted there (docs/simulator.md).
    """

    fill: float = 0.9  # KV fraction new sessions may reserve on a cell
    pack_fill: float = 0.9  # KV fraction consolidation may pack a cell to
    train_horizon_s: float = 1_200.0
    min_dwell_s: float = 300.0
    payback: float = 2.0
    margin: int = 2
    max_moves: int = 256  # migrations per decision when spreading load
    critical_weight: float = 2.0  # load weight of the current batch's sessions when spreading
    transfer: Literal["kv", "recompute"] = "kv"  # how a session moves: its KV, or its history prefilled again
    gate: Literal["payback", "step"] = "payback"  # what a switch must clear: see the class docstring
    name: str = "elastic"
    allows_parking: bool = False

    def decide(self, snapshot: Snapshot) -> list[Action]:
        cells = sorted(snapshot.cells, key=lambda c: c.cell_id)
        in_budget = sum(1 for c in cells if c.role is not Role.IDLE)
        spare = [c for c in cells if c.role is Role.IDLE][: max(0, snapshot.budget_cells - in_budget)]
        room = Room.of(snapshot, self.fill)
        reserve = max(1, snapshot.session_kv_reserve_tokens)
        trainer = snapshot.trainer
        work_now = trainer.backlog_tokens > 0
        actions: list[Action] = []

        # 1. Grow rollout when the queries allowed to start do not fit in what rollout has or gets.
        incoming = [c for c in cells if c.role is Role.ROLLOUT and c.state is CellState.SWITCHING]
        slots = sum(max(0, room.free(c.cell_id)) // reserve for c in cells if accepting(c))
        slots += sum(self._empty_slots(c, reserve) for c in incoming)
        deficit = pending_sessions(snapshot) - slots
        moved: set[str] = set()
        if deficit > 0:
            trainers = [c for c in cells if c.role is Role.TRAIN and c.state is CellState.ACTIVE]
            if work_now:
                trainers = trainers[1:]  # keep the trainer alive while it has work
            if not self._back_to_rollout_pays(snapshot, cells):
                trainers = []
            donors = spare + trainers
            donors += [c for c in cells if c.role is Role.ROLLOUT and c.state is CellState.DRAINING]
            for cell in donors:
                if deficit <= 0:
                    break
                actions.append(AssignCell(cell.cell_id, Role.ROLLOUT))
                moved.add(cell.cell_id)
                deficit -= self._empty_slots(cell, reserve) - max(0, room.reserved[cell.cell_id]) // reserve

        # 2. Start what fits now.
        started = dispatch_onto(snapshot, room, [c.cell_id for c in cells if accepting(c)])
        actions += started
        placed = {cid for a in started if isinstance(a, DispatchQuery) for cid in a.placements}
        waiting = pending_sessions(snapshot) - sum(len(a.placements) for a in started if isinstance(a, DispatchQuery))
        if waiting > 0:
            # Rollout has claimed what it can use; spare cells left over serve the trainer's backlog.
            if work_now:
                actions += [AssignCell(c.cell_id, Role.TRAIN) for c in spare if c.cell_id not in moved]
            return actions

        # 3. Size the train pool to its work.
        n_train = sum(1 for c in cells if c.role is Role.TRAIN)
        if trainer.batch_complete and trainer.policy_version < trainer.steps_total:
            target = snapshot.budget_cells
        elif work_now and trainer.tokens_per_cell_s > 0:
            target = math.ceil(trainer.backlog_tokens / (trainer.tokens_per_cell_s * self.train_horizon_s))
        elif work_now:
            target = snapshot.budget_cells
        else:
            target = 0
        for cell in spare:
            if cell.cell_id in moved:
                continue
            role = Role.TRAIN if (n_train < target or not snapshot.live) else Role.ROLLOUT
            actions.append(AssignCell(cell.cell_id, role))
            n_train += role is Role.TRAIN
        if n_train < target:
            actions += self._consolidate(snapshot, cells, room, placed | moved, target - n_train)
        elif n_train > target + self.margin and snapshot.live and self._back_to_rollout_pays(snapshot, cells):
            actions += self._release_trainers(snapshot, cells, n_train - target)
        actions += self._spread(snapshot, cells, room, actions)
        if work_now:
            actions += self._empty_to_train(snapshot, cells, actions, placed | moved)
        return actions

    def _empty_to_train(
        self, snapshot: Snapshot, cells: list[CellView], so_far: list[Action], keep: set[str]
    ) -> list[Action]:
        """A rollout cell left with no session and none arriving trains rather than idles."""
        touched = {a.cell_id for a in so_far if isinstance(a, AssignCell)}
        touched |= {a.to_cell for a in so_far if isinstance(a, MigrateSession)}
        occupied = {e.cell_id for e in snapshot.live}
        return [
            AssignCell(c.cell_id, Role.TRAIN)
            for c in cells
            if accepting(c)
            and c.cell_id not in touched | keep | occupied
            and self._dwelled(snapshot, c)
        ]

    def _empty_slots(self, cell: CellView, reserve: int) -> int:
        return int(cell.kv_capacity_tokens * self.fill) // reserve

    def _dwelled(self, snapshot: Snapshot, cell: CellView) -> bool:
        return snapshot.now_s - cell.role_since_s >= self.min_dwell_s

    def _release_trainers(self, snapshot: Snapshot, cells: list[CellView], count: int) -> list[Action]:
        """Idle train cells go back to rollout, where they take load off the busiest cells."""
        idle = [c for c in cells if c.role is Role.TRAIN and c.state is CellState.ACTIVE and self._dwelled(snapshot, c)]
        return [AssignCell(c.cell_id, Role.ROLLOUT) for c in idle[:count]]

    def _consolidate(
        self, snapshot: Snapshot, cells: list[CellView], room: Room, keep: set[str], wanted: int
    ) -> list[Action]:
        """Release up to `wanted` rollout cells to training, emptiest first, migrating their sessions."""
        on_cell: dict[str, list[LiveExecution]] = defaultdict(list)
        for e in snapshot.live:
            on_cell[e.cell_id].append(e)
        pack = Room(
            reserved=dict(room.reserved),
            limit={c.cell_id: int(c.kv_capacity_tokens * self.pack_fill) for c in cells},
        )
        rollout = [c for c in cells if c.role is Role.ROLLOUT and c.state is not CellState.SWITCHING]
        n_train = sum(1 for c in cells if c.role is Role.TRAIN)
        costs = snapshot.switch_costs
        candidates = [c for c in rollout if c.cell_id not in keep and self._dwelled(snapshot, c)]
        candidates.sort(key=lambda c: (room.reserved[c.cell_id], c.cell_id))
        receivers = {c.cell_id for c in rollout if accepting(c)}
        received: set[str] = set()
        actions: list[Action] = []
        for cell in candidates:
            if wanted <= 0:
                break
            if cell.cell_id in received:
                continue  # it took sessions from an emptier cell in this decision
            sessions = on_cell.get(cell.cell_id, [])
            if any(e.migrating for e in sessions):
                continue  # a session whose KV is in flight is moved again only once it has landed
            plan = self._plan_moves(snapshot, sessions, cell.cell_id, pack, receivers)
            if plan is None:
                break  # cells are tried emptiest first: if this one does not fit, fuller ones will not
            if sessions and self.gate == "payback":
                cost_s = self._move_s(snapshot, plan) + costs.to_train_s + costs.to_rollout_s
                if self._training_horizon_s(snapshot, n_train + 1) < self.payback * cost_s:
                    break
            for e, dst in plan:
                need = snapshot.reserved_tokens(e)
                pack.reserved[dst] += need
                pack.reserved[cell.cell_id] -= need
                actions.append(MigrateSession(e.execution_id, cell.cell_id, dst, self.transfer))
                received.add(dst)
            receivers.discard(cell.cell_id)
            actions.append(AssignCell(cell.cell_id, Role.TRAIN))
            wanted -= 1
            n_train += 1
        # Keep the shared bookkeeping in step for the spreading pass.
        room.reserved.update(pack.reserved)
        return actions

    def _plan_moves(
        self,
        snapshot: Snapshot,
        sessions: list[LiveExecution],
        source: str,
        pack: Room,
        receivers: set[str],
    ) -> list[tuple[LiveExecution, str]] | None:
        """Best-fit-decreasing placement of a cell's sessions on the other receivers, or None."""
        if not sessions:
            return []
        free = {c: pack.free(c) for c in receivers if c != source}
        plan: list[tuple[LiveExecution, str]] = []
        for e in sorted(sessions, key=lambda e: (-snapshot.reserved_tokens(e), e.execution_id)):
            need = snapshot.reserved_tokens(e)
            fits = [(f, c) for c, f in free.items() if f >= need]
            if not fits:
                return None
            _, dst = min(fits)
            free[dst] -= need
            plan.append((e, dst))
        return plan

    def _spread(self, snapshot: Snapshot, cells: list[CellView], room: Room, so_far: list[Action]) -> list[Action]:
        """Even out KV load across the rollout cells that stay, busiest cell to emptiest."""
        leaving = {a.cell_id for a in so_far if isinstance(a, AssignCell)}
        moving = {a.execution_id for a in so_far if isinstance(a, MigrateSession)}
        targets = [c.cell_id for c in cells if accepting(c) and c.cell_id not in leaving]
        if len(targets) < 2:
            return []
        on_cell: dict[str, list[LiveExecution]] = defaultdict(list)
        for e in snapshot.live:
            if e.execution_id not in moving and not e.migrating:
                on_cell[e.cell_id].append(e)
        # Sessions of the batch the trainer waits for are the critical path: they count
        # `critical_weight` times, so spreading leaves them on lighter (faster) cells.
        version = snapshot.trainer.policy_version

        def weight(e: LiveExecution) -> float:
            need = snapshot.reserved_tokens(e)
            return need * self.critical_weight if e.batch == version else float(need)

        real = {c: room.reserved[c] for c in targets}
        load = {c: float(room.reserved[c]) for c in targets}
        for c in targets:
            load[c] += sum(weight(e) - snapshot.reserved_tokens(e) for e in on_cell[c])
        mean = sum(load.values()) / len(targets)
        reserve = max(1, snapshot.session_kv_reserve_tokens)
        # Two lazy heaps find the busiest and the emptiest cell in O(log n) per move.
        high = [(-v, c) for c, v in load.items()]
        low = [(v, c) for c, v in load.items()]
        heapq.heapify(high)
        heapq.heapify(low)
        actions: list[Action] = []
        while len(actions) < self.max_moves and high and low:
            neg, hi = high[0]
            if -neg != load[hi]:
                heapq.heappop(high)
                continue
            lo_load, lo = low[0]
            if lo_load != load[lo]:
                heapq.heappop(low)
                continue
            if load[hi] - mean < reserve or mean - load[lo] < reserve or not on_cell[hi]:
                break
            # Move the lightest non-critical session first: critical ones stay where they run.
            e = min(on_cell[hi], key=lambda e: (e.batch == version, snapshot.reserved_tokens(e), e.execution_id))
            need = snapshot.reserved_tokens(e)
            w = weight(e)
            if real[lo] + need > room.limit[lo] or load[lo] + w >= load[hi]:
                break
            on_cell[hi].remove(e)
            real[hi] -= need
            real[lo] += need
            load[hi] -= w
            load[lo] += w
            heapq.heappush(high, (-load[hi], hi))
            heapq.heappush(low, (load[lo], lo))
            heapq.heappush(high, (-load[lo], lo))
            heapq.heappush(low, (load[hi], hi))
            actions.append(MigrateSession(e.execution_id, hi, lo, self.transfer))
        return actions

    def _move_s(self, snapshot: Snapshot, plan: list[tuple[LiveExecution, str]]) -> float:
        """How long moving a cell's sessions keeps them from decoding: KV moves run side by side, each at the
        migration rate; recomputes queue on their target, whose prefill they share."""
        costs = snapshot.switch_costs
        if self.transfer == "kv":
            return max(snapshot.reserved_tokens(e) for e, _ in plan) / costs.migration_tokens_per_s
        per_target: dict[str, int] = defaultdict(int)
        for e, dst in plan:
            per_target[dst] += e.context_tokens
        return max(per_target.values()) / costs.prefill_tokens_per_s

    def _back_to_rollout_pays(self, snapshot: Snapshot, cells: list[CellView]) -> bool:
        """Whether train cells may go back to rollout: always under the payback gate; under the step gate only
        while the trainer waits on executions of its batch and the wait they would save outweighs a round trip.

        The saving is verl's estimate: executions still to finish × measured wait per execution × the share of
        the budget the train pool holds (the extra rollout capacity it brings). Without a measured wait yet the
        gate is open, as verl's is before it has history.
        """
        if self.gate == "payback":
            return True
        trainer = snapshot.trainer
        if trainer.batch_complete or trainer.policy_version >= trainer.steps_total:
            return False
        version = trainer.policy_version
        remaining = sum(1 for e in snapshot.live if e.batch == version)
        first_after = (version + 1) * snapshot.batch_queries
        undispatched = max(0, first_after - max(snapshot.queries_dispatched, version * snapshot.batch_queries))
        remaining += undispatched * (snapshot.queued[0].group_size if snapshot.queued else 0)
        if remaining == 0:
            return False
        if trainer.sample_wait_s <= 0:
            return True
        n_train = sum(1 for c in cells if c.role is Role.TRAIN)
        share = n_train / max(1, snapshot.budget_cells)
        costs = snapshot.switch_costs
        return remaining * trainer.sample_wait_s * share > costs.to_rollout_s + costs.to_train_s

    def _training_horizon_s(self, snapshot: Snapshot, train_cells: int) -> float:
        """How long the training work in sight keeps `train_cells` busy (inf when unmeasured)."""
        rate = snapshot.trainer.tokens_per_cell_s * train_cells
        if rate <= 0:
            return math.inf
        version = snapshot.trainer.policy_version
        coming = sum(e.context_tokens for e in snapshot.live if e.batch == version)
        return (snapshot.trainer.backlog_tokens + coming) / rate
