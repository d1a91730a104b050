"""One forward of a Hugging Face causal LM over a tree-packed micro-batch (shared/batch.py).

position_ids = depth, ancestor-only attention (flex BlockMask above a length threshold, dense additive
mask below it), and each target's logprob read from the logits at its parent position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F

from shared.batch import MicroBatch

# Below this many tokens a dense [L, L] mask is cheap (L=2048 fp32 is 16 MiB) and sdpa is as fast as
# flex; above it the dense mask is O(L^2) memory and flex's block-sparse mask wins (ENVIRONMENT.md).
DEFAULT_FLEX_THRESHOLD = 2048

# dense: sdpa/eager with a [1, 1, L, L] additive mask. flex: a flex-attention BlockMask (CUDA; on CPU flex has
# no backward in torch 2.13). tree: our tree-sparse attention (below): each query chunk attends only to the
# keys that are ancestors of some query in it, so memory and work follow the tree, not L^2.
AttentionKind = Literal["dense", "flex", "tree"]
TREE_ATTENTION = "gyre_tree"
# The forward kwarg that carries the tree plan from `packed_logits` through the HF model to the attention function.
TREE_PLAN_KWARG = "gyre_tree_plan"
DEFAULT_TREE_CHUNK = 256
SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM")


class PackedForwardError(Exception):
    pass


@dataclass(frozen=True)
class PackedTensors:
    """A MicroBatch moved to torch on one device; labels are the target token ids."""

    input_ids: torch.Tensor  # long [1, L]
    position_ids: torch.Tensor  # long [1, L]
    subtree_end: torch.Tensor  # long [L]
    target_pos: torch.Tensor  # long [T]
    pred_pos: torch.Tensor  # long [T]
    labels: torch.Tensor  # long [T]
    behaviour_logprob: torch.Tensor  # float32 [T]
    policy_version: torch.Tensor  # long [T]
    target_exec: torch.Tensor  # long [T]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])


def to_tensors(mb: MicroBatch, device: torch.device | str = "cpu") -> PackedTensors:
    def long(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.asarray(a, dtype=np.int64)).to(device)

    return PackedTensors(
        input_ids=long(mb.input_ids).unsqueeze(0),
        position_ids=long(mb.position_ids).unsqueeze(0),
        subtree_end=long(mb.subtree_end),
        target_pos=long(mb.target_pos),
        pred_pos=long(mb.pred_pos),
        labels=long(mb.input_ids[mb.target_pos]),
        behaviour_logprob=torch.from_numpy(np.asarray(mb.behaviour_logprob, dtype=np.float32)).to(device),
        policy_version=long(mb.policy_version),
        target_exec=long(mb.target_exec),
    )


def ancestor_mask(subtree_end: torch.Tensor) -> torch.Tensor:
    """Boolean [L, L]: entry (q, k) is True iff key k is an ancestor-or-self of query q."""
    idx = torch.arange(subtree_end.shape[0], device=subtree_end.device)
    q = idx[:, None]
    k = idx[None, :]
    return (k <= q) & (q < subtree_end[None, :])


def dense_additive_mask(subtree_end: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The 4D additive mask [1, 1, L, L] (0 where allowed, dtype-min elsewhere) for sdpa/eager."""
    allowed = ancestor_mask(subtree_end)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=subtree_end.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def tree_block_mask(subtree_end: torch.Tensor, block: int = 128) -> Any:
    """A flex-attention BlockMask for ancestor-only attention, built from `subtree_end` in O(L + (L/block)²).

    `create_block_mask` would evaluate the mask_mod on the whole [L, L] grid (outside `torch.compile`), which
    at a million tokens is a terabyte. Here the block structure comes straight from the tree: key k is seen
    by exactly the queries [k, subtree_end[k]), one interval, so it touches the query blocks
    k // block … (subtree_end[k] − 1) // block, and a block pair is full when every key of the key block
    precedes every query of the query block and stays visible past its last query.
    """
    from torch.nn.attention.flex_attention import BlockMask

    ends = subtree_end.contiguous().long()
    device = ends.device
    length = int(ends.shape[0])
    n = -(-length // block)  # blocks per side
    keys = torch.arange(length, device=device)
    kb = keys // block
    # Partial-or-full: per key block, a difference array over query blocks marks each key's interval.
    diff = torch.zeros(n, n + 1, dtype=torch.int32, device=device)
    ones = torch.ones(length, dtype=torch.int32, device=device)
    diff.view(-1).scatter_add_(0, kb * (n + 1) + keys // block, ones)
    diff.view(-1).scatter_add_(0, kb * (n + 1) + (ends - 1) // block + 1, -ones)
    touched = diff.cumsum(dim=1)[:, :n].T > 0  # [query block, key block]
    # Full: the key block lies wholly before the query block, and its shortest-lived key stays visible
    # past the block's last query (never true of a block the sequence's end cuts short: ends ≤ L).
    min_end = torch.full((n,), length + 1, dtype=torch.long, device=device).scatter_reduce(
        0, kb, ends, reduce="amin")
    blocks = torch.arange(n, device=device)
    full = (blocks[None, :] < blocks[:, None]) & (min_end[None, :] >= (blocks[:, None] + 1) * block)
    partial = touched & ~full

    def ordered(grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # per query block: count, key blocks
        counts = grid.sum(dim=1, dtype=torch.int32)
        indices = torch.argsort(grid.to(torch.int8), dim=1, descending=True, stable=True).to(torch.int32)
        return counts[None, None], indices[None, None]

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return (kv_idx <= q_idx) & (q_idx < ends[kv_idx])

    kv_num, kv_idx = ordered(partial)
    full_num, full_idx = ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(length, length))


def choose_attention(num_tokens: int, flex_threshold: int, device: torch.device) -> AttentionKind:
    if num_tokens <= flex_threshold:
        return "dense"
    return "flex" if device.type == "cuda" else "tree"


@dataclass(frozen=True)
class TreeChunk:
    q_start: int
    q_end: int
    keys: torch.Tensor  # long [K]: every key that is an ancestor-or-self of some query in [q_start, q_end)
    mask: torch.Tensor  # [1, 1, q_end - q_start, K] additive


def tree_attention_plan(subtree_end: torch.Tensor, dtype: torch.dtype, chunk: int = DEFAULT_TREE_CHUNK) -> list[TreeChunk]:
    """Split the queries into chunks and list, per chunk, the keys it may see (built once, used by every layer).

    k is visible to some q in [a, b) iff k < b and subtree_end[k] > a: the ancestors of a plus the chunk's own
    earlier tokens, so |keys| <= depth + chunk.
    """
    length = int(subtree_end.shape[0])
    idx = torch.arange(length, device=subtree_end.device)
    plan = []
    for a in range(0, length, chunk):
        b = min(a + chunk, length)
        keys = idx[:b][subtree_end[:b] > a]
        q = idx[a:b, None]
        allowed = (keys[None, :] <= q) & (q < subtree_end[keys][None, :])
        mask = torch.zeros(allowed.shape, dtype=dtype, device=subtree_end.device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        plan.append(TreeChunk(a, b, keys, mask[None, None]))
    return plan


def tree_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function: query [B, H, L, D], key/value [B, Hkv, L, D] -> [B, L, H, D]."""
    plan: list[TreeChunk] | None = kwargs.get(TREE_PLAN_KWARG)
    if plan is None:
        raise PackedForwardError(f"tree attention needs {TREE_PLAN_KWARG} in the forward kwargs; none arrived")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    outs = []
    for c in plan:
        k = key.index_select(2, c.keys)
        v = value.index_select(2, c.keys)
        outs.append(
            F.scaled_dot_product_attention(
                query[:, :, c.q_start : c.q_end], k, v, attn_mask=c.mask.to(query.dtype), scale=scaling
            )
        )
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def _register_tree_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(TREE_ATTENTION, tree_attention_forward)


_register_tree_attention()


def _set_attention(model: torch.nn.Module, kind: AttentionKind, dense_impl: str) -> None:
    # transformers looks the attention function up from config._attn_implementation at call time, so
    # switching per micro-batch is a config change, not a reload; all sub-configs must agree.
    wanted = {"flex": "flex_attention", "tree": TREE_ATTENTION, "dense": dense_impl}[kind]
    config: Any = model.config
    if getattr(config, "_attn_implementation", None) != wanted:
        config._attn_implementation = wanted


def packed_logits(
    model: torch.nn.Module,
    batch: PackedTensors,
    *,
    flex_threshold: int = DEFAULT_FLEX_THRESHOLD,
    dense_impl: str = "sdpa",
    attention: AttentionKind | None = None,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Logits [T, V] at each target's pred_pos from one packed forward (only those rows hit lm_head).

    `compute_dtype`: the dtype the model computes in, for the masks; a sharded model under mixed precision
    computes in its policy's dtype (`distributed.apply_fsdp` returns it), an unsharded one (None) in its
    parameters' dtype."""
    kind = attention or choose_attention(batch.num_tokens, flex_threshold, batch.input_ids.device)
    dtype = compute_dtype if compute_dtype is not None else next(model.parameters()).dtype
    extra: dict[str, Any] = {}
    mask: Any = None
    match kind:
        case "flex":
            mask = tree_block_mask(batch.subtree_end)
        case "dense":
            mask = dense_additive_mask(batch.subtree_end, dtype)
        case "tree":
            # No mask for transformers to build: the attention function reads the plan from the kwargs.
            extra[TREE_PLAN_KWARG] = tree_attention_plan(batch.subtree_end, dtype)
        case _:
            raise ValueError(f"attention must be one of dense, flex, tree; got {kind!r}")
    _set_attention(model, kind, dense_impl)
    out = model(
        input_ids=batch.input_ids,
        position_ids=batch.position_ids,
        attention_mask=mask,
        use_cache=False,
        logits_to_keep=batch.pred_pos,
        **extra,
    )
    logits: torch.Tensor = out.logits
    if logits.shape[1] != batch.pred_pos.shape[0]:
        raise PackedForwardError(
            f"model returned logits for {logits.shape[1]} positions, expected {batch.pred_pos.shape[0]} "
            "(does this architecture support logits_to_keep as an index tensor?)"
        )
    return logits[0]


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[label] per row, in fp32 whatever the model's dtype."""
    logp = F.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, labels[:, None]).squeeze(-1)


def packed_logprobs(
    model: torch.nn.Module,
    batch: PackedTensors,
    *,
    flex_threshold: int = DEFAULT_FLEX_THRESHOLD,
    dense_impl: str = "sdpa",
    attention: AttentionKind | None = None,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Per-target logprobs [T] (fp32) of labels input_ids[target_pos] under the model (`compute_dtype` as for
    `packed_logits`)."""
    if batch.pred_pos.shape[0] == 0:
        # Nothing to read, but run the model so FSDP collectives stay in step across ranks.
        logits = packed_logits(
            model,
            PackedTensors(
                **{**batch.__dict__, "pred_pos": batch.pred_pos.new_zeros(1), "labels": batch.labels.new_zeros(1)}
            ),
            flex_threshold=flex_threshold,
            dense_impl=dense_impl,
            attention=attention,
            compute_dtype=compute_dtype,
        )
        return logits.float().sum() * 0.0 + logits.new_zeros(0, dtype=torch.float32)
    logits = packed_logits(
        model, batch, flex_threshold=flex_threshold, dense_impl=dense_impl, attention=attention,
        compute_dtype=compute_dtype,
    )
    return token_logprobs(logits, batch.labels)
