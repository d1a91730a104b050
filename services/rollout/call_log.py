"""The call log of one execution as the gateway keeps it (pure): where each new call goes in the log (the earlier
call it is stored as a delta of, and what kind of branch it opens), the events and blob that record it, and what
the log tells a gateway taking an execution up (`ExecutionSoFar`). The recorder (`recorder.py`) persists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

import numpy as np

from shared.branching import classify_branch
from shared.calls import (
    CallRecord,
    CallTokens,
    ExecutionSequences,
    call_completed,
    longest_prefix_parent,
)
from shared.events import (
    BlobRef,
    BranchKind,
    CallApi,
    CallCompleted,
    CallRefused,
    Event,
    EventData,
    ExecutionBranched,
    ExecutionFinished,
    ExecutionStarted,
    ExecutionTimedOut,
    new_event,
    stream_id_for,
)
from shared.tokens import TokenBuffer

Api = CallApi  # which API a call came through


@dataclass(frozen=True)
class CompletedCall:
    """Everything the gateway knows about one finished generation, before it is recorded."""

    execution_id: str
    call_id: str
    chain_id: str
    prompt: np.ndarray
    completion: np.ndarray
    logprobs: np.ndarray
    policy_version: int
    cell_id: str
    finish_reason: str
    api: Api
    latency_s: float


@dataclass(frozen=True)
class Placement:
    """Where a call goes in its execution's log: stored as a delta against the earlier call sharing the longest
    prefix (`parent_call_index`), and classified against the previous call of its own chain (`head_call_index`,
    sharing `head_shared` tokens with it)."""

    call_index: int
    chain_id: str
    parent_call_index: int | None
    parent_prefix_len: int
    new_prompt: np.ndarray
    branch_hint: BranchKind | None  # None for the execution's first call
    head_call_index: int | None = None
    head_shared: int = 0
    in_completion: bool = False  # the prompt leaves the head inside text the model generated


@dataclass(frozen=True)
class PastCall:
    """A call the log holds, as a resumed agent's replay needs it: its prompt and completion ids and what its
    answer carried."""

    call_index: int
    prompt: np.ndarray
    completion: np.ndarray
    call_id: str
    finish_reason: str
    policy_version: int


@dataclass(frozen=True)
class _CallFacts:
    call_id: str
    finish_reason: str
    policy_version: int


@dataclass
class CallLog:
    """The full sequences of an execution's recorded calls, with each call's chain, prompt length and parent.

    A call that extends the whole of its parent's sequence shares the parent's buffer, so an execution's log
    holds about as many ids as its longest sequence (times its forks), not the sum over its calls.
    """

    seqs: ExecutionSequences = field(default_factory=ExecutionSequences)
    prompt_lens: list[int] = field(default_factory=list)
    parents: list[tuple[int | None, int]] = field(default_factory=list)  # (parent call, shared prefix) per call
    heads: dict[str, int] = field(default_factory=dict)  # chain id -> its latest call
    facts: list[_CallFacts] = field(default_factory=list)  # per call: what its answer carried beyond its ids

    def past(self, call_index: int) -> PastCall | None:
        """Call `call_index` as recorded, or None when the log holds no such call."""
        if not 0 <= call_index < len(self.sequences):
            return None
        sequence, prompt_len, facts = self.sequences[call_index], self.prompt_lens[call_index], self.facts[call_index]
        return PastCall(call_index=call_index, prompt=sequence[:prompt_len], completion=sequence[prompt_len:],
                        call_id=facts.call_id, finish_reason=facts.finish_reason,
                        policy_version=facts.policy_version)

    @property
    def sequences(self) -> list[np.ndarray]:
        return self.seqs.sequences

    @property
    def buffers(self) -> list[TokenBuffer]:
        return self.seqs.buffers

    def place(self, prompt: np.ndarray, *, chain_id: str) -> Placement:
        """Where a call of chain `chain_id` with this prompt goes. Its branch kind is `classify_branch`'s against
        the chain's previous call (the first call of a chain other than the execution's first is a delegation);
        the parent it is stored against is the earlier call of any chain sharing the longest prefix."""
        prompt = np.asarray(prompt, dtype=np.int32)
        parent, shared = longest_prefix_parent(self.sequences, prompt)
        head = self.heads.get(chain_id)
        head_shared = 0
        in_completion = False
        hint: BranchKind | None = None
        if self.sequences:
            if head is None:
                hint = classify_branch(new_chain=True, shared=0, prompt_len=len(prompt), head_len=0,
                                       diverges_in_completion=False)
            else:
                head_len = len(self.sequences[head])
                head_shared = shared if head == parent else _shared_len(self.sequences[head], prompt)
                # Inside generated text: the tokens just before and at the divergence are both the policy's.
                in_completion = (0 < head_shared < head_len and self.generated_at(head, head_shared)
                                 and self.generated_at(head, head_shared - 1))
                hint = classify_branch(new_chain=False, shared=head_shared, prompt_len=len(prompt),
                                       head_len=head_len, diverges_in_completion=in_completion,
                                       sibling_shared=shared)
                if hint == "compaction" and any(  # only then: does it resume after an earlier call's whole turn?
                    len(seq) <= head_shared and np.array_equal(seq, prompt[: len(seq)]) for seq in self.sequences
                ):
                    hint = classify_branch(new_chain=False, shared=head_shared, prompt_len=len(prompt),
                                           head_len=head_len, diverges_in_completion=False, after_a_call=True)
        return Placement(
            call_index=len(self.sequences),
            chain_id=chain_id,
            parent_call_index=parent,
            parent_prefix_len=shared if parent is not None else 0,
            new_prompt=prompt[shared:] if parent is not None else prompt,
            branch_hint=hint,
            head_call_index=head,
            head_shared=head_shared,
            in_completion=in_completion,
        )

    def generated_at(self, call: int, position: int) -> bool:
        """Whether the token at `position` of call `call`'s sequence was generated by the policy: in that call's
        completion, or in the completion of the earlier call its prefix was taken from (and so on up)."""
        while True:
            if position >= self.prompt_lens[call]:
                return position < len(self.sequences[call])
            parent, prefix = self.parents[call]
            if parent is None or position >= prefix:
                return False  # prompt tokens this call brought
            call = parent

    def add(self, placement: Placement, prompt: np.ndarray, completion: np.ndarray, *, call_id: str = "",
            finish_reason: str = "stop", policy_version: int = 0) -> None:
        if placement.call_index != len(self.sequences):
            raise ValueError(f"expected call_index {len(self.sequences)}, got {placement.call_index}")
        shared = placement.parent_prefix_len
        self.seqs.extend(placement.parent_call_index, shared, np.asarray(prompt[shared:], dtype=np.int32),
                         np.asarray(completion, dtype=np.int32))
        self._note(placement.chain_id, len(prompt), placement.parent_call_index, shared,
                   _CallFacts(call_id, finish_reason, policy_version))

    def _note(self, chain_id: str, prompt_len: int, parent: int | None, shared: int, facts: _CallFacts) -> None:
        self.heads[chain_id] = len(self.prompt_lens)
        self.prompt_lens.append(prompt_len)
        self.parents.append((parent, shared))
        self.facts.append(facts)

    @classmethod
    def from_records(cls, records: list[CallRecord]) -> CallLog:
        """Rebuild from stored records (a restarted gateway continues an execution's indices and parents)."""
        log = cls()
        for record in sorted(records, key=lambda r: r.call_index):
            log.seqs.add(record)
            log._note(record.chain_id, record.prompt_len, record.parent_call_index, record.parent_prefix_len,
                      _CallFacts(record.call_id, record.finish_reason, record.policy_version))
        return log


def _shared_len(sequence: np.ndarray, prompt: np.ndarray) -> int:
    n = min(len(sequence), len(prompt))
    mismatch = np.flatnonzero(sequence[:n] != prompt[:n])
    return int(mismatch[0]) if mismatch.size else n


@dataclass
class ExecutionSoFar:
    """What the log holds of an execution: how a gateway that did not see it start (it restarted since) picks
    up its seed, call budget and placement, and learns whether it has already ended."""

    started: ExecutionStarted | None = None
    calls: int = 0  # call.completed events: the calls answered so far
    last_cell_id: str | None = None  # the cell of the latest answered call (where its KV most likely is)
    ended: bool = False

    def answered(self, cell_id: str) -> None:
        """One more call answered, on `cell_id`."""
        self.calls += 1
        self.last_cell_id = cell_id or self.last_cell_id

    @classmethod
    def of(cls, events: list[Event]) -> ExecutionSoFar:
        so_far = cls()
        for event in events:
            data = event.data
            if isinstance(data, ExecutionStarted) and so_far.started is None:
                so_far.started = data
            elif isinstance(data, CallCompleted):
                so_far.answered(data.cell_id)
            elif isinstance(data, ExecutionFinished | ExecutionTimedOut):
                so_far.ended = True
        return so_far


@dataclass(frozen=True)
class RecordedCall:
    placement: Placement
    event: Event
    blob: BlobRef


def build_events(
    call: CompletedCall,
    placement: Placement,
    blob: BlobRef,
    *,
    run_id: str,
    occurred_at: datetime,
) -> list[Event]:
    """The `call.completed` event, preceded by `execution.branched` (kind fork, from the chain's previous call)
    when the call forks: a divergence no harness announces."""
    stream = stream_id_for("execution", call.execution_id)
    data: list[EventData] = []
    if placement.branch_hint == "fork":
        data.append(
            ExecutionBranched(
                execution_id=call.execution_id,
                kind="fork",
                at_call_index=placement.call_index,
                from_call_index=placement.head_call_index,
                chain_id=call.chain_id,
                reason=f"prompt diverges from call {placement.head_call_index} after {placement.head_shared} tokens"
                       + (", inside the text the model generated" if placement.in_completion else ""),
                cause="reply_rewritten" if placement.in_completion else "context_rewritten",
            )
        )
    record = CallRecord(
        execution_id=call.execution_id,
        call_id=call.call_id,
        call_index=placement.call_index,
        parent_call_index=placement.parent_call_index,
        parent_prefix_len=placement.parent_prefix_len,
        tokens=call_tokens(call, placement),
        policy_version=call.policy_version,
        cell_id=call.cell_id,
        chain_id=call.chain_id,
        branch_hint=placement.branch_hint,
        finish_reason=call.finish_reason,
    )
    data.append(call_completed(record, blob, api=call.api, latency_s=call.latency_s))
    # Versions are placeholders: the store assigns the stream's next versions (expected_version="any").
    return [
        new_event(d, run_id=run_id, stream_id=stream, version=1, occurred_at=occurred_at) for d in data
    ]


def refused_event(refusal: CallRefused, *, run_id: str, occurred_at: datetime) -> Event:
    """The `call.refused` event on the execution's stream (its version too is the store's to assign)."""
    return new_event(refusal, run_id=run_id, stream_id=stream_id_for("execution", refusal.execution_id), version=1,
                     occurred_at=occurred_at)


def call_tokens(call: CompletedCall, placement: Placement) -> CallTokens:
    return CallTokens(
        new_prompt=np.asarray(placement.new_prompt, dtype=np.int32),
        completion=np.asarray(call.completion, dtype=np.int32),
        logprobs=np.asarray(call.logprobs, dtype=np.float32),
    )


__all__ = [
    "Api",
    "CallLog",
    "CompletedCall",
    "ExecutionSoFar",
    "PastCall",
    "Placement",
    "RecordedCall",
    "build_events",
    "call_tokens",
    "refused_event",
]
