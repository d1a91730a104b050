"""Replay: rebuild trajectory trees and batches from an execution log, export/import the log as JSONL, and
verify determinism by digest. Pure: events and a blob getter in, reports out (the CLI does the I/O)."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from services.trajectory.advantages import ExecutionReward, compute_advantages
from services.trajectory.state import (
    BatchParams,
    BlobGetter,
    LogError,
    RunLog,
    assemble_step_batch,
    execution_tree,
)
from services.trajectory.tree import TrajectoryTree
from shared.batch import MicroBatch, TrainingBatch
from shared.events import (
    BatchReady,
    BlobRef,
    CallCompleted,
    Event,
    EventError,
    ExecutionScored,
    ExecutionStarted,
    parse_event,
)
from shared.tokens import digest_of

LOG_FORMAT = "gyre-execution-log"
LOG_FORMAT_VERSION = 1


class ReplayError(Exception):
    """Replay could not run: a bad selection, or a log that cannot be read."""


class CorruptLog(ReplayError):
    """The log (file or tables) is malformed, incomplete, or a blob does not match its digest."""


class ReplayDivergence(ReplayError):
    """Two builds that must be byte-identical differ; says where first."""

    def __init__(self, what: str, where: str, expected: object, actual: object) -> None:
        super().__init__(f"{what} diverged at {where}: expected {expected!r}, got {actual!r}")
        self.what = what
        self.where = where
        self.expected = expected
        self.actual = actual


# ---- selection -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Selection:
    execution: str | None = None
    query: str | None = None
    step: int | None = None
    run: str | None = None

    def describe(self) -> str:
        for name in ("execution", "query", "step", "run"):
            value = getattr(self, name)
            if value is not None:
                return f"{name} {value}"
        return "the whole log"


def _event_execution(event: Event) -> str | None:
    return getattr(event.data, "execution_id", None)


def select_events(events: Sequence[Event], selection: Selection) -> list[Event]:
    """The events a replay of `selection` needs (its executions, their queries, the step's batch)."""
    if selection.run is not None:
        events = [e for e in events if e.run_id == selection.run]
    log = RunLog()
    try:
        log.apply_all(events)
    except LogError as exc:
        raise CorruptLog(str(exc)) from exc
    if selection.execution is not None:
        known = selection.execution in log.executions
        wanted = {selection.execution} if known else set()
        query_ids: set[str | None] = {log.executions[selection.execution].query_id} if known else set()
        steps: set[int] = set()
    elif selection.query is not None:
        q = log.queries.get(selection.query)
        wanted = set(q.execution_ids) if q else set()
        query_ids, steps = {selection.query}, set()
    elif selection.step is not None:
        wanted = {e for q in log.step_queries(selection.step) for e in q.execution_ids}
        query_ids = {q.query_id for q in log.step_queries(selection.step)}
        steps = {selection.step}
    else:
        return list(events)
    if not wanted:
        raise ReplayError(f"nothing in the log matches {selection.describe()}")
    query_ids.discard(None)
    # Group siblings' start and score events come along so advantages can be shown for a single execution.
    siblings = {x for q in query_ids if q in log.queries for x in log.queries[q].execution_ids} - wanted
    out = []
    for e in events:
        d = e.data
        if _event_execution(e) in wanted and not isinstance(d, BatchReady):
            out.append(e)
        elif _event_execution(e) in siblings and isinstance(d, (ExecutionStarted, ExecutionScored)):
            out.append(e)
        elif getattr(d, "query_id", None) in query_ids and _event_execution(e) is None:
            out.append(e)  # query.dispatched
        elif isinstance(d, BatchReady) and d.step in steps:
            out.append(e)
    return out


# ---- replay --------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class ExecutionReplay:
    execution_id: str
    query_id: str | None
    step: int | None
    status: str  # finished | timed_out | running
    reward: float | None
    advantage: float | None
    tree: TrajectoryTree
    digest: str


@dataclass(frozen=True, eq=False)
class BatchReplay:
    step: int
    live_digest: str | None  # from batch.ready, when the live service emitted one
    rebuilt: TrainingBatch | None
    rebuilt_digest: str | None
    live: TrainingBatch | None = None


@dataclass(frozen=True, eq=False)
class ReplayReport:
    selection: Selection
    executions: tuple[ExecutionReplay, ...]
    batches: tuple[BatchReplay, ...] = field(default_factory=tuple)


def _get_checked(get_blob: BlobGetter, ref: BlobRef, what: str) -> bytes:
    try:
        blob = get_blob(ref)
    except KeyError as exc:
        raise CorruptLog(f"{what}: blob {ref.digest} is not in the log") from exc
    actual = digest_of(blob)
    if actual != ref.digest:
        raise CorruptLog(f"{what}: blob should have digest {ref.digest}, reads back as {actual}")
    return blob


def replay(events: Sequence[Event], get_blob: BlobGetter, selection: Selection = Selection()) -> ReplayReport:
    """Rebuild the trees of the selected executions, and each selected step's batch when one was emitted.

    Steps are numbered per run, so a log of several runs is replayed run by run (its steps and batches would
    otherwise mix) unless the selection names one.
    """
    runs = sorted({e.run_id for e in events})
    if selection.run is None and len(runs) > 1:
        parts = [replay(events, get_blob, replace(selection, run=run)) for run in runs]
        return ReplayReport(selection, tuple(x for p in parts for x in p.executions),
                            tuple(b for p in parts for b in p.batches))
    chosen = select_events(events, selection)
    log = RunLog()
    try:
        log.apply_all(chosen)
    except LogError as exc:
        raise CorruptLog(str(exc)) from exc
    # Advantages for display: per query, over the group's scored executions.
    complete_groups = {
        q.query_id for q in log.queries.values()
        if sum(1 for x in q.execution_ids if log.executions[x].reward is not None) >= q.group_size
    }
    rewards = [
        ExecutionReward(s.execution_id, s.query_id, s.reward, s.timed_out)
        for s in log.executions.values()
        if s.reward is not None and s.query_id in complete_groups and s.infra_failure is None
    ]
    advantages = compute_advantages(rewards).by_execution() if rewards else {}
    replays = []
    trees: dict[str, TrajectoryTree] = {}
    for execution_id in sorted(log.executions, key=lambda e: _sort_key(log, e)):
        state = log.executions[execution_id]
        if not state.calls and state.ended is None:
            continue
        try:
            tree = execution_tree(state, get_blob)
        except LogError as exc:
            raise CorruptLog(str(exc)) from exc
        trees[execution_id] = tree
        adv = advantages.get(execution_id)
        replays.append(
            ExecutionReplay(
                execution_id=execution_id,
                query_id=state.query_id,
                step=state.step,
                status=state.ended or "running",
                reward=state.reward,
                advantage=adv.advantage if adv else None,
                tree=tree,
                digest=tree.digest(),
            )
        )
    batches = []
    for step, event in sorted(log.batches.items()):
        assert isinstance(event.data, BatchReady)
        ref = event.data.batch
        live = TrainingBatch.decode(_get_checked(get_blob, ref, f"batch of step {step}"))
        params = BatchParams.from_meta(live.meta)
        try:
            rebuilt = assemble_step_batch(log, step, get_blob, params, trees)
        except LogError as exc:
            raise CorruptLog(str(exc)) from exc
        batches.append(BatchReplay(step, ref.digest, rebuilt, rebuilt.digest(), live))
    return ReplayReport(selection, tuple(replays), tuple(batches))


def _sort_key(log: RunLog, execution_id: str) -> tuple[int, str, int, str]:
    s = log.executions[execution_id]
    return (s.step if s.step is not None else -1, s.query_id or "", s.sample_index, execution_id)


# ---- determinism ---------------------------------------------------------------------------------


def _first_array_difference(name: str, a: np.ndarray, b: np.ndarray) -> ReplayDivergence | None:
    if a.shape != b.shape:
        n = min(a.shape[0], b.shape[0])
        diff = np.flatnonzero(a[:n] != b[:n])
        where = int(diff[0]) if diff.size else n
        return ReplayDivergence(f"{name} (length {a.shape[0]} vs {b.shape[0]})", f"position {where}",
                                a[where].item() if where < a.shape[0] else "<end>",
                                b[where].item() if where < b.shape[0] else "<end>")
    if a.dtype.kind == "f" and a.dtype == b.dtype:
        kind = f"<i{a.dtype.itemsize}"
        diff = np.flatnonzero(a.view(kind) != b.view(kind))  # bitwise, so NaN and -0.0 count
    else:
        diff = np.flatnonzero(a != b)
    if diff.size:
        i = int(diff[0])
        return ReplayDivergence(name, f"position {i}", a[i].item(), b[i].item())
    return None


def tree_difference(expected: TrajectoryTree, actual: TrajectoryTree) -> ReplayDivergence | None:
    for (name, a), (_, b) in zip(expected.canonical_arrays(), actual.canonical_arrays(), strict=True):
        found = _first_array_difference(f"tree {expected.execution_id} {name}", a, b)
        if found is not None:
            return found
    for i, (pa, pb) in enumerate(zip(expected.calls, actual.calls, strict=False)):
        if pa != pb:
            return ReplayDivergence(f"tree {expected.execution_id} call placement", f"call {i}", pa, pb)
    if len(expected.calls) != len(actual.calls):
        return ReplayDivergence(f"tree {expected.execution_id} calls", "count", len(expected.calls), len(actual.calls))
    return None


def batch_difference(expected: TrainingBatch, actual: TrainingBatch) -> ReplayDivergence | None:
    if expected.step != actual.step:
        return ReplayDivergence("batch step", "header", expected.step, actual.step)
    for i, (ea, eb) in enumerate(zip(expected.executions, actual.executions, strict=False)):
        if ea != eb:
            return ReplayDivergence(f"batch {expected.step} executions", f"entry {i}", ea, eb)
    if len(expected.executions) != len(actual.executions):
        return ReplayDivergence(f"batch {expected.step} executions", "count", len(expected.executions),
                                len(actual.executions))
    if len(expected.micro_batches) != len(actual.micro_batches):
        return ReplayDivergence(f"batch {expected.step} micro-batches", "count", len(expected.micro_batches),
                                len(actual.micro_batches))
    for m, (ma, mb) in enumerate(zip(expected.micro_batches, actual.micro_batches, strict=True)):
        for name in MicroBatch._ARRAYS:
            found = _first_array_difference(f"batch {expected.step} micro-batch {m} {name}",
                                            getattr(ma, name), getattr(mb, name))
            if found is not None:
                return found
    if expected.meta != actual.meta:
        keys = sorted(set(expected.meta) | set(actual.meta))
        key = next(k for k in keys if expected.meta.get(k) != actual.meta.get(k))
        return ReplayDivergence(f"batch {expected.step} meta", key, expected.meta.get(key), actual.meta.get(key))
    if expected.digest() != actual.digest():
        return ReplayDivergence(f"batch {expected.step}", "encoding", expected.digest(), actual.digest())
    return None


def verify(events: Sequence[Event], get_blob: BlobGetter, selection: Selection = Selection()) -> ReplayReport:
    """Replay twice and against the live batches; raise ReplayDivergence at the first difference."""
    first = replay(events, get_blob, selection)
    second = replay(events, get_blob, selection)
    for a, b in zip(first.executions, second.executions, strict=True):
        if a.digest != b.digest:
            found = tree_difference(a.tree, b.tree)
            raise found or ReplayDivergence(f"tree {a.execution_id}", "digest", a.digest, b.digest)
    for ba, bb in zip(first.batches, second.batches, strict=True):
        if ba.rebuilt_digest != bb.rebuilt_digest:
            assert ba.rebuilt is not None and bb.rebuilt is not None
            found = batch_difference(ba.rebuilt, bb.rebuilt)
            raise found or ReplayDivergence(f"batch {ba.step}", "digest", ba.rebuilt_digest, bb.rebuilt_digest)
    for batch in first.batches:
        if batch.live is not None and batch.rebuilt is not None and batch.live_digest != batch.rebuilt_digest:
            found = batch_difference(batch.live, batch.rebuilt)
            raise found or ReplayDivergence(f"batch {batch.step} (live vs replay)", "digest", batch.live_digest,
                                            batch.rebuilt_digest)
    return first


# ---- export / import -----------------------------------------------------------------------------


def referenced_blobs(events: Iterable[Event]) -> list[BlobRef]:
    refs: dict[str, BlobRef] = {}
    for e in events:
        if isinstance(e.data, CallCompleted):
            refs.setdefault(e.data.record.digest, e.data.record)
        elif isinstance(e.data, BatchReady):
            refs.setdefault(e.data.batch.digest, e.data.batch)
    return list(refs.values())


def export_lines(events: Sequence[Event], get_blob: BlobGetter) -> list[str]:
    """The JSONL lines of a log file: a header, every blob the events reference (base64), then the events."""
    lines = [json.dumps({"format": LOG_FORMAT, "version": LOG_FORMAT_VERSION, "events": len(events)},
                        sort_keys=True)]
    for ref in sorted(referenced_blobs(events), key=lambda r: r.digest):
        data = _get_checked(get_blob, ref, "export")
        lines.append(json.dumps({"blob": {"digest": ref.digest, "media_type": ref.media_type,
                                          "data": base64.b64encode(data).decode()}}, sort_keys=True))
    for e in events:
        lines.append(json.dumps({"event": e.to_dict()}, sort_keys=True, separators=(",", ":")))
    return lines


def export_text(events: Sequence[Event], get_blob: BlobGetter) -> str:
    return "\n".join(export_lines(events, get_blob)) + "\n"


@dataclass(frozen=True)
class LoadedLog:
    events: list[Event]
    blobs: dict[str, bytes]

    def get_blob(self, ref: BlobRef) -> bytes:
        return self.blobs[ref.digest]


def import_text(text: str) -> LoadedLog:
    """Parse a log file; every problem is a CorruptLog naming the line."""
    events: list[Event] = []
    blobs: dict[str, bytes] = {}
    header_seen = False
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CorruptLog(f"line {number}: not JSON ({exc})") from exc
        if not isinstance(obj, dict):
            raise CorruptLog(f"line {number}: expected a JSON object")
        if "format" in obj:
            if obj["format"] != LOG_FORMAT or obj.get("version") != LOG_FORMAT_VERSION:
                raise CorruptLog(
                    f"line {number}: expected format {LOG_FORMAT} v{LOG_FORMAT_VERSION}, got "
                    f"{obj.get('format')} v{obj.get('version')}"
                )
            header_seen = True
        elif "blob" in obj:
            b = obj["blob"]
            try:
                data = base64.b64decode(b["data"], validate=True)
                digest = b["digest"]
            except (KeyError, TypeError, ValueError) as exc:
                raise CorruptLog(f"line {number}: malformed blob entry ({exc})") from exc
            if digest_of(data) != digest:
                raise CorruptLog(f"line {number}: blob should have digest {digest}, reads back as {digest_of(data)}")
            blobs[digest] = data
        elif "event" in obj:
            try:
                events.append(parse_event(obj["event"]))
            except EventError as exc:
                raise CorruptLog(f"line {number}: {exc}") from exc
        else:
            raise CorruptLog(f"line {number}: expected a header, a blob or an event, got keys {sorted(obj)}")
    if not header_seen:
        raise CorruptLog(f"no {LOG_FORMAT} header line: this is not a Gyre execution log")
    return LoadedLog(events, blobs)
