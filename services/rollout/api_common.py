"""What both HTTP API adapters check, checked once (pure): the model, numbers, stop strings, seeds, token limits,
tool specs, forced tools and text content. Each adapter keeps only its own shapes and field paths."""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from typing import Any

from services.rollout.conversation import ToolSpec, schema_problem
from services.rollout.errors import invalid

TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,128}$")
# How deep a request's JSON may nest (tool schemas and inputs nest a few levels; what reads them recurses).
MAX_JSON_DEPTH = 100
# A call seed is derived from the request's seed by the engine's sampler as a signed 64-bit integer.
MAX_SEED = 2**63


def nesting_problem(value: Any, limit: int = MAX_JSON_DEPTH) -> str | None:
    """Why a parsed JSON value nests too deeply for the code that walks it (digests, the chat template), if it
    does: checked without recursion, stopping at the first path past `limit`."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return f"request body nests deeper than {limit} levels"
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node if isinstance(v, (dict, list)))
    return None


def request_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise invalid("request body: expected a JSON object")
    return body


def checked_model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model: Field required (a non-empty string)", param="model")
    return model


def checked_number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise invalid(f"{name}: expected a number in [{low}, {high}], got {value!r}", param=name)
    return float(value)


def checked_max_tokens(value: Any, where: str) -> int | None:
    """A token limit, when one is given: an integer ≥ 1."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise invalid(f"{where}: expected an integer ≥ 1, got {value!r}", param=where)
    return value


def checked_stop(value: Any, where: str, *, single_string: bool = False) -> tuple[str, ...]:
    """Stop strings: a list of non-empty strings (or, with `single_string`, one string); nothing when falsy."""
    if not value:
        return ()
    if single_string and isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        expected = "a string or a list of non-empty strings" if single_string else "a list of non-empty strings"
        raise invalid(f"{where}: expected {expected}", param=where)
    return tuple(value)


def checked_seed(value: Any) -> int | None:
    """A request's sampling seed, when given: an integer in [0, 2^63) (both APIs)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_SEED:
        raise invalid(f"seed: expected an integer in [0, 2^63), got {value!r}", param="seed")
    return value


def tool_spec(name: Any, description: Any, schema: Any, *, where: str, schema_field: str,
              type_optional: bool = False) -> ToolSpec:
    """One tool (`where` is its path, `schema_field` the name of its parameter schema there): a name guided
    decoding can match, an object schema whose properties and required names it can read, a text description.
    `type_optional`: a schema without "type" counts as an object (OpenAI's rule)."""
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise invalid(f"{where}.name: expected a string matching {TOOL_NAME.pattern}, got {name!r}",
                      param=f"{where}.name")
    schema_where = f"{where}.{schema_field}"
    kind = schema.get("type", "object" if type_optional else None) if isinstance(schema, dict) else None
    if kind != "object":
        shown = json.dumps(schema)[:200] if schema is not None else "nothing"
        raise invalid(f'{schema_where}: expected a JSON Schema object with "type": "object", got {shown}',
                      param=schema_where)
    assert isinstance(schema, dict)
    if problem := schema_problem(schema):
        raise invalid(f"{schema_where}.{problem}", param=schema_where)
    description = description or ""
    if not isinstance(description, str):
        raise invalid(f"{where}.description: expected a string", param=f"{where}.description")
    return ToolSpec(name=name, description=description, parameters=schema)


def all_tools(names: tuple[str, ...], where: str, choice: str) -> tuple[str, ...]:
    """A tool choice that forces a call of any tool: there must be one."""
    if not names:
        raise invalid(f"{where}: '{choice}' needs at least one tool", param=where)
    return names


def one_tool(name: Any, names: tuple[str, ...], where: str) -> tuple[str, ...]:
    """A tool choice that forces a call of the tool named `name`, which must be one of the request's tools."""
    if name not in names:
        raise invalid(f"{where}: expected one of {list(names)}, got {name!r}", param=where)
    return (name,)


def content_text(content: Any, where: str, *, placeholders: Collection[str], item: str = "{where}.{i}",
                 bare_strings: bool = False) -> str:
    """The text of a string or a list of content parts (text parts joined; the kinds in `placeholders`, images
    and the like, become "[kind]"; other kinds carry nothing for the model). `item` spells a part's path;
    `bare_strings` lets a part be a plain string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where}: expected a string or a list of content blocks, got {type(content).__name__}",
                      param=where)
    parts: list[str] = []
    for i, part in enumerate(content):
        if bare_strings and isinstance(part, str):
            parts.append(part)
            continue
        path = item.format(where=where, i=i)
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise invalid(f"{path}: expected a content block object with a string 'type'", param=where)
        kind = part["type"]
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise invalid(f"{path}.text: Field required (a string)", param=where)
            parts.append(part["text"])
        elif kind in placeholders:
            parts.append(f"[{kind}]")
    return "".join(parts)


def chunks(text: str, size: int = 64) -> list[str]:
    """A streamed text in pieces of `size` characters (at least one, possibly empty)."""
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


__all__ = [
    "MAX_JSON_DEPTH",
    "MAX_SEED",
    "TOOL_NAME",
    "all_tools",
    "checked_max_tokens",
    "checked_model",
    "checked_number",
    "checked_seed",
    "checked_stop",
    "chunks",
    "content_text",
    "nesting_problem",
    "one_tool",
    "request_object",
    "tool_spec",
]
