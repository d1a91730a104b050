"""A session's saved KV as one self-describing byte string: the KV connector's files for one prompt (one
safetensors file a layer) behind a manifest naming the model they belong to. What the KV transport carries
between workers; pure: no I/O.
"""

from __future__ import annotations

import json
import struct

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAGIC = b"GYREKV1\n"
_HEADER = struct.Struct("<Q")  # the manifest's length in bytes
MAX_MANIFEST_BYTES = 1 << 20


class KvBundleError(Exception):
    """The bytes are not a KV bundle this worker can load: truncated, malformed, or for another model or
    prompt. The message says which; a migration then recomputes."""


class KvManifest(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    fingerprint: str  # the engine's model identity (weights' shapes and dtype, block size): see engine.kv_fingerprint
    folder: str  # the connector's key for the saved prompt (kv_connector.kv_folder_name)
    prompt_tokens: int = Field(ge=1)
    files: tuple[tuple[str, int], ...]  # (file name, bytes) in the order they follow the manifest


def pack_bundle(manifest: KvManifest, files: dict[str, bytes]) -> bytes:
    if sorted(files) != sorted(name for name, _ in manifest.files):
        raise KvBundleError(f"manifest names {sorted(n for n, _ in manifest.files)}, files are {sorted(files)}")
    head = manifest.model_dump_json().encode()
    parts = [MAGIC, _HEADER.pack(len(head)), head]
    for name, size in manifest.files:
        if len(files[name]) != size:
            raise KvBundleError(f"file {name}: manifest says {size} B, it has {len(files[name])} B")
        parts.append(files[name])
    return b"".join(parts)


def unpack_bundle(data: bytes) -> tuple[KvManifest, dict[str, bytes]]:
    """The manifest and the files of a bundle; KvBundleError when the bytes are not a whole bundle."""
    if not data.startswith(MAGIC):
        raise KvBundleError(f"not a KV bundle (starts {data[:8]!r})")
    at = len(MAGIC)
    if len(data) < at + _HEADER.size:
        raise KvBundleError(f"KV bundle truncated: {len(data)} B, no manifest length")
    (head_len,) = _HEADER.unpack_from(data, at)
    at += _HEADER.size
    if head_len > MAX_MANIFEST_BYTES or at + head_len > len(data):
        raise KvBundleError(f"KV bundle truncated or malformed: manifest of {head_len} B in {len(data)} B")
    try:
        manifest = KvManifest.model_validate(json.loads(data[at : at + head_len]))
    except (ValueError, ValidationError) as exc:
        raise KvBundleError(f"KV bundle manifest unreadable: {exc}".splitlines()[0]) from exc
    at += head_len
    expected = at + sum(size for _, size in manifest.files)
    if expected != len(data):
        raise KvBundleError(f"KV bundle truncated: manifest needs {expected} B, {len(data)} B arrived")
    files: dict[str, bytes] = {}
    for name, size in manifest.files:
        if "/" in name or name.startswith(".") or not name:
            raise KvBundleError(f"KV bundle names a file outside its folder: {name!r}")
        files[name] = data[at : at + size]
        at += size
    return manifest, files


__all__ = ["KvBundleError", "KvManifest", "pack_bundle", "unpack_bundle"]
