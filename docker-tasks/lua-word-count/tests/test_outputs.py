"""Grades lua-word-count by running the module under Lua 5.4 (in the task's image only) on fresh texts."""

import json
import subprocess

import pytest

DUMP = """
package.path = "/app/?.lua;" .. package.path
local counts = require("wordcount").count(io.read("a"))
local keys = {}
for k in pairs(counts) do keys[#keys + 1] = k end
table.sort(keys)
local parts = {}
for _, k in ipairs(keys) do parts[#parts + 1] = string.format("%q:%d", k, counts[k]) end
print("{" .. table.concat(parts, ",") .. "}")
"""


def _count(text: str) -> dict[str, int]:
    result = subprocess.run(["lua5.4", "-e", DUMP], input=text, capture_output=True, text=True, timeout=20)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The the THE", {"the": 3}),
        ("one, two; two... three3three", {"one": 1, "two": 2, "three": 2}),
        ("  Mixed\tCASE\nmixed  ", {"mixed": 2, "case": 1}),
        ("", {}),
    ],
)
def test_counts(text: str, expected: dict[str, int]) -> None:
    assert _count(text) == expected
