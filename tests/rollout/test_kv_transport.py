"""The KV transport port's contract, run against the NATS Object Store transport and the in-memory fake: a bundle
arrives exactly as sent, and one that does not (gone, spoiled, for another transport) fails with the reason,
never as other bytes."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest
from nats.js.api import StorageType

from services.rollout.kv_transport import KvTransferFailed, KvTransport
from services.rollout.protocol import KvTicket
from services.rollout.transport import NatsKvTransport
from shared.tokens import digest_of
from tests.conftest import Infra, drop_bus, make_bus
from tests.rollout.fakes import MemoryKvTransport

pytestmark = pytest.mark.asyncio


@dataclass
class Backend:
    transport: KvTransport
    # Replace what a ticket names with other bytes (the object spoiled in transit or by a second writer).
    overwrite: Callable[[KvTicket, bytes], Awaitable[None]]


@pytest.fixture(params=["nats", "memory"])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    if request.param == "memory":
        memory = MemoryKvTransport()

        async def overwrite_memory(ticket: KvTicket, data: bytes) -> None:
            memory.objects[ticket.object_name] = data

        yield Backend(memory, overwrite_memory)
        return
    infra: Infra = request.getfixturevalue("infra")
    bus = await make_bus(infra.nats_url)
    nats = NatsKvTransport(bus.kv_objects, stall_s=2.0)

    async def overwrite_nats(ticket: KvTicket, data: bytes) -> None:
        # The sender's upload finishes; then its chunks are replaced by other bytes under the same id and name,
        # so the streamed read (by the chunks' id) and a read of the finished object both meet them.
        upload = nats._uploads[ticket.object_name]
        await upload.task
        await bus.kv_objects.purge_chunks(upload.chunks)
        await bus.kv_objects._write(ticket.object_name, data, digest_of(data), nuid=upload.chunks)

    yield Backend(nats, overwrite_nats)
    await drop_bus(bus)


async def test_a_bundle_arrives_as_sent_and_its_ticket_says_what_it_is(backend: Backend) -> None:
    bundle = os.urandom(3 * 128 * 1024 + 17)  # several Object Store chunks and a partial one
    ticket = await backend.transport.send(bundle, fingerprint="model-a", prompt_tokens=129)
    assert (ticket.transport, ticket.bytes, ticket.fingerprint, ticket.prompt_tokens) == (
        backend.transport.name, len(bundle), "model-a", 129)
    assert await backend.transport.receive(ticket) == bundle
    assert await backend.transport.receive(ticket) == bundle  # a read does not consume it


async def test_two_sends_of_the_same_bytes_are_apart_so_one_discard_leaves_the_other(backend: Backend) -> None:
    bundle = b"the same KV" * 100
    first = await backend.transport.send(bundle, fingerprint="m", prompt_tokens=17)
    second = await backend.transport.send(bundle, fingerprint="m", prompt_tokens=17)
    assert first.object_name != second.object_name
    await backend.transport.discard(first)
    assert await backend.transport.receive(second) == bundle


async def test_a_discarded_or_never_finished_bundle_is_missing_not_empty(backend: Backend) -> None:
    ticket = await backend.transport.send(b"x" * 1000, fingerprint="m", prompt_tokens=17)
    await backend.transport.discard(ticket)
    await backend.transport.discard(ticket)  # a second discard is no error
    with pytest.raises(KvTransferFailed, match="missing"):
        await backend.transport.receive(ticket)
    never_sent = ticket.model_copy(update={"object_name": "kv-never-finished"})
    with pytest.raises(KvTransferFailed, match="missing"):
        await backend.transport.receive(never_sent)


@pytest.mark.parametrize("spoil", ["flipped", "truncated"])
async def test_bytes_other_than_the_ticket_names_fail_on_their_digest(backend: Backend, spoil: str) -> None:
    bundle = os.urandom(200_000)
    ticket = await backend.transport.send(bundle, fingerprint="m", prompt_tokens=17)
    other = bundle[:-1] + bytes([bundle[-1] ^ 1]) if spoil == "flipped" else bundle[: len(bundle) // 2]
    await backend.overwrite(ticket, other)
    with pytest.raises(KvTransferFailed, match="digest"):
        await backend.transport.receive(ticket)


async def test_a_bundle_is_read_while_it_is_still_being_sent_and_a_send_cut_off_is_missing(
    infra: Infra) -> None:
    """The NATS transport streams: a ticket is handed over before the upload ends, the target reads the chunks
    as they land, and an upload stopped half-way (its sender died) fails the read instead of waiting for ever."""
    bus = await make_bus(infra.nats_url)
    try:
        transport = NatsKvTransport(bus.kv_objects, stall_s=2.0)
        bundle = os.urandom(24 * 2**20)  # many chunks: the upload is still going when the ticket is out
        ticket = await transport.send(bundle, fingerprint="m", prompt_tokens=17)
        upload = transport._uploads[ticket.object_name]
        assert ticket.chunks == upload.chunks and not upload.task.done()
        assert await transport.receive(ticket) == bundle
        await transport.discard(ticket)
        # In transit only: the bucket lives in the server's memory (a TTL bucket), the weights' one in files.
        kv_stream = await bus.kv_objects.js.stream_info(f"OBJ_{bus.kv_objects.bucket}")
        assert kv_stream.config.storage == StorageType.MEMORY and kv_stream.config.max_age

        ticket = await transport.send(bundle, fingerprint="m", prompt_tokens=17)
        upload = transport._uploads[ticket.object_name]
        upload.task.cancel()  # the sender dies mid-upload: what it wrote is purged, no meta is ever written
        with pytest.raises(KvTransferFailed, match="missing or cut off"):
            await transport.receive(ticket)
        await transport.discard(ticket)
    finally:
        await drop_bus(bus)


async def test_a_ticket_of_another_transport_is_refused(backend: Backend) -> None:
    ticket = await backend.transport.send(b"kv", fingerprint="m", prompt_tokens=17)
    with pytest.raises(KvTransferFailed, match="transport"):
        await backend.transport.receive(ticket.model_copy(update={"transport": "nixl"}))
