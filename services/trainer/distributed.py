"""Process groups, FSDP2 sharding and micro-batch balancing for the trainer ranks.

One rank per train cell: gloo on CPU, NCCL on GPU. Re-forming with another world size goes through a
distributed checkpoint (checkpoints.py), which DCP reshards on load.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from shared import ports

Precision = Literal["auto", "fp32", "bf16"]


class DistributedError(Exception):
    pass


# ------------------------------------------------------------------------------------------------
# Process group


@dataclass(frozen=True)
class GroupSpec:
    """Where a rank finds its peers: a TCP rendezvous (MASTER_ADDR/PORT), this rank and the world size."""

    rank: int
    world_size: int
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    backend: str | None = None  # None: nccl when CUDA is available, else gloo
    timeout_s: float = 600.0

    @classmethod
    def from_env(cls) -> GroupSpec:
        return cls(
            rank=int(os.environ.get("RANK", "0")),
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
            master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(os.environ.get("MASTER_PORT", "29500")),
        )


def free_port() -> int:
    return ports.free_port()


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


_groups_joined = 0  # process groups this process has joined (each one's mesh is named apart)


def init_group(spec: GroupSpec, store: dist.Store | None = None) -> DeviceMesh:
    """Join (or re-join after `leave_group`) the trainer's process group; returns a 1-D mesh over it.

    The rendezvous is `spec`'s MASTER_ADDR/PORT (torchrun's way), or `store` when given: the coordinator's
    TCPStore under a prefix of the group's generation, so each re-formed group meets in keys of its own.
    `spec.timeout_s` also bounds every collective: a rank whose peer died returns with an error after it."""
    if dist.is_initialized():
        raise DistributedError("a process group is already initialised in this process; call leave_group first")
    device = default_device()
    backend = spec.backend or ("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rendezvous: dict[str, Any] = (
        {"store": store} if store is not None else {"init_method": f"tcp://{spec.master_addr}:{spec.master_port}"}
    )
    dist.init_process_group(
        backend=backend,
        rank=spec.rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=spec.timeout_s),
        **rendezvous,
    )
    # A mesh of its own name each time: DeviceMesh equality ignores which rank this process is, and DTensor caches
    # its sharding decisions (output specs holding the mesh they were made with) by that equality. A process that
    # was rank 0 of a two-rank group and is rank 1 of a later one would otherwise get the earlier group's mesh back
    # from the cache, with its coordinate: its shards' offsets come out as rank 0's, and the checkpoint it saves
    # or loads covers half of each tensor twice.
    global _groups_joined
    _groups_joined += 1
    return init_device_mesh(device.type, (spec.world_size,), mesh_dim_names=(f"fsdp{_groups_joined}",))


def group_store(host: str, port: int, generation: int, timeout_s: float) -> dist.Store:
    """A member's view of the coordinator's TCPStore, prefixed by the group's generation."""
    base = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    return dist.PrefixStore(f"gen-{generation}", base)


def leave_group(*, barrier: bool = True) -> None:
    """Leave the process group. Without `barrier` when a peer may be gone (a re-form after a failure, or a
    rank let go alone): a barrier would wait for it until the timeout."""
    if dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()
    _forget_sharding_decisions()


def _forget_sharding_decisions() -> None:
    """Drop DTensor's cached sharding decisions, which hold the meshes of groups this process has left (correctness
    does not depend on it, each group's mesh being named apart; a rank re-formed many times would keep them all)."""
    from torch.distributed.tensor import DTensor

    propagator = getattr(getattr(DTensor, "_op_dispatcher", None), "sharding_propagator", None)
    clear = getattr(getattr(propagator, "propagate_op_sharding", None), "cache_clear", None)
    if callable(clear):
        clear()  # per thread: the thread that trains is the one that leaves


# ------------------------------------------------------------------------------------------------
# Sharding


def mixed_precision_policy(precision: Precision, device: torch.device) -> MixedPrecisionPolicy | None:
    match precision:
        case "fp32":
            return None
        case "bf16":
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        case "auto":
            # bf16 compute with fp32 master weights and fp32 gradient reduction where the hardware has fast
            # bf16; CPU stays fp32 (bf16 matmuls there are emulated and slower, and tests want exactness).
            if device.type == "cuda" and torch.cuda.is_bf16_supported():
                return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            return None
        case _:
            raise ValueError(f"precision must be auto, fp32 or bf16; got {precision!r}")


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise DistributedError(f"{type(model).__name__} has no model.layers; expected a HF decoder-only LM")
    return list(layers)


def apply_fsdp(model: torch.nn.Module, mesh: DeviceMesh, precision: Precision = "auto") -> torch.dtype:
    """Shard each decoder layer, then the root (embeddings, final norm, lm_head) over the mesh. Returns the dtype
    the sharded model computes in (the mixed-precision policy's parameter dtype, else fp32), which the packed
    forward needs for its attention masks: the stored parameters stay fp32 either way."""
    device = torch.device(mesh.device_type)
    mp = mixed_precision_policy(precision, device)
    kwargs: dict[str, Any] = {"mesh": mesh}
    if mp is not None:
        kwargs["mp_policy"] = mp
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        # The last layer's parameters are needed again at once by backward: keep them gathered.
        fully_shard(layer, reshard_after_forward=i < len(layers) - 1, **kwargs)
    fully_shard(model, **kwargs)
    if mp is None or mp.param_dtype is None:
        return torch.float32
    return mp.param_dtype


def set_gradient_sync(model: torch.nn.Module, enabled: bool) -> None:
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


def discard_gradients(model: torch.nn.Module) -> None:
    """Drop the gradients of an interrupted accumulation (the caller zeroes `.grad` as well).

    FSDP2 accumulates the passes run without gradient sync on its unsharded parameters, outside `.grad`,
    where `zero_grad` does not reach. `reset_iter_state` clears its per-iteration state but, in torch 2.13,
    leaves those gradients, and no public call drops them, so they are cleared here (tested by
    tests/trainer/test_engine.py: a retried step equals a clean one).
    """
    if not isinstance(model, FSDPModule):
        return
    model.reset_iter_state()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for param in group.fsdp_params:
                    param.unsharded_accumulated_grad = None
                    if hasattr(param, "_unsharded_param"):
                        param._unsharded_param.grad = None


# ------------------------------------------------------------------------------------------------
# Balancing micro-batches across ranks


def balance_micro_batches(token_counts: list[int], world_size: int) -> list[list[int]]:
    """Assign micro-batch indices to ranks so that token totals are even (longest first, least-loaded rank).

    Deterministic: ties go to the earlier micro-batch and the lower rank. Each rank's list is sorted.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    loads = [0] * world_size
    assigned: list[list[int]] = [[] for _ in range(world_size)]
    for idx in sorted(range(len(token_counts)), key=lambda i: (-token_counts[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], len(assigned[r]), r))
        assigned[rank].append(idx)
        loads[rank] += token_counts[idx]
    return [sorted(a) for a in assigned]


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded weights on CPU (a collective: every rank calls it; rank 0 receives the tensors)."""
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}


@dataclass(frozen=True)
class ReformTiming:
    group_s: float
    build_s: float
    load_s: float

    @property
    def total_s(self) -> float:
        return self.group_s + self.build_s + self.load_s


def timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - start
