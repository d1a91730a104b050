"""The weight publication format, written by the trainer and read by rollout workers: the full state dict in the
dtype the engines serve, cut into safetensors shards along layer boundaries, each stored as its own blob with its
own digest, and one small manifest that names them (the blob `weights.published` refers to).

Shards let a worker fetch, check and decode the model piece by piece while the rest is still arriving (and fetch
again only the piece that came back corrupted); cutting them between layers keeps every layer's tensors in one
shard, so a shard can be handed to an engine's in-place reload on its own (vLLM processes a layer once all its
weights have arrived). A shard's blob is content-addressed: a layer a step did not change keeps its digest, so
consecutive versions can share it, and retention (services/trainer/retention.py) counts references before it
deletes. Pure but for torch/safetensors: no I/O.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shared.events import BlobRef

if TYPE_CHECKING:
    import torch

SHARD_MEDIA_TYPE = "application/x-safetensors"
MANIFEST_MEDIA_TYPE = "application/vnd.gyre.weights-manifest+json"
DEFAULT_SHARD_BYTES = 256 * 2**20
PublishDtype = Literal["auto", "float32", "bfloat16", "float16"]
_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


class WeightsFormatError(Exception):
    """A publication that is not what its manifest says (missing tensors, a shard of another dtype, …)."""


class WeightShard(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    ref: BlobRef
    tensors: int = Field(ge=1)


class WeightsManifest(BaseModel):
    """What a publication holds: its shards in load order, the dtype of every floating tensor, the totals."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal["gyre.weights/1"] = "gyre.weights/1"
    dtype: str
    tensors: int = Field(ge=1)
    size: int = Field(ge=0)  # bytes: the shards' sizes together
    shards: tuple[WeightShard, ...] = Field(min_length=1)
    # The same-node handoff: rank 0 also wrote each shard as `<local_dir>/<digest hex>.safetensors` on `node`;
    # a worker on that node hands those files to its engine instead of reading the Object Store.
    node: str = ""
    local_dir: str = ""
    # The weights stream (shared/weights_stream.py): rank 0's rendezvous address and the group's backend, where it
    # also sends the shards to workers directly.
    stream: str = ""
    stream_backend: str = ""

    def local_path(self, shard: WeightShard) -> Path:
        return Path(self.local_dir) / local_name(shard.ref.digest)

    def digests(self) -> set[str]:
        return {s.ref.digest for s in self.shards}

    def to_bytes(self) -> bytes:
        # Without a stream, the bytes of manifests written before it existed (so their digests stay the same).
        unset = {k for k in ("stream", "stream_backend") if not getattr(self, k)}
        return self.model_dump_json(exclude=unset or None).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> WeightsManifest:
        try:
            return cls.model_validate_json(data)
        except ValueError as exc:
            raise WeightsFormatError(f"not a weights manifest: {exc}") from None


def local_name(digest: str) -> str:
    """A shard's file name in a node-local folder: its digest, so a name says what the bytes are."""
    return digest.split(":", 1)[1] + ".safetensors"


def layer_group(name: str) -> str:
    """The unit a shard never splits: a decoder layer (`model.layers.3`) for its tensors, else the tensor's
    own module (`model.embed_tokens`, `lm_head`)."""
    match = _LAYER.match(name)
    if match:
        return match.group(1)
    return name.rsplit(".", 1)[0] if "." in name else name


