"""Creates Gyre's tiny Hugging Face–format causal LMs (Qwen3, random weights, local BPE tokenizer, ChatML
template with tool calls) deterministically from a seed, and describes any local model directory.

Files written by `create_tiny_model(out_dir, seed=..., size=...)`:
  config.json             Qwen3ForCausalLM, fp32, head_dim 32 (vLLM's CPU attention supports it),
                          max_position_embeddings = 131072, untied input/output embeddings.
  model.safetensors       fp32 weights ~ N(0, 0.02) from numpy PCG64(seed), norms 1; metadata {"format": "pt"}.
  tokenizer.json          byte-level BPE trained here on a corpus generated in code (the same for every
                          seed and size, so all tiny models share token ids); len(tokenizer) == vocab_size.
  tokenizer_config.json   PreTrainedTokenizerFast; eos `<|im_end|>`, pad `<|endoftext|>`, no BOS; chat_template.
  generation_config.json  eos [<|im_end|>, <|endoftext|>], plain sampling at temperature 1 (what RL wants).
Every file is byte-identical for the same seed and size (same library versions).

Chat format (shared/chat_template.jinja; the gateway renders with it and parses generations back):
  <|im_start|>system\n{system text}<|im_end|>\n                   -- only when a system message or tools exist
  With tools the system turn is:
  <|im_start|>system\n{system text}\n\n# Tools\n\n...<tools>\n{tool json}\n...\n</tools>\n\n...<|im_end|>\n
      (one tool per line: `tojson` (json.dumps, ", "/": " separators, key order kept) of an OpenAI tool's
      `function` object, or of the tool itself for other shapes such as Anthropic's name/input_schema)
  <|im_start|>user\n{text}<|im_end|>\n
  <|im_start|>assistant\n{text}<tool_call>\n{"name": NAME, "arguments": ARGS}\n</tool_call><|im_end|>\n
      (several calls: each `<tool_call>` block after the previous one, separated by "\n"; when the text is
      non-empty the first block is preceded by "\n"; ARGS is a JSON object, or a given JSON string verbatim)
  Consecutive `tool` messages form ONE user turn:
  <|im_start|>user\n<tool_response>\n{result}\n</tool_response>\n<tool_response>\n...\n</tool_response><|im_end|>\n
  Any other role (e.g. a later `system` message) renders as <|im_start|>{role}\n{text}<|im_end|>\n.
  add_generation_prompt appends `<|im_start|>assistant\n`.
  Content may be a string or a list of parts ({"text": ...} or strings); parts are concatenated.
A generation ends with `<|im_end|>` (the EOS). `<tool_call>`, `</tool_call>`, `<tool_response>`,
`</tool_response>`, `<think>`, `</think>` are single non-special tokens, so they survive
`skip_special_tokens=True` decoding; `parse_tool_calls` extracts the calls from decoded text (the
format is Hermes/Qwen's, so vLLM's `hermes` tool parser reads it too).
"""

from __future__ import annotations

import json
import os
import random
import re
import struct
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

__all__ = [
    "ADDED_TOKENS",
    "SPECIAL_TOKENS",
    "ModelDirError",
    "ParsedReply",
    "ToolCall",
    "TinyModelError",
    "chat_template",
    "create_tiny_model",
    "model_info",
    "parse_tool_calls",
    "tokenizer_corpus",
]

Size = Literal["tiny", "small"]

# The one vocabulary size for every tiny model: small enough for fast CPU softmax, large enough that a
# 50 KB Claude Code request stays well inside the context.
VOCAB_SIZE = 4096
MAX_POSITION_EMBEDDINGS = 131072
HEAD_DIM = 32
INITIALIZER_RANGE = 0.02
ROPE_THETA = 1_000_000.0
# Fixed so the tokenizer (and so the token ids) never depend on the model seed.
CORPUS_SEED = 20260101

# Special tokens are dropped by skip_special_tokens decoding; the tool-call markers must not be.
SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ADDED_TOKENS: tuple[str, ...] = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

