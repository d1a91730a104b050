"""The weights stream (shared/weights_stream.py, services/trainer/weights_stream.py): rank 0 stores a publication
and holds it for the stream; a worker that is offered it receives every tensor exactly over gloo and reads no
shard from the Object Store; a stream that no longer holds the publication, cannot be reached or sends a shard
unlike its manifest is refused, and the worker service then loads the same version from the Object Store."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch

from services.rollout.service import RolloutSettings, RolloutWorkerService
from services.rollout.weights_fetch import fetch_weights
from services.rollout.worker import RolloutWorker
from services.trainer.engine import PublishedShards
from services.trainer.rank import LocalShards, store_publication
from services.trainer.weights_stream import StreamServer
from shared.blobs import Blobs
from shared.events import WeightsPublished, new_event
from shared.objects import ObjectBlobStore
from shared.settings import Settings
from shared.weights import MANIFEST_MEDIA_TYPE, WeightsManifest
from shared.weights_stream import StreamPull, StreamRefused, receive, split_address
from tests.rollout.fakes import CharCodec, ScriptedEngine
from tests.rollout.test_weights_fetch import FlakyBlobs, blobs, weights  # noqa: F401 - blobs: the fixture


@pytest.fixture
def server() -> Iterator[StreamServer]:
    s = StreamServer("127.0.0.1", timeout_s=20)
    yield s
    s.close()


async def streamed(blobs: Blobs, server: StreamServer, sd: dict[str, torch.Tensor], version: int,
                   local: LocalShards | None = None) -> WeightsPublished:
    """What rank 0 stores with the stream on (`store_publication` with its server)."""
    ref = await store_publication(blobs, PublishedShards(sd, torch.bfloat16, 2_000), local, server)
    manifest = WeightsManifest.from_bytes(await blobs.get(ref))
    return WeightsPublished(version=version, step=version - 1, weights=ref, format="shards", dtype=manifest.dtype,
                            bytes=manifest.size)


async def test_a_streamed_publication_arrives_exactly_and_reads_no_shard_from_the_object_store(
        blobs: Blobs, server: StreamServer, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    sd = weights(11)
    published = await streamed(blobs, server, sd, 2)
    manifest = WeightsManifest.from_bytes(await blobs.get(published.weights))
    assert (manifest.stream, manifest.stream_backend) == (server.address, "gloo") and len(manifest.shards) > 1
    no_reads = FlakyBlobs(blobs, manifest.digests(), bad=10**6)  # any shard read would fail
    # A worker (a staging folder): the shards land in the files its engine loads.
    fetched = await fetch_weights(no_reads, published, stage_dir=tmp_path / "stage", node="node-b",
                                  stream_timeout_s=20)
    assert fetched.via == "stream" and no_reads.reads == 0 and len(fetched.files) == len(manifest.shards)
    staged: dict[str, torch.Tensor] = {}
    for path in fetched.files:
        staged.update(load_file(str(path)))
    assert staged.keys() == sd.keys() and all(torch.equal(staged[k], sd[k].to(torch.bfloat16)) for k in sd)
    assert not list((tmp_path / "stage").glob("*.tmp"))
    fetched.discard()
    assert not list((tmp_path / "stage").iterdir())
    # Without one: a state dict.
    in_memory = await fetch_weights(no_reads, published, stream_timeout_s=20)
    assert in_memory.via == "stream" and all(torch.equal(in_memory.state_dict[k], sd[k].to(torch.bfloat16))
                                              for k in sd)
    # A worker that does not take the stream reads the Object Store as before.
    assert (await fetch_weights(blobs, published, stage_dir=tmp_path / "stage")).via == "object_store"
    # Over NCCL nothing is fetched here: the engine receives onto its GPU at the swap.
    nccl = manifest.model_copy(update={"stream_backend": "nccl"})
    on_gpu = published.model_copy(update={"weights": await blobs.put(nccl.to_bytes(), MANIFEST_MEDIA_TYPE,
                                                                      store="object")})
    pulled = await fetch_weights(no_reads, on_gpu, stage_dir=tmp_path / "stage", stream_timeout_s=20)
    assert pulled.pull is not None and pulled.pull.backend == "nccl" and pulled.weights is pulled.pull


async def test_the_same_node_handoff_comes_before_the_stream(blobs: Blobs, server: StreamServer,
                                                             tmp_path: Path) -> None:
    published = await streamed(blobs, server, weights(12), 3, LocalShards(tmp_path / "published", "node-a"))
    here = await fetch_weights(blobs, published, stage_dir=tmp_path / "stage", node="node-a", stream_timeout_s=20)
    assert here.handoff and here.pull is None
    there = await fetch_weights(blobs, published, stage_dir=tmp_path / "stage", node="node-b", stream_timeout_s=20)
    assert there.via == "stream"
    there.discard()


async def test_a_pull_the_stream_cannot_serve_is_refused_in_one_line(blobs: Blobs, server: StreamServer) -> None:
    published = await streamed(blobs, server, weights(13), 4)
    pull = StreamPull.of(WeightsManifest.from_bytes(await blobs.get(published.weights)), timeout_s=5)
    assert pull is not None
    # A shard whose header does not say what its manifest entry does.
    wrong = dataclasses.replace(pull, shards=(pull.shards[0].model_copy(update={"tensors": 99}), *pull.shards[1:]))
    with pytest.raises(StreamRefused, match="99"):
        await asyncio.to_thread(receive, wrong, "cpu")
    # Rank 0 holds a newer publication now.
    await streamed(blobs, server, weights(14), 5)
    with pytest.raises(StreamRefused, match="not held"):
        await asyncio.to_thread(receive, pull, "cpu")
    # No one listens at the address (rank 0 gone).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    gone = dataclasses.replace(pull, address=f"127.0.0.1:{port}", timeout_s=2)
    with pytest.raises(StreamRefused) as refused:
        await asyncio.to_thread(receive, gone, "cpu")
    assert "\n" not in str(refused.value)
    assert server.served == 1  # the first was sent whole: the receiver refused its header
    with pytest.raises(ValueError, match="host:port"):
        split_address("nowhere")


class RecordingEngine(ScriptedEngine):
    async def load_weights(self, state_dict):  # noqa: ANN001, ANN201
        self.loaded = {k: v.clone() for k, v in state_dict.items()}


async def test_the_worker_service_takes_the_stream_and_reads_the_object_store_when_it_is_refused(
        store, bus, server: StreamServer, tmp_path: Path) -> None:  # noqa: ANN001
    """v1 arrives over the stream (no shard of it is read from the Object Store); v2's stream is refused (rank 0
    already holds another publication): the worker loads v2 from the Object Store. v3 is offered over NCCL, the
    engine's pull is refused the same way, and the worker loads v3 from the Object Store after all."""
    blobs = Blobs(store.blobs, ObjectBlobStore(bus.objects))
    service = RolloutWorkerService(Settings(run_id="run-stream"), RolloutSettings(cell_id="cell-s"))
    service.store = store
    service._weights_stage = tmp_path / "staging"  # noqa: SLF001 - as set up
    engine = RecordingEngine(CharCodec())
    service.worker = RolloutWorker(engine, worker_id="ws", cell_id="cell-s")
    now = datetime.now(UTC)
    sds = {v: weights(20 + v) for v in (1, 2, 3)}

    async def handle(published: WeightsPublished) -> None:
        effects = await service.handle(new_event(published, run_id="run-stream",
                                                 stream_id=f"weights-{published.version}", version=1,
                                                 occurred_at=now))
        assert effects is not None
        (loaded,) = [e.data for e in effects.appends[0].events]
        assert loaded.version == published.version and "fetch_s" in loaded.phases
        expected = sds[published.version]
        assert all(torch.equal(engine.loaded[k], expected[k].to(torch.bfloat16)) for k in expected)

    v1 = await streamed(blobs, server, sds[1], 1)
    v1_shards = WeightsManifest.from_bytes(await blobs.get(v1.weights)).digests()
    service.blobs = FlakyBlobs(blobs, v1_shards, bad=10**6)  # any read of v1's shards would fail
    await handle(v1)
    assert server.served == 1

    v2 = await streamed(blobs, server, sds[2], 2)
    server.offer({})  # rank 0 no longer holds it
    await handle(v2)

    v3 = await streamed(blobs, server, sds[3], 3)
    nccl = WeightsManifest.from_bytes(await blobs.get(v3.weights)).model_copy(update={"stream_backend": "nccl"})
    v3 = v3.model_copy(update={"weights": await blobs.put(nccl.to_bytes(), MANIFEST_MEDIA_TYPE, store="object")})
    server.offer({})
    await handle(v3)  # the engine's pull is refused at the swap; the old weights stay until the fallback's load
    assert service.worker.policy_version == 3 and server.served == 1
    assert list((tmp_path / "staging").iterdir()) == [], "staged shards are removed once loaded"
