"""What the fuzz suites share: generated JSON values of any shape, and a valid body with one value replaced or
removed (the suites' mutations of a good request, event or task)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from hypothesis import strategies as st

DELETE = object()  # `replaced`'s value that removes the entry instead


def json_values(*, words: Sequence[Any] = (), keys: Sequence[str] = (), text_size: int = 12, width: int = 3,
                max_leaves: int = 6) -> st.SearchStrategy[Any]:
    """Any JSON value (NaN, infinities and integers past 64 bits included, as Python writes them), its scalars
    also drawn from `words` and its object keys also from `keys` (the names the code under test reads)."""
    scalars = (st.none() | st.booleans() | st.integers() | st.integers(-(2**80), 2**80)
               | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=text_size))
    if words:
        scalars = scalars | st.sampled_from(list(words))
    names = st.text(max_size=6)
    if keys:
        names = st.sampled_from(list(keys)) | names
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=width)
                        | st.dictionaries(names, inner, max_size=width), max_leaves=max_leaves)


def replaced(body: Any, path: Sequence[Any], value: Any) -> Any:
    """A deep copy of `body` with the value at `path` set to `value`, or removed when it is `DELETE`."""
    out = copy.deepcopy(body)
    holder = out
    for step in path[:-1]:
        holder = holder[step]
    if value is not DELETE:
        holder[path[-1]] = value
    elif isinstance(holder, list):
        del holder[path[-1]]
    else:
        holder.pop(path[-1], None)
    return out


__all__ = ["DELETE", "json_values", "replaced"]
