"""The generation engine port: what a rollout worker needs from an engine (`Engine`), what one request returns
(`EngineOutput`) and its error. The vLLM implementation is `engine.py`; tests use a scripted fake. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from services.rollout.protocol import SamplingSpec
from shared.weights_stream import StreamPull


class EngineError(Exception):
    pass


@dataclass(frozen=True)
class EngineOutput:
    token_ids: list[int]
    logprobs: list[float]  # logprob of each generated token under the policy
    finish_reason: Literal["stop", "length"]
    stop_sequence: str | None  # the stop string that matched, if any
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache or loaded through the KV connector


class Engine(Protocol):
    max_model_len: int
    block_size: int
    kv_transfer: bool  # whether a KV connector is configured (migration by KV is possible)
    kv_fingerprint: str  # the model identity saved KV must share to be loaded here
    kv_capacity_tokens: int  # the tokens of KV the engine holds (0: unknown)

    async def generate(self, prompt: list[int], sampling: SamplingSpec, request_id: str) -> EngineOutput: ...

    async def load_weights(self, state_dict: Mapping[str, Any]) -> None:
        """Replace the weights in place and drop the prefix cache (it holds KV of the old policy)."""
        ...

    async def load_weight_files(self, paths: Sequence[Path]) -> None:
        """`load_weights` from safetensors files on this node (a publication's shards, staged by the worker):
        the engine reads them itself rather than being handed the tensors."""
        ...

    async def receive_weights(self, pull: StreamPull) -> float:
        """`load_weights` from rank 0 over the weights stream: the engine process receives the shards onto its own
        device and reloads from them; returns the transfer's seconds. StreamRefused, with the old weights kept,
        when the stream does not deliver them whole."""
        ...

    async def reset_prefix_cache(self) -> None: ...

    async def sleep(self) -> None:
        """Stop generating while the cell serves another role, freeing what the platform can: with vLLM's sleep
        mode (GPU) the weights go to host memory and the KV cache is freed; elsewhere (CPU) generation pauses and
        the prefix cache is dropped, nothing is freed. Called with no request in flight; a request sent before
        `wake` waits."""
        ...

    async def wake(self) -> None:
        """Undo `sleep`: the same weights as before it, an empty prefix cache, generation resumed."""
        ...

    def kv_bytes(self, prompt: list[int]) -> int:
        """Bytes the connector stored for this prompt's saved KV (0 when nothing is stored)."""
        ...

    def export_kv(self, prompt: list[int]) -> bytes:
        """What a save request of `prompt` stored, as one bundle (kv_bundle.py), removed from the engine's folder;
        KvBundleError when nothing was stored."""
        ...

    def import_kv(self, prompt: list[int], bundle: bytes) -> int:
        """Stage a bundle for this engine's next load request of `prompt`; returns its bytes. KvBundleError when
        the bundle is not whole or belongs to another model or prompt."""
        ...

    def drop_kv(self, prompt: list[int]) -> None: ...

    async def close(self) -> None: ...


__all__ = ["Engine", "EngineError", "EngineOutput"]
