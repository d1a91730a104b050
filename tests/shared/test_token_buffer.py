"""TokenBuffer: prefixes handed out as views never change, whatever is appended or branched after them."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.calls import CallRecord, CallTokens, ExecutionSequences
from shared.tokens import TokenBuffer

ids = st.lists(st.integers(0, 2**31 - 1), max_size=40)


@settings(max_examples=200, deadline=None)
@given(ids, st.lists(st.tuples(st.integers(0, 10_000), ids), min_size=1, max_size=30))
def test_views_keep_what_they_showed_through_appends_branches_and_growth(
    first: list[int], ops: list[tuple[int, list[int]]]
) -> None:
    start = TokenBuffer.of(first)
    # Every result handed out: its buffer, its length, its view, and what it must show.
    handed: list[tuple[TokenBuffer, int, np.ndarray, list[int]]] = [(start, len(first), start.view(), first)]
    for pick, part in ops:
        buffer, n, _, expected = handed[pick % len(handed)]
        at_end = n == len(buffer)
        grown, view = buffer.extended(n, np.asarray(part, dtype=np.int32))
        assert (grown is buffer) == at_end  # in place only at the end: anything past n may be someone's view
        assert len(grown) == len(view) == n + len(part)
        handed.append((grown, len(view), view, expected + part))
        for _, _, v, shown in handed:
            assert v.tolist() == shown
            assert v.dtype == np.int32 and not v.flags.writeable


def test_a_view_is_read_only_and_bounded() -> None:
    buffer = TokenBuffer.of([1, 2, 3])
    with pytest.raises(ValueError):
        buffer.view()[0] = 9
    with pytest.raises(ValueError):
        buffer.view(4)
    assert buffer.view(2).tolist() == [1, 2]
    for n in (-1, 4):  # never the unused capacity past the end
        with pytest.raises(ValueError):
            buffer.extended(n, [7])


def test_a_chain_of_extensions_holds_its_ids_about_once() -> None:
    buffer, views = TokenBuffer(), []
    for i in range(200):
        buffer, view = buffer.extended(len(buffer), np.full(1000, i, dtype=np.int32))
        views.append(view)
    assert len(buffer) == 200_000
    assert buffer.nbytes <= 2 * 4 * 200_000  # doubling: at most twice the ids, not the 200 copies' 80 MB
    assert [int(v[-1]) for v in views] == list(range(200))


def _record(index: int, parent: int | None, prefix: int, new: list[int], completion: list[int]) -> CallRecord:
    return CallRecord(execution_id="e", call_id=f"c{index}", call_index=index, parent_call_index=parent,
                      parent_prefix_len=prefix, policy_version=0,
                      tokens=CallTokens(new_prompt=np.asarray(new, dtype=np.int32),
                                        completion=np.asarray(completion, dtype=np.int32),
                                        logprobs=np.zeros(len(completion), dtype=np.float32)))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 1000), ids, ids), min_size=1, max_size=20))
def test_execution_sequences_equal_concatenating_each_parents_prefix(
    calls: list[tuple[int, int, list[int], list[int]]],
) -> None:
    seqs, naive = ExecutionSequences(), []
    for index, (pick, cut, new, completion) in enumerate(calls):
        parent = None if index == 0 or pick % 4 == 0 else pick % index
        prefix = 0 if parent is None else cut % (len(naive[parent]) + 1)
        seq = seqs.add(_record(index, parent, prefix, new, completion))
        naive.append(([] if parent is None else naive[parent][:prefix]) + new + completion)
        assert seq.tolist() == naive[-1]
    assert [s.tolist() for s in seqs.sequences] == naive


def test_continuations_share_one_buffer() -> None:
    seqs = ExecutionSequences()
    seqs.add(_record(0, None, 0, [1, 2], [3]))
    for i in range(1, 20):
        seqs.add(_record(i, i - 1, len(seqs.sequences[-1]), [10 + i], [20 + i]))
    assert len({id(b) for b in seqs.buffers}) == 1
