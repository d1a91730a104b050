"""Test doubles for the rollout service: a char-level codec over Gyre's real chat template, a scripted engine,
in-process worker transport, and an in-process gateway over them (`build_stack`). Used by the fast tests; the
vLLM tests use the real engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import jinja2
import numpy as np

from services.rollout.codec import reply_message
from services.rollout.conversation import Conversation
from services.rollout.credentials import TokenVerifier
from services.rollout.engine_port import EngineError, EngineOutput
from services.rollout.gateway import create_app
from services.rollout.gateway_core import GatewayCore
from services.rollout.kv_bundle import KvBundleError, KvManifest, pack_bundle, unpack_bundle
from services.rollout.kv_handoff import KV_LOAD_PREFIX, KV_SAVE_PREFIX
from services.rollout.kv_transport import KvTransferFailed
from shared.weights_stream import StreamPull
from services.rollout.protocol import (
    AdoptReply,
    AdoptRequest,
    GenerateReply,
    GenerateRequest,
    KvTicket,
    SamplingSpec,
)
from services.rollout.recorder_memory import InMemoryCallRecorder
from services.rollout.router import Router, WorkerDirectory, WorkerUnreachable
from services.rollout.worker import RolloutWorker
from shared.chat import chat_template
from shared.events import Event, ExecutionStarted, new_event, stream_id_for
from shared.execution_tokens import derive_execution_token
from shared.tokens import digest_of
from shared.tool_formats import FORMATS
from shared.worker_status import WorkerStatus

TOKEN_SECRET = b"test-secret"  # the run's execution-token secret in every stack

SPECIALS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")


class CharCodec:
    """Renders with shared/chat_template.jinja; one token per character, special markers are single ids."""

    end_of_turn = "<|im_end|>"
    end_of_turn_id = 2
    tool_format = FORMATS["hermes"]  # what Gyre's template writes (TokenizerCodec reads it off the template)

    def __init__(self) -> None:
        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda v: json.dumps(v, ensure_ascii=False)
        self._template = env.from_string(chat_template())

    def render(self, conversation: Conversation, *, add_generation_prompt: bool) -> str:
        return self._template.render(
            messages=[m.template_dict() for m in conversation.messages],
            tools=[t.template_dict() for t in conversation.tools] or None,
            add_generation_prompt=add_generation_prompt,
        )

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        i = 0
        while i < len(text):
            for n, special in enumerate(SPECIALS, start=1):
                if text.startswith(special, i):
                    ids.append(n)
                    i += len(special)
                    break
            else:
                ids.append(100 + ord(text[i]))
                i += 1
        return ids

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i - 100) for i in ids if i >= 100)

    def token_texts(self, ids: list[int]) -> list[str]:
        return [chr(i - 100) if i >= 100 else SPECIALS[i - 1] for i in ids]


class ScriptedEngine:
    """Generates scripted replies (text → char ids ⊕ EOS); logprobs are a pure function of the prompt. Asleep, it
    refuses to generate (a real one would hold the request until woken): a worker must never send it one.

    With `kv_transfer`, it saves and loads "KV" the way Gyre's connector does for `kvsave-`/`kvload-` requests:
    the saved bundle holds the prompt's ids themselves, so a load checks that the prefix it is given is the one
    the bundle was saved for, and a load request hits it (cached tokens) only when it was staged."""

    block_size = 16
    kv_transfer = False
    kv_fingerprint = "scripted-model"
    kv_capacity_tokens = 0  # unknown: the cell's registered capacity stands

    def __init__(
        self,
        codec: CharCodec,
        script: Callable[[list[int]], str] | None = None,
        *,
        max_model_len: int = 4096,
    ) -> None:
        self.codec = codec
        self.script = script or (lambda prompt: f"reply {len(prompt)}")
        self.max_model_len = max_model_len
        self.prompts: list[list[int]] = []
        self.samplings: list[SamplingSpec] = []
        self.weights_version = 0
        self.fail_next: BaseException | None = None
        self.asleep = False
        self.sleeps = 0
        self.wakes = 0
        self.kv_saved: dict[tuple[int, ...], bytes] = {}  # what kvsave- requests stored, by prompt
        self.kv_staged: dict[tuple[int, ...], bytes] = {}  # what import_kv placed for a kvload- request
        self.kv_loads: list[int] = []  # cached tokens of each kvload- request

    async def generate(self, prompt: list[int], sampling: SamplingSpec, request_id: str) -> EngineOutput:
        if self.kv_transfer and request_id.startswith(KV_SAVE_PREFIX) and not self.asleep:
            self.kv_saved[tuple(prompt)] = np.asarray(prompt, dtype="<i4").tobytes()
        out = await self._generate(prompt, sampling, request_id)
        if self.kv_transfer and request_id.startswith(KV_LOAD_PREFIX):
            hit = tuple(prompt) in self.kv_staged
            loaded = (len(prompt) - 1) // self.block_size * self.block_size if hit else 0
            out = dataclasses.replace(out, cached_tokens=max(out.cached_tokens, loaded))
            self.kv_loads.append(out.cached_tokens)
        return out

    async def _generate(self, prompt: list[int], sampling: SamplingSpec, request_id: str) -> EngineOutput:
        if self.asleep:
            raise EngineError(f"request {request_id} sent to a sleeping engine")
        if self.fail_next is not None:
            exc, self.fail_next = self.fail_next, None
            raise exc
        if len(prompt) >= self.max_model_len:  # vLLM's rule: room for at least one generated token
            raise ValueError(f"the prompt (length {len(prompt)}) fills the maximum model length {self.max_model_len}")
        cached = 0
        for earlier in self.prompts:
            n = 0
            while n < min(len(earlier), len(prompt)) and earlier[n] == prompt[n]:
                n += 1
            cached = max(cached, n // self.block_size * self.block_size)
        self.prompts.append(list(prompt))
        self.samplings.append(sampling)
        text = self.script(prompt)
        if self.weights_version:
            text = f"[v{self.weights_version}] {text}"
        # Like vLLM: at the first stop string, generation ends with the tokens that spell it kept (one
        # character a token here) and the string reported.
        hits = [(text.index(stop), stop) for stop in sampling.stop if stop in text]
        stop_sequence = None
        if hits:
            at, stop_sequence = min(hits)
            text = text[: at + len(stop_sequence)]
        ids = self.codec.encode(text)
        finish = "stop"
        if len(ids) >= sampling.max_tokens:
            ids, finish, stop_sequence = ids[: sampling.max_tokens], "length", None
        elif stop_sequence is None:
            ids = ids + [self.codec.end_of_turn_id]
        logprobs = [-((sum(prompt) + 7 * k) % 97) / 10.0 for k in range(len(ids))]
        return EngineOutput(ids, logprobs, finish, stop_sequence, len(prompt), min(cached, max(0, len(prompt) - 1)))

    async def load_weights(self, state_dict: Mapping[str, Any]) -> None:
        self.weights_version = int(state_dict["version"])

    async def load_weight_files(self, paths: Sequence[Path]) -> None:
        from safetensors.torch import load_file

        state_dict: dict[str, Any] = {}
        for path in paths:
            state_dict.update(load_file(str(path)))
        await self.load_weights(state_dict)

    async def receive_weights(self, pull: StreamPull) -> float:
        from shared.weights_stream import receive

        started = time.perf_counter()
        tensors = await asyncio.to_thread(receive, pull, "cpu")
        await self.load_weights(dict(tensors))
        return time.perf_counter() - started

    async def reset_prefix_cache(self) -> None:
        self.prompts.clear()

    async def sleep(self) -> None:
        if not self.asleep:
            self.asleep, self.sleeps = True, self.sleeps + 1
            self.prompts.clear()  # like vLLM's: the prefix cache goes with the sleep

    async def wake(self) -> None:
        if self.asleep:
            self.asleep, self.wakes = False, self.wakes + 1

    def kv_bytes(self, prompt: list[int]) -> int:
        return len(self.kv_saved.get(tuple(prompt), b""))

    def export_kv(self, prompt: list[int]) -> bytes:
        data = self.kv_saved.pop(tuple(prompt), None)
        if data is None:
            raise KvBundleError("the engine saved no KV for the prompt")
        manifest = KvManifest(fingerprint=self.kv_fingerprint, folder=f"p{len(prompt)}", prompt_tokens=len(prompt),
                              files=(("layers.bin", len(data)),))
        return pack_bundle(manifest, {"layers.bin": data})

    def import_kv(self, prompt: list[int], bundle: bytes) -> int:
        manifest, files = unpack_bundle(bundle)
        if manifest.fingerprint != self.kv_fingerprint:
            raise KvBundleError(f"KV of another model ({manifest.fingerprint})")
        if files["layers.bin"] != np.asarray(prompt, dtype="<i4").tobytes():
            raise KvBundleError("KV saved for another prompt")
        self.kv_staged[tuple(prompt)] = files["layers.bin"]
        return len(bundle)

    def drop_kv(self, prompt: list[int]) -> None:
        self.kv_saved.pop(tuple(prompt), None)
        self.kv_staged.pop(tuple(prompt), None)

    async def close(self) -> None:
        return None


class MemoryKvTransport:
    """The KV transport in this process's memory (the NATS one's fake; one contract suite runs against both).
    `corrupt_next`, `truncate_next` and `lose_next` spoil the next bundle sent: a flipped byte under the sender's
    digest, half of it, or nothing at all (its sender died before it finished)."""

    name = "memory"

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.sent = 0
        self.corrupt_next = self.truncate_next = self.lose_next = False

    async def send(self, bundle: bytes, *, fingerprint: str, prompt_tokens: int) -> KvTicket:
        self.sent += 1
        name = f"kv-{self.sent}"
        stored = bundle
        if self.corrupt_next:
            stored, self.corrupt_next = bundle[:-1] + bytes([bundle[-1] ^ 0xFF]), False
        if self.truncate_next:
            stored, self.truncate_next = bundle[: len(bundle) // 2], False
        if self.lose_next:
            self.lose_next = False
        else:
            self.objects[name] = stored
        return KvTicket(transport=self.name, object_name=name, digest=digest_of(bundle), bytes=len(bundle),
                        fingerprint=fingerprint, prompt_tokens=prompt_tokens)

    async def receive(self, ticket: KvTicket) -> bytes:
        if ticket.transport != self.name:
            raise KvTransferFailed(f"ticket for the {ticket.transport!r} transport, this worker uses {self.name!r}")
        data = self.objects.get(ticket.object_name)
        if data is None:
            raise KvTransferFailed(f"KV object {ticket.object_name} missing (its sender died or it expired)")
        if digest_of(data) != ticket.digest:
            raise KvTransferFailed(f"KV object {ticket.object_name}: expected digest {ticket.digest}, "
                                   f"read {digest_of(data)}")
        return data

    async def discard(self, ticket: KvTicket) -> None:
        self.objects.pop(ticket.object_name, None)


class LocalWorkers:
    """In-process transport between router and workers, and between workers (peers)."""

    def __init__(self) -> None:
        self.workers: dict[str, RolloutWorker] = {}
        self.down: set[str] = set()

    def add(self, worker: RolloutWorker) -> RolloutWorker:
        self.workers[worker.worker_id] = worker
        worker.peers = self
        return worker

    # WorkerClient
    async def generate(self, worker_id: str, request: GenerateRequest, delta: np.ndarray) -> GenerateReply:
        if worker_id in self.down or worker_id not in self.workers:
            raise WorkerUnreachable(f"{worker_id} is down")
        return await self.workers[worker_id].generate(request, delta)

    # WorkerPeers
    def candidates(self, exclude: str) -> list[WorkerStatus]:
        return [w.status() for wid, w in sorted(self.workers.items()) if wid != exclude and wid not in self.down]

    async def adopt(self, target: str, request: AdoptRequest, history: np.ndarray) -> AdoptReply:
        return await self.workers[target].adopt(request, history)


# ---- an in-process gateway over fake or real engines ------------------------------------------------


@dataclass
class Stack:
    app: Any
    core: GatewayCore
    recorder: InMemoryCallRecorder
    local: LocalWorkers
    directory: WorkerDirectory
    engines: list[Any] = field(default_factory=list)

    def token(self, execution_id: str) -> str:
        """The execution's API key, as the harness derives it from the run's secret."""
        return derive_execution_token(TOKEN_SECRET, execution_id)

    def start(self, execution_id: str, *, seed: int, call_budget: int | None = None,
              cell_id: str | None = None) -> ExecutionStarted:
        """What the harness's `execution.started` does to the gateway: the event in the execution's log, and the
        gateway taking it up (its first call then settles seed and budget from the log)."""
        started = ExecutionStarted(execution_id=execution_id, query_id="q", task_id="t", group_size=1,
                                   sample_index=0, seed=seed, call_budget=call_budget, cell_id=cell_id)
        self.log(started)
        self.core.take_up(started)
        return started

    def log(self, data: Any) -> Event:
        """Append an event another service writes (an execution's start or end) to the execution's stream."""
        event = new_event(data, run_id=self.recorder.run_id, stream_id=stream_id_for("execution", data.execution_id),
                          version=1, occurred_at=datetime.now(UTC))
        self.recorder.storage.add([event])
        return event

    def refresh(self) -> None:
        """Feed the workers' current status to the router (the NATS shell does this with heartbeats)."""
        for w in self.local.workers.values():
            self.directory.update(w.status())

    def http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://gateway")

    def sdk_http(self) -> Any:
        # The SDKs are built on httpx2 and refuse httpx objects.
        import httpx2

        return httpx2.AsyncClient(transport=httpx2.ASGITransport(app=self.app), base_url="http://gateway")

    def anthropic(self, token: str) -> Any:
        import anthropic

        return anthropic.AsyncAnthropic(api_key=token, base_url="http://gateway", http_client=self.sdk_http(),
                                        max_retries=0)

    def openai(self, token: str) -> Any:
        import openai

        return openai.AsyncOpenAI(api_key=token, base_url="http://gateway/v1", http_client=self.sdk_http(),
                                  max_retries=0)


def build_stack(
    engines: list[Any],
    codec: Any,
    *,
    capacity: int = 8,
    recorder: InMemoryCallRecorder | None = None,
    max_body_bytes: int = 32 * 1024 * 1024,
    emit: Any = None,
    kv_transport: Any = None,
    max_reply_tokens: int | None = None,
) -> Stack:
    """A gateway over workers of `engines` in this process, moving KV through `kv_transport` (default: one
    in-memory transport they share). Pass `recorder.restarted()` of an earlier stack for a gateway that restarted
    over the same log."""
    local = LocalWorkers()
    directory = WorkerDirectory(stale_after_s=1e9)
    kv_transport = kv_transport or MemoryKvTransport()
    for i, engine in enumerate(engines):
        local.add(RolloutWorker(engine, worker_id=f"w{i}", cell_id=f"cell-{i}", capacity=capacity, emit=emit,
                                kv_transport=kv_transport))
    router = Router(directory, local)
    recorder = recorder or InMemoryCallRecorder()
    core = GatewayCore(codec=codec, router=router, recorder=recorder, tokens=TokenVerifier(TOKEN_SECRET),
                       max_model_len=min(e.max_model_len for e in engines), model_name="tiny",
                       max_reply_tokens=max_reply_tokens)
    app = create_app(core, max_body_bytes=max_body_bytes)
    stack = Stack(app, core, recorder, local, directory, list(engines))
    for w in local.workers.values():
        w._on_change = stack.refresh
    stack.refresh()
    return stack


__all__ = ["TOKEN_SECRET", "CharCodec", "LocalWorkers", "MemoryKvTransport", "ScriptedEngine", "Stack", "build_stack", "reply_message"]
