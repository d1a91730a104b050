"""NATS shell of the rollout data path: worker endpoints, the router's worker client, peers, status heartbeats,
and the KV transport (moved sessions' KV through the Object Store).

Subjects (under the bus prefix): `rollout.worker.<id>.{generate,adopt,drain,end}` (request/reply) and
`rollout.status` (each worker's heartbeat). Token arrays above `inline_limit` go through the object store.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import nats.errors
import nats.js.errors
import numpy as np

from services.rollout.kv_transport import KvTransferFailed
from services.rollout.protocol import (
    AdoptReply,
    AdoptRequest,
    DrainReply,
    DrainRequest,
    EndSessions,
    GenerateReply,
    GenerateRequest,
    KvTicket,
    TokenPayload,
    unpack,
)
from services.rollout.router import WorkerDirectory, WorkerUnreachable
from services.rollout.worker import RolloutWorker
from shared.bus import Bus
from shared.logging import get_logger
from shared.objects import ObjectFetchTimeout, ObjectStore, ObjectStoreError, Upload
from shared.tokens import digest_of
from shared.worker_status import (
    WorkerStatus,
    ended_subject,
    status_subject,
    worker_subject,
)

# A KV object read that stops arriving for this long fails (its writer died, or the bucket lost it): the target
# then recomputes rather than wait.
KV_STALL_S = 10.0
INLINE_LIMIT = 512 * 1024  # packed bytes; NATS's default max_payload is 1 MiB and base64 adds a third
GENERATE_TIMEOUT_S = 900.0

log = get_logger(component="rollout_transport")


async def send_tokens(bus: Bus, ids: np.ndarray, *, inline_limit: int = INLINE_LIMIT) -> TokenPayload:
    payload, packed = TokenPayload.pack(ids)
    if len(packed) <= inline_limit:
        return payload
    digest = await bus.put_object(packed)
    return TokenPayload(count=len(ids), object_name=digest)


async def receive_tokens(bus: Bus, payload: TokenPayload) -> np.ndarray:
    if payload.inline is not None:
        return payload.unpack_inline()
    if payload.object_name is None:
        if payload.count == 0:
            return np.zeros(0, dtype=np.int32)
        raise ValueError(f"token payload of {payload.count} tokens has neither inline data nor an object name")
    return unpack(await bus.get_object(payload.object_name), payload.count)


async def _request(bus: Bus, subject: str, body: bytes, timeout: float) -> bytes:
    try:
        return await bus.request(subject, body, timeout=timeout)
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as exc:
        raise WorkerUnreachable(f"{subject}: {type(exc).__name__}") from exc


def _reply_or_error(data: bytes) -> dict[str, Any]:
    body = json.loads(data)
    if isinstance(body, dict) and set(body) == {"error"}:
        raise RuntimeError(f"worker failed: {body['error']}")
    return body


class NatsWorkerClient:
    """The router's WorkerClient over NATS request/reply."""

    def __init__(self, bus: Bus, *, inline_limit: int = INLINE_LIMIT, timeout_s: float = GENERATE_TIMEOUT_S) -> None:
        self.bus = bus
        self.inline_limit = inline_limit
        self.timeout_s = timeout_s

    async def generate(self, worker_id: str, request: GenerateRequest, delta: np.ndarray) -> GenerateReply:
        payload = await send_tokens(self.bus, delta, inline_limit=self.inline_limit)
        body = request.model_copy(update={"delta": payload}).model_dump_json().encode()
        data = await _request(self.bus, worker_subject(self.bus.prefix, worker_id, "generate"), body, self.timeout_s)
        try:
            return GenerateReply.model_validate(_reply_or_error(data))
        except RuntimeError as exc:
            return GenerateReply(status="error", detail=str(exc), worker_id=worker_id)

    async def drain(self, worker_id: str, request: DrainRequest, *, timeout_s: float = 600.0) -> DrainReply:
        data = await _request(
            self.bus, worker_subject(self.bus.prefix, worker_id, "drain"), request.model_dump_json().encode(), timeout_s
        )
        return DrainReply.model_validate(_reply_or_error(data))

    async def end_sessions(self, worker_id: str, execution_id: str) -> None:
        await _request(
            self.bus,
            worker_subject(self.bus.prefix, worker_id, "end"),
            EndSessions(execution_id=execution_id).model_dump_json().encode(),
            10.0,
        )

    async def announce_end(self, execution_id: str) -> None:
        """Tell every worker the execution has ended (no answer awaited)."""
        body = EndSessions(execution_id=execution_id).model_dump_json().encode()
        await self.bus.nc.publish(ended_subject(self.bus.prefix), body)