_SIZES: dict[str, dict[str, int]] = {
    "tiny": {
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 384,
    },
    "small": {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "intermediate_size": 768,
    },
}


class TinyModelError(Exception):
    """Base class for errors raised while creating or describing a model directory."""


class ModelDirError(TinyModelError):
    """The directory is not usable: missing files, or not empty when a new model should go there."""


class ToolCall(BaseModel):
    """One `<tool_call>` block parsed out of a generation."""

    model_config = ConfigDict(frozen=True)

    name: str
    arguments: dict[str, Any]


class ParsedReply(BaseModel):
    """A generation split into its free text, its well-formed tool calls, and the raw malformed blocks."""

    model_config = ConfigDict(frozen=True)

    content: str
    tool_calls: tuple[ToolCall, ...]
    malformed: tuple[str, ...]


def chat_template() -> str:
    """The Jinja chat template shipped with `shared` (see the module docstring for the format)."""
    return resources.files("shared").joinpath("chat_template.jinja").read_text(encoding="utf-8")


# ----------------------------------------------------------------------------------------------------
# Tool-call parsing (pure)

_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> ParsedReply:
    """Split decoded assistant text into content and tool calls.

    A block is well-formed when it holds a JSON object with a string "name" and an "arguments" object
    (or a string containing one). Anything else between the markers, and an unterminated `<tool_call>`
    (a generation cut off by max_tokens), is returned verbatim in `malformed` so the caller can retry.
    """
    calls: list[ToolCall] = []
    malformed: list[str] = []
    pieces: list[str] = []
    cursor = 0
    for match in _TOOL_CALL_RE.finditer(text):
        pieces.append(text[cursor : match.start()])
        cursor = match.end()
        call = _parse_call_body(match.group(1))
        if call is None:
            malformed.append(match.group(0))
        else:
            calls.append(call)
    tail = text[cursor:]
    open_at = tail.find("<tool_call>")
    if open_at >= 0:
        malformed.append(tail[open_at:])
        tail = tail[:open_at]
    pieces.append(tail)
    return ParsedReply(content="".join(pieces).strip(), tool_calls=tuple(calls), malformed=tuple(malformed))


def _parse_call_body(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(name=obj["name"], arguments=arguments)


# ----------------------------------------------------------------------------------------------------
# Tokenizer corpus (pure, deterministic)

_WORDS = (
    "the be to of and a in that have it for not on with he as you do at this but his by from they we say her "
    "she or an will my one all would there their what so up out if about who get which go me when make can like "
    "time no just him know take people into year your good some could them see other than then now look only "
    "come its over think also back after use two how our work first well way even new want because any these "
    "give day most us is are was were been has had did does done doing made makes found find keep kept let "
    "may might shall should must need needs here where why each every before until while again next last long "
    "great little own old right big high different small large early young important few public bad same able "
    "much many more less very still never always often sometimes already almost enough quite rather really "
    "today tomorrow yesterday morning evening night week month hour minute second world life hand part child "
    "eye woman man place case point government company number group problem fact home water room mother area "
    "money story month lot study book job word business issue side kind head house service friend father power "
    "game line end member law car city community name president team minute idea body information back parent "
    "face others level office door health person art war history party result change morning reason research "
    "girl guy moment air teacher force education foot boy age policy everything process music market sense "
    "nation plan college interest death experience effect class control care field development role effort rate "
    "heart drug show leader light voice wife police mind price report decision son view relationship town road "
    "arm difference value building action model season society tax director position player record paper space "
    "ground form event official matter center couple site project activity star table need court oil situation "
    "cost industry figure street image phone data picture practice piece land product doctor wall patient worker "
    "news movie north love support technology step baby computer type attention film tree source organization "
    "hair window evidence population site chance answer question tool tools call called using used agent code "
    "path text content message system user assistant response request server client program script shell "
    "terminal environment variable file files directory output test tests error errors command commands run "
    "running task tasks result results values list string function class method module package install build "
    "check fix update create write read open close please first second third because however therefore although "
    "without within between through during against among under above below across around behind beyond "
    "Hello Hi Thanks Sure Okay Yes No Let Now First Then Finally Next The This That It I We You They There Here "
    "What Why How When Where Which Please Note Error Warning Done Running Created Updated Deleted Reading "
    "Writing Checking Found Failed Passed Success Usage Example Returns Args Raises Important IMPORTANT TODO"
).split()
# Syllables make English-looking pseudo-words so the BPE learns sub-word pieces, not only the word list.
_ONSETS = ("", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
           "bl", "br", "ch", "cl", "cr", "dr", "fl", "fr", "gr", "pl", "pr", "sh", "sl", "sp", "st", "str", "th",
           "tr", "wh")
_NUCLEI = ("a", "e", "i", "o", "u", "ai", "ea", "ee", "io", "oo", "ou", "y")
_CODAS = ("", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "nt", "rt", "st", "ck", "ct", "ll", "ss", "x")
_SUFFIXES = ("", "", "", "s", "ed", "ing", "er", "ly", "tion", "ment", "ness", "able", "ize", "ive", "al")


def _pseudo_word(rng: random.Random) -> str:
    word = "".join(
        rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS) for _ in range(rng.randint(1, 3))
    )
    return word + rng.choice(_SUFFIXES)


