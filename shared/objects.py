"""The JetStream Object Store: large payloads by digest (weights, token arrays past the message limit), and the
blob store port's object backend (`ObjectBlobStore`, `store="object"`)."""

from __future__ import annotations

import asyncio
import base64
import io
import time
from typing import Any

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import ObjectStoreConfig

from shared.blobs import DEFAULT_MEDIA_TYPE, BlobCorrupted, BlobLocation, BlobNotFound, blob_ref
from shared.events import BlobRef
from shared.tokens import digest_of


class ObjectStoreError(Exception):
    pass


class ObjectDigestMismatch(ObjectStoreError):
    def __init__(self, name: str, expected: str, actual: str) -> None:
        super().__init__(f"object {name!r}: expected digest {expected}, read {actual}")


class ObjectFetchTimeout(ObjectStoreError):
    """An Object Store read stopped arriving (its chunks were purged by a put of the same name, or are gone)."""

    def __init__(self, name: str, received: int, stall_s: float) -> None:
        super().__init__(f"object {name!r}: {received} B arrived, then nothing for {stall_s:.0f} s")


class ObjectStore:
    """One bucket of the JetStream Object Store, created on first use; with `ttl_s`, objects the server forgets
    after that long (what is only in transit, so a writer that died leaves nothing behind for good)."""

    def __init__(self, js: JetStreamContext, bucket: str, *, ttl_s: float | None = None) -> None:
        self.js = js
        self.bucket = bucket
        self.ttl_s = ttl_s
        self._object_store: Any = None

    async def _objects(self) -> Any:
        if self._object_store is None:
            try:
                self._object_store = await self.js.object_store(self.bucket)
            except nats.js.errors.BucketNotFoundError:
                config = ObjectStoreConfig(bucket=self.bucket, ttl=self.ttl_s)
                self._object_store = await self.js.create_object_store(self.bucket, config=config)
        return self._object_store

    async def put_object(self, data: bytes, *, name: str | None = None) -> str:
        """Store bytes under their digest (or `name`); returns the digest.

        Under its digest an object is written once: a second put of the same bytes (a trainer publishing
        weights a step did not change, say) is skipped, because the Object Store replaces an object by writing
        new chunks and purging the old ones, and a reader still on the old chunks would then wait for ever.
        A put under an explicit `name` replaces what is there."""
        digest = digest_of(data)
        store = await self._objects()
        key = name or digest.replace(":", "-")
        if name is None:
            try:
                info = await store.get_info(key)
            except nats.js.errors.NotFoundError:
                info = None
            if info is not None and info.size == len(data) and info.digest == _nats_digest(digest):
                return digest
        await store.put(key, io.BytesIO(data))
        return digest

    async def get_object(
        self, name_or_digest: str, *, expected_digest: str | None = None, stall_s: float = 60.0
    ) -> bytes:
        """Read an object whole. A read during which no chunk arrives for `stall_s` (its chunks were purged, say)
        fails with ObjectFetchTimeout instead of waiting for ever; a large object that keeps arriving, however
        slowly, is read to the end."""
        store = await self._objects()
        name = name_or_digest.replace(":", "-")
        sink = _Sink()
        reading = asyncio.ensure_future(store.get(name, writeinto=sink))
        try:
            while not reading.done():
                await asyncio.wait({reading}, timeout=min(stall_s, 5.0))
                if not reading.done() and time.monotonic() - sink.at > stall_s:
                    # nats-py's read leaves its ordered consumer subscribed when cancelled (rare: this path only).
                    raise ObjectFetchTimeout(name, len(sink.data), stall_s)
            reading.result()
        finally:
            if not reading.done():
                reading.cancel()
        data = bytes(sink.data)
        expected = expected_digest or (name_or_digest if name_or_digest.startswith("sha256") else None)
        if expected and digest_of(data) != expected.replace("-", ":", 1):
            raise ObjectDigestMismatch(name, expected, digest_of(data))
        return data

    async def delete_object(self, name_or_digest: str) -> bool:
        """Remove an object; False when there was none."""
        store = await self._objects()
        try:
            await store.delete(name_or_digest.replace(":", "-"))
        except nats.js.errors.NotFoundError:
            return False
        return True


class ObjectBlobStore:
    """The blob store port's object backend: blobs too large to sit beside events (weights)."""

    location: BlobLocation = "object"

    def __init__(self, objects: ObjectStore) -> None:
        self.objects = objects

    async def put(self, data: bytes, media_type: str = DEFAULT_MEDIA_TYPE) -> BlobRef:
        await self.objects.put_object(data)
        return blob_ref(data, media_type, store="object")

    async def get(self, ref: BlobRef) -> bytes:
        try:
            return await self.objects.get_object(ref.digest)
        except nats.js.errors.NotFoundError as exc:
            raise BlobNotFound(ref.digest) from exc
        except ObjectDigestMismatch as exc:
            raise BlobCorrupted(ref.digest, str(exc)) from exc

    async def has(self, ref: BlobRef) -> bool:
        store = await self.objects._objects()
        try:
            await store.get_info(ref.digest.replace(":", "-"))
        except nats.js.errors.NotFoundError:
            return False
        return True


class _Sink(io.RawIOBase):
    """Where an Object Store read writes its chunks (from a worker thread): the bytes, and when the last came."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.at = time.monotonic()

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        self.data += b
        self.at = time.monotonic()
        return len(b)


def _nats_digest(digest: str) -> str:
    """Our `sha256:<hex>` digest as the Object Store records it (ObjectInfo.digest): the same hash, spelt apart."""
    return "SHA-256=" + base64.urlsafe_b64encode(bytes.fromhex(digest.split(":", 1)[1])).decode()


__all__ = ["ObjectBlobStore", "ObjectDigestMismatch", "ObjectFetchTimeout", "ObjectStore", "ObjectStoreError"]
