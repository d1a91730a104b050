"""Wire models between the gateway/router and the rollout workers (NATS request/reply, JSON bodies).

Token arrays travel as zstd-packed int32 (shared.tokens) in base64, or by object-store name when large.
"""

from __future__ import annotations

import base64
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from shared.tokens import decode_arrays, digest_of, encode_arrays


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ProtocolError(Exception):
    pass


class TokenPayload(_Frozen):
    """Token ids inline (base64 of the packed array) or as the name of an object in the bus's object store."""

    count: int = Field(ge=0)
    inline: str | None = None
    object_name: str | None = None

    @classmethod
    def pack(cls, ids: np.ndarray) -> tuple[TokenPayload, bytes]:
        """Returns the inline payload and the packed bytes (the caller moves big ones to the object store)."""
        packed = encode_arrays([np.asarray(ids, dtype=np.int32)])
        return cls(count=len(ids), inline=base64.b64encode(packed).decode()), packed

    @classmethod
    def from_packed(cls, count: int, packed: bytes) -> TokenPayload:
        return cls(count=count, inline=base64.b64encode(packed).decode())

    def unpack_inline(self) -> np.ndarray:
        if self.inline is None:
            raise ProtocolError("token payload is not inline")
        return unpack(base64.b64decode(self.inline), self.count)


def unpack(packed: bytes, count: int) -> np.ndarray:
    arrays = decode_arrays(packed)
    if len(arrays) != 1 or len(arrays[0]) != count:
        raise ProtocolError(f"expected one array of {count} tokens, got {[len(a) for a in arrays]}")
    return arrays[0].astype(np.int32)


def tokens_digest(ids: np.ndarray) -> str:
    return digest_of(np.ascontiguousarray(ids, dtype="<i4").tobytes())


class SamplingSpec(_Frozen):
    max_tokens: int = Field(ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    regex: str | None = None  # guided decoding (forced tool calls)


class GenerateRequest(_Frozen):
    """Continue session (execution_id, chain_id): its history[:base_len] ⊕ delta is the prompt."""

    request_id: str
    execution_id: str
    chain_id: str = "main"
    base_len: int = Field(ge=0)
    base_digest: str = ""  # digest of history[:base_len]; "" when base_len == 0
    delta: TokenPayload
    sampling: SamplingSpec
    # The worker this execution moved to is gone (unreachable): serve it here from the whole prompt (base 0)
    # instead of answering `moved` again.
    reclaim: bool = False


ReplyStatus = Literal["ok", "resync", "moved", "draining", "ended", "error"]


class GenerateReply(_Frozen):
    status: ReplyStatus
    detail: str = ""
    moved_to: str | None = None
    worker_id: str = ""
    cell_id: str = ""
    completion: list[int] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)
    finish_reason: Literal["stop", "length", ""] = ""
    stop_sequence: str | None = None  # the caller's stop string that ended generation, if one did
    prompt_tokens: int = 0
    cached_tokens: int = 0
    policy_version: int = 0


class KvTicket(_Frozen):
    """Where a session's saved KV waits for its target (kv_transport.py) and what it must be when it arrives."""

    transport: str  # the transport that carries it ("nats": an Object Store object)
    object_name: str
    digest: str  # of the whole bundle (kv_bundle.py)
    bytes: int = Field(ge=0)
    fingerprint: str  # the source engine's model identity: a target serving another model recomputes
    prompt_tokens: int = Field(ge=1)  # the saved prompt's length (see kv_handoff.kv_prompt)
    # The id its chunks land under while the sender still writes them (NatsKvTransport streams: the target
    # reads as they arrive); "" when only the finished object is to be read.
    chunks: str = ""


class AdoptRequest(_Frozen):
    """Sent by a draining worker to its target: take over a session, loading its KV when `kv` says where it is
    (else, or when loading it fails, the target recomputes the history)."""

    execution_id: str
    chain_id: str
    history: TokenPayload
    kv: KvTicket | None = None
    from_worker: str
    # The policy that computed the saved KV: a target already on another version recomputes instead.
    policy_version: int = Field(default=0, ge=0)
    # Why the source sends no KV although it tried (its export failed, no whole block to move): "" otherwise.
    fallback: str = ""


class AdoptReply(_Frozen):
    ok: bool
    detail: str = ""
    ended: bool = False  # refused because the execution has ended: the source drops the session
    method: Literal["kv", "recompute"] = "recompute"  # how the target rebuilt the session's KV
    fallback: str = ""  # why a move that tried KV recomputed instead ("" when it did not fall back)
    cached_tokens: int = 0  # prompt tokens the target's prefill took from the moved KV (or its prefix cache)
    seconds: float = 0.0
    phases: dict[str, float] = Field(default_factory=dict)  # receive_s, load_s; recompute_s


class DrainRequest(_Frozen):
    targets: tuple[str, ...] = ()  # preferred target workers; empty: the least loaded active ones
    force_method: Literal["kv", "recompute"] | None = None


class MigrationResult(_Frozen):
    execution_id: str
    chain_id: str
    to_worker: str
    method: Literal["kv", "recompute"]
    tokens: int
    bytes: int
    seconds: float
    cached_tokens: int
    fallback: str = ""  # why a move that tried KV recomputed instead
    phases: dict[str, float] = Field(default_factory=dict)  # save_s, send_s (source); receive_s, load_s (target)


class DrainReply(_Frozen):
    """How a drain ended: sessions moved, sessions parked (no active worker to take them) and sessions whose
    move failed; the last two stay on the draining worker. `ok` when every session moved."""

    ok: bool
    detail: str = ""
    migrated: list[MigrationResult] = Field(default_factory=list)
    parked: list[str] = Field(default_factory=list)  # "<execution>/<chain>: why"
    failed: list[str] = Field(default_factory=list)  # "<execution>/<chain>: the error"
    seconds: float = 0.0


class EndSessions(_Frozen):
    execution_id: str
