"""The vLLM implementation of the engine port (`engine_port.Engine`): V1 AsyncLLM, continuous batching, prefix
caching, KV moved between workers through Gyre's connector, sleep while the cell trains. Only the worker service
imports it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from services.rollout.engine_port import EngineError, EngineOutput
from services.rollout.kv_handoff import KV_LOAD_PREFIX, KV_SAVE_PREFIX
from services.rollout.protocol import SamplingSpec
from shared.weights_stream import StreamPull, StreamRefused

RESET_ATTEMPTS = 50  # tries, 0.1 s apart, to drop the prefix cache after a weight swap
NIXL_DESCRIPTOR = "nixl.json"  # the one file of a NIXL bundle: where the saved blocks are to be pulled from


def _prompt_key(prompt: list[int], block_size: int) -> str:
    from services.rollout.kv_connector import kv_folder_name

    return kv_folder_name(prompt, block_size)


@dataclass(frozen=True)
class VllmConfig:
    model: Path
    max_model_len: int = 8192
    dtype: str = "float32"  # fp32 on CPU keeps logprobs equal to transformers (~5e-7)
    seed: int = 0
    # This worker's own folder for the KV connector's files of sessions in transit (saved before a move, loaded
    # after one); shared with no other worker: the KV transport carries them. None: migrate by recompute only.
    kv_storage: Path | None = None
    # Which connector saves and loads a moved session's KV: "gyre" (files in `kv_storage`, carried by the KV
    # transport) or "nixl" (GPU nodes: vLLM's NixlConnector pulls the blocks device to device; the KV transport
    # then carries only their descriptor). See docs/rollout.md, "KV transport".
    kv_connector: Literal["gyre", "nixl"] = "gyre"
    gpu_memory_utilization: float = 0.5
    max_num_seqs: int = 64
    # The tokens of KV the engine allocates (rounded up to whole blocks), as an accelerator cell's memory would
    # bound them; beyond it vLLM preempts. None: what the memory given to the KV cache holds.
    kv_capacity_tokens: int | None = None
    # vLLM's sleep mode (level 1: weights to host memory, KV cache freed). None: where the platform has it (CUDA,
    # ROCm, XPU); on CPU vLLM refuses it and `sleep` pauses generation instead.
    sleep_mode: bool | None = None


def sleep_mode_available() -> bool:
    """Whether this platform has vLLM's sleep mode (`Platform.is_sleep_mode_available`; not on CPU)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_sleep_mode_available())


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def kv_fingerprint(vllm_config: Any, block_size: int) -> str:
    """The identity KV must share to be loaded: the model's architecture (its config), the served dtype, the KV
    cache's dtype and block size, and the names and sizes of the weight files (another checkpoint of the same
    architecture differs there). Paths are left out: the same model sits at different paths on different nodes."""
    model = vllm_config.model_config
    weights = sorted((f.name, f.stat().st_size) for f in Path(model.model).glob("*.safetensors")) \
        if Path(model.model).is_dir() else []
    config = {k: v for k, v in model.hf_config.to_dict().items() if k != "_name_or_path"}  # the folder it was read from
    identity = {
        "config": config,
        "dtype": str(model.dtype),
        "kv_cache_dtype": str(vllm_config.cache_config.cache_dtype),
        "block_size": block_size,
        "weights": weights,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


class VllmEngine:
    """One vLLM AsyncLLM (its engine core runs in a child process)."""

    def __init__(self, llm: Any, config: VllmConfig) -> None:
        self._llm = llm
        self.config = config
        vcfg = llm.vllm_config
        self.max_model_len: int = int(vcfg.model_config.max_model_len)
        self.block_size: int = int(vcfg.cache_config.block_size)
        # The engine core reports the blocks it allocated; its pool holds one back (the null block).
        blocks = int(vcfg.cache_config.num_gpu_blocks or 0)
        self.kv_capacity_tokens: int = max(blocks - 1, 0) * self.block_size
        self.kv_transfer = config.kv_storage is not None or config.kv_connector == "nixl"
        self.kv_fingerprint = kv_fingerprint(vcfg, self.block_size)
        # NIXL: descriptors of blocks a save request left for a peer to pull, and those a peer sent for a load.
        self._nixl_saved: dict[tuple[int, ...], dict[str, Any]] = {}
        self._nixl_staged: dict[tuple[int, ...], dict[str, Any]] = {}
        self.sleep_mode = bool(vcfg.model_config.enable_sleep_mode)
        self.asleep = False

    @classmethod
    def start(cls, config: VllmConfig) -> VllmEngine:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        kv_transfer: dict[str, Any] | None = None
        if config.kv_connector == "nixl":
            # Both roles in every engine: a worker is a source for the sessions it moves and a target for those it
            # adopts. The side channel (VLLM_NIXL_SIDE_CHANNEL_HOST/PORT) must be reachable from the other nodes.
            kv_transfer = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
        elif config.kv_storage is not None:
            config.kv_storage.mkdir(parents=True, exist_ok=True)
            kv_transfer = {
                "kv_connector": "GyreKVConnector",
                "kv_connector_module_path": "services.rollout.kv_connector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": str(config.kv_storage)},
            }
        sleep_mode = sleep_mode_available() if config.sleep_mode is None else config.sleep_mode
        # On CPU a prompt is never split across engine steps: a seeded request whose prefill is chunked has its
        # sampled token discarded and vLLM rewinds its torch generator, which a CPU generator cannot do (the
        # engine core dies: "CPU Generator does not use offset"). Seen when a drain moves several long sessions
        # onto a worker at once. The budget holds the longest prompt, so a request waits rather than split.
        cpu = _on_cpu()
        args = AsyncEngineArgs(
            model=str(config.model),
            dtype=config.dtype,  # type: ignore[arg-type]  # validated by vLLM
            max_model_len=config.max_model_len,
            enable_prefix_caching=True,
            enforce_eager=True,
            seed=config.seed,
            disable_log_stats=True,
            max_num_seqs=config.max_num_seqs,
            enable_sleep_mode=sleep_mode,
            enable_chunked_prefill=False if cpu else None,
            max_num_batched_tokens=max(config.max_model_len, 2048) if cpu else None,
            kv_transfer_config=kv_transfer,  # type: ignore[arg-type]  # vLLM parses the dict form
        )
        vllm_config = args.create_engine_config()
        if config.kv_capacity_tokens is not None:
            cache = vllm_config.cache_config  # its block size is the platform's, known once the config is made
            cache.num_gpu_blocks_override = -(-config.kv_capacity_tokens // cache.block_size) + 1  # + the null block
        return cls(AsyncLLM.from_vllm_config(vllm_config, disable_log_stats=True), config)

    async def generate(self, prompt: list[int], sampling: SamplingSpec, request_id: str) -> EngineOutput:
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        params = SamplingParams(
            structured_outputs=StructuredOutputsParams(regex=sampling.regex) if sampling.regex else None,
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else 0,
            seed=sampling.seed,
            stop=list(sampling.stop) or None,
            logprobs=0,  # 0: only the sampled token's logprob
            extra_args=self._nixl_params(prompt, request_id),
        )
        final = None
        ids = prompt if type(prompt) is list else list(prompt)  # taken as given: a copy costs ~10 ms a million ids
        async for out in self._llm.generate({"prompt_token_ids": ids}, params, request_id=request_id):
            final = out
        if final is None or not final.outputs:
            raise EngineError(f"engine returned no output for request {request_id}")
        if self.config.kv_connector == "nixl" and request_id.startswith(KV_SAVE_PREFIX):
            if not final.kv_transfer_params:
                raise EngineError(f"NIXL save request {request_id} returned no block descriptor")
            self._nixl_saved[tuple(prompt)] = dict(final.kv_transfer_params)
        out = final.outputs[0]
        token_ids = [int(t) for t in out.token_ids]
        logprobs: list[float] = []
        for tid, entry in zip(token_ids, out.logprobs or [], strict=False):
            if tid not in entry:
                raise EngineError(f"engine omitted the logprob of sampled token {tid} in request {request_id}")
            logprobs.append(float(entry[tid].logprob))
        if len(logprobs) != len(token_ids):
            raise EngineError(f"engine returned {len(logprobs)} logprobs for {len(token_ids)} tokens")
        stop_sequence = out.stop_reason if isinstance(out.stop_reason, str) else None
        return EngineOutput(
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason="length" if out.finish_reason == "length" else "stop",
            stop_sequence=stop_sequence,
            prompt_tokens=len(prompt),
            cached_tokens=int(final.num_cached_tokens or 0),
        )

    async def warm_up(self) -> float:
        """Serve one tiny request and forget it; returns its seconds. The engine's first request pays a
        one-off cost (18 s against 0.2 s for the next on this machine's CPU engine, whatever the prompt), so
        a worker pays it before it reports ready rather than inside the first execution's time budget."""
        prompt = list(range(1, 17))
        started = time.perf_counter()
        await self.generate(prompt, SamplingSpec(max_tokens=2, seed=0), request_id=f"warm-up-{id(self):x}")
        self.drop_kv(prompt)
        await self.reset_prefix_cache()
        return time.perf_counter() - started

    async def load_weights(self, state_dict: Mapping[str, Any]) -> None:
        items = list(state_dict.items())

        def reload(worker: Any, items: list[tuple[str, Any]] = items) -> None:
            worker.reload_weights(weights_iterator=iter(items), is_checkpoint_format=True)

        await self._reload(reload)

    async def load_weight_files(self, paths: Sequence[Path]) -> None:
        """The engine process opens the files itself (safetensors, memory-mapped) and streams their tensors into
        one in-place reload: nothing but the paths crosses the RPC."""
        names = [str(p) for p in paths]

        def reload(worker: Any, names: list[str] = names) -> None:
            from safetensors import safe_open

            def tensors() -> Iterator[tuple[str, Any]]:
                for name in names:
                    with safe_open(name, framework="pt") as f:
                        for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                            yield key, f.get_tensor(key)

            worker.reload_weights(weights_iterator=tensors(), is_checkpoint_format=True)

        await self._reload(reload)

    async def receive_weights(self, pull: StreamPull) -> float:
        """Each engine worker pulls the shards over the weights stream onto its model's device, then reloads from
        views into them (one RPC; only the pull's description crosses it). A pull that fails raises before any
        weight changes."""

        def reload(worker: Any, pull: StreamPull = pull) -> float | str:
            from shared.weights_stream import receive

            device = next(worker.model_runner.model.parameters()).device
            started = time.perf_counter()
            try:
                tensors = receive(pull, str(device))
            except StreamRefused as exc:  # crosses the RPC as text: the caller raises it again
                return f"refused: {exc}"
            seconds = time.perf_counter() - started
            worker.reload_weights(weights_iterator=iter(tensors), is_checkpoint_format=True)
            return seconds

        results = await self._reload(reload)
        refused = [r for r in results if isinstance(r, str)]
        if refused:
            raise StreamRefused(refused[0].removeprefix("refused: "))
        return max((float(r) for r in results), default=0.0)

    async def _reload(self, reload: Callable[[Any], Any]) -> list[Any]:
        # First make sure nothing holds cache blocks (this raises before the weights change, leaving the
        # worker consistent on the old policy); then, with the worker's gate closed, nothing can start
        # between the reload and the reset that drops the old policy's KV.
        await self.reset_prefix_cache()
        results = await self._llm.collective_rpc(reload)
        await self.reset_prefix_cache()
        return list(results)

    async def reset_prefix_cache(self) -> None:
        """Drop the prefix cache. vLLM refuses (returns False) while a request holds cache blocks; the worker
        swaps weights only with nothing running, so a refusal is retried briefly and then is an error: the
        old policy's KV must not be served under the new weights."""
        for _ in range(RESET_ATTEMPTS):
            if await self._llm.reset_prefix_cache() is not False:
                return
            await asyncio.sleep(0.1)
        raise RuntimeError("vLLM kept its prefix cache: requests still hold blocks after the weight swap")

    async def sleep(self) -> None:
        """With sleep mode, vLLM's level 1: weights offloaded to host memory, KV cache freed (and with it the
        prefix cache). On CPU, where vLLM has no sleep mode, the engine pauses its scheduler and drops the prefix
        cache: the weights and the KV cache's memory stay allocated and the engine process stays up, so a CPU
        sleep frees nothing; what it gives is a worker that serves nothing and keeps no KV of the old policy.
        "wait", not vLLM's default "abort": the worker sleeps with nothing in flight, and were anything still
        running it must finish rather than come back cut short as if it had stopped."""
        if self.asleep:
            return
        if self.sleep_mode:
            await self._llm.sleep(level=1, mode="wait")
        else:
            await self._llm.pause_generation(mode="wait", clear_cache=True)
        self.asleep = True

    async def wake(self) -> None:
        """Back to serving, with the weights it had before `sleep` (the worker then loads newer ones) and an empty
        prefix cache."""
        if not self.asleep:
            return
        if self.sleep_mode:
            await self._llm.wake_up()
        else:
            await self._llm.resume_generation()
        self.asleep = False

    def _kv_folder(self, prompt: list[int]) -> Path | None:
        if self.config.kv_storage is None:
            return None
        return self.config.kv_storage / _prompt_key(prompt, self.block_size)

    def _nixl_params(self, prompt: list[int], request_id: str) -> dict[str, Any] | None:
        """NIXL: a save request keeps its blocks for a peer to pull (`do_remote_decode`); a load request pulls the
        blocks its staged descriptor names (`do_remote_prefill`). Other requests, and the file connector: none."""
        if self.config.kv_connector != "nixl":
            return None
        if request_id.startswith(KV_SAVE_PREFIX):
            return {"kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
        if request_id.startswith(KV_LOAD_PREFIX) and (staged := self._nixl_staged.get(tuple(prompt))) is not None:
            return {"kv_transfer_params": {**staged, "do_remote_prefill": True, "do_remote_decode": False}}
        return None

    def kv_bytes(self, prompt: list[int]) -> int:
        folder = self._kv_folder(prompt)
        if folder is None or not folder.is_dir():
            return 0
        return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())

    def export_kv(self, prompt: list[int]) -> bytes:
        """The KV a `kvsave-` request of `prompt` saved, as one bundle (kv_bundle.py): the connector's files, which
        are removed, or with NIXL the descriptor of the blocks this engine keeps for a peer to pull. KvBundleError
        when nothing was saved."""
        from services.rollout.kv_bundle import KvBundleError, KvManifest, pack_bundle

        files: dict[str, bytes] = {}
        if self.config.kv_connector == "nixl":
            descriptor = self._nixl_saved.pop(tuple(prompt), None)
            if descriptor is not None:
                files[NIXL_DESCRIPTOR] = json.dumps(descriptor, sort_keys=True).encode()
        elif (folder := self._kv_folder(prompt)) is not None and folder.is_dir():
            try:
                files = {f.name: f.read_bytes() for f in sorted(folder.iterdir()) if f.is_file()}
            finally:
                self.drop_kv(prompt)
        if not files:
            raise KvBundleError("the engine saved no KV for the prompt")
        manifest = KvManifest(fingerprint=self.kv_fingerprint, folder=_prompt_key(prompt, self.block_size),
                              prompt_tokens=len(prompt), files=tuple((name, len(data)) for name, data in files.items()))
        return pack_bundle(manifest, files)

    def import_kv(self, prompt: list[int], bundle: bytes) -> int:
        """Place a bundle where this engine's next `kvload-` request of `prompt` finds it; returns its bytes.
        KvBundleError when it is not whole, or was saved by another model or for another prompt."""
        from services.rollout.kv_bundle import KvBundleError, unpack_bundle

        manifest, files = unpack_bundle(bundle)
        if manifest.fingerprint != self.kv_fingerprint:
            raise KvBundleError(f"KV of another model ({manifest.fingerprint[:16]}…, this engine serves "
                                f"{self.kv_fingerprint[:16]}…)")
        key = _prompt_key(prompt, self.block_size)
        if manifest.folder != key or manifest.prompt_tokens != len(prompt):
            raise KvBundleError(f"KV saved for another prompt ({manifest.prompt_tokens} tokens, key "
                                f"{manifest.folder[:12]}…; expected {len(prompt)}, {key[:12]}…)")
        if self.config.kv_connector == "nixl":
            if set(files) != {NIXL_DESCRIPTOR}:
                raise KvBundleError(f"expected a NIXL block descriptor, the bundle holds {sorted(files)}")
            try:
                self._nixl_staged[tuple(prompt)] = dict(json.loads(files[NIXL_DESCRIPTOR]))
            except ValueError as exc:
                raise KvBundleError(f"NIXL block descriptor unreadable: {exc}") from exc
            return len(bundle)
        folder = self._kv_folder(prompt)
        if folder is None:
            raise KvBundleError("this engine has no KV connector")
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            # Written aside and renamed: the connector never reads half a file.
            part = folder / f".{name}.part"
            part.write_bytes(data)
            part.replace(folder / name)
        return len(bundle)

    def drop_kv(self, prompt: list[int]) -> None:
        self._nixl_saved.pop(tuple(prompt), None)
        self._nixl_staged.pop(tuple(prompt), None)
        folder = self._kv_folder(prompt)
        if folder is None or not folder.is_dir():
            return
        for f in folder.iterdir():
            f.unlink(missing_ok=True)
        folder.rmdir()

    async def close(self) -> None:
        self._llm.shutdown()
        if self.config.kv_storage is not None:  # KV in transit is no one's once its engine is gone (and may be RAM)
            shutil.rmtree(self.config.kv_storage, ignore_errors=True)
