"""The coordinator's side of weight publication (shell): the `weights.published` a stored manifest becomes,
and retention run against the log — which versions go (retention.py decides), their objects deleted from the
Object Store, and `weights.retired` for each."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.trainer.retention import Publication, plan_retirement
from shared.blobs import Blobs
from shared.events import BlobRef, Event, WeightsLoaded, WeightsPublished, WeightsRetired
from shared.store import EventStore
from shared.weights import WeightsManifest


class Publications:
    """What the coordinator has published in a run, and what it deletes once no one needs it."""

    def __init__(self, store: EventStore, blobs: Blobs, *, run_id: str, window: int,
                 event: Callable[..., Event], log: Any) -> None:
        self.store, self.blobs, self.run_id, self.window, self.log = store, blobs, run_id, window, log
        self._event = event  # the service's event factory (`Service.event`): an event of this run
        self._manifests: dict[int, WeightsManifest] = {}  # published versions' manifests, read once
        # The log folded so far (read on from `_position` at each retirement, not again from the start).
        self._position = 0
        self._published: dict[int, WeightsPublished] = {}
        self._served: dict[str, int] = {}  # worker → the version it last said it serves
        self._retired: set[int] = set()

    async def published(self, version: int, step: int, manifest_ref: BlobRef, publish_s: float) -> WeightsPublished:
        """`weights.published` for a manifest rank 0 stored (read back for its dtype and size)."""
        manifest = WeightsManifest.from_bytes(await self.blobs.get(manifest_ref))
        self._manifests[version] = manifest
        return WeightsPublished(version=version, step=step, weights=manifest_ref, format="shards",
                                dtype=manifest.dtype, bytes=manifest.size, publish_s=round(publish_s, 4))

    async def retire(self, stream_of: Callable[[int], str]) -> None:
        """Delete the objects of published versions no one needs any more (retention.py): kept are the newest,
        the window before it (the staleness bound at least) and what each worker last said it serves. Each
        retired version gets `weights.retired` on its stream (`stream_of(version)`). Best effort: a failure
        is logged and the next publication tries again."""
        try:
            await self._read_on()
            # A retired version's manifest is gone with it: only the others are read.
            publications = {v: await self._view(p) for v, p in self._published.items() if v not in self._retired}
            plan = plan_retirement(publications, window=self.window, served=self._served.values(),
                                   retired=self._retired)
            for version, objects in sorted(plan.objects.items()):
                deleted = 0
                for digest, size in objects.items():
                    if await self.blobs.delete(BlobRef(digest=digest, size=size, store="object")):
                        deleted += 1
                self._manifests.pop(version, None)
                self._published.pop(version, None)
                size = sum(objects.values())
                data = WeightsRetired(version=version, objects=deleted, bytes=size, kept=plan.kept)
                await self.store.append([self._event(data, stream_id=stream_of(version))], expected_version="any")
                self._retired.add(version)
                self.log.info("weights_retired", version=version, objects=deleted, bytes=size, kept=plan.kept)
        except Exception as exc:  # retention must never fail a step: the next publication retries
            self.log.warning("weights_retention_failed", error=f"{type(exc).__name__}: {exc}")

    async def _read_on(self) -> None:
        """Fold the publications, loads and retirements recorded since the last read."""
        types = ["weights.published", "weights.loaded", "weights.retired"]
        while page := await self.store.read_after(self._position, limit=5000, types=types, run_id=self.run_id):
            for s in page:
                data = s.event.data
                if isinstance(data, WeightsPublished):
                    self._published[data.version] = data
                elif isinstance(data, WeightsLoaded):
                    self._served[data.worker_id] = data.version
                elif isinstance(data, WeightsRetired):
                    self._retired.add(data.version)
            self._position = page[-1].position

    async def _view(self, data: WeightsPublished) -> Publication:
        if data.format == "safetensors":  # one file, from before shards
            return Publication(data.version, data.weights.digest, data.weights.size)
        manifest = self._manifests.get(data.version)
        if manifest is None:
            manifest = WeightsManifest.from_bytes(await self.blobs.get(data.weights))
            self._manifests[data.version] = manifest
        return Publication(data.version, data.weights.digest, data.weights.size, manifest)


__all__ = ["Publications"]
