"""A worker fetching a sharded publication (services/rollout/weights_fetch.py) from the real Object Store and from
the in-memory fake: every tensor back exactly, a corrupted shard read again, a deleted publication `WeightsGone`
(the worker service then loads the newest), and a worker that was behind loading the version it needs."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch

from services.rollout.service import RolloutSettings, RolloutWorkerService
from services.rollout.weights_fetch import SHARD_ATTEMPTS, WeightsGone, WeightsUnreadable, fetch_weights
from services.rollout.worker import RolloutWorker
from services.trainer.engine import PublishedShards
from services.trainer.rank import LocalShards, store_publication
from shared.blobs import BlobCorrupted, Blobs, InMemoryBlobStore
from shared.events import BlobRef, WeightsPublished, new_event
from shared.objects import ObjectBlobStore
from shared.settings import Settings
from shared.weights import (
    MANIFEST_MEDIA_TYPE,
    SHARD_MEDIA_TYPE,
    WeightsManifest,
    encode_shards,
    local_name,
    manifest_for,
)
from tests.conftest import Infra, drop_bus, make_bus
from tests.rollout.fakes import CharCodec, ScriptedEngine


def weights(seed: int, layers: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {"model.embed_tokens.weight": torch.randn(64, 16, generator=g)}
    for i in range(layers):
        sd[f"model.layers.{i}.mlp.up_proj.weight"] = torch.randn(16, 16, generator=g)
        sd[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(16)
    return sd


async def publish(blobs: Blobs, sd: dict[str, torch.Tensor], version: int, *, store: str = "object",
                  dtype: torch.dtype = torch.bfloat16) -> WeightsPublished:
    """What a trainer rank stores: every shard, then the manifest."""
    shards = []
    for data, n in encode_shards(sd, dtype, max_bytes=2_000):
        shards.append((await blobs.put(data, SHARD_MEDIA_TYPE, store=store), n))  # type: ignore[arg-type]
    manifest = manifest_for(shards, str(dtype).removeprefix("torch."))
    ref = await blobs.put(manifest.to_bytes(), MANIFEST_MEDIA_TYPE, store=store)  # type: ignore[arg-type]
    return WeightsPublished(version=version, step=version - 1, weights=ref, format="shards", dtype=manifest.dtype,
                            bytes=manifest.size)


class FlakyBlobs(Blobs):
    """Reads back corrupted the first `bad` reads of the digests in `flaky`."""

    def __init__(self, inner: Blobs, flaky: set[str], bad: int) -> None:
        super().__init__(*inner.backends.values())
        self.flaky, self.bad, self.reads = flaky, bad, 0

    async def get(self, ref: BlobRef) -> bytes:
        if ref.digest in self.flaky and self.bad > 0:
            self.bad -= 1
            self.reads += 1
            raise BlobCorrupted(ref.digest, "sha256:" + "0" * 64)
        return await super().get(ref)


@pytest.fixture(params=["nats", "memory"])
async def blobs(request: pytest.FixtureRequest, infra: Infra) -> AsyncIterator[Blobs]:
    if request.param == "memory":
        yield Blobs(InMemoryBlobStore("object"))
        return
    bus = await make_bus(infra.nats_url)
    try:
        yield Blobs(ObjectBlobStore(bus.objects))
    finally:
        await drop_bus(bus)


async def test_a_sharded_publication_reads_back_exactly_in_its_dtype(blobs: Blobs) -> None:
    sd = weights(1)
    published = await publish(blobs, sd, 3)
    manifest = WeightsManifest.from_bytes(await blobs.get(published.weights))
    assert len(manifest.shards) > 2
    fetched = await fetch_weights(blobs, published)
    assert fetched.state_dict.keys() == sd.keys()
    assert all(torch.equal(fetched.state_dict[k], sd[k].to(torch.bfloat16)) for k in sd)
    assert (fetched.shards, fetched.bytes, fetched.dtype, fetched.refetched) == (len(manifest.shards),
                                                                                 manifest.size, "bfloat16", 0)


async def test_staged_shards_are_the_published_files_and_go_once_discarded(blobs: Blobs, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    sd = weights(4)
    published = await publish(blobs, sd, 2)
    fetched = await fetch_weights(blobs, published, stage_dir=tmp_path / "stage")
    assert fetched.state_dict == {} and fetched.weights == fetched.files and len(fetched.files) == fetched.shards
    staged: dict[str, torch.Tensor] = {}
    for path in fetched.files:
        staged.update(load_file(str(path)))
    assert staged.keys() == sd.keys() and all(torch.equal(staged[k], sd[k].to(torch.bfloat16)) for k in sd)
    fetched.discard()
    assert list((tmp_path / "stage").iterdir()) == []


async def test_a_shard_unlike_its_manifest_is_refused_and_nothing_stays_staged(blobs: Blobs, tmp_path: Path) -> None:
    published = await publish(blobs, weights(5), 2)
    manifest = WeightsManifest.from_bytes(await blobs.get(published.weights))
    lying = manifest.model_copy(update={"dtype": "float32"})
    ref = await blobs.put(lying.to_bytes(), MANIFEST_MEDIA_TYPE, store="object")
    wrong = published.model_copy(update={"weights": ref})
    with pytest.raises(WeightsUnreadable, match="manifest says float32"):
        await fetch_weights(blobs, wrong, stage_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(WeightsUnreadable, match="manifest says float32"):
        await fetch_weights(blobs, wrong)


async def test_a_shard_read_back_corrupted_is_fetched_again(blobs: Blobs) -> None:
    sd = weights(2)
    published = await publish(blobs, sd, 1)
    manifest = WeightsManifest.from_bytes(await blobs.get(published.weights))
    one = manifest.shards[1].ref.digest
    flaky = FlakyBlobs(blobs, {one}, bad=SHARD_ATTEMPTS - 1)
    fetched = await fetch_weights(flaky, published)
    assert fetched.refetched == SHARD_ATTEMPTS - 1
    assert all(torch.equal(fetched.state_dict[k], sd[k].to(torch.bfloat16)) for k in sd)
    with pytest.raises(WeightsUnreadable, match=f"corrupted {SHARD_ATTEMPTS} times"):
        await fetch_weights(FlakyBlobs(blobs, {one}, bad=SHARD_ATTEMPTS), published)


async def test_a_deleted_publication_is_gone_not_waited_for(blobs: Blobs) -> None:
    published = await publish(blobs, weights(3), 1)
    manifest = WeightsManifest.from_bytes(await blobs.get(published.weights))
    assert await blobs.delete(manifest.shards[-1].ref)
    with pytest.raises(WeightsGone, match="version 1"):
        await fetch_weights(blobs, published)
    assert await blobs.delete(published.weights)
    with pytest.raises(WeightsGone):
        await fetch_weights(blobs, published)


class RecordingEngine(ScriptedEngine):
    async def load_weights(self, state_dict):  # noqa: ANN001, ANN201
        self.loaded = {k: v.clone() for k, v in state_dict.items()}


async def test_a_worker_behind_a_retired_version_loads_the_newest_and_says_so(store, bus, tmp_path) -> None:  # noqa: ANN001
    """The worker serves v1 when v2 (since retired: its objects deleted) arrives late; v5 is the newest in the
    log. It loads v5, not nothing, and `weights.loaded` says v5 with the load's phases."""
    blobs = Blobs(store.blobs, ObjectBlobStore(bus.objects))
    service = RolloutWorkerService(Settings(run_id="run-behind"), RolloutSettings(cell_id="cell-b"))
    service.store, service.blobs = store, blobs
    service._weights_stage = tmp_path / "staging"  # noqa: SLF001 - as set up: shards staged as files
    engine = RecordingEngine(CharCodec())
    service.worker = RolloutWorker(engine, worker_id="wb", cell_id="cell-b")
    service.worker.policy_version, service.worker._serves_published = 1, True  # noqa: SLF001
    v2 = await publish(blobs, weights(20), 2)
    v5_weights = weights(50)
    v5 = await publish(blobs, v5_weights, 5)
    now = datetime.now(UTC)
    await store.append([new_event(v5, run_id="run-behind", stream_id="weights-5", version=1, occurred_at=now)],
                       expected_version=0)
    for shard in WeightsManifest.from_bytes(await blobs.get(v2.weights)).shards:
        await blobs.delete(shard.ref)
    effects = await service.handle(new_event(v2, run_id="run-behind", stream_id="weights-2", version=1,
                                             occurred_at=now))
    assert service.worker.policy_version == 5
    assert all(torch.equal(engine.loaded[k], v5_weights[k].to(torch.bfloat16)) for k in v5_weights)
    assert effects is not None
    (loaded,) = [e.data for e in effects.appends[0].events]
    assert loaded.version == 5 and {"fetch_s", "pause_s", "swap_s"} <= loaded.phases.keys()
    assert list((tmp_path / "staging").iterdir()) == [], "staged shards are removed once loaded"


