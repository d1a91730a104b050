"""Fetching a publication's weights for a worker to load: the manifest, then its shards one after another, the
next one downloading while the last is checked and put down, all while the worker still serves the old policy
(the engine's gate closes only for the swap itself). Put down where: with a staging folder (what a worker
does), each shard is written there as the safetensors file it is, checked from its header alone, and the
engine reads the files in its own process (`Engine.load_weight_files`) — handing a 1 GB state dict to vLLM's
engine process as tensors pickles it through the RPC (16–26 s on this machine against 0.5 s from files).
From where: rank 0's own files on its node (the same-node handoff), else rank 0 itself over the weights stream
when it offers one, else the Object Store (the path of record, and the fallback of the other two).
Without one, the shards are decoded into a state dict in this process. A shard that reads back corrupted is
fetched again; a publication whose objects retention has deleted is `WeightsGone` (the caller loads the
newest instead).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.blobs import BlobCorrupted, BlobNotFound, Blobs
from shared.events import WeightsPublished
from shared.objects import ObjectFetchTimeout
from shared.weights import WeightShard, WeightsFormatError, WeightsManifest, check_shard, decode_shard
from shared.weights_stream import StreamPull, StreamRefused, receive, receive_files

if TYPE_CHECKING:
    import torch

SHARD_ATTEMPTS = 3  # reads of one shard before the publication counts as unreadable


class WeightsGone(Exception):
    """The publication's objects are no longer stored (retired after newer versions, or never written)."""


class WeightsUnreadable(Exception):
    """A shard kept reading back corrupted, or the publication is not what its manifest says."""


@dataclass
class FetchedWeights:
    """A publication ready to swap in: as files in the staging folder, or as a state dict."""

    bytes: int  # as stored (the shards' sizes)
    shards: int
    fetch_s: float  # download, digest checks and putting down, all while the worker served
    refetched: int = 0  # shard reads repeated after a corrupted read
    dtype: str = ""
    files: list[Path] = field(default_factory=list)
    state_dict: dict[str, torch.Tensor] = field(default_factory=dict)
    handoff: bool = False  # the files are rank 0's on this node (the same-node handoff): not ours to delete
    pull: StreamPull | None = None  # nothing fetched yet: the engine pulls the shards over the weights stream
    via: str = "object_store"  # or "handoff", or "stream"

    @property
    def weights(self) -> list[Path] | dict[str, torch.Tensor] | StreamPull:
        """What `RolloutWorker.apply_weights` takes."""
        return self.pull or self.files or self.state_dict

    def discard(self) -> None:
        """Remove the staged files (once the engine has loaded them, or given up)."""
        if self.handoff:
            return
        for path in self.files:
            path.unlink(missing_ok=True)


