"""The weights stream: a publication's shards sent by trainer rank 0 straight to a rollout engine over a
torch.distributed pair group (gloo between host memories, NCCL between GPUs), beside the Object Store, which stays
the path of record and the fallback.

Rank 0 holds its newest publication's shards and answers pulls through a rendezvous store it hosts
(`StreamServer`, services/trainer/weights_stream.py). A pull takes a ticket from that store, names the shards it
wants by digest and, once told they are held, forms a two-member group with rank 0 under the ticket's prefix and
receives each shard into one buffer. Where: over gloo (host memory), into the pages of the staged safetensors
files the engine then loads (`receive_files`: the transfer runs while the worker serves, and the swap is the same
file load as after an Object Store fetch); over NCCL, inside the vLLM worker onto the GPU the weights serve from
(`receive`, at the swap). The shard is safetensors as stored, so its header (copied to the host: a few kilobytes)
names every tensor, and the tensors are views into the received buffer — nothing is decoded or copied again
before the engine's reload.

Checks: each received shard's header is checked against the manifest (tensor count, floating dtype) and its
length is the stored one; the bytes themselves are not hashed (the transports are TCP and NCCL; the digests
guard the copies at rest in the Object Store). A publication rank 0 no longer holds (a newer one replaced it), a
store that cannot be reached, or a transfer cut short is `StreamRefused`: the caller reads the Object Store.
"""

from __future__ import annotations

import datetime as dt
import json
import struct
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from shared.weights import SAFETENSORS_DTYPES, WeightShard, WeightsFormatError, WeightsManifest, check_shard

if TYPE_CHECKING:
    import torch

StreamBackend = Literal["gloo", "nccl"]
TICKETS = "tickets"  # the store's counter a pull takes its ticket from
HELD = "ok"  # rank 0's answer when it holds every shard asked for


class StreamRefused(Exception):
    """The stream did not deliver the publication (not held any more, unreachable, cut short): read the
    Object Store instead."""


@dataclass(frozen=True)
class StreamPull:
    """What a receiver needs to pull one publication (plain data: it crosses vLLM's RPC to the engine process)."""

    address: str  # host:port of rank 0's rendezvous store
    backend: StreamBackend
    shards: tuple[WeightShard, ...]
    dtype: str
    timeout_s: float = 60.0

    @classmethod
    def of(cls, manifest: WeightsManifest, timeout_s: float = 60.0) -> StreamPull | None:
        """The pull a manifest offers; None when its rank 0 serves no stream."""
        if not manifest.stream:
            return None
        backend: StreamBackend = "nccl" if manifest.stream_backend == "nccl" else "gloo"
        return cls(manifest.stream, backend, manifest.shards, manifest.dtype, timeout_s)

    @property
    def digests(self) -> list[str]:
        return [s.ref.digest for s in self.shards]


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"a stream address is host:port, got {address!r}")
    return host.strip("[]"), int(port)


def rendezvous(address: str, timeout_s: float, *, serve: bool = False) -> Any:
    """Rank 0's store (`serve`: it listens, port 0 picks a free one) or a receiver's connection to it."""
    import torch.distributed as dist

    host, port = split_address(address)
    return dist.TCPStore(host, port, is_master=serve, wait_for_workers=False, use_libuv=True,
                         timeout=dt.timedelta(seconds=timeout_s))


def pair_group(store: Any, ticket: int, rank: int, backend: StreamBackend, timeout_s: float) -> Any:
    """The two-member group of one pull (rank 0 the sender, rank 1 the receiver), under the ticket's prefix."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore(f"t{ticket}/group/", store)
    timeout = dt.timedelta(seconds=timeout_s)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, 2, options)
    return dist.ProcessGroupGloo(prefixed, rank, 2, timeout)


def shard_buffer(data: bytes, device: str) -> torch.Tensor:
    """A stored shard's bytes as the uint8 tensor to send (no copy on the host; one to a GPU)."""
    import torch

    with warnings.catch_warnings():  # bytes are read-only; a send only reads them
        warnings.simplefilter("ignore", UserWarning)
        buffer = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return buffer if device == "cpu" else buffer.to(device)


def receive(pull: StreamPull, device: str) -> list[tuple[str, torch.Tensor]]:
    """Pull a publication from rank 0 into buffers on `device`; its tensors, in the shards' order, as views
    into them. Raises StreamRefused when the stream does not deliver it whole."""
    import torch

    # NCCL receives on the GPU itself; gloo into host memory (pinned, for a GPU engine: one copy over).
    landing = device if pull.backend == "nccl" else "cpu"

    def buffer(i: int, shard: WeightShard) -> torch.Tensor:
        return torch.empty(shard.ref.size, dtype=torch.uint8, device=landing, pin_memory=landing != device)

    buffers = [b if landing == device else b.to(device, non_blocking=True) for b in _pull(pull, buffer)]
    if device != "cpu":
        torch.cuda.synchronize(device)
    tensors: list[tuple[str, torch.Tensor]] = []
    for shard, received in zip(pull.shards, buffers, strict=True):
        try:
            tensors.extend(shard_tensors(received, shard, pull.dtype))
        except WeightsFormatError as exc:
            raise StreamRefused(f"stream {pull.address}: {exc}") from None
    return tensors


