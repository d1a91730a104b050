"""A vLLM KV connector for migrating sessions: vLLM's shared-storage ExampleConnector, but only on request.

The stock connector saves every new prompt's KV to disk and loads any match. Gyre saves only for requests
whose id starts with `kvsave-` (a draining worker checkpointing a session) and loads only for `kvload-`
(the target worker adopting it), so ordinary traffic pays nothing. Loaded blocks then sit in the target's
prefix cache, which is what the session's next real request hits.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
    ExampleConnectorMetadata,
    align_to_block_size,
)
from vllm.utils.hashing import safe_hash

from services.rollout.kv_handoff import KV_LOAD_PREFIX, KV_SAVE_PREFIX


def kv_folder_name(prompt: list[int], block_size: int) -> str:
    """The folder the connector uses for a prompt saved by a `kvsave-` request (mirrors ExampleConnector)."""
    n = align_to_block_size(len(prompt), block_size)
    token_bytes = torch.tensor(prompt)[:n].numpy().tobytes()
    return safe_hash(token_bytes, usedforsecurity=False).hexdigest()


class GyreKVConnector(ExampleConnector):
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not str(request.request_id).startswith(KV_LOAD_PREFIX):
            return 0, False
        matched, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        # The local prefix cache may already cover more than the stored prefix.
        return max(0, matched or 0), is_async

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = ExampleConnectorMetadata()
        for new_req in scheduler_output.scheduled_new_reqs:
            token_ids = new_req.prompt_token_ids or []
            mm_hashes = [f.identifier for f in new_req.mm_features]
            if new_req.req_id in self._requests_need_load:
                meta.add_request(
                    token_ids=token_ids,
                    block_ids=new_req.block_ids[0],
                    block_size=self._block_size,
                    is_store=False,
                    mm_hashes=mm_hashes,
                )
            elif str(new_req.req_id).startswith(KV_SAVE_PREFIX):
                meta.add_request(
                    token_ids=token_ids,
                    block_ids=new_req.block_ids[0],
                    block_size=self._block_size,
                    is_store=True,
                    mm_hashes=mm_hashes,
                )
        # Preempted-and-resumed loads are not supported here: adoption requests are single short prefills.
        self._requests_need_load.clear()
        return meta
