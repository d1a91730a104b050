"""The blob store port: content-addressed bytes (token arrays, batches, weights) that events refer to by `BlobRef`.

Two backends hold blobs: PostgreSQL (`store="pg"`: written in the same transaction as the events that refer to
them; `shared.store.PostgresBlobStore`) and the JetStream Object Store (`store="object"`: large payloads such as
weights; `shared.bus.ObjectBlobStore`). A reader never asks where a blob lives: `Blobs` reads each reference from
the backend it names, in this one place. `InMemoryBlobStore` is the fake; every backend passes the same contract
suite (tests/shared/test_blob_contract.py). This module is pure: it imports neither backend.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, Protocol

from shared.events import BlobRef
from shared.tokens import digest_of

BlobLocation = Literal["pg", "object"]
DEFAULT_MEDIA_TYPE = "application/octet-stream"


class BlobError(Exception):
    """Base of the blob store's errors."""


class BlobNotFound(BlobError):
    def __init__(self, digest: str) -> None:
        super().__init__(f"no blob with digest {digest}")
        self.digest = digest


class BlobCorrupted(BlobError):
    def __init__(self, digest: str, actual: str) -> None:
        super().__init__(f"blob {digest} reads back with digest {actual}")
        self.digest = digest


def blob_ref(data: bytes, media_type: str = DEFAULT_MEDIA_TYPE, *, store: BlobLocation = "pg") -> BlobRef:
    """The reference a blob gets (content-addressed): known before it is written."""
    return BlobRef(digest=digest_of(data), size=len(data), media_type=media_type, store=store)


def checked(ref: BlobRef | str, data: bytes) -> bytes:
    """`data` if it hashes to the reference's digest; BlobCorrupted otherwise."""
    digest = ref.digest if isinstance(ref, BlobRef) else ref
    actual = digest_of(data)
    if actual != digest:
        raise BlobCorrupted(digest, actual)
    return data


class BlobStore(Protocol):
    """One backend: `put` returns the reference (naming this backend), `get` returns the bytes checked against
    the digest (BlobNotFound, BlobCorrupted)."""

    location: BlobLocation

    async def put(self, data: bytes, media_type: str = DEFAULT_MEDIA_TYPE) -> BlobRef: ...

    async def get(self, ref: BlobRef) -> bytes: ...

    async def has(self, ref: BlobRef) -> bool: ...

    async def delete(self, ref: BlobRef) -> bool:
        """Forget a blob (retention); False when there was none. Content-addressed: every reference to the same
        bytes loses them, so only a caller that knows no one else refers to them deletes."""
        ...


class Blobs:
    """Every backend behind one port: reads go where each reference says, writes where the caller says (events'
    own payloads to Postgres, beside them; large ones such as weights to the object store)."""

    def __init__(self, *backends: BlobStore) -> None:
        self.backends: dict[BlobLocation, BlobStore] = {b.location: b for b in backends}

    def _backend(self, location: BlobLocation) -> BlobStore:
        backend = self.backends.get(location)
        if backend is None:
            raise BlobError(f"no {location!r} blob store is configured (have {sorted(self.backends)})")
        return backend

    async def put(self, data: bytes, media_type: str = DEFAULT_MEDIA_TYPE, *, store: BlobLocation = "pg") -> BlobRef:
        return await self._backend(store).put(data, media_type)

    async def get(self, ref: BlobRef) -> bytes:
        return await self._backend(ref.store).get(ref)

    async def has(self, ref: BlobRef) -> bool:
        return await self._backend(ref.store).has(ref)

    async def delete(self, ref: BlobRef) -> bool:
        return await self._backend(ref.store).delete(ref)


class InMemoryBlobStore:
    """A dict behind the port (for pure tests and replay from an exported file): passes the contract suite."""

    def __init__(self, location: BlobLocation = "pg", blobs: Mapping[str, bytes] | None = None) -> None:
        self.location: BlobLocation = location
        self.data: dict[str, bytes] = dict(blobs or {})

    async def put(self, data: bytes, media_type: str = DEFAULT_MEDIA_TYPE) -> BlobRef:
        ref = blob_ref(data, media_type, store=self.location)
        self.data.setdefault(ref.digest, bytes(data))
        return ref

    async def get(self, ref: BlobRef) -> bytes:
        found = self.data.get(ref.digest)
        if found is None:
            raise BlobNotFound(ref.digest)
        return checked(ref, found)

    async def has(self, ref: BlobRef) -> bool:
        return ref.digest in self.data

    async def delete(self, ref: BlobRef) -> bool:
        return self.data.pop(ref.digest, None) is not None


__all__ = [
    "BlobCorrupted",
    "BlobError",
    "BlobLocation",
    "BlobNotFound",
    "BlobStore",
    "Blobs",
    "DEFAULT_MEDIA_TYPE",
    "InMemoryBlobStore",
    "blob_ref",
    "checked",
]
