"""The tiny models' tokenizer corpus: English-like text, shell, JSON, code, chat and markdown generated in code.

Pure and deterministic (a fixed seed): every tiny model, whatever its own seed, trains the same tokenizer.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

from shared.chat import ADDED_TOKENS, SPECIAL_TOKENS, chat_template

# Fixed so the tokenizer (and so the token ids) never depend on the model seed.
CORPUS_SEED = 20260101


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


__all__ = ["CORPUS_SEED", "tokenizer_corpus"]
