"""The trainer rank process (`python -m services.trainer rank`), one per cell: stands by warm, says so with
`trainer.rank_ready`, and serves the coordinator's verbs (protocol.py) on the cell's subjects.

Torch runs on one thread of its own (rank_work.py), so the NATS connection keeps answering while a step trains:
the coordinator's `ping` tells a busy rank from a dead one, whose subjects have no responders.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from services.trainer.checkpoints import CheckpointStore, open_checkpoints
from services.trainer.engine import PublishedShards
from services.trainer.options import RankOptions
from services.trainer.protocol import (
    VERBS,
    Body,
    ErrorReply,
    FormRequest,
    LeaveReply,
    LeaveRequest,
    PingReply,
    PublishReply,
    PublishRequest,
    StepReply,
    StepRequest,
    Verb,
    REQUESTS,
    rank_subject,
)
from services.trainer.rank_work import RankWork
from services.trainer.weights_stream import StreamServer
from shared.blobs import Blobs
from shared.events import BlobRef, RankReady, stream_id_for
from shared.logging import configure_logging
from shared.runtime import Service
from shared.settings import Settings, load_settings
from shared.weights import MANIFEST_MEDIA_TYPE, SHARD_MEDIA_TYPE, local_name, manifest_for
from shared.weights_stream import first_line

T = TypeVar("T")


class TrainerRankError(Exception):
    pass


class RankRefused(TrainerRankError):
    """A `form` meant for another process on this cell (one that ran here before this one)."""


class RankService(Service):
    name = "trainer-rank"

    def __init__(self, settings: Settings | None = None, options: RankOptions | None = None) -> None:
        super().__init__(settings)
        self.options = options or RankOptions()
        if not self.options.cell_id:
            raise TrainerRankError("GYRE_TRAINER_CELL_ID must name the cell this rank stands by on")
        if self.settings.model_dir is None:
            raise TrainerRankError("GYRE_MODEL_DIR must name the model directory the trainer starts from")
        self.cell_id = self.options.cell_id
        self.rank_id = f"{self.cell_id}-{uuid.uuid4().hex[:8]}"  # a restarted process is another rank
        self.log = self.log.bind(cell_id=self.cell_id, rank_id=self.rank_id)
        self.work = RankWork(self.settings.model_dir, self._checkpoints)
        self.busy: str | None = None  # the verb the torch thread runs
        self._torch = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch")
        # The same-node handoff (rank 0's publications, for rollout workers on this node): on unless turned off.
        folder = self.options.local_weights_dir or Path(self.settings.state_dir) / "weights" / "published"
        self.local = LocalShards(folder, self.settings.node_id) if self.options.local_weights else None
        self.stream: StreamServer | None = None  # the weights stream, started at this rank's first publication
        self._subscriptions: list[Any] = []
        self.warm_s = 0.0
        self.loop: asyncio.AbstractEventLoop | None = None  # the bus's, where the torch thread's transfers run
        # This process's folder for checkpoints staged before an upload and fetched before a load: its cell and
        # pid, so that a later rank on the cell clears what a killed one left (`_clear_dead_ranks_folders`).
        self.checkpoint_local = Path(self.settings.state_dir) / "trainer" / self.settings.run_id / "ranks" / \
            f"{self.cell_id}-{os.getpid()}"

    async def setup(self) -> None:
        assert self.bus is not None
        self.loop = asyncio.get_running_loop()
        _clear_dead_ranks_folders(self.checkpoint_local.parent, self.cell_id)
        started = time.perf_counter()
        await self._on_torch("warm", self.work.warm)
        self.warm_s = time.perf_counter() - started
        handlers: dict[Verb, Callable[[Any], Awaitable[Body]]] = {
            "form": self.form, "step": self.step, "leave": self.leave, "publish": self.publish, "ping": self.ping,
        }
        for verb in VERBS:
            subject = rank_subject(self.bus.prefix, self.cell_id, verb)
            self._subscriptions.append(await self.bus.serve(subject, self._answering(verb, handlers[verb])))
        # Only now: the coordinator may ask for it the moment it reads this.
        ready = self.event(RankReady(cell_id=self.cell_id, rank_id=self.rank_id),
                           stream_id=stream_id_for("cell", self.cell_id))
        await self.emit([ready], expected_version="any")
        self.log.info("rank_ready", warm_s=round(self.warm_s, 3))

    async def teardown(self) -> None:
        for sub in self._subscriptions:
            try:
                await sub.unsubscribe()
            except Exception:  # gone with the connection
                pass
        try:
            await asyncio.wait_for(self._on_torch("leave", self.work.leave), 10)
        except Exception as exc:  # a thread stuck in a collective: the process exits without it
            self.log.warning("leave_on_stop_failed", error=f"{type(exc).__name__}: {exc}")
        self._torch.shutdown(wait=False, cancel_futures=True)
        if self.stream is not None:
            await asyncio.to_thread(self.stream.close)
        shutil.rmtree(self.checkpoint_local, ignore_errors=True)  # staged or fetched copies of what the store holds

    def _checkpoints(self, root: str) -> CheckpointStore:
        """The store a form's checkpoint root names (called on the torch thread): in the Object Store, staged and
        fetched through a folder of this process's own."""
        assert self.bus is not None and self.loop is not None
        return open_checkpoints(root, self.bus.checkpoints, local=self.checkpoint_local, loop=self.loop)

    def health(self) -> dict[str, Any]:
        return {"cell_id": self.cell_id, "rank_id": self.rank_id, "generation": self.work.generation,
                "busy": self.busy, "warm_s": round(self.warm_s, 3)}

    # ---- the verbs ----

    def _answering(self, verb: Verb, handler: Callable[[Any], Awaitable[Body]]) -> Callable[[bytes], Awaitable[bytes]]:
        async def answer(data: bytes) -> bytes:
            try:
                request = REQUESTS[verb].model_validate_json(data)
                reply: Body = await handler(request)
            except Exception as exc:
                if verb != "ping":
                    self.log.warning("verb_failed", verb=verb, error=f"{type(exc).__name__}: {exc}")
                reply = ErrorReply(rank_id=self.rank_id, error=f"{type(exc).__name__}: {exc}")
            return reply.model_dump_json().encode()

        return answer

    async def form(self, request: FormRequest) -> Body:
        if request.rank_id != self.rank_id:
            raise RankRefused(f"the form is for rank {request.rank_id}; this process on {self.cell_id} is "
                              f"{self.rank_id}")
        reply = await self._on_torch("form", self.work.form, request)
        self.log.info("rank_formed", generation=request.generation, rank=request.rank, world_size=request.world_size,
                      last_step=reply.state.last_step, **{k: round(v, 3) for k, v in reply.phases.items()})
        return reply

    async def step(self, request: StepRequest) -> Body:
        batch = await self.blobs.get(request.batch)
        self.log.info("step_started", step=request.step, generation=request.generation)
        reply: StepReply
        reply, weights = await self._on_torch("step", self.work.step, request, batch, self.rank_id)
        if weights is not None:
            ref, store_s = await self._store(weights)
            reply = reply.model_copy(update={"weights": ref, "publish_s": weights.seconds + store_s})
        self.log.info("step_done", step=request.step, seconds=round(reply.seconds, 3),
                      checkpoint_s=round(reply.checkpoint_s, 3))
        return reply

    async def leave(self, request: LeaveRequest) -> Body:
        started = time.perf_counter()
        generation = self.work.generation
        if request.generation in (0, generation) or generation is None:
            await self._on_torch("leave", self.work.leave)
        self.log.info("rank_left", generation=generation)
        return LeaveReply(rank_id=self.rank_id, seconds=time.perf_counter() - started)

    async def publish(self, request: PublishRequest) -> Body:
        weights = await self._on_torch("publish", self.work.publish, request.generation)
        if weights is None:
            return PublishReply(rank_id=self.rank_id)
        ref, store_s = await self._store(weights)
        return PublishReply(rank_id=self.rank_id, weights=ref, publish_s=weights.seconds + store_s)

    async def _store(self, published: PublishedShards) -> tuple[BlobRef, float]:
        started = time.perf_counter()
        ref = await store_publication(self.blobs, published, self.local, self._stream())
        seconds = time.perf_counter() - started
        self.log.info("weights_stored", dtype=published.dtype_name, gather_s=round(published.seconds, 3),
                      store_s=round(seconds, 3))
        return ref, seconds

    def _stream(self) -> StreamServer | None:
        """The weights stream's server, started on first use when the options turn it on (None when they do
        not, or when it cannot listen: the Object Store then carries the weights alone, as it always can)."""
        o = self.options
        if self.stream is None and o.weights_stream:
            try:
                self.stream = StreamServer(o.weights_stream_host, o.weights_stream_port,
                                           backend=o.weights_stream_backend,
                                           device="cuda" if o.weights_stream_backend == "nccl" else "cpu",
                                           timeout_s=o.weights_stream_timeout_s, log=self.log)
            except (RuntimeError, OSError, ValueError) as exc:
                self.log.warning("weights_stream_unavailable", error=first_line(exc)[:200])
                self.options = o.model_copy(update={"weights_stream": False})
                return None
            self.log.info("weights_stream_listening", address=self.stream.address, backend=self.stream.backend)
        return self.stream

    async def ping(self, request: Body) -> Body:
        return PingReply(rank_id=self.rank_id, generation=self.work.generation, busy=self.busy)

    async def _on_torch(self, verb: str, fn: Callable[..., T], *args: Any) -> T:
        def run() -> T:
            self.busy = verb
            try:
                return fn(*args)
            finally:
                self.busy = None

        return await asyncio.get_running_loop().run_in_executor(self._torch, run)