def _word(rng: random.Random) -> str:
    return rng.choice(_WORDS) if rng.random() < 0.7 else _pseudo_word(rng)


_NOUNS = (
    "file directory script test function module server request config log repository branch commit "
    "package database table query user process container image task output report result value"
).split()
_VERBS = "create read write delete update check fix run build install find list print move copy rename".split()
_ADJECTIVES = "new old empty large small failing passing missing broken simple final temporary hidden".split()
_FILES = (
    "main.py", "app.py", "utils.py", "test_main.py", "README.md", "setup.sh", "run-tests.sh", "config.json",
    "data.csv", "notes.txt", "hello.txt", "output.txt", "Makefile", "requirements.txt", "task.yaml",
    "solution.sh", "index.js", "package.json", "server.go", "lib.rs", "Cargo.toml", "pyproject.toml",
)
_DIRS = ("/app", "/tmp", "/home/user", "/workspace", "src", "tests", "data", "logs", "build", "/etc", "/var/log")
_TOOL_NAMES = ("bash", "Bash", "Read", "Write", "Edit", "Glob", "Grep", "Task", "submit", "delegate", "TodoWrite")


def _sentence(rng: random.Random) -> str:
    match rng.randrange(4):
        case 0:
            words = [_word(rng) for _ in range(rng.randint(4, 14))]
            return " ".join(words).capitalize() + rng.choice(".?!.")
        case 1:
            return (
                f"{rng.choice(_VERBS).capitalize()} the {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)} "
                f"in {rng.choice(_DIRS)} and {rng.choice(_VERBS)} {rng.choice(_FILES)}."
            )
        case 2:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            return f"What is {a} + {b}? The answer is {a + b}."
        case _:
            return (
                f"The {rng.choice(_NOUNS)} {rng.choice(_FILES)} has {rng.randint(1, 500)} lines; "
                f"{_word(rng)} {_word(rng)} {_word(rng)}."
            )


