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


class TokenBuffer:
    """An append-only int32 sequence whose prefixes are handed out as read-only views.

    An agent's calls each resend the whole context, so each call's prompt extends the one before; kept as
    copies, an execution of hundreds of calls over a million tokens holds hundreds of millions of ids. Kept as
    views of one buffer that only grows, it holds each id once (about twice, with the doubling). Appending never
    changes what an earlier view shows: it writes past every view, and a buffer that must grow moves to a new
    array while the earlier views keep the old one.
    """

    __slots__ = ("_data", "_len")

    def __init__(self, capacity: int = 0) -> None:
        self._data = np.empty(max(capacity, 16), dtype=np.int32)
        self._len = 0

    def __len__(self) -> int:
        return self._len

    @property
    def nbytes(self) -> int:
        """The memory it holds (its capacity), not counting earlier arrays that views still keep."""
        return int(self._data.nbytes)

    @classmethod
    def of(cls, *parts: np.ndarray | Sequence[int]) -> TokenBuffer:
        arrays = [np.asarray(p, dtype=np.int32) for p in parts]
        buffer = cls(sum(len(a) for a in arrays))
        buffer.append(*arrays)
        return buffer

    def view(self, n: int | None = None) -> np.ndarray:
        """The first `n` ids (all of them by default), read-only."""
        n = self._len if n is None else n
        if not 0 <= n <= self._len:
            raise ValueError(f"view of {n} ids from a buffer of {self._len}")
        out = self._data[:n]
        out.flags.writeable = False
        return out

    def append(self, *parts: np.ndarray | Sequence[int]) -> np.ndarray:
        """Append `parts` in order; returns the view of the whole sequence."""
        arrays = [np.asarray(p, dtype=np.int32) for p in parts]
        end = self._len + sum(len(a) for a in arrays)
        if end > len(self._data):
            grown = np.empty(max(end, 2 * len(self._data)), dtype=np.int32)
            grown[: self._len] = self._data[: self._len]
            self._data = grown
        for a in arrays:
            self._data[self._len : self._len + len(a)] = a
            self._len += len(a)
        return self.view()

    def extended(self, n: int, *parts: np.ndarray | Sequence[int]) -> tuple[TokenBuffer, np.ndarray]:
        """Its first `n` ids followed by `parts`: appended here when `n` is its whole length, else in a new
        buffer (the ids past `n` may be in views someone holds). Returns the buffer that holds the result and
        the result's view."""
        if not 0 <= n <= self._len:
            raise ValueError(f"cannot extend the first {n} ids of a buffer of {self._len}")
        if n == self._len:
            return self, self.append(*parts)
        buffer = TokenBuffer.of(self._data[:n], *parts)
        return buffer, buffer.view()
