"""The call record: one model call stored as a delta against its execution's earlier calls.

A call's full sequence is `seq(parent)[:parent_prefix_len] ⊕ new_prompt ⊕ completion`, where `seq(parent)` is
the full sequence (prompt ⊕ completion) of an earlier call of the same execution. The writer (the rollout
gateway) picks the earlier call sharing the longest prefix, so an execution costs O(unique tokens) bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from shared.events import BlobRef, BranchKind, CallApi, CallCompleted
from shared.tokens import TokenBuffer, decode_arrays, digest_of, encode_arrays

CALL_RECORD_MEDIA_TYPE = "application/x-gyre-call-record"
# Response header by which the gateway tells a client the index its call was recorded under. An agent that
# numbers its calls by it stays aligned with the log even when a reply was lost and the request re-sent.
CALL_INDEX_HEADER = "x-gyre-call-index"
# Request header by which a resumed agent (its harness restarted) says which of its execution's calls it is
# making again: the gateway answers it from the log, without generating, when its prompt is the recorded one.
REPLAY_HEADER = "x-gyre-replay-of"


def call_seed(execution_seed: int, call_index: int) -> int:
    """The sampling seed of an execution's call: distinct per call (a retry samples anew) and reproducible."""
    return execution_seed * 100_003 + call_index


class CallRecordError(Exception):
    pass


@dataclass(frozen=True)
class CallTokens:
    """The token payload of one call record (what goes into the blob)."""

    new_prompt: np.ndarray  # int32: prompt tokens not covered by the parent prefix
    completion: np.ndarray  # int32: generated tokens (targets)
    logprobs: np.ndarray  # float32: behaviour logprob of each completion token

    def __post_init__(self) -> None:
        if len(self.completion) != len(self.logprobs):
            raise CallRecordError(
                f"completion has {len(self.completion)} tokens but {len(self.logprobs)} logprobs"
            )

    def encode(self) -> bytes:
        return encode_arrays([self.new_prompt, self.completion, self.logprobs])

    @classmethod
    def decode(cls, blob: bytes) -> CallTokens:
        arrays = decode_arrays(blob)
        if len(arrays) != 3:
            raise CallRecordError(f"call record blob holds {len(arrays)} arrays, expected 3")
        return cls(new_prompt=arrays[0], completion=arrays[1], logprobs=arrays[2])


@dataclass(frozen=True)
class CallRecord:
    """A decoded call: the metadata of its `call.completed` event plus its tokens."""

    execution_id: str
    call_id: str
    call_index: int
    parent_call_index: int | None
    parent_prefix_len: int
    tokens: CallTokens
    policy_version: int
    cell_id: str = ""
    chain_id: str = "main"
    branch_hint: BranchKind | None = None
    finish_reason: str = "stop"

    @property
    def prompt_len(self) -> int:
        return self.parent_prefix_len + len(self.tokens.new_prompt)


def call_completed(record: CallRecord, blob: BlobRef, *, api: CallApi = "anthropic", latency_s: float = 0.0) -> CallCompleted:
    """The `call.completed` payload that stores `record` (its tokens in `blob`): the only place one is built."""
    return CallCompleted(
        execution_id=record.execution_id,
        call_id=record.call_id,
        call_index=record.call_index,
        record=blob,
        parent_call_index=record.parent_call_index,
        parent_prefix_len=record.parent_prefix_len,
        prompt_tokens=record.prompt_len,
        new_prompt_tokens=len(record.tokens.new_prompt),
        completion_tokens=len(record.tokens.completion),
        policy_version=record.policy_version,
        cell_id=record.cell_id,
        chain_id=record.chain_id,
        branch_hint=record.branch_hint,
        finish_reason=record.finish_reason,
        api=api,
        latency_s=max(0.0, latency_s),
    )