def _shell(rng: random.Random) -> str:
    f, d = rng.choice(_FILES), rng.choice(_DIRS)
    commands = [
        f"ls -la {d}",
        f"cd {d} && ls",
        f"cat {f}",
        f"grep -rn \"{_word(rng)}\" {d}",
        f"find . -name \"*.py\" -type f | head -{rng.randint(1, 50)}",
        f"echo \"{_word(rng)} {_word(rng)}\" > {f}",
        f"mkdir -p {d}/{rng.choice(_NOUNS)}",
        f"python3 {f}",
        "python -m pytest -x -q",
        f"sed -n '{rng.randint(1, 40)},{rng.randint(41, 99)}p' {f}",
        "git status && git diff",
        f"git commit -am \"{rng.choice(_VERBS)} {rng.choice(_NOUNS)}\"",
        f"pip install {rng.choice(['numpy', 'requests', 'pytest', 'flask', 'pandas'])}",
        f"chmod +x {f} && ./{f}",
        f"wc -l {f}",
        f"tail -n {rng.randint(5, 100)} {d}/app.log",
        f"cp {f} {d}/ && rm -f {f}",
        f"export PATH=$PATH:{d}/bin",
        f"for i in $(seq 1 {rng.randint(2, 9)}); do echo $i; done",
    ]
    outputs = [
        f"total {rng.randint(4, 200)}\ndrwxr-xr-x 2 root root 4096 Jan {rng.randint(1, 28)} 12:{rng.randint(10, 59)} .\n"
        f"-rw-r--r-- 1 root root {rng.randint(10, 9999)} Jan 3 09:41 {f}",
        f"{rng.randint(1, 99)} passed, {rng.randint(0, 9)} failed in {rng.randint(0, 99)}.{rng.randint(10, 99)}s",
        f"bash: {rng.choice(_NOUNS)}: command not found",
        f"Traceback (most recent call last):\n  File \"{f}\", line {rng.randint(1, 300)}, in <module>\n"
        f"NameError: name '{_word(rng)}' is not defined",
        f"{f}:{rng.randint(1, 300)}: {_word(rng)} {_word(rng)}",
        "",
    ]
    return f"$ {rng.choice(commands)}\n{rng.choice(outputs)}"


