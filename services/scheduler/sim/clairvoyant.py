"""A clairvoyant reference schedule for the simulator: deadline-aware packing with every duration known.

Not a policy the live scheduler can run: it reads each execution's nominal duration and final context from
the sampled workload. It answers how close *any* schedule gets to the lower bound when the future is known,
which separates the bound's optimism from the price of not knowing durations (docs/simulator.md, item 3).

Each batch gets a deadline: the time the staleness bound releases it plus `slack` × its slowest execution's
time alone on a cell.
A session's tolerance is the largest cell context at which its remaining work still meets that deadline,
`(time left / work left − a) / β` under the engine's decode law; a cell's sessions must all tolerate the
cell's context an hour ahead. Sessions are placed least tolerant first on the fullest cell that fits,
sessions on a cell past its tolerance are moved out most tolerant first, and a waiting trainer gets every
cell whose sessions all fit elsewhere. It respects the admission reserve, the staleness bound and the budget
like every policy (the engine validates its actions).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from services.scheduler.policies.actions import Action, AssignCell, DispatchQuery, MigrateSession
from services.scheduler.policies.base import Room, accepting
from services.scheduler.policies.snapshot import CellState, Snapshot
from services.scheduler.sim.bounds import DecodeLaw, alone_seconds
from services.scheduler.sim.workload import Preset, Workload
from shared.cells import Role


@dataclass
class ClairvoyantPolicy:
    preset: Preset
    workload: Workload
    slack: float = 1.1  # batch deadline = release + slack × its slowest execution alone
    horizon_s: float = 3_600.0  # a cell must tolerate its sessions' context this far (nominal) ahead
    fill: float = 0.95  # context fraction of capacity a cell is packed to at most
    name: str = "clairvoyant"
    allows_parking: bool = False
    _released_at: dict[int, float] = field(default_factory=dict)  # per batch; one policy object per run

    def __post_init__(self) -> None:
        self.law = DecodeLaw.of(self.preset)
        l0 = float(self.preset.prompt_tokens)
        dur = self.workload.duration_s.astype(float)
        self.slope = (self.workload.context_tokens.astype(float) - l0) / dur
        alone = alone_seconds(self.preset, self.workload)
        per_batch = self.preset.batch_queries * self.preset.group_size
        self.batch_alone = [float(alone[i : i + per_batch].max()) for i in range(0, len(alone), per_batch)]

    def _row(self, execution_id: str) -> int:
        return int(execution_id[1:])  # the engine names execution `row` of the workload "s<row>"

    def _batch(self, row: int) -> int:
        return row // (self.preset.batch_queries * self.preset.group_size)

    def _tolerance(self, row: int, context: float, now: float) -> tuple[float, float]:
        """(largest cell context the session tolerates, its context `horizon_s` of progress ahead)."""
        b = self._batch(row)
        start = self._released_at.get(b, now)
        l0 = float(self.preset.prompt_tokens)
        slope = float(self.slope[row])
        done = (context - l0) / slope if slope > 0 else 0.0
        left = max(1.0, float(self.workload.duration_s[row]) - done)
        w_needed = (start + self.slack * self.batch_alone[b] - now) / left
        tolerance = (w_needed - self.law.a) / self.law.beta if w_needed > self.law.a else 0.0
        ahead = min(float(self.workload.context_tokens[row]), context + slope * self.horizon_s)
        return tolerance, ahead

    def decide(self, snapshot: Snapshot) -> list[Action]:
        cells = sorted(snapshot.cells, key=lambda c: c.cell_id)
        in_budget = sum(1 for c in cells if c.role is not Role.IDLE)
        idle = [c for c in cells if c.role is Role.IDLE][: max(0, snapshot.budget_cells - in_budget)]
        if idle:
            return [AssignCell(c.cell_id, Role.ROLLOUT) for c in idle]
        now = snapshot.now_s
        cap = self.fill * self.law.capacity
        room = Room.of(snapshot, 1.0)  # the admission reserve, as the engine checks it
        reserve = snapshot.session_kv_reserve_tokens
        acc = [c.cell_id for c in cells if accepting(c)]
        members: dict[str, list[int]] = defaultdict(list)
        info: dict[int, tuple[float, float]] = {}
        need: dict[int, int] = {}
        moving: set[int] = set()
        for e in snapshot.live:
            row = self._row(e.execution_id)
            info[row] = self._tolerance(row, float(e.context_tokens), now)
            need[row] = snapshot.reserved_tokens(e)
            members[e.cell_id].append(row)
            if e.migrating:
                moving.add(row)
        load = {c: sum(info[r][1] for r in members[c]) for c in acc}
        limit = {c: min([cap, *(info[r][0] for r in members[c])]) for c in acc}

        def fits(cell: str, row: int) -> bool:
            tolerance, ahead = info[row]
            return load[cell] + ahead <= min(limit[cell], tolerance) and room.free(cell) >= need[row]

        def put(cell: str, row: int) -> None:
            members[cell].append(row)
            load[cell] += info[row][1]
            limit[cell] = min(limit[cell], info[row][0])
            room.reserved[cell] += need[row]

        def take(cell: str, row: int) -> None:
            members[cell].remove(row)
            load[cell] -= info[row][1]
            limit[cell] = min([cap, *(info[r][0] for r in members[cell])])
            room.reserved[cell] -= need[row]

        def best_cell(row: int, among: list[str]) -> str | None:
            ok = [c for c in among if members[c] and fits(c, row)]
            if ok:
                return max(ok, key=lambda c: (load[c], c))  # the fullest cell that still fits
            empty = [c for c in among if not members[c] and room.free(c) >= need[row]]
            if empty:
                return empty[0]
            spare = [c for c in among if room.free(c) >= need[row]]  # nothing fits: the least loaded with room
            return min(spare, key=lambda c: (load[c] / max(1.0, limit[c]), c)) if spare else None

        actions: list[Action] = []
        touched: set[str] = set()
        # 1. Cells past the tolerance of a session on them shed their most tolerant sessions.
        evicted: list[tuple[int, str]] = []
        for cell in acc:
            for row in sorted((r for r in members[cell] if r not in moving), key=lambda r: -info[r][0]):
                if len(members[cell]) <= 1 or load[cell] <= limit[cell]:
                    break
                take(cell, row)
                evicted.append((row, cell))
        # A cell that sheds does not receive: the engine applies moves in order, so room it frees by a later
        # move is not there yet for an earlier one.
        shedding = {src for _, src in evicted}
        receivers = [c for c in acc if c not in shedding]
        for row, src in sorted(evicted, key=lambda x: info[x[0]][0]):
            dst = best_cell(row, receivers)
            if dst is None:
                put(src, row)
                continue
            put(dst, row)
            actions.append(MigrateSession(f"s{row}", src, dst))
            touched |= {src, dst}
        # 2. Queries the staleness bound lets start, in order, each only if its whole group finds room.
        g = self.preset.group_size
        for query in snapshot.queued[: snapshot.dispatch_room()]:
            q = int(query.query_id[1:])
            rows = list(range(q * g, q * g + g))
            # The deadline runs from the batch's release by the staleness bound, as in the bound's chain: a
            # batch still waiting for room is already late.
            self._released_at.setdefault(self._batch(rows[0]), now)
            for row in rows:
                info[row] = self._tolerance(row, float(self.preset.prompt_tokens), now)
                need[row] = reserve
            places: list[tuple[int, str]] = []
            for row in sorted(rows, key=lambda r: info[r][0]):
                dst = best_cell(row, acc)
                if dst is None:
                    break
                put(dst, row)
                places.append((row, dst))
            if len(places) < g:
                for row, dst in places:
                    take(dst, row)
                break
            by_row = dict(places)
            actions.append(DispatchQuery(query.query_id, snapshot.trainer.policy_version, tuple(by_row[r] for r in rows)))
            touched |= set(by_row.values())
        # 3. Training: a waiting trainer gets every untouched cell whose sessions all fit elsewhere; none otherwise.
        trainer = snapshot.trainer
        work = trainer.backlog_tokens > 0 or (trainer.batch_complete and trainer.policy_version < trainer.steps_total)
        trainers = [c for c in cells if c.role is Role.TRAIN and c.state is CellState.ACTIVE]
        if not work:
            return actions + [AssignCell(c.cell_id, Role.ROLLOUT) for c in trainers]
        if not acc and snapshot.dispatch_room() > 0:
            return actions + [AssignCell(c.cell_id, Role.ROLLOUT) for c in trainers[1:2]]
        training: set[str] = set()
        for cell in sorted(acc, key=lambda c: (load[c], c)):
            rows = list(members[cell])
            if cell in touched or any(r in moving for r in rows):
                continue
            others = [c for c in acc if c != cell and c not in training]
            plan: list[tuple[int, str]] = []
            for row in sorted(rows, key=lambda r: info[r][0]):
                ok = [c for c in others if members[c] and fits(c, row)]
                if not ok:
                    break
                dst = max(ok, key=lambda c: (load[c], c))
                put(dst, row)
                plan.append((row, dst))
            if len(plan) < len(rows):
                for row, dst in plan:
                    take(dst, row)
                continue
            for row, dst in plan:
                members[cell].remove(row)
                actions.append(MigrateSession(f"s{row}", cell, dst))
                touched.add(dst)
            load[cell] = 0.0
            training.add(cell)
            actions.append(AssignCell(cell, Role.TRAIN))
        return actions
