"""Retention of published weights (services/trainer/retention.py): the newest version, the window before it and
what workers serve stay; everything else goes, except shards a kept version shares; bounded over any run."""

from __future__ import annotations

from shared.events import BlobRef
from shared.weights import WeightShard, WeightsManifest
from services.trainer.retention import Publication, kept_versions, plan_retirement


def ref(name: str, size: int = 10) -> BlobRef:
    return BlobRef(digest="sha256:" + (name.encode().hex() * 64)[:64], size=size, store="object")


def publication(version: int, *shards: str) -> Publication:
    manifest = WeightsManifest(dtype="bfloat16", tensors=len(shards), size=10 * len(shards),
                               shards=tuple(WeightShard(ref=ref(s), tensors=1) for s in shards))
    return Publication(version, ref(f"m{version}").digest, 5, manifest)


def test_kept_are_the_newest_its_window_and_what_workers_serve() -> None:
    assert kept_versions(range(10), window=1, served=[3, 9, 42]) == {3, 8, 9}
    assert kept_versions(range(10), window=0, served=[]) == {9}
    assert kept_versions([], window=2, served=[1]) == set()


def test_a_retired_version_loses_only_the_objects_no_kept_version_shares() -> None:
    pubs = {0: publication(0, "emb0", "L0"), 1: publication(1, "emb0", "L1"), 2: publication(2, "emb0", "L2")}
    plan = plan_retirement(pubs, window=1, served=[])
    assert plan.kept == [1, 2]
    assert set(plan.objects) == {0}
    assert set(plan.objects[0]) == {ref("m0").digest, ref("L0").digest}, "the shared embedding stays"


def test_versions_retired_before_are_not_retired_again_and_shared_objects_are_deleted_once() -> None:
    pubs = {v: publication(v, "same", f"L{v}") for v in range(5)}
    plan = plan_retirement(pubs, window=0, served=[], retired=[0])
    assert set(plan.objects) == {1, 2, 3}
    assert all(ref("same").digest not in objs for objs in plan.objects.values()), "v4 still refers to it"


def test_one_file_publications_from_before_shards_are_retired_whole() -> None:
    old = Publication(0, ref("file0").digest, 1000)
    plan = plan_retirement({0: old, 1: publication(1, "a"), 2: publication(2, "b")}, window=1, served=[])
    assert plan.objects == {0: {ref("file0").digest: 1000}}


def test_storage_stays_bounded_over_a_long_run_with_a_lagging_worker() -> None:
    """A thousand versions, one worker stuck on version 7 for good, another lagging one version: what is stored
    never exceeds the window + 1 + one version per worker."""
    stored: dict[str, int] = {}
    pubs: dict[int, Publication] = {}
    retired: list[int] = []
    window = 2
    for v in range(1000):
        pubs[v] = publication(v, "embed", f"L{v}a", f"L{v}b")
        stored.update({d: 1 for d in (pubs[v].manifest_digest, *pubs[v].manifest.digests())})  # type: ignore[union-attr]
        plan = plan_retirement(pubs, window=window, served=[min(v, 7), max(0, v - 1)], retired=retired)
        for version, objects in plan.objects.items():
            for digest in objects:
                stored.pop(digest)
            retired.append(version)
        live = {x for x in range(v + 1) if x not in retired}
        assert live == kept_versions(range(v + 1), window=window, served=[min(v, 7), max(0, v - 1)])
        assert len(live) <= window + 1 + 2
        assert len(stored) == 1 + 3 * len(live), "the shared shard once, and each kept version's own"
