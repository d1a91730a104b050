"""The JetStream Object Store: large payloads by digest (weights, token arrays past the message limit), and the
blob store port's object backend (`ObjectBlobStore`, `store="object"`)."""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import hashlib
import json
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext, api
from nats.js.api import ObjectStoreConfig

from shared.blobs import DEFAULT_MEDIA_TYPE, BlobCorrupted, BlobLocation, BlobNotFound, blob_ref
from shared.events import BlobRef
from shared.tokens import digest_of


# One thread hashes objects as they are written and read: hashlib releases the GIL, so it runs beside the
# transfer; one, so a read's chunks are hashed in order.
_HASHER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="object-hash")
# A chunk: 512 KiB, or less where the server's max_payload is smaller. Four times nats-py's 128 KiB: a quarter
# of the messages, and 20-25 % faster both ways on this machine (256 MiB: write 0.48 → 0.37 s, read 0.93 →
# 0.78 s). Readers take whatever size each chunk is, nats-py's `get` included.
CHUNK_BYTES = 512 * 1024
ACK_TIMEOUT_S = 30.0  # for a chunk's store acknowledgement
# Bytes in flight (sent, not yet acknowledged) across all of one bucket's writes: JetStream answers a stream
# flooded with pending publishes with 429 (seen storing a 1 GB model's shards all at once), and a chunk cannot
# simply be sent again (an object's chunks are read in stream order). 32 MiB keeps the pipe full.
WINDOW_BYTES = 32 * 2**20
# How long a bucket's first use waits for its stream to have a leader (`ObjectStore._until_led`).
LEADER_WAIT_S = 15.0


class ObjectStoreError(Exception):
    pass


class ObjectDigestMismatch(ObjectStoreError):
    def __init__(self, name: str, expected: str, actual: str) -> None:
        super().__init__(f"object {name!r}: expected digest {expected}, read {actual}")


class ObjectFetchTimeout(ObjectStoreError):
    """An Object Store read stopped arriving (its chunks were purged by a put of the same name, or are gone)."""

    def __init__(self, name: str, received: int, stall_s: float) -> None:
        super().__init__(f"object {name!r}: {received} B arrived, then nothing for {stall_s:.0f} s")


@dataclass
class Upload:
    """An object being written (`ObjectStore.start_put`): where its chunks land, and the write itself."""

    chunks: str  # the id its chunks are stored under ($O.<bucket>.C.<chunks>)
    task: asyncio.Task[str]


