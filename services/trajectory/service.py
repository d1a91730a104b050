"""The trajectory service shell: folds the execution log, builds trees as executions finish, and emits one
`batch.ready` per training step once the step's groups are complete. All decisions come from the pure core
(`state`, `tree_builder`, `training_batch`, `shared.packing`); this file only moves events and blobs, and its
handler computes outside any transaction, returning the batch and its event as `Effects` for the runtime to record."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from services.trajectory.state import (
    CONSUMED_TYPES,
    ExecutionState,
    BatchParams,
    LogError,
    RunLog,
    assemble_step_batch,
    execution_tree,
)
from services.trajectory.tree import TrajectoryTree
from shared.batch import BATCH_MEDIA_TYPE, TrainingBatch
from shared.effects import Effects
from shared.events import BatchReady, BlobRef, Event, stream_id_for
from shared.runtime import Service


def batch_stream_id(run_id: str, step: int) -> str:
    """One stream per (run, step) holding exactly one batch.ready: a second append is a version conflict."""
    return stream_id_for("batch", f"{run_id}-{step}")


def batch_ready_data(step: int, batch: TrainingBatch, ref: BlobRef) -> BatchReady:
    meta = batch.meta
    queries = str(meta.get("queries", ""))
    return BatchReady(
        step=step,
        batch=ref,
        query_ids=[q for q in queries.split(",") if q],
        executions=len(batch.executions),
        trees=len(batch.executions),
        micro_batches=len(batch.micro_batches),
        unique_tokens=int(meta["unique_tokens"]),
        flat_tokens=int(meta["flat_tokens"]),
        target_tokens=int(meta["target_tokens"]),
        min_policy_version=int(meta["min_policy_version"]),
        max_policy_version=int(meta["max_policy_version"]),
        stale_executions=int(meta.get("stale_executions", 0)),
        trajectories_before_cap=int(meta.get("trajectories_before_cap", 0)),
        trajectories_after_cap=int(meta.get("trajectories_after_cap", 0)),
        capped_executions=int(meta.get("capped_executions", 0)),
        dropped_targets=int(meta.get("dropped_targets", 0)),
        group_shared_tokens=int(meta.get("group_shared_tokens", 0)),
    )


class TrajectoryService(Service):
    name = "trajectory"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.run_log = RunLog()
        self.trees: dict[str, TrajectoryTree] = {}
        # What each cached tree was built from: a later end event may still change an execution's calls.
        self.tree_inputs: dict[str, tuple[int | None, int]] = {}
        self.blob_cache: dict[str, bytes] = {}  # call records fetched for trees not yet built
        s = self.settings
        self.params = BatchParams(
            budget=s.micro_batch_tokens,
            cap_k=s.cap_k,
            eps=s.advantage_eps,
            drop_zero_variance=s.drop_zero_variance,
            max_staleness=s.max_staleness,
        )
        # A floor for logs whose dispatches do not say how many queries feed a step (QueryDispatched.step_queries).
        self.queries_per_step: int | None = s.queries_per_step

    async def setup(self) -> None:
        # State is derived from the log, never kept: a restarted service folds the same events and so
        # knows every batch already emitted (no duplicate) and every execution already finished (no miss).
        assert self.store is not None
        history = await self.store.read_all(types=list(CONSUMED_TYPES), run_id=self.settings.run_id)
        self.run_log.apply_all(s.event for s in history)
        self.log.info("trajectory_state_loaded", events=len(history), executions=len(self.run_log.executions),
                      batches=sorted(self.run_log.batches))
        self.on(list(CONSUMED_TYPES), self.handle)
        await self.record(await self._ready_effects(cause=None))

    def health(self) -> dict[str, Any]:
        return {"executions": len(self.run_log.executions), "batches": sorted(self.run_log.batches)}

    async def handle(self, event: Event) -> Effects | None:
        if event.run_id != self.settings.run_id:
            return None
        try:
            self.run_log.apply(event)
        except LogError as exc:
            self.log.error("log_inconsistent", error=str(exc), event_id=str(event.event_id))
            return None
        if isinstance(event.data, BatchReady):
            # The step is done: its trees are no longer needed in memory (replay rebuilds them from the log).
            for done in self.run_log.step_execution_ids(event.data.step):
                self.trees.pop(done, None)
                self.tree_inputs.pop(done, None)
            return None
        execution_id = getattr(event.data, "execution_id", None)
        if isinstance(execution_id, str):
            await self._maybe_build(execution_id)
        return await self._ready_effects(cause=event)

    async def _get_blobs(self, refs: list[BlobRef]) -> None:
        assert self.store is not None
        for ref in refs:
            if ref.digest not in self.blob_cache:
                self.blob_cache[ref.digest] = await self.blobs.get(ref)

    async def _maybe_build(self, execution_id: str) -> None:
        state = self.run_log.executions.get(execution_id)
        if state is None or not (state.ended and state.has_all_calls):
            return
        if self.tree_inputs.get(execution_id) == _tree_inputs(state):
            return  # built from this end already; another end event (state.RunLog._end) means a rebuild
        if state.step is not None and state.step in self.run_log.batches:
            return  # its step's batch is already committed
        refs = self.run_log.blob_refs([execution_id])
        await self._get_blobs(refs)
        try:
            # A private copy: other handlers keep folding events into the live state meanwhile.
            snapshot = replace(state, calls=dict(state.calls), labels=list(state.labels))
            tree = await asyncio.to_thread(execution_tree, snapshot, self._blob)
        except LogError as exc:
            self.log.error("tree_build_failed", execution_id=execution_id, error=str(exc))
            return
        self.trees[execution_id] = tree
        self.tree_inputs[execution_id] = _tree_inputs(snapshot)
        for ref in refs:  # token blobs are only needed until the tree exists
            self.blob_cache.pop(ref.digest, None)
        stats = tree.stats()
        self.log.info("tree_built", execution_id=execution_id, digest=tree.digest(),
                      late_calls_left_out=len(snapshot.late_calls), **stats.as_dict())

    def _blob(self, ref: BlobRef) -> bytes:
        return self.blob_cache[ref.digest]

    async def _ready_effects(self, cause: Event | None) -> Effects:
        """A `batch.ready` (and its batch blob) for every step whose groups are complete."""
        assert self.store is not None
        effects = Effects()
        for step in self.run_log.ready_steps(self.queries_per_step):
            stream = batch_stream_id(self.settings.run_id, step)
            existing = await self.store.read_stream(stream)
            if existing:  # emitted by an earlier incarnation whose batch.ready we have not folded yet
                self.run_log.apply(existing[0].event)
                continue
            ids = self.run_log.step_execution_ids(step)
            for execution_id in ids:  # builds the missing trees and any an end event has made stale
                await self._maybe_build(execution_id)
            try:
                # Synchronous on purpose: the fold must not change under it (trees are already built).
                batch = assemble_step_batch(self.run_log, step, self._blob, self.params, self.trees)
            except LogError as exc:
                self.log.error("batch_failed", step=step, error=str(exc))
                continue
            data = batch.encode()
            ref = effects.put_blob(data, media_type=BATCH_MEDIA_TYPE)
            event = self.event(batch_ready_data(step, batch, ref), stream_id=stream, version=1, cause=cause)
            # Not folded here: only a committed batch counts. Until it comes back (store check above, or the
            # bus), a concurrent handler may try the same step and lose on the version check; its event is
            # then redelivered and finds the batch. If recording fails, the redelivery rebuilds it.
            effects.append([event], expected_version=0)
            self.log.info("batch_ready", step=step, digest=ref.digest, executions=len(batch.executions),
                          micro_batches=len(batch.micro_batches), **{k: v for k, v in batch.meta.items()
                                                                     if isinstance(v, int)})
        return effects


def _tree_inputs(state: ExecutionState) -> tuple[int | None, int]:
    """What an execution's tree depends on beyond its (immutable) call records: the calls its end reported
    and the branch labels seen."""
    return state.ended_calls, len(state.labels)


if __name__ == "__main__":
    TrajectoryService.main()