def call_record(event: CallCompleted, blob: bytes) -> CallRecord:
    """The call a `call.completed` stores, decoded from its record blob: the only place one is read back.

    Checks the blob against the event's digest and the token counts against the event's, so a log that was
    tampered with or mixed up fails here, naming the call, instead of training on the wrong tokens."""
    where = f"execution {event.execution_id} call {event.call_index}"
    actual = digest_of(blob)
    if actual != event.record.digest:
        raise CallRecordError(f"{where}: blob should have digest {event.record.digest}, reads back as {actual}")
    try:
        tokens = CallTokens.decode(blob)
    except CallRecordError as exc:
        raise CallRecordError(f"{where}: {exc}") from exc
    except Exception as exc:
        raise CallRecordError(f"{where}: undecodable call record: {exc}") from exc
    if (len(tokens.new_prompt), len(tokens.completion)) != (event.new_prompt_tokens, event.completion_tokens):
        raise CallRecordError(
            f"{where}: event says {event.new_prompt_tokens}+{event.completion_tokens} tokens, record holds "
            f"{len(tokens.new_prompt)}+{len(tokens.completion)}"
        )
    return CallRecord(
        execution_id=event.execution_id,
        call_id=event.call_id,
        call_index=event.call_index,
        parent_call_index=event.parent_call_index,
        parent_prefix_len=event.parent_prefix_len,
        tokens=tokens,
        policy_version=event.policy_version,
        cell_id=event.cell_id,
        chain_id=event.chain_id,
        branch_hint=event.branch_hint,
        finish_reason=event.finish_reason,
    )


@dataclass
class ExecutionSequences:
    """Materialises full call sequences from delta records, in call order (a pure helper).

    A call that extends the whole of its parent's sequence shares the parent's buffer (`TokenBuffer`), so a
    long execution's sequences take about the memory of its longest one, not the sum of all of them.
    """

    sequences: list[np.ndarray] = field(default_factory=list)
    buffers: list[TokenBuffer] = field(default_factory=list)  # the buffer each sequence is a view of

    def add(self, record: CallRecord) -> np.ndarray:
        if record.call_index != len(self.sequences):
            raise CallRecordError(
                f"call {record.call_id}: expected call_index {len(self.sequences)}, got {record.call_index}"
            )
        if record.parent_call_index is None:
            if record.parent_prefix_len != 0:
                raise CallRecordError(f"call {record.call_id}: prefix length without a parent")
        else:
            if not 0 <= record.parent_call_index < len(self.sequences):
                raise CallRecordError(
                    f"call {record.call_id}: parent call {record.parent_call_index} is not an earlier call"
                )
            parent = self.sequences[record.parent_call_index]
            if record.parent_prefix_len > len(parent):
                raise CallRecordError(
                    f"call {record.call_id}: prefix {record.parent_prefix_len} longer than parent ({len(parent)})"
                )
        return self.extend(record.parent_call_index, record.parent_prefix_len, record.tokens.new_prompt,
                           record.tokens.completion)

    def extend(self, parent: int | None, prefix_len: int, *parts: np.ndarray) -> np.ndarray:
        """Add the next call's sequence: the first `prefix_len` ids of call `parent`'s (none without a parent)
        followed by `parts`. Unchecked: `add` checks a stored record first."""
        if parent is None:
            buffer = TokenBuffer.of(*parts)
            seq = buffer.view()
        else:
            buffer, seq = self.buffers[parent].extended(prefix_len, *parts)
        self.sequences.append(seq)
        self.buffers.append(buffer)
        return seq


def longest_prefix_parent(
    earlier: Sequence[np.ndarray], prompt: np.ndarray
) -> tuple[int | None, int]:
    """Choose the earlier full sequence that shares the longest prefix with `prompt` (ties: latest call).

    Returns (parent_call_index, shared_len). The latest call wins ties because continuations usually extend it.
    """
    best_index: int | None = None
    best_len = 0
    for index in range(len(earlier) - 1, -1, -1):
        seq = earlier[index]
        n = min(len(seq), len(prompt))
        if n <= best_len:
            continue
        mismatch = np.flatnonzero(seq[:n] != prompt[:n])
        shared = int(mismatch[0]) if mismatch.size else n
        if shared > best_len:
            best_index, best_len = index, shared
    return best_index, best_len