def _clear_dead_ranks_folders(parent: Path, cell_id: str) -> None:
    """Remove the checkpoint folders that this cell's earlier rank processes left when they were killed."""
    for folder in parent.glob(f"{cell_id}-*") if parent.is_dir() else []:
        pid = folder.name.removeprefix(f"{cell_id}-")
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except PermissionError:  # alive, another user's
            pass


async def store_publication(blobs: Blobs, published: PublishedShards, local: LocalShards | None = None,
                            stream: StreamServer | None = None) -> BlobRef:
    """Store a publication's shards in the Object Store one after another, each encoded on a thread while the
    one before it is stored (its chunks pipelined), then the manifest that names them; returns the manifest's
    reference (what `weights.published` carries). With `local`, each shard is also written to the node-local
    folder (on a thread, beside the next shard's upload) for the same-node handoff, and the manifest says so;
    with `stream`, the shards are held for the weights stream from then on, and the manifest offers it."""
    shards = published.shards()
    stored: list[tuple[BlobRef, int]] = []
    held: dict[str, bytes] = {}
    writes: list[asyncio.Future[None]] = []
    encoding = asyncio.ensure_future(asyncio.to_thread(next, shards, None))
    try:
        while (shard := await encoding) is not None:
            data, tensors = shard
            encoding = asyncio.ensure_future(asyncio.to_thread(next, shards, None))
            ref = await blobs.put(data, SHARD_MEDIA_TYPE, store="object")
            stored.append((ref, tensors))
            if stream is not None:
                held[ref.digest] = data
            if local is not None:
                writes.append(asyncio.ensure_future(asyncio.to_thread(local.write, ref.digest, data)))
        await asyncio.gather(*writes)
    finally:
        if not encoding.done():
            encoding.cancel()
    offers: dict[str, str] = {}
    if local is not None:
        offers |= {"node": local.node, "local_dir": str(local.folder)}
    if stream is not None:
        stream.offer(held)
        offers |= {"stream": stream.address, "stream_backend": stream.backend}
    manifest = manifest_for(stored, published.dtype_name, **offers)
    if local is not None:
        local.keep_only(manifest.digests())
    return await blobs.put(manifest.to_bytes(), MANIFEST_MEDIA_TYPE, store="object")


class LocalShards:
    """The same-node handoff's folder on rank 0's node: each shard written as `<digest hex>.safetensors` (atomic:
    a reader never sees half a file), and only the newest `keep` publications' files kept (a worker that finds
    one gone reads the Object Store instead)."""

    def __init__(self, folder: Path, node: str, keep: int = 3) -> None:
        self.folder, self.node, self.keep = Path(folder), node, keep
        self._recent: list[set[str]] = []  # the digests of the publications written, oldest first

    def write(self, digest: str, data: bytes) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / local_name(digest)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        tmp.replace(path)

    def keep_only(self, digests: set[str]) -> None:
        """Record a publication's digests; delete the files of any publication older than the newest `keep`
        (and what a process before this one left)."""
        self._recent = [*self._recent, digests][-self.keep :]
        wanted = {local_name(d) for recent in self._recent for d in recent}
        for path in self.folder.glob("*.safetensors*"):
            if path.name not in wanted:
                path.unlink(missing_ok=True)


def main() -> None:
    settings = load_settings()
    configure_logging(RankService.name, run_id=settings.run_id)
    asyncio.run(RankService(settings).run(freeze_heap=True))


__all__ = ["LocalShards", "RankRefused", "RankService", "TrainerRankError", "main", "store_publication"]