async def fetch_weights(
    blobs: Blobs, published: WeightsPublished, *, stage_dir: Path | None = None, node: str = "", log: Any = None,
    stream_timeout_s: float | None = None,
) -> FetchedWeights:
    """The publication's weights, checked shard by shard against its manifest and digests: written to
    `stage_dir` as files, or decoded into a state dict without one. A worker on rank 0's node (`node`, with a
    staging folder: it hands files to its engine) takes rank 0's own files when they are all there and whole
    (the same-node handoff). Otherwise, with `stream_timeout_s`, a publication whose rank 0 offers the weights
    stream comes over it (shared/weights_stream.py): over gloo, received here into the staged files (or a state
    dict); over NCCL, not fetched at all: the result is the pull its engine makes at the swap (`StreamPull`).
    The Object Store is read when neither serves, or the gloo stream is refused."""
    started = time.perf_counter()
    version = published.version
    if published.format == "safetensors":  # one file: runs recorded before shards
        from safetensors.torch import load as load_safetensors

        data = await _read(blobs, published.weights, version)
        whole = await asyncio.to_thread(load_safetensors, data)
        return FetchedWeights(len(data), 1, time.perf_counter() - started, state_dict=whole)
    try:
        manifest = WeightsManifest.from_bytes(await _read(blobs, published.weights, version))
    except WeightsFormatError as exc:
        raise WeightsUnreadable(f"version {version}: {exc}") from None
    if stage_dir is not None and node and node == manifest.node and manifest.local_dir:
        local = await asyncio.to_thread(_handed_over, manifest)
        if local is not None:
            return FetchedWeights(manifest.size, len(manifest.shards), time.perf_counter() - started,
                                  dtype=manifest.dtype, files=local, handoff=True, via="handoff")
        if log is not None:
            log.info("weights_handoff_missed", version=version, folder=manifest.local_dir)
    pull = StreamPull.of(manifest, stream_timeout_s) if stream_timeout_s is not None else None
    if pull is not None and pull.backend == "nccl":  # GPU to GPU: the engine itself receives, at the swap
        return FetchedWeights(manifest.size, len(manifest.shards), time.perf_counter() - started,
                              dtype=manifest.dtype, pull=pull, via="stream")
    if pull is not None:
        try:
            streamed = await _streamed(pull, manifest, version, stage_dir)
        except StreamRefused as exc:
            if log is not None:
                log.warning("weights_stream_refused", version=version, detail=str(exc))
        else:
            streamed.fetch_s = time.perf_counter() - started
            return streamed
    fetched = FetchedWeights(manifest.size, len(manifest.shards), 0.0, dtype=manifest.dtype)
    if stage_dir is not None:
        stage_dir.mkdir(parents=True, exist_ok=True)
    shards = manifest.shards
    pending = asyncio.ensure_future(_read_checked(blobs, shards[0], version))
    try:
        for i, shard in enumerate(shards):
            data, retries = await pending
            fetched.refetched += retries
            if i + 1 < len(shards):  # the next one downloads while this one is put down
                pending = asyncio.ensure_future(_read_checked(blobs, shards[i + 1], version))
            try:
                if stage_dir is not None:
                    path = stage_dir / f"v{version}-{i:05d}.safetensors"
                    fetched.files.append(path)
                    await asyncio.to_thread(_stage, data, shard, manifest.dtype, path)
                else:
                    tensors = await asyncio.to_thread(decode_shard, data, shard, manifest.dtype)
                    overlap = fetched.state_dict.keys() & tensors.keys()
                    if overlap:
                        raise WeightsFormatError(f"{sorted(overlap)[0]} is in two shards")
                    fetched.state_dict.update(tensors)
            except WeightsFormatError as exc:
                raise WeightsUnreadable(f"version {version}: {exc}") from None
        if stage_dir is None and len(fetched.state_dict) != manifest.tensors:
            raise WeightsUnreadable(f"version {version}: {len(fetched.state_dict)} tensors, manifest says "
                                    f"{manifest.tensors}")
    except BaseException:
        fetched.discard()
        raise
    finally:
        if not pending.done():
            pending.cancel()
    if fetched.refetched and log is not None:
        log.warning("weights_shards_refetched", version=version, refetched=fetched.refetched)
    fetched.fetch_s = time.perf_counter() - started
    return fetched


async def _streamed(pull: StreamPull, manifest: WeightsManifest, version: int,
                    stage_dir: Path | None) -> FetchedWeights:
    """The publication over the gloo stream: into staged files, or into a state dict without a staging folder."""
    fetched = FetchedWeights(manifest.size, len(manifest.shards), 0.0, dtype=manifest.dtype, via="stream")
    if stage_dir is None:
        fetched.state_dict = dict(await asyncio.to_thread(receive, pull, "cpu"))
        return fetched
    stage_dir.mkdir(parents=True, exist_ok=True)
    fetched.files = [stage_dir / f"v{version}-{i:05d}.safetensors" for i in range(len(manifest.shards))]
    await asyncio.to_thread(receive_files, pull, fetched.files)
    return fetched


def _handed_over(manifest: WeightsManifest) -> list[Path] | None:
    """Rank 0's files of every shard, each of the right size and with the header its manifest entry says;
    None when any is missing (pruned, or another node's folder of the same name) or is not what it should be.
    Named by digest and written atomically by rank 0, a file of the right size is not hashed again."""
    paths = []
    for shard in manifest.shards:
        path = manifest.local_path(shard)
        try:
            if path.stat().st_size != shard.ref.size:
                return None
            with path.open("rb") as f:
                head = f.read(8)
                header = f.read(int.from_bytes(head, "little")) if len(head) == 8 else b""
            check_shard(head + header, shard, manifest.dtype)
        except (OSError, WeightsFormatError):
            return None
        paths.append(path)
    return paths


def _stage(data: bytes, shard: WeightShard, dtype: str, path: Path) -> None:
    check_shard(data, shard, dtype)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


async def _read(blobs: Blobs, ref: Any, version: int) -> bytes:
    try:
        return await blobs.get(ref)
    except (BlobNotFound, ObjectFetchTimeout) as exc:
        raise WeightsGone(f"version {version}: {exc}") from None


async def _read_checked(blobs: Blobs, shard: WeightShard, version: int) -> tuple[bytes, int]:
    """A shard's bytes, read again (up to SHARD_ATTEMPTS reads) while they come back corrupted."""
    for attempt in range(SHARD_ATTEMPTS):
        try:
            return await _read(blobs, shard.ref, version), attempt
        except BlobCorrupted as exc:
            last = exc
    raise WeightsUnreadable(f"version {version}: shard {shard.ref.digest[:19]} read back corrupted "
                            f"{SHARD_ATTEMPTS} times ({last})")


__all__ = ["FetchedWeights", "SHARD_ATTEMPTS", "WeightsGone", "WeightsUnreadable", "fetch_weights"]
