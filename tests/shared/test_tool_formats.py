"""Tool-call formats (shared/tool_formats.py): each family's calls written and read back, attempts that cannot be
read kept visible, guided-decoding regexes that match exactly one call, and the format read off a chat template
(rendered by transformers' own Jinja renderer, as the gateway's tokenizer renders)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from transformers.utils.chat_template_utils import render_jinja_template

from shared.chat import ToolCall, chat_template
from shared.tool_formats import (
    FORMATS,
    PYTHON_TAG,
    ToolCallFormat,
    ToolFormatError,
    detect_format,
    get_format,
    has_tool_call_marker,
)

# Llama 3.1's JSON tool calling, as its template writes an assistant call: the bare object after <|python_tag|>.
LLAMA3_TEMPLATE = (
    "{{- '<|begin_of_text|>' -}}"
    "{%- if tools -%}{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' -}}"
    "{%- for t in tools %}{{ t | tojson }}\n{% endfor -%}{{- '<|eot_id|>' -}}{%- endif -%}"
    "{%- for m in messages -%}"
    "{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' -}}"
    "{%- if m.tool_calls -%}"
    "{%- for c in m.tool_calls -%}{{- '<|python_tag|>{\"name\": \"' + c.function.name + '\", \"parameters\": ' "
    "+ (c.function.arguments | tojson) + '}' -}}{%- endfor -%}"
    "{%- else -%}{{- m.content -}}{%- endif -%}"
    "{{- '<|eot_id|>' -}}"
    "{%- endfor -%}"
)
# Mistral's v3 format: text, then [TOOL_CALLS] and a JSON list of calls.
MISTRAL_TEMPLATE = (
    "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{%- elif m.tool_calls %}{{ m.content }}[TOOL_CALLS][{% for c in m.tool_calls %}"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}]</s>"
    "{%- else %}{{ m.content }}</s>{% endif -%}"
    "{%- endfor -%}"
)
# A family none of the formats reads (XML-style function calls).
XML_TEMPLATE = (
    "{%- for m in messages -%}<|{{ m.role }}|>"
    "{%- for c in m.tool_calls or [] %}<function={{ c.function.name }}>"
    "{% for k, v in c.function.arguments.items() %}<parameter={{ k }}>{{ v }}</parameter>{% endfor %}"
    "</function>{% endfor %}{{ m.content }}{%- endfor -%}"
)


def _render(template: str):  # type: ignore[no-untyped-def]
    def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
        return str(render_jinja_template([messages], tools=tools, chat_template=template)[0][0])
    return render


def test_each_template_is_read_as_the_format_it_writes() -> None:
    assert detect_format(_render(chat_template())) == FORMATS["hermes"]
    llama = detect_format(_render(LLAMA3_TEMPLATE))
    assert (llama.name, llama.arguments_key, llama.prefix) == ("llama3_json", "parameters", PYTHON_TAG)
    assert detect_format(_render(MISTRAL_TEMPLATE)).name == "mistral"


def test_a_template_no_format_reads_is_refused_with_its_rendering() -> None:
    with pytest.raises(ToolFormatError, match=r"writes a tool call as .*<function=gyre_probe>.*hermes, llama3_json"):
        detect_format(_render(XML_TEMPLATE))
    with pytest.raises(ToolFormatError, match="does not write an assistant turn's tool calls"):
        detect_format(_render("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"))
    with pytest.raises(ToolFormatError, match="unknown tool-call format 'xml'"):
        get_format("xml")


names = st.from_regex(r"[a-z][a-z_]{0,11}", fullmatch=True)
arguments = st.dictionaries(st.from_regex(r"[a-z]{1,8}", fullmatch=True),
                            st.one_of(st.text(max_size=20), st.integers(), st.booleans()), max_size=3)
formats = st.sampled_from([*FORMATS.values(), ToolCallFormat("llama3_json", prefix=PYTHON_TAG)])


@given(formats, names, arguments)
def test_a_written_call_reads_back_as_itself(fmt: ToolCallFormat, name: str, args: dict[str, Any]) -> None:
    text = "" if fmt.name == "llama3_json" else "let me look"
    parsed = fmt.parse(fmt.format(name, args, text))
    assert parsed.tool_calls == (ToolCall(name=name, arguments=args),)
    assert parsed.malformed == () and parsed.content == text


def test_several_calls_and_plain_text() -> None:
    llama = FORMATS["llama3_json"]
    two = '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": "{\\"y\\": 2}"}'
    assert [c.name for c in llama.parse(two).tool_calls] == ["a", "b"]
    assert llama.parse(PYTHON_TAG + two).tool_calls[1].arguments == {"y": 2}
    assert llama.parse("just an answer") == llama.parse("just an answer ")  # text, no call
    assert llama.parse("just an answer").tool_calls == () and not llama.parse("just an answer").malformed
    mistral = FORMATS["mistral"]
    parsed = mistral.parse('thinking [TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]')
    assert [c.name for c in parsed.tool_calls] == ["a", "b"] and parsed.content == "thinking"


@pytest.mark.parametrize("fmt,text", [
    ("llama3_json", '{"name": "bash", "parameters": {"command": "ls'),  # cut off by max_tokens
    ("llama3_json", '{"name": 3, "parameters": {}}'),
    ("llama3_json", PYTHON_TAG + "ls -la"),
    ("llama3_json", '{"name": "bash", "parameters": [1]}'),
    ("mistral", 'ok [TOOL_CALLS][{"name": "bash", "arguments": {"command": "ls"'),
    ("mistral", 'ok [TOOL_CALLS]{"name": "bash"}'),
    ("mistral", 'ok [TOOL_CALLS][{"arguments": {}}]'),
])
def test_an_attempt_that_cannot_be_read_stays_visible(fmt: str, text: str) -> None:
    parsed = get_format(fmt).parse(text)
    assert parsed.tool_calls == () and parsed.malformed
    assert has_tool_call_marker("\n".join([parsed.content, *parsed.malformed]))  # the harness re-samples it


def test_plain_answers_carry_no_marker() -> None:
    assert not has_tool_call_marker("the answer is 42")
    assert has_tool_call_marker("<tool_call>{") and has_tool_call_marker(' {"name": "x"')


@pytest.mark.parametrize("fmt", [*FORMATS.values(), ToolCallFormat("llama3_json", prefix=PYTHON_TAG)],
                         ids=lambda f: f"{f.name}{'+tag' if f.prefix else ''}")
def test_the_forced_call_regex_matches_one_call_of_the_format(fmt: ToolCallFormat) -> None:
    schema = {"type": "object", "properties": {"command": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["command"]}
    pattern = re.compile(fmt.regex([("bash", schema), ("submit", {"type": "object"})], ["bash"]))
    written = fmt.format("bash", {"command": "ls -la"})
    assert pattern.fullmatch(written), (pattern.pattern, written)
    assert fmt.parse(written).tool_calls[0].arguments == {"command": "ls -la"}
    assert not pattern.fullmatch(fmt.format("submit", {}))
    assert not pattern.fullmatch(json.dumps({"command": "ls"}))