def _json_value(rng: random.Random, depth: int = 0) -> Any:
    match rng.randrange(6 if depth < 2 else 4):
        case 0:
            return rng.randint(-1000, 100000)
        case 1:
            return " ".join(_word(rng) for _ in range(rng.randint(1, 5)))
        case 2:
            return rng.choice([True, False, None])
        case 3:
            return rng.choice(_FILES)
        case 4:
            return [_json_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
        case _:
            return {_word(rng): _json_value(rng, depth + 1) for _ in range(rng.randint(1, 4))}


def _tool_schema(rng: random.Random) -> dict[str, Any]:
    props = {
        rng.choice(("command", "path", "file_path", "pattern", "content", "description", "timeout", "prompt")): {
            "type": rng.choice(("string", "integer", "boolean", "array", "object")),
            "description": _sentence(rng),
        }
        for _ in range(rng.randint(1, 4))
    }
    schema = {"type": "object", "properties": props, "required": sorted(props)[:1]}
    if rng.random() < 0.5:
        return {"type": "function", "function": {"name": rng.choice(_TOOL_NAMES), "description": _sentence(rng),
                                                  "parameters": schema}}
    return {"name": rng.choice(_TOOL_NAMES), "description": _sentence(rng), "input_schema": schema,
            "additionalProperties": False, "$schema": "http://json-schema.org/draft-07/schema#"}


def _json_doc(rng: random.Random) -> str:
    match rng.randrange(4):
        case 0:
            doc: Any = _tool_schema(rng)
        case 1:
            doc = {"name": rng.choice(_TOOL_NAMES), "arguments": {"command": _shell(rng).splitlines()[0][2:]}}
        case 2:
            doc = {"role": rng.choice(("user", "assistant")), "content": [
                {"type": rng.choice(("text", "tool_use", "tool_result")), "text": _sentence(rng),
                 "cache_control": {"type": "ephemeral"}}]}
        case _:
            doc = _json_value(rng)
    indent = rng.choice((None, None, 2))
    return json.dumps(doc, indent=indent, ensure_ascii=False)


def _code(rng: random.Random) -> str:
    name = f"{rng.choice(_VERBS)}_{rng.choice(_NOUNS)}"
    arg = rng.choice(_NOUNS)
    match rng.randrange(3):
        case 0:
            return (
                f"def {name}({arg}: str, count: int = {rng.randint(0, 9)}) -> list[str]:\n"
                f"    \"\"\"{_sentence(rng)}\"\"\"\n"
                f"    result = []\n"
                f"    for i in range(count):\n"
                f"        if {arg}.startswith(\"{_word(rng)}\"):\n"
                f"            result.append(f\"{{i}}: {{{arg}}}\")\n"
                f"    return result\n"
            )
        case 1:
            return (
                f"import os\nimport sys\nfrom pathlib import Path\n\n\nclass {arg.capitalize()}Manager:\n"
                f"    def __init__(self, path: Path) -> None:\n        self.path = path\n\n"
                f"    def {name}(self) -> None:\n        with open(self.path / \"{rng.choice(_FILES)}\") as f:\n"
                f"            print(f.read())\n\n\nif __name__ == \"__main__\":\n"
                f"    {arg.capitalize()}Manager(Path(sys.argv[1])).{name}()\n"
            )
        case _:
            return (
                f"#!/bin/bash\nset -euo pipefail\n# {_sentence(rng)}\n"
                f"if [ -f \"{rng.choice(_FILES)}\" ]; then\n  echo \"found\"\nelse\n  exit 1\nfi\n"
            )


def _markdown(rng: random.Random) -> str:
    ident = "_".join(_pseudo_word(rng) for _ in range(rng.randint(1, 3)))
    camel = "".join(_word(rng).capitalize() for _ in range(rng.randint(1, 3)))
    return (
        f"# {_word(rng).capitalize()} {_word(rng)}\n\n{_sentence(rng)} {_sentence(rng)}\n\n"
        f"## {rng.choice(('Usage', 'Notes', 'Examples', 'Tone and style', 'Doing tasks', 'Tool usage policy'))}\n"
        f"- {_sentence(rng)}\n- Use `{ident}` or `{camel}` when {_word(rng)} {_word(rng)}.\n"
        f"- **{_word(rng).upper()}**: {_sentence(rng)}\n\n```bash\n{_shell(rng)}\n```\n"
    )


def _chat(rng: random.Random) -> str:
    # Rendered by hand in the template's exact layout so the BPE learns the pieces between the markers.
    parts = [f"<|im_start|>system\n{_sentence(rng)} {_sentence(rng)}"]
    if rng.random() < 0.5:
        tools = "\n".join(json.dumps(_tool_schema(rng)) for _ in range(rng.randint(1, 3)))
        parts[0] += (
            "\n\n# Tools\n\nYou may call one or more functions. Function signatures are within <tools></tools>:\n"
            f"<tools>\n{tools}\n</tools>\n\nTo call a function, reply with a JSON object within "
            "<tool_call></tool_call>:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
            "<args-json-object>}\n</tool_call>"
        )
    parts.append("<|im_end|>\n")
    for _ in range(rng.randint(1, 4)):
        parts.append(f"<|im_start|>user\n{_sentence(rng)}<|im_end|>\n")
        call = {"name": rng.choice(_TOOL_NAMES), "arguments": {"command": _shell(rng).splitlines()[0][2:]}}
        parts.append(
            f"<|im_start|>assistant\n<think>\n{_sentence(rng)}\n</think>\n\n{_sentence(rng)}\n<tool_call>\n"
            f"{json.dumps(call)}\n</tool_call><|im_end|>\n"
        )
        parts.append(f"<|im_start|>user\n<tool_response>\n{_shell(rng)}\n</tool_response><|im_end|>\n")
    parts.append(f"<|im_start|>assistant\n{_sentence(rng)}<|im_end|>\n<|endoftext|>")
    return "".join(parts)


_MARKER_RE = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS + ADDED_TOKENS))


def tokenizer_corpus(*, target_bytes: int = 400_000) -> list[str]:
    """The deterministic training corpus, already split at the marker tokens (which never merge)."""
    rng = random.Random(CORPUS_SEED)
    makers = (_sentence, _shell, _json_doc, _code, _chat, _markdown)
    pieces: list[str] = [chat_template()]
    total = 0
    while total < target_bytes:
        doc = rng.choice(makers)(rng)
        for piece in _MARKER_RE.split(doc):
            if piece:
                pieces.append(piece)
                total += len(piece)
    return pieces


