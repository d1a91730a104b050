"""Compact binary codecs for token arrays: little-endian int32 ids and float32 logprobs, zstd-compressed.

Blobs are content-addressed by the digest of their encoded bytes, so encoding must be deterministic.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import numpy as np
import zstandard

_MAGIC = b"GYT1"
_ZSTD_LEVEL = 3


class TokenCodecError(Exception):
    pass


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def encode_arrays(arrays: Sequence[np.ndarray]) -> bytes:
    """Pack a list of 1-D int32/float32 arrays into one deterministic, compressed buffer."""
    header = [struct.pack("<4sI", _MAGIC, len(arrays))]
    payload = []
    for arr in arrays:
        if arr.ndim != 1:
            raise TokenCodecError(f"expected 1-D arrays, got shape {arr.shape}")
        if arr.dtype == np.int32 or np.issubdtype(arr.dtype, np.integer):
            kind, data = b"i", np.ascontiguousarray(arr, dtype="<i4").tobytes()
        elif np.issubdtype(arr.dtype, np.floating):
            kind, data = b"f", np.ascontiguousarray(arr, dtype="<f4").tobytes()
        else:
            raise TokenCodecError(f"unsupported dtype {arr.dtype}; expected an integer or float array")
        header.append(struct.pack("<cI", kind, arr.shape[0]))
        payload.append(data)
    raw = b"".join(header) + b"".join(payload)
    return zstandard.ZstdCompressor(level=_ZSTD_LEVEL, write_checksum=False, write_content_size=True).compress(raw)


def decode_arrays(blob: bytes) -> list[np.ndarray]:
    try:
        raw = zstandard.ZstdDecompressor().decompress(blob)
    except zstandard.ZstdError as exc:
        raise TokenCodecError(f"token blob is not zstd data: {exc}") from exc
    if len(raw) < 8 or raw[:4] != _MAGIC:
        raise TokenCodecError("token blob has no GYT1 header")
    (count,) = struct.unpack_from("<I", raw, 4)
    offset = 8
    specs = []
    for _ in range(count):
        kind, length = struct.unpack_from("<cI", raw, offset)
        offset += 5
        specs.append((kind, length))
    out = []
    for kind, length in specs:
        dtype = "<i4" if kind == b"i" else "<f4"
        end = offset + 4 * length
        if end > len(raw):
            raise TokenCodecError(f"token blob truncated: needs {end} bytes, has {len(raw)}")
        out.append(np.frombuffer(raw, dtype=dtype, count=length, offset=offset).copy())
        offset = end
    if offset != len(raw):
        raise TokenCodecError(f"token blob has {len(raw) - offset} trailing bytes")
    return out