class NatsPeers:
    """A worker's view of the other workers (for drains): the status directory plus adopt requests."""

    def __init__(self, bus: Bus, directory: WorkerDirectory, *, inline_limit: int = INLINE_LIMIT) -> None:
        self.bus = bus
        self.directory = directory
        self.inline_limit = inline_limit

    def candidates(self, exclude: str) -> list[WorkerStatus]:
        return self.directory.candidates(exclude=exclude)

    async def adopt(self, target: str, request: AdoptRequest, history: np.ndarray) -> AdoptReply:
        payload = await send_tokens(self.bus, history, inline_limit=self.inline_limit)
        body = request.model_copy(update={"history": payload}).model_dump_json().encode()
        data = await _request(self.bus, worker_subject(self.bus.prefix, target, "adopt"), body, GENERATE_TIMEOUT_S)
        return AdoptReply.model_validate(_reply_or_error(data))


class NatsKvTransport:
    """Bundles as Object Store objects under a fresh name each (two moves of equal KV never share one, so one
    move's discard cannot take the other's), read back against the sender's digest.

    Streamed: `send` hashes the bundle, starts its upload and returns the ticket at once, naming the object's
    chunks; the target reads the chunks as they land, so the upload and the download overlap instead of one
    following the other (a 16 MiB move: send 0.04-0.08 s then receive 0.07-0.09 s, one after the other before).
    The digest is checked when the last byte is in; chunks that stop arriving (the sender died mid-upload, the
    bundle was discarded) fail the read after `stall_s`."""

    name = "nats"

    def __init__(self, objects: ObjectStore, *, stall_s: float = KV_STALL_S) -> None:
        self.objects = objects
        self.stall_s = stall_s
        self._uploads: dict[str, Upload] = {}

    async def send(self, bundle: bytes, *, fingerprint: str, prompt_tokens: int) -> KvTicket:
        name = f"kv-{uuid.uuid4().hex}"
        try:
            digest = await asyncio.to_thread(digest_of, bundle)  # hashlib lets go of the GIL
            upload = await self.objects.start_put(bundle, name=name, digest=digest)
        except (nats.errors.Error, ObjectStoreError) as exc:
            raise KvTransferFailed(f"KV upload failed: {type(exc).__name__}: {exc}") from exc
        self._uploads[name] = upload
        upload.task.add_done_callback(lambda task: self._uploaded(name, task))
        return KvTicket(transport=self.name, object_name=name, digest=digest, bytes=len(bundle),
                        fingerprint=fingerprint, prompt_tokens=prompt_tokens, chunks=upload.chunks)

    def _uploaded(self, name: str, task: asyncio.Task[str]) -> None:
        if not task.cancelled() and task.exception() is not None:
            # The target's read stalls and fails, and it recomputes; say why here.
            log.warning("kv_upload_failed", object_name=name, error=f"{type(task.exception()).__name__}: "
                        f"{task.exception()}")

    async def receive(self, ticket: KvTicket) -> bytes:
        if ticket.transport != self.name:
            raise KvTransferFailed(f"ticket for the {ticket.transport!r} transport, this worker uses {self.name!r}")
        try:
            if ticket.chunks:
                data = await self.objects.read_chunks(ticket.object_name, ticket.chunks, ticket.bytes,
                                                      expected_digest=ticket.digest, stall_s=self.stall_s)
            else:
                data = await self.objects.get_object(ticket.object_name, expected_digest=ticket.digest,
                                                     stall_s=self.stall_s)
        except nats.js.errors.NotFoundError as exc:
            raise KvTransferFailed(f"KV object {ticket.object_name} missing (its sender died or it expired)") from exc
        except ObjectFetchTimeout as exc:
            raise KvTransferFailed(f"KV object {ticket.object_name} missing or cut off (its sender died, or it was "
                                   f"discarded or expired): {exc}") from exc
        except ObjectStoreError as exc:  # digest mismatch
            raise KvTransferFailed(f"KV object {ticket.object_name}: {exc}") from exc
        except nats.errors.Error as exc:
            raise KvTransferFailed(f"KV download failed: {type(exc).__name__}: {exc}") from exc
        if len(data) != ticket.bytes:  # the digest matched, so only a ticket that lies about the size gets here
            raise KvTransferFailed(f"KV object {ticket.object_name}: {len(data)} B, the ticket says {ticket.bytes}")
        return data

    async def discard(self, ticket: KvTicket) -> None:
        upload = self._uploads.pop(ticket.object_name, None)
        if upload is not None and not upload.task.done():  # the target is done with it: stop writing it
            upload.task.cancel()
            with contextlib.suppress(BaseException):
                await upload.task  # purges the chunks written so far
        try:
            await self.objects.delete_object(ticket.object_name)  # a finished upload: its meta and chunks
        except nats.errors.Error:
            pass  # the bucket's TTL removes it anyway
        if upload is None and ticket.chunks:  # not this transport's upload (a cancelled one purges its own chunks)
            with contextlib.suppress(nats.errors.Error):
                await self.objects.purge_chunks(ticket.chunks)


