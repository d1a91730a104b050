"""Run as a script: start one vLLM engine on a model dir, reload published weights in place, print logprobs.

Usage: python -m tests.trainer.vllm_reload_check MODEL_DIR WEIGHTS_FILE TOKENS_JSON OUT_JSON WORK_DIR
Writes {"before": [...], "after": [...]}: prompt logprobs of the tokens before and after the reload.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from services.rollout.engine_environment import prepare_cpu_environment


def main() -> None:
    model_dir, weights_file, tokens_json, out_json, work = sys.argv[1:6]
    # The engine's own preparation: its IPC sockets in a folder short enough for a socket's path.
    prepare_cpu_environment(Path(work))
    from safetensors.torch import load
    from vllm import LLM, SamplingParams

    tokens = json.loads(Path(tokens_json).read_text())
    llm = LLM(model=model_dir, dtype="float32", max_model_len=512, enforce_eager=True, seed=0, enable_prefix_caching=True)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)

    def prompt_logprobs() -> list[float]:
        out = llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)[0]
        return [float(d[t].logprob) for d, t in zip(out.prompt_logprobs[1:], tokens[1:], strict=True)]

    before = prompt_logprobs()
    sd = load(Path(weights_file).read_bytes())
    items = list(sd.items())
    llm.collective_rpc(
        lambda self, items=items: self.reload_weights(weights_iterator=iter(items), is_checkpoint_format=True)
    )
    llm.reset_prefix_cache()
    after = prompt_logprobs()
    Path(out_json).write_text(json.dumps({"before": before, "after": after}))
    # The verdict is written. Stop the engine's processes ourselves and leave without the interpreter's
    # teardown, where vLLM's engine client can abort ("terminate called without an active exception").
    llm.llm_engine.engine_core.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
