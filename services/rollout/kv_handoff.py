"""How a session's KV moves between workers through the engine: the request-id prefixes the Gyre KV connector
acts on, and the prompt whose KV is saved and loaded (whole blocks only). Pure: imported by the worker, the
engine and the connector that vLLM loads in its own process.
"""

from __future__ import annotations

import numpy as np

# Request-id prefixes the Gyre KV connector acts on (see kv_connector.py): only these save or load KV.
KV_SAVE_PREFIX = "kvsave-"
KV_LOAD_PREFIX = "kvload-"


def kv_prompt(history: np.ndarray, block_size: int) -> np.ndarray | None:
    """The prompt whose KV is saved and loaded for a migration, or None when no whole block would move.

    vLLM's shared-storage connector keys saved KV by the prompt's first ⌊(n−1)/B⌋·B tokens when saving but
    ⌊(n−2)/B⌋·B when looking up, so save and load use the same prompt, of a length n with (n−1) mod B ≠ 0.
    """
    n = len(history)
    if (n - 1) % block_size == 0:
        n -= 1
    if (n - 1) // block_size < 1:
        return None
    return history[:n]


__all__ = ["KV_LOAD_PREFIX", "KV_SAVE_PREFIX", "kv_prompt"]