# ----------------------------------------------------------------------------------------------------
# Shell: building the files


def _train_tokenizer() -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    n_added = len(SPECIAL_TOKENS) + len(ADDED_TOKENS)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - n_added,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(tokenizer_corpus(), trainer=trainer)
    # If the corpus ran out of merges, fill with reserved tokens so len(tokenizer) == vocab_size and a
    # random model can never sample an id the tokenizer cannot decode.
    reserved = VOCAB_SIZE - n_added - tokenizer.get_vocab_size(with_added_tokens=True)
    tokenizer.add_special_tokens(
        [AddedToken(f"<|reserved_{i}|>", special=True, normalized=False) for i in range(reserved)]
    )
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    if tokenizer.get_vocab_size(with_added_tokens=True) != VOCAB_SIZE:
        raise TinyModelError(
            f"tokenizer has {tokenizer.get_vocab_size(with_added_tokens=True)} tokens, expected {VOCAB_SIZE}"
        )
    return tokenizer


def _qwen3_config(size: Size, *, eos_id: int, pad_id: int) -> dict[str, Any]:
    # Written by hand (in the format transformers 5 saves) so creation needs neither a transformers import
    # nor its version string, which would make the bytes depend on the installed release.
    if size not in _SIZES:
        raise ValueError(f"size must be one of {sorted(_SIZES)}, got {size!r}")
    dims = _SIZES[size]
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "dtype": "float32",
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "initializer_range": INITIALIZER_RANGE,
        "layer_types": ["full_attention"] * dims["num_hidden_layers"],
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "max_window_layers": dims["num_hidden_layers"],
        # A large base keeps rotary phases distinct across the whole 128K context.
        "rope_parameters": {"rope_theta": ROPE_THETA, "rope_type": "default"},
        "rms_norm_eps": 1e-6,
        "sliding_window": None,
        # Untied so every weight has exactly one name in state dicts, FSDP shards and vLLM reloads.
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": VOCAB_SIZE,
        **dims,
    }


def _parameter_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Qwen3ForCausalLM's state-dict names and shapes (the transformers test checks they match)."""
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    inter, head_dim, vocab = config["intermediate_size"], config["head_dim"], config["vocab_size"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}"
        shapes |= {
            f"{layer}.input_layernorm.weight": (hidden,),
            f"{layer}.post_attention_layernorm.weight": (hidden,),
            f"{layer}.self_attn.q_proj.weight": (heads * head_dim, hidden),
            f"{layer}.self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            f"{layer}.self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            f"{layer}.self_attn.o_proj.weight": (hidden, heads * head_dim),
            f"{layer}.self_attn.q_norm.weight": (head_dim,),
            f"{layer}.self_attn.k_norm.weight": (head_dim,),
            f"{layer}.mlp.gate_proj.weight": (inter, hidden),
            f"{layer}.mlp.up_proj.weight": (inter, hidden),
            f"{layer}.mlp.down_proj.weight": (hidden, inter),
        }
    return shapes


def _random_weights(config: dict[str, Any], seed: int) -> dict[str, Any]:
    import numpy as np

    # One PCG64 stream from the seed, consumed in sorted-name order: the values depend on the seed alone.
    rng = np.random.Generator(np.random.PCG64(seed))
    weights: dict[str, Any] = {}
    shapes = _parameter_shapes(config)
    for name in sorted(shapes):
        if name.endswith("norm.weight"):
            weights[name] = np.ones(shapes[name], dtype=np.float32)
        else:
            values = rng.standard_normal(shapes[name], dtype=np.float32) * np.float32(INITIALIZER_RANGE)
            weights[name] = np.ascontiguousarray(values, dtype=np.float32)
    return weights