async def test_a_worker_joining_late_loads_the_newest_kept_version(store, bus, tmp_path) -> None:  # noqa: ANN001
    """Six versions published, the first four retired (their objects deleted): a worker starting now reads the
    log and loads version 5, the newest, from the Object Store."""
    blobs = Blobs(store.blobs, ObjectBlobStore(bus.objects))
    now = datetime.now(UTC)
    newest = weights(55)
    for v in range(6):
        published = await publish(blobs, newest if v == 5 else weights(v), v)
        await store.append([new_event(published, run_id="run-late", stream_id=f"weights-{v}", version=1,
                                      occurred_at=now)], expected_version=0)
        if v < 4:
            for shard in WeightsManifest.from_bytes(await blobs.get(published.weights)).shards:
                await blobs.delete(shard.ref)
    service = RolloutWorkerService(Settings(run_id="run-late"), RolloutSettings(cell_id="cell-l"))
    service.store, service.blobs = store, blobs
    service._weights_stage = tmp_path  # noqa: SLF001
    engine = RecordingEngine(CharCodec())
    service.worker = RolloutWorker(engine, worker_id="wl", cell_id="cell-l")
    await service._load_newest()  # noqa: SLF001 - what set-up does before the worker serves
    assert service.worker.policy_version == 5
    assert all(torch.equal(engine.loaded[k], newest[k].to(torch.bfloat16)) for k in newest)