def plan_shards(sizes: Mapping[str, int], max_bytes: int) -> list[list[str]]:
    """Tensor names cut into shards of at most `max_bytes` (a layer larger than that is a shard of its own),
    in sorted-name order, never splitting a layer group between shards."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    groups: dict[str, list[str]] = {}
    for name in sorted(sizes):
        groups.setdefault(layer_group(name), []).append(name)
    shards: list[list[str]] = []
    current: list[str] = []
    current_bytes = 0
    for names in groups.values():
        size = sum(sizes[n] for n in names)
        if current and current_bytes + size > max_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.extend(names)
        current_bytes += size
    if current:
        shards.append(current)
    return shards


def resolve_dtype(requested: str, model_dtype: Any) -> torch.dtype:
    """The dtype to publish (or serve) in: `auto` is the model's own (its config's `dtype`), so a bf16
    checkpoint ships bf16 whatever the trainer computes in; float32 when the model names no floating dtype.
    Floating tensors are cast to it, others are left alone."""
    import torch

    name = requested if requested != "auto" else model_dtype
    found = name if isinstance(name, torch.dtype) else getattr(torch, name, None) if isinstance(name, str) else None
    return found if isinstance(found, torch.dtype) and found.is_floating_point else torch.float32


def encode_shards(
    state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype, max_bytes: int = DEFAULT_SHARD_BYTES,
    *, skip: Iterable[str] = (),
) -> Iterator[tuple[bytes, int]]:
    """Each shard as safetensors bytes (deterministic: sorted names, contiguous CPU tensors) with its tensor
    count, cast to `dtype` as it is encoded (one shard's copy at a time, not the whole model's)."""
    from safetensors.torch import save as save_safetensors

    left_out = set(skip)
    names = [n for n in state_dict if n not in left_out]
    if not names:
        raise WeightsFormatError("expected a full state dict with tensors, got an empty one (not rank 0?)")
    itemsize = dtype.itemsize
    sizes = {n: state_dict[n].numel() * (itemsize if state_dict[n].is_floating_point()
                                         else state_dict[n].element_size()) for n in names}
    for shard in plan_shards(sizes, max_bytes):
        tensors = {}
        for name in shard:
            t = state_dict[name].detach().to("cpu")
            tensors[name] = (t.to(dtype) if t.is_floating_point() else t).contiguous()
        yield save_safetensors(tensors, metadata={"format": "pt"}), len(tensors)


def manifest_for(shards: Sequence[tuple[BlobRef, int]], dtype: str, *, node: str = "", local_dir: str = "",
                 stream: str = "", stream_backend: str = "") -> WeightsManifest:
    """The manifest of stored shards (references and tensor counts, in load order) of one dtype (`bfloat16`)."""
    return WeightsManifest(dtype=dtype.removeprefix("torch."), tensors=sum(n for _, n in shards),
                           size=sum(ref.size for ref, _ in shards),
                           shards=tuple(WeightShard(ref=ref, tensors=n) for ref, n in shards),
                           node=node, local_dir=local_dir, stream=stream, stream_backend=stream_backend)


# safetensors' dtype codes, by torch's names; the floating ones are what a manifest's dtype governs
SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                      "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32",
                      "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
_FLOAT_CODES = {code: name for code, name in SAFETENSORS_DTYPES.items() if name.startswith(("float", "bfloat"))}


def check_shard(data: bytes | memoryview, shard: WeightShard, dtype: str) -> None:
    """What `decode_shard` checks, from the safetensors header alone (no tensor is built): the tensor count and
    the dtype of every floating tensor. For a worker that hands the shard to its engine as a file."""
    where = f"shard {shard.ref.digest[:19]}"
    try:
        size = struct.unpack("<Q", bytes(data[:8]))[0]
        if not 0 < size <= len(data) - 8:
            raise ValueError(f"header length {size} past the end")
        header = json.loads(bytes(data[8 : 8 + size]))
        tensors = {k: v["dtype"] for k, v in header.items() if k != "__metadata__"}
    except (ValueError, KeyError, TypeError, struct.error) as exc:
        raise WeightsFormatError(f"{where}: not safetensors ({exc})") from None
    if len(tensors) != shard.tensors:
        raise WeightsFormatError(f"{where}: {len(tensors)} tensors, manifest says {shard.tensors}")
    for name, code in tensors.items():
        if code in _FLOAT_CODES and _FLOAT_CODES[code] != dtype:
            raise WeightsFormatError(f"{where}: {name} is {_FLOAT_CODES[code]}, manifest says {dtype}")


def decode_shard(data: bytes, shard: WeightShard, dtype: str) -> dict[str, torch.Tensor]:
    """A shard's tensors, checked against the manifest (count, and the dtype of every floating tensor)."""
    from safetensors.torch import load as load_safetensors

    check_shard(data, shard, dtype)
    try:
        return load_safetensors(data)
    except Exception as exc:  # safetensors raises its own SafetensorError on a malformed body
        raise WeightsFormatError(f"shard {shard.ref.digest[:19]}: not safetensors ({exc})") from None


__all__ = [
    "DEFAULT_SHARD_BYTES",
    "MANIFEST_MEDIA_TYPE",
    "PublishDtype",
    "SAFETENSORS_DTYPES",
    "SHARD_MEDIA_TYPE",
    "WeightShard",
    "WeightsFormatError",
    "WeightsManifest",
    "check_shard",
    "decode_shard",
    "encode_shards",
    "layer_group",
    "local_name",
    "manifest_for",
    "plan_shards",
    "resolve_dtype",
]