def _write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def create_tiny_model(out_dir: Path, *, seed: int, size: Size = "tiny", overwrite: bool = False) -> Path:
    """Write a tiny Qwen3 model directory (see the module docstring) and return its path.

    Raises ModelDirError when `out_dir` is a file, or exists and is not empty unless `overwrite` is set
    (which replaces the model's files and leaves any others alone).
    """
    from safetensors.numpy import save

    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ModelDirError(f"expected a directory for the new model, {out_dir} is a file")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise ModelDirError(f"expected an empty or missing directory for the new model, {out_dir} has files")
    out_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = _train_tokenizer()
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    pad_id = tokenizer.token_to_id(PAD_TOKEN)
    endoftext_id = tokenizer.token_to_id("<|endoftext|>")
    config = _qwen3_config(size, eos_id=eos_id, pad_id=pad_id)

    # "format": "pt" is what transformers and vLLM expect to find in the header of PyTorch checkpoints.
    weights = save(_random_weights(config, seed), metadata={"format": "pt"})
    _write_bytes(out_dir / "model.safetensors", weights)
    _write_bytes(out_dir / "config.json", _json_bytes(config))
    _write_bytes(out_dir / "tokenizer.json", (tokenizer.to_str(pretty=True) + "\n").encode("utf-8"))
    _write_bytes(
        out_dir / "tokenizer_config.json",
        _json_bytes(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": EOS_TOKEN,
                "pad_token": PAD_TOKEN,
                "unk_token": None,
                "add_bos_token": False,
                "add_eos_token": False,
                "clean_up_tokenization_spaces": False,
                "model_max_length": MAX_POSITION_EMBEDDINGS,
                "split_special_tokens": False,
                "chat_template": chat_template(),
            }
        ),
    )
    _write_bytes(
        out_dir / "generation_config.json",
        _json_bytes(
            {
                "bos_token_id": None,
                "eos_token_id": [eos_id, endoftext_id],
                "pad_token_id": pad_id,
                "do_sample": True,
                "temperature": 1.0,
                "top_p": 1.0,
                "top_k": 0,
            }
        ),
    )
    return out_dir


# ----------------------------------------------------------------------------------------------------
# Describing any model directory


def _safetensors_parameters(path: Path) -> tuple[int, set[str]]:
    # Read only the header (8-byte little-endian length, then JSON) so large models cost nothing.
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    count, dtypes = 0, set()
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        n = 1
        for dim in entry["shape"]:
            n *= dim
        count += n
        dtypes.add(entry["dtype"])
    return count, dtypes


def model_info(model_dir: Path) -> dict[str, Any]:
    """Architecture, parameter count, vocabulary and context of a local Hugging Face model directory."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ModelDirError(f"expected a Hugging Face model directory with config.json, found none in {model_dir}")
    config = json.loads(config_path.read_text(encoding="utf-8"))
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise ModelDirError(f"expected *.safetensors weights in {model_dir}, found none")
    parameters, dtypes = 0, set()
    for shard in shards:
        n, kinds = _safetensors_parameters(shard)
        parameters += n
        dtypes |= kinds
    tokenizer_vocab: int | None = None
    tokenizer_path = model_dir / "tokenizer.json"
    if tokenizer_path.is_file():
        from tokenizers import Tokenizer

        tokenizer_vocab = Tokenizer.from_file(str(tokenizer_path)).get_vocab_size(with_added_tokens=True)
    architectures = config.get("architectures") or [None]
    return {
        "path": str(model_dir),
        "architecture": architectures[0],
        "model_type": config.get("model_type"),
        "parameters": parameters,
        "dtypes": sorted(dtypes),
        "vocab_size": config.get("vocab_size"),
        "tokenizer_vocab_size": tokenizer_vocab,
        "max_context": config.get("max_position_embeddings"),
        "layers": config.get("num_hidden_layers"),
        "hidden_size": config.get("hidden_size"),
        "attention_heads": config.get("num_attention_heads"),
        "kv_heads": config.get("num_key_value_heads"),
        "head_dim": config.get("head_dim"),
    }