async def handed_over(blobs: Blobs, folder: Path, sd: dict[str, torch.Tensor], version: int,
                      local: LocalShards | None = None) -> WeightsPublished:
    """What rank 0 stores with the same-node handoff on (`store_publication` with its local folder)."""
    local = local or LocalShards(folder, "node-a")
    ref = await store_publication(blobs, PublishedShards(sd, torch.bfloat16, 2_000), local)
    manifest = WeightsManifest.from_bytes(await blobs.get(ref))
    return WeightsPublished(version=version, step=version - 1, weights=ref, format="shards", dtype=manifest.dtype,
                            bytes=manifest.size)


async def test_a_worker_on_rank_0s_node_takes_its_files_and_reads_no_shard_from_the_object_store(
        blobs: Blobs, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    sd = weights(7)
    published = await handed_over(blobs, tmp_path / "published", sd, 3)
    manifest = WeightsManifest.from_bytes(await blobs.get(published.weights))
    assert (manifest.node, manifest.local_dir) == ("node-a", str(tmp_path / "published"))
    no_reads = FlakyBlobs(blobs, manifest.digests(), bad=10**6)  # any shard read would fail
    fetched = await fetch_weights(no_reads, published, stage_dir=tmp_path / "stage", node="node-a")
    assert fetched.handoff and no_reads.reads == 0
    assert all(p.parent == tmp_path / "published" for p in fetched.files)
    staged: dict[str, torch.Tensor] = {}
    for path in fetched.files:
        staged.update(load_file(str(path)))
    assert all(torch.equal(staged[k], sd[k].to(torch.bfloat16)) for k in sd)
    fetched.discard()
    assert all(p.exists() for p in fetched.files), "rank 0's files are not the worker's to delete"
    # Another node, or a worker without a staging folder, reads the Object Store.
    elsewhere = await fetch_weights(blobs, published, stage_dir=tmp_path / "stage", node="node-b")
    assert not elsewhere.handoff and elsewhere.files[0].parent == tmp_path / "stage"
    elsewhere.discard()
    assert not (await fetch_weights(blobs, published, node="node-a")).handoff


async def test_a_handoff_file_missing_or_cut_short_sends_the_worker_to_the_object_store(
        blobs: Blobs, tmp_path: Path) -> None:
    sd = weights(8)
    published = await handed_over(blobs, tmp_path / "published", sd, 4)
    manifest = WeightsManifest.from_bytes(await blobs.get(published.weights))
    first, second = (manifest.local_path(s) for s in manifest.shards[:2])
    first.write_bytes(first.read_bytes()[:-10])
    fetched = await fetch_weights(blobs, published, stage_dir=tmp_path / "stage", node="node-a")
    assert not fetched.handoff and len(fetched.files) == len(manifest.shards)
    fetched.discard()
    second.unlink()
    assert not (await fetch_weights(blobs, published, stage_dir=tmp_path / "stage", node="node-a")).handoff


async def test_rank_0_keeps_the_files_of_its_newest_publications_only(blobs: Blobs, tmp_path: Path) -> None:
    folder = tmp_path / "published"
    (folder / "left-by-a-dead-process.safetensors").parent.mkdir(parents=True)
    (folder / "left-by-a-dead-process.safetensors").write_bytes(b"x")
    local = LocalShards(folder, "node-a", keep=2)
    manifests = []
    for v in range(4):
        published = await handed_over(blobs, folder, weights(100 + v), v, local)
        manifests.append(WeightsManifest.from_bytes(await blobs.get(published.weights)))
    kept = {p.name for p in folder.iterdir()}
    assert kept == {local_name(d) for m in manifests[-2:] for d in m.digests()}


def test_the_engine_serves_the_models_own_dtype_unless_told(tmp_path: Path) -> None:
    """Workers and the trainer's publications both default to the model's dtype, so weights load uncast."""
    import json

    from services.rollout.service import served_dtype

    for config, expected in (({"dtype": "bfloat16"}, "bfloat16"), ({"torch_dtype": "float16"}, "float16"),
                             ({"dtype": "float32"}, "float32"), ({}, "float32"), ({"dtype": "int8"}, "float32")):
        (tmp_path / "config.json").write_text(json.dumps(config))
        assert served_dtype("auto", tmp_path) == expected
    assert served_dtype("bfloat16", tmp_path) == "bfloat16"
    assert served_dtype("auto", tmp_path / "missing") == "float32"
    assert RolloutSettings().dtype == "auto"