class ObjectStore:
    """One bucket of the JetStream Object Store, created on first use; with `ttl_s`, objects the server forgets
    after that long, kept in its memory (what is only in transit, so a writer that died leaves nothing behind
    for good)."""

    def __init__(self, js: JetStreamContext, bucket: str, *, ttl_s: float | None = None, replicas: int = 1) -> None:
        self.js = js
        self.bucket = bucket
        self.ttl_s = ttl_s
        self.replicas = replicas
        self._object_store: Any = None
        self._window: asyncio.Semaphore | None = None  # WINDOW_BYTES in chunks, made in the loop that writes

    async def _objects(self) -> Any:
        if self._object_store is None:
            try:
                self._object_store = await self.js.object_store(self.bucket)
            except nats.js.errors.BucketNotFoundError:
                # A bucket of objects in transit (a TTL) is kept in the servers' memory where they allow it: what
                # it holds lives seconds, and one lost with a server is only fetched again or recomputed (KV
                # between workers: the JetStream file store's writes cost a 16 MiB move ~0.02 s here).
                storages = [api.StorageType.MEMORY, api.StorageType.FILE] if self.ttl_s else [api.StorageType.FILE]
                for i, storage in enumerate(storages):
                    config = ObjectStoreConfig(bucket=self.bucket, ttl=self.ttl_s, replicas=self.replicas,
                                               storage=storage)
                    try:
                        self._object_store = await self.js.create_object_store(self.bucket, config=config)
                        break
                    except nats.js.errors.APIError:  # no memory store on these servers (or none left): files
                        if i == len(storages) - 1:
                            raise
            await self._until_led()
        return self._object_store

    async def _until_led(self) -> None:
        """Until the bucket's stream has a leader, for at most LEADER_WAIT_S. In a cluster a stream just created
        (here or by another process) answers no publish until its replicas have elected one: each chunk written
        then came back 503 (no responders), seen moving a session's KV just after its bucket was made with one
        of three servers down. A single server (no cluster) leads at once. Past the wait the writes go ahead
        and say what is wrong."""
        deadline = time.monotonic() + LEADER_WAIT_S
        while True:
            try:
                info = await self.js.stream_info(f"OBJ_{self.bucket}")
                if info.cluster is None or info.cluster.leader:
                    return
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.js.errors.APIError):
                pass  # no leader to answer yet
            if time.monotonic() > deadline:
                return
            await asyncio.sleep(0.1)

    async def put_object(self, data: bytes, *, name: str | None = None) -> str:
        """Store bytes under their digest (or `name`); returns the digest.

        Under its digest an object is written once: a second put of the same bytes (a trainer publishing
        weights a step did not change, say) is skipped, because the Object Store replaces an object by writing
        new chunks and purging the old ones, and a reader still on the old chunks would then wait for ever.
        A put under an explicit `name` replaces what is there. Its bytes are hashed on a thread while the chunks
        go out (hashlib lets go of the GIL): the digest, needed only for the meta written last, costs no time."""
        store = await self._objects()
        if name is None:
            digest = digest_of(data)
            key = digest.replace(":", "-")
            hashing: asyncio.Future[str] | None = None
        else:
            key, hashing = name, asyncio.get_running_loop().run_in_executor(_HASHER, digest_of, data)
        try:
            info = await store.get_info(key)
        except nats.js.errors.NotFoundError:
            info = None
        if hashing is None and info is not None and info.size == len(data) and info.digest == _nats_digest(digest):
            return digest
        digest = await self._write(key, data, hashing or digest)
        if info is not None and not info.deleted and info.nuid:
            await self.js.purge_stream(f"OBJ_{self.bucket}", subject=f"$O.{self.bucket}.C.{info.nuid}")
        return digest

    async def _write(self, key: str, data: bytes, digest: str | asyncio.Future[str], *, nuid: str | None = None) -> str:
        """Write an object as nats-py's `put` lays it out (chunks under a fresh id, then the meta record that
        names them), but with the chunks pipelined: nats-py waits for each chunk's ack before sending the next,
        128 round trips for 16 MiB; here up to WINDOW_BYTES of chunks (shared by the bucket's writes) are in flight and
        each ack lets the next one go. The meta goes last, so a reader never sees an object whose chunks are
        not all stored."""
        nc = self.js._nc
        nuid = nuid or nc._nuid.next().decode()
        chunks_subject = f"$O.{self.bucket}.C.{nuid}"
        inbox = nc.new_inbox()
        chunk = max(4096, min(CHUNK_BYTES, nc.max_payload - 4096))  # room for the headers
        if self._window is None:
            self._window = asyncio.Semaphore(max(8, WINDOW_BYTES // chunk))
        window = self._window
        count = (len(data) + chunk - 1) // chunk
        in_flight = 0
        failed: list[str] = []
        all_acked = asyncio.Event()
        acked = 0

        async def on_ack(msg: Any) -> None:
            nonlocal in_flight, acked
            in_flight -= 1
            acked += 1
            window.release()
            status = (msg.headers or {}).get("Status")
            reply = {} if status else json.loads(msg.data)
            if status or "error" in reply:
                failed.append(str(status or reply["error"]))
            if acked == count or failed:
                all_acked.set()

        sub = await nc.subscribe(f"{inbox}.*", cb=on_ack)
        view = memoryview(data)
        try:
            for i in range(count):
                await asyncio.wait_for(window.acquire(), timeout=ACK_TIMEOUT_S)
                in_flight += 1
                if failed:
                    break
                await nc.publish(chunks_subject, bytes(view[i * chunk : (i + 1) * chunk]),
                                 reply=f"{inbox}.{i}")
            if count:
                await asyncio.wait_for(all_acked.wait(), timeout=ACK_TIMEOUT_S)
            if failed:
                raise ObjectStoreError(f"object {key!r}: a chunk was not stored: {failed[0]}")
            if not isinstance(digest, str):
                digest = await digest
            meta = api.ObjectInfo(name=key, bucket=self.bucket, nuid=nuid, size=len(data), chunks=count,
                                  mtime=datetime.now(UTC).isoformat(), digest=_nats_digest(digest),
                                  options=api.ObjectMetaOptions(max_chunk_size=chunk))
            meta_subject = f"$O.{self.bucket}.M.{base64.urlsafe_b64encode(key.encode()).decode()}"
            await self.js.publish(meta_subject, json.dumps(meta.as_dict()).encode(),
                                  headers={api.Header.ROLLUP: "sub"})
        except BaseException:
            with contextlib.suppress(Exception):
                await self.js.purge_stream(f"OBJ_{self.bucket}", subject=chunks_subject)
            raise
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            for _ in range(in_flight):  # never acknowledged (a failed or abandoned write): free their places
                window.release()
        return digest

    async def start_put(self, data: bytes, *, name: str, digest: str) -> Upload:
        """Begin writing `data` (whose digest the caller knows) under a fresh `name`, and return at once: the
        upload names the chunks' id, so a reader can follow them as they land (`read_chunks`) instead of
        waiting for the whole object; its task ends with the meta written (or the chunks purged, failed or
        cancelled). For objects in transit (KV moving between workers): `name` must not be in use."""
        await self._objects()
        nuid = self.js._nc._nuid.next().decode()
        task = asyncio.create_task(self._write(name, data, digest, nuid=nuid), name=f"put-{name}")
        return Upload(chunks=nuid, task=task)

    async def read_chunks(self, name: str, chunks: str, size: int, *, expected_digest: str,
                          stall_s: float = 60.0) -> bytes:
        """Read object `name` by its chunks' id while its writer may still be writing them (`start_put`): the
        `size` bytes as they land, checked against `expected_digest`. Chunks that stop arriving for `stall_s`
        fail with ObjectFetchTimeout (the writer died, or the object was removed), or with ObjectDigestMismatch
        when the object was finished with another size."""
        store = await self._objects()
        try:
            data, digest = await self._read(chunks, size, name, stall_s, caught_up_ends=False)
        except ObjectFetchTimeout:
            with contextlib.suppress(nats.js.errors.NotFoundError):
                info = await store.get_info(name)
                if info.nuid == chunks and not info.deleted and info.size != size:
                    raise ObjectDigestMismatch(name, f"{size} B", f"{info.size} B") from None
            raise
        if digest != expected_digest:
            raise ObjectDigestMismatch(name, expected_digest, digest)
        return data

    async def get_object(
        self, name_or_digest: str, *, expected_digest: str | None = None, stall_s: float = 60.0
    ) -> bytes:
        """Read an object whole, checked against the digest the Object Store recorded and `expected_digest` (or
        the name, when it is a digest). A read during which no chunk arrives for `stall_s` (its chunks were
        purged, say) fails with ObjectFetchTimeout instead of waiting for ever; a large object that keeps
        arriving, however slowly, is read to the end.

        Read here rather than by nats-py's `get`, which hands each chunk to a thread (or grows one bytes object
        chunk by chunk): that read 4 MiB at 15 MB/s on this machine. Each chunk lands in a buffer of the
        object's size from the subscription's callback (twice the rate of pulling them with `next_msg`)."""
        store = await self._objects()
        name = name_or_digest.replace(":", "-")
        info = await store.get_info(name)  # ObjectNotFoundError (a NotFoundError) when there is none
        if info.nuid is None or info.nuid == "" or info.is_link():
            raise ObjectStoreError(f"object {name!r}: not a stored object (a link, or no chunks)")
        out, digest = await self._read(info.nuid, info.size, name, stall_s, caught_up_ends=True)
        if _nats_digest(digest) != info.digest:
            raise ObjectDigestMismatch(name, info.digest or "", digest)
        expected = expected_digest or (name_or_digest if name_or_digest.startswith("sha256") else None)
        if expected and digest != expected.replace("-", ":", 1):
            raise ObjectDigestMismatch(name, expected, digest)
        return out

    async def _read(self, nuid: str, size: int, name: str, stall_s: float, *, caught_up_ends: bool
                    ) -> tuple[bytes, str]:
        """The `size` bytes of the chunks under `nuid`, and their digest. With `caught_up_ends` (a whole object)
        the read ends where the stream has no more chunks; without (chunks still being written) once `size`
        bytes are in, waiting for each. Too few or too many bytes fail with ObjectDigestMismatch."""
        data = bytearray(size)
        view = memoryview(data)
        received = 0
        overflow = False
        finished = asyncio.Event()
        # Each chunk is hashed on a thread as it arrives (in order: one thread), overlapping the transfer.
        h = hashlib.sha256()
        hashed: concurrent.futures.Future[None] | None = None  # the latest chunk's: the ones before are done

        async def on_chunk(msg: Any) -> None:
            nonlocal received, hashed, overflow
            if finished.is_set():
                return
            n = len(msg.data)
            if received + n > len(data):
                overflow = True  # more than the meta says: not this object's chunks
                finished.set()
                return
            view[received : received + n] = msg.data
            received += n
            hashed = _HASHER.submit(h.update, msg.data)
            if msg.metadata.num_pending == 0 if caught_up_ends else received == len(data):
                finished.set()

        if size:
            sub = await self.js.subscribe(f"$O.{self.bucket}.C.{nuid}", ordered_consumer=True, cb=on_chunk)
            try:
                seen = -1
                while not finished.is_set():
                    if received == seen:  # nothing arrived for stall_s
                        raise ObjectFetchTimeout(name, received, stall_s)
                    seen = received
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(finished.wait(), timeout=stall_s)
            finally:
                with contextlib.suppress(nats.errors.Error):
                    await sub.unsubscribe()
        if hashed is not None:
            await asyncio.wrap_future(hashed)
        if overflow or received != size:
            raise ObjectDigestMismatch(name, f"{size} B", f"{received} B{' or more' if overflow else ''}")
        return bytes(data), "sha256:" + h.hexdigest()

    async def list_names(self, prefix: str = "", *, timeout_s: float = 60.0) -> list[str]:
        """The names of the objects stored (not deleted) whose name starts with `prefix`."""
        store = await self._objects()
        try:
            infos = await asyncio.wait_for(store.list(ignore_deletes=True), timeout_s)
        except nats.js.errors.NotFoundError:  # an empty bucket
            return []
        except TimeoutError as exc:
            raise ObjectStoreError(f"bucket {self.bucket}: the listing did not finish in {timeout_s:g} s") from exc
        return sorted(i.name for i in infos if i.name.startswith(prefix) and not i.deleted)

    async def purge_chunks(self, chunks: str) -> None:
        """Remove the chunks stored under an id (an upload abandoned before it wrote its meta)."""
        await self._objects()
        await self.js.purge_stream(f"OBJ_{self.bucket}", subject=f"$O.{self.bucket}.C.{chunks}")

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

    async def delete(self, ref: BlobRef) -> bool:
        return await self.objects.delete_object(ref.digest)


def _nats_digest(digest: str) -> str:
    """Our `sha256:<hex>` digest as the Object Store records it (ObjectInfo.digest): the same hash, spelt apart."""
    return "SHA-256=" + base64.urlsafe_b64encode(bytes.fromhex(digest.split(":", 1)[1])).decode()


__all__ = ["ObjectBlobStore", "ObjectDigestMismatch", "ObjectFetchTimeout", "ObjectStore", "ObjectStoreError", "Upload"]
