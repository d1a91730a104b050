"""Which published weights stay in the Object Store: the newest version, the window a rollout may still be
generating from (the staleness bound, or more), and whatever version a rollout worker last said it serves;
every other version's objects are deleted, except shards a kept version shares (a layer a step did not change
keeps its digest). Bounded whatever the run's length: the window, plus at most one version per worker.

Pure: the trainer service reads the log, calls `plan_retirement` and deletes what it says (service.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from shared.weights import WeightsManifest


@dataclass(frozen=True)
class Publication:
    """One published version as retention sees it: its manifest's digest, and its shards' digests and sizes
    (None for a one-file publication from before shards: the file is its only object)."""

    version: int
    manifest_digest: str
    manifest_bytes: int
    manifest: WeightsManifest | None = None


@dataclass
class Retirement:
    """The versions to retire now, each with the objects (digest → bytes) only it holds."""

    kept: list[int]
    objects: dict[int, dict[str, int]] = field(default_factory=dict)


def kept_versions(published: Iterable[int], *, window: int, served: Iterable[int]) -> set[int]:
    """The newest version, the `window` versions before it, and every version a worker serves."""
    versions = set(published)
    if not versions:
        return set()
    newest = max(versions)
    return {v for v in versions if v >= newest - window} | (set(served) & versions)


def _objects(p: Publication) -> dict[str, int]:
    objects = {p.manifest_digest: p.manifest_bytes}
    if p.manifest is not None:
        objects.update({s.ref.digest: s.ref.size for s in p.manifest.shards})
    return objects


def plan_retirement(
    publications: Mapping[int, Publication], *, window: int, served: Iterable[int], retired: Iterable[int] = ()
) -> Retirement:
    """What to delete: for each version neither kept nor retired already, its objects no kept version refers
    to. A version's objects are counted once even when an earlier one shared them (the first to go deletes)."""
    kept = kept_versions(publications, window=window, served=served)
    done = set(retired)
    still_referenced: set[str] = set()
    for v in kept:
        still_referenced |= _objects(publications[v]).keys()
    plan = Retirement(kept=sorted(kept))
    deleted: set[str] = set()
    for v in sorted(publications):
        if v in kept or v in done:
            continue
        mine = {d: n for d, n in _objects(publications[v]).items() if d not in still_referenced and d not in deleted}
        deleted |= mine.keys()
        plan.objects[v] = mine
    return plan


__all__ = ["Publication", "Retirement", "kept_versions", "plan_retirement"]
