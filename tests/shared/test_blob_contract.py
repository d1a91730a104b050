"""Contract suite for the blob store port, run against every backend: PostgreSQL (embedded and by URL), the
JetStream Object Store (the real nats-server), the in-memory fake the pure tests use, and `Blobs`, the port that
reads each reference from the backend it names. A fake that drifts from the real backends fails here."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import sqlalchemy as sa

from shared.blobs import BlobCorrupted, BlobNotFound, Blobs, BlobStore, InMemoryBlobStore, blob_ref
from shared.events import BlobRef
from shared.objects import ObjectBlobStore
from shared.store import EventStore
from shared.store_sql import blobs_table
from tests.conftest import drop_bus, drop_store, make_bus, make_store

MISSING = BlobRef(digest="sha256:" + "1" * 64, size=3)


class BlobStoreContract:
    """What every backend promises. Subclasses provide `blobs` (and `tamper`, which corrupts a stored blob)."""

    @pytest.fixture
    async def blobs(self) -> AsyncIterator[BlobStore]:
        raise NotImplementedError
        yield

    async def tamper(self, blobs: BlobStore, ref: BlobRef) -> None:
        raise NotImplementedError

    async def test_a_blob_reads_back_under_its_content_address(self, blobs: BlobStore) -> None:
        data = b"tokens" * 100_000
        ref = await blobs.put(data, "application/x-test")
        assert ref == blob_ref(data, "application/x-test", store=ref.store) and ref.size == len(data)
        assert ref.store == blobs.location
        assert await blobs.get(ref) == data
        assert await blobs.has(ref)

    async def test_putting_the_same_bytes_twice_gives_the_same_reference(self, blobs: BlobStore) -> None:
        first = await blobs.put(b"same", "text/plain")
        assert await blobs.put(b"same", "text/plain") == first
        assert await blobs.get(first) == b"same"

    async def test_a_missing_blob_is_a_named_error(self, blobs: BlobStore) -> None:
        missing = MISSING.model_copy(update={"store": blobs.location})
        assert not await blobs.has(missing)
        with pytest.raises(BlobNotFound):
            await blobs.get(missing)

    async def test_a_deleted_blob_is_gone_and_deleting_it_again_says_so(self, blobs: BlobStore) -> None:
        kept, gone = await blobs.put(b"kept bytes"), await blobs.put(b"retired bytes" * 50_000)
        assert await blobs.delete(gone)
        assert not await blobs.has(gone)
        with pytest.raises(BlobNotFound):
            await blobs.get(gone)
        assert not await blobs.delete(gone)
        assert await blobs.get(kept) == b"kept bytes"

    async def test_a_blob_that_no_longer_matches_its_digest_is_refused(self, blobs: BlobStore) -> None:
        ref = await blobs.put(b"original")
        await self.tamper(blobs, ref)
        with pytest.raises(BlobCorrupted):
            await blobs.get(ref)


class TestPostgresBlobStore(BlobStoreContract):
    @pytest.fixture
    async def blobs(self, backend) -> AsyncIterator[BlobStore]:  # noqa: ANN001
        store = await make_store(backend.database_url)
        self.store: EventStore = store
        yield store.blobs
        await drop_store(store)

    async def tamper(self, blobs: BlobStore, ref: BlobRef) -> None:
        async with self.store.engine.begin() as conn:
            await conn.execute(sa.update(blobs_table).values(data=b"tampered"))

    async def test_a_blob_is_stored_once(self, blobs: BlobStore) -> None:
        await blobs.put(b"x" * 600)
        await blobs.put(b"x" * 600)
        async with self.store.engine.connect() as conn:
            count = (await conn.execute(sa.select(sa.func.count()).select_from(blobs_table))).scalar()
        assert count == 1


class TestObjectBlobStore(BlobStoreContract):
    @pytest.fixture
    async def blobs(self, backend) -> AsyncIterator[BlobStore]:  # noqa: ANN001
        bus = await make_bus(backend.nats_url)
        self.bus = bus
        yield ObjectBlobStore(bus.objects)
        await drop_bus(bus)

    async def tamper(self, blobs: BlobStore, ref: BlobRef) -> None:
        await self.bus.put_object(b"tampered", name=ref.digest.replace(":", "-"))


class TestInMemoryBlobStore(BlobStoreContract):
    @pytest.fixture
    async def blobs(self) -> AsyncIterator[BlobStore]:
        yield InMemoryBlobStore()

    async def tamper(self, blobs: BlobStore, ref: BlobRef) -> None:
        assert isinstance(blobs, InMemoryBlobStore)
        blobs.data[ref.digest] = b"tampered"


class _OneBackend:
    """`Blobs` with one backend, seen through the single-backend contract."""

    def __init__(self, blobs: Blobs, inner: InMemoryBlobStore) -> None:
        self.blobs, self.inner, self.location = blobs, inner, inner.location

    async def put(self, data: bytes, media_type: str = "application/octet-stream") -> BlobRef:
        return await self.blobs.put(data, media_type, store=self.location)

    async def get(self, ref: BlobRef) -> bytes:
        return await self.blobs.get(ref)

    async def has(self, ref: BlobRef) -> bool:
        return await self.blobs.has(ref)

    async def delete(self, ref: BlobRef) -> bool:
        return await self.blobs.delete(ref)


class TestBlobsPort(BlobStoreContract):
    @pytest.fixture
    async def blobs(self) -> AsyncIterator[BlobStore]:
        inner = InMemoryBlobStore("object")
        yield _OneBackend(Blobs(InMemoryBlobStore("pg"), inner), inner)  # type: ignore[misc]

    async def tamper(self, blobs: BlobStore, ref: BlobRef) -> None:
        assert isinstance(blobs, _OneBackend)
        blobs.inner.data[ref.digest] = b"tampered"


async def test_blobs_reads_each_reference_from_the_backend_it_names(infra) -> None:  # noqa: ANN001
    store, bus = await make_store(infra.database_url), await make_bus(infra.nats_url)
    try:
        blobs = Blobs(store.blobs, ObjectBlobStore(bus.objects))
        in_pg = await blobs.put(b"a call record", "application/x-gyre-call-record")
        in_objects = await blobs.put(b"weights" * 1000, "application/x-safetensors", store="object")
        assert (in_pg.store, in_objects.store) == ("pg", "object")
        assert await blobs.get(in_pg) == b"a call record"
        assert await blobs.get(in_objects) == b"weights" * 1000
        assert not await store.blobs.has(in_objects.model_copy(update={"store": "pg"}))
    finally:
        await drop_store(store)
        await drop_bus(bus)


async def test_a_reference_to_a_backend_that_is_not_configured_is_a_named_error() -> None:
    from shared.blobs import BlobError

    with pytest.raises(BlobError, match="no 'object' blob store"):
        await Blobs(InMemoryBlobStore("pg")).get(MISSING.model_copy(update={"store": "object"}))