def receive_files(pull: StreamPull, paths: Sequence[Path]) -> None:
    """Pull a publication from rank 0 (gloo) straight into one safetensors file per shard, each received into
    the file's own pages (memory-mapped: no copy in between) under a temporary name, its header checked, then
    renamed: the files an engine loads as it loads staged shards. StreamRefused, with no file left, when the
    stream does not deliver them whole."""
    import torch

    if pull.backend != "gloo":
        raise ValueError(f"a {pull.backend} stream lands on a GPU, not in files")
    temporary = [p.with_name(p.name + ".tmp") for p in paths]

    def buffer(i: int, shard: WeightShard) -> torch.Tensor:
        with open(temporary[i], "wb") as f:
            f.truncate(shard.ref.size)
        if not shard.ref.size:
            return torch.empty(0, dtype=torch.uint8)
        return torch.from_file(str(temporary[i]), shared=True, size=shard.ref.size, dtype=torch.uint8)

    try:
        buffers = _pull(pull, buffer)
        for shard, received in zip(pull.shards, buffers, strict=True):
            try:
                check_shard(_header(received), shard, pull.dtype)
            except WeightsFormatError as exc:
                raise StreamRefused(f"stream {pull.address}: {exc}") from None
        del buffers
        for tmp, path in zip(temporary, paths, strict=True):
            tmp.replace(path)
    except BaseException:
        for path in [*temporary, *paths]:
            path.unlink(missing_ok=True)
        raise


def _pull(pull: StreamPull, buffer: Callable[[int, WeightShard], torch.Tensor]) -> list[torch.Tensor]:
    """Take a ticket, ask for the publication's shards and receive each into `buffer(i, shard)`."""
    try:
        store = rendezvous(pull.address, pull.timeout_s)
        ticket = int(store.add(TICKETS, 1))
        store.set(f"t{ticket}/want", json.dumps(pull.digests))
        store.wait([f"t{ticket}/answer"], dt.timedelta(seconds=pull.timeout_s))
        answer = store.get(f"t{ticket}/answer").decode()
    except (RuntimeError, OSError, ValueError) as exc:  # torch raises DistStoreError (a RuntimeError)
        raise StreamRefused(f"stream {pull.address}: {first_line(exc)}") from None
    if answer != HELD:
        raise StreamRefused(f"stream {pull.address}: {answer}")
    try:
        group = pair_group(store, ticket, 1, pull.backend, pull.timeout_s)
        buffers = []
        for i, shard in enumerate(pull.shards):
            landing = buffer(i, shard)
            group.recv([landing], 0, i).wait()
            buffers.append(landing)
    except RuntimeError as exc:
        raise StreamRefused(f"stream {pull.address}: cut short ({first_line(exc)})") from None
    return buffers


def _header(buffer: torch.Tensor) -> bytes:
    """A received shard's 8-byte length and JSON header, copied to the host (the tensor bytes stay where they are)."""
    head = buffer[:8].cpu().numpy().tobytes()
    if len(head) < 8:
        return head
    (length,) = struct.unpack("<Q", head)
    return head + buffer[8 : 8 + length].cpu().numpy().tobytes()


def shard_tensors(buffer: torch.Tensor, shard: WeightShard, dtype: str) -> Iterator[tuple[str, torch.Tensor]]:
    """A received shard's tensors as views into its buffer, after its header is checked against the manifest."""
    import torch

    header_bytes = _header(buffer)
    check_shard(header_bytes, shard, dtype)
    header = json.loads(header_bytes[8:])
    start = len(header_bytes)
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        if start + end > buffer.numel():
            raise WeightsFormatError(f"shard {shard.ref.digest[:19]}: {name} runs past the shard's end")
        raw = buffer[start + begin : start + end]
        kind = getattr(torch, SAFETENSORS_DTYPES[info["dtype"]])
        if (start + begin) % kind.itemsize:  # not aligned for a view: one copy of this tensor
            raw = raw.clone()
        yield name, raw.view(kind).view(info["shape"])


def first_line(exc: BaseException) -> str:
    """An exception's message in one line (torch's carry a C++ stack trace below it)."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


__all__ = ["HELD", "StreamBackend", "StreamPull", "StreamRefused", "TICKETS", "first_line", "pair_group",
           "receive", "receive_files", "rendezvous", "shard_buffer", "shard_tensors", "split_address"]
