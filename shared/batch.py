"""The tree-packed training batch: what the trajectory service emits and the trainer consumes.

A micro-batch is one packed sequence holding one or more trajectory trees in depth-first pre-order.
Attention: query q may attend key k iff `k <= q < subtree_end[k]` (k is an ancestor-or-self of q), which
also keeps trees in one pack apart. `position_ids` is the depth in the tree. Each target's logprob is
read from the logits at `pred_pos` (its parent in the tree). Every target of an execution appears in
exactly one micro-batch, once.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

import numpy as np

from shared.tokens import decode_arrays, digest_of, encode_arrays

BATCH_MEDIA_TYPE = "application/x-gyre-batch"
_MAGIC = b"GYB1"


class BatchFormatError(Exception):
    pass


@dataclass(frozen=True)
class ExecutionEntry:
    execution_id: str
    query_id: str
    reward: float
    advantage: float
    num_targets: int  # |T_e| after the cap, over all micro-batches
    timed_out: bool = False


@dataclass(frozen=True)
class MicroBatch:
    input_ids: np.ndarray  # int32 [L]
    position_ids: np.ndarray  # int32 [L]: depth
    subtree_end: np.ndarray  # int32 [L]: one past the last descendant of each position
    target_pos: np.ndarray  # int32 [T]: position of each target token (label = input_ids[target_pos])
    pred_pos: np.ndarray  # int32 [T]: position whose logits predict the target (its parent)
    behaviour_logprob: np.ndarray  # float32 [T]: μ_t from the rollout
    policy_version: np.ndarray  # int32 [T]
    target_exec: np.ndarray  # int32 [T]: index into TrainingBatch.executions

    _ARRAYS = (
        "input_ids",
        "position_ids",
        "subtree_end",
        "target_pos",
        "pred_pos",
        "behaviour_logprob",
        "policy_version",
        "target_exec",
    )

    @classmethod
    def from_lists(
        cls,
        *,
        input_ids: list[int],
        position_ids: list[int],
        subtree_end: list[int],
        target_pos: list[int],
        pred_pos: list[int],
        behaviour_logprob: list[float] | None = None,
        policy_version: list[int] | None = None,
        target_exec: list[int] | int = 0,
    ) -> MicroBatch:
        """Build from plain lists with the format's dtypes; absent logprobs and versions are zeros."""
        t = len(target_pos)
        execs = np.full(t, target_exec, dtype=np.int32) if isinstance(target_exec, int) else np.array(target_exec, dtype=np.int32)
        return cls(
            input_ids=np.array(input_ids, dtype=np.int32),
            position_ids=np.array(position_ids, dtype=np.int32),
            subtree_end=np.array(subtree_end, dtype=np.int32),
            target_pos=np.array(target_pos, dtype=np.int32),
            pred_pos=np.array(pred_pos, dtype=np.int32),
            behaviour_logprob=np.array(behaviour_logprob if behaviour_logprob is not None else [0.0] * t, dtype=np.float32),
            policy_version=np.array(policy_version if policy_version is not None else [0] * t, dtype=np.int32),
            target_exec=execs,
        )

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_targets(self) -> int:
        return int(self.target_pos.shape[0])

    def labels(self) -> np.ndarray:
        labels: np.ndarray = self.input_ids[self.target_pos]
        return labels

    def validate(self, num_executions: int) -> None:
        n = self.num_tokens
        for name in ("position_ids", "subtree_end"):
            if getattr(self, name).shape != (n,):
                raise BatchFormatError(f"{name} has shape {getattr(self, name).shape}, expected ({n},)")
        t = self.num_targets
        for name in ("pred_pos", "behaviour_logprob", "policy_version", "target_exec"):
            if getattr(self, name).shape != (t,):
                raise BatchFormatError(f"{name} has shape {getattr(self, name).shape}, expected ({t},)")
        idx = np.arange(n)
        if n and (np.any(self.subtree_end <= idx) or np.any(self.subtree_end > n)):
            raise BatchFormatError("subtree_end must satisfy i < subtree_end[i] <= L")
        if t:
            if np.any(self.pred_pos >= self.target_pos) or np.any(self.pred_pos < 0):
                raise BatchFormatError("each pred_pos must come before its target_pos")
            if np.any(self.subtree_end[self.pred_pos] <= self.target_pos):
                raise BatchFormatError("a pred_pos is not an ancestor of its target")
            if np.any(self.target_exec < 0) or np.any(self.target_exec >= num_executions):
                raise BatchFormatError("target_exec out of range")


@dataclass(frozen=True)
class TrainingBatch:
    step: int
    executions: list[ExecutionEntry]
    micro_batches: list[MicroBatch]
    meta: dict[str, int | float | str] = field(default_factory=dict)

    def encode(self) -> bytes:
        header = {
            "step": self.step,
            "executions": [e.__dict__ for e in self.executions],
            "micro_batches": len(self.micro_batches),
            "meta": self.meta,
        }
        head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
        arrays = [getattr(mb, name) for mb in self.micro_batches for name in MicroBatch._ARRAYS]
        body = encode_arrays(arrays)
        return _MAGIC + struct.pack("<I", len(head)) + head + body

    def digest(self) -> str:
        return digest_of(self.encode())

    @classmethod
    def decode(cls, blob: bytes) -> TrainingBatch:
        if blob[:4] != _MAGIC:
            raise BatchFormatError("not a Gyre batch (missing GYB1 header)")
        (head_len,) = struct.unpack_from("<I", blob, 4)
        header = json.loads(blob[8 : 8 + head_len])
        arrays = decode_arrays(blob[8 + head_len :])
        per = len(MicroBatch._ARRAYS)
        if len(arrays) != per * header["micro_batches"]:
            raise BatchFormatError(f"batch holds {len(arrays)} arrays, expected {per * header['micro_batches']}")
        mbs = [
            MicroBatch(**dict(zip(MicroBatch._ARRAYS, arrays[i * per : (i + 1) * per], strict=True)))
            for i in range(header["micro_batches"])
        ]
        executions = [ExecutionEntry(**e) for e in header["executions"]]
        batch = cls(step=header["step"], executions=executions, micro_batches=mbs, meta=header["meta"])
        for mb in mbs:
            mb.validate(len(executions))
        return batch