async def watch_statuses(bus: Bus, directory: WorkerDirectory) -> Any:
    """Feed worker heartbeats into a directory; returns the subscription."""

    async def on_msg(msg: Any) -> None:
        try:
            directory.update(WorkerStatus.model_validate_json(msg.data))
        except ValueError:
            log.warning("bad_worker_status", data=msg.data[:200])

    return await bus.nc.subscribe(status_subject(bus.prefix), cb=on_msg)


@dataclass
class WorkerServer:
    """A worker's NATS endpoints and heartbeat; `stop()` unsubscribes and ends the heartbeat."""

    worker: RolloutWorker
    bus: Bus
    heartbeat_s: float = 1.0
    subscriptions: list[Any] = field(default_factory=list)
    _task: asyncio.Task[None] | None = None
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    _inflight: set[asyncio.Task[None]] = field(default_factory=set)

    async def start(self) -> WorkerServer:
        w, bus = self.worker, self.bus
        w._on_change = self._changed.set

        async def generate(data: bytes) -> bytes:
            request = GenerateRequest.model_validate_json(data)
            delta = await receive_tokens(bus, request.delta)
            return (await w.generate(request, delta)).model_dump_json().encode()

        async def adopt(data: bytes) -> bytes:
            request = AdoptRequest.model_validate_json(data)
            history = await receive_tokens(bus, request.history)
            return (await w.adopt(request, history)).model_dump_json().encode()

        async def drain(data: bytes) -> bytes:
            return (await w.drain(DrainRequest.model_validate_json(data))).model_dump_json().encode()

        async def end(data: bytes) -> bytes:
            ended = w.end_sessions(EndSessions.model_validate_json(data).execution_id)
            return json.dumps({"ended": ended}).encode()

        for verb, handler in (("generate", generate), ("adopt", adopt), ("drain", drain), ("end", end)):
            self.subscriptions.append(await self._serve(worker_subject(bus.prefix, w.worker_id, verb), handler))

        async def on_ended(msg: Any) -> None:
            try:
                w.end_sessions(EndSessions.model_validate_json(msg.data).execution_id)
            except ValueError:
                log.warning("bad_end_announcement", data=msg.data[:200])

        self.subscriptions.append(await bus.nc.subscribe(ended_subject(bus.prefix), cb=on_ended))
        await self.publish_status()
        self._task = asyncio.create_task(self._heartbeat())
        return self

    async def _serve(self, subject: str, handler: Any) -> Any:
        # nats-py runs one subscription's callbacks one after another; a task per request lets the engine
        # batch concurrent generations.
        async def respond(msg: Any) -> None:
            try:
                reply = await handler(msg.data)
            except Exception as exc:  # the requester gets an answer, not a timeout
                log.exception("worker_request_failed", subject=msg.subject)
                reply = json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode()
            await msg.respond(reply)

        async def on_msg(msg: Any) -> None:
            task = asyncio.create_task(respond(msg))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)

        return await self.bus.nc.subscribe(subject, cb=on_msg)

    async def publish_status(self) -> None:
        await self.bus.nc.publish(status_subject(self.bus.prefix), self.worker.status().model_dump_json().encode())

    async def _heartbeat(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=self.heartbeat_s)
            self._changed.clear()
            try:
                await self.publish_status()
            except Exception:  # a reconnecting client must not kill the heartbeat
                log.warning("heartbeat_failed", worker_id=self.worker.worker_id)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for sub in self.subscriptions:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self.subscriptions.clear()
