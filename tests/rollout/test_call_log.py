"""The gateway's call log (pure): each call stored against the earlier call sharing the longest prefix, and its
branch hint given by the one classifier (shared.branching) against the previous call of its own chain."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from services.rollout.call_log import CallLog
from shared.calls import CallRecord, CallTokens


def ids(*parts: range | list[int]) -> np.ndarray:
    return np.concatenate([np.asarray(list(p), dtype=np.int32) for p in parts])


def _add(log: CallLog, prompt: np.ndarray, completion: np.ndarray, chain_id: str = "main"):
    placement = log.place(prompt, chain_id=chain_id)
    log.add(placement, prompt, completion)
    return placement


A, a = range(10, 30), range(500, 510)  # call 0: context A, generated a


def test_a_prompt_that_leaves_generated_text_is_a_fork_even_inside_an_earlier_calls_reply() -> None:
    log = CallLog()
    _add(log, ids(A), ids(a))
    _add(log, ids(A, a, range(70, 75)), ids(range(600, 603)))  # call 1 continues call 0
    # Call 2 re-renders call 0's reply: it leaves call 1 at a token call 0 generated.
    placement = log.place(ids(A, list(a)[:4], range(900, 905)), chain_id="main")
    assert placement.branch_hint == "fork" and placement.in_completion  # its cause: a reply rewritten
    assert (placement.head_call_index, placement.head_shared) == (1, len(A) + 4)
    assert placement.parent_call_index == 1 and placement.parent_prefix_len == len(A) + 4
    assert log.generated_at(1, len(A) + 4) and not log.generated_at(1, len(A) + len(a))


def test_leaving_the_context_is_a_compaction_when_shorter_and_a_fork_when_not() -> None:
    log = CallLog()
    _add(log, ids(A), ids(a))
    assert log.place(ids(list(A)[:5], range(900, 903)), chain_id="main").branch_hint == "compaction"
    fork = log.place(ids(list(A)[:5], range(900, 960)), chain_id="main")
    assert fork.branch_hint == "fork" and not fork.in_completion  # its cause: context rewritten


def test_a_shorter_prompt_that_redoes_a_turn_after_a_whole_earlier_call_is_a_fork_not_a_compaction() -> None:
    """Calls 1 and 2 both extend call 0: call 2 leaves call 1 in its tool result (context, not generated text)
    and is shorter, but keeps call 0's whole turn, so nothing was summarised away: a fork from its sibling.
    The tree builder infers the same (tests/trajectory/test_tree_units.py)."""
    log = CallLog()
    _add(log, ids(A), ids(a))
    _add(log, ids(A, a, range(70, 90)), ids(range(600, 603)))
    redo = log.place(ids(A, a, range(70, 72), range(900, 903)), chain_id="main")
    assert redo.branch_hint == "fork" and redo.head_call_index == 1 and not redo.in_completion


def test_a_call_is_classified_against_its_own_chains_previous_call_not_the_longest_prefix() -> None:
    """A sub-agent's call (another chain) shares more with the main chain's next prompt than the main chain's
    previous call does; the main chain's call still continues its own previous call."""
    log = CallLog()
    _add(log, ids(A), ids(a))
    assert _add(log, ids(A, a, range(40, 50)), ids(range(600, 603)), chain_id="chain-1").branch_hint == "delegation"
    placement = log.place(ids(A, a, range(80, 90)), chain_id="main")
    assert placement.branch_hint == "continuation" and placement.head_call_index == 0
    assert placement.parent_call_index == 1  # stored against the latest of the equally long prefixes


def test_the_first_call_has_no_hint_and_a_resent_prompt_is_a_retry() -> None:
    log = CallLog()
    assert _add(log, ids(A), ids(a)).branch_hint is None
    assert log.place(ids(A), chain_id="main").branch_hint == "retry"


calls = st.lists(
    st.tuples(st.sampled_from(["main", "chain-1"]), st.floats(0, 1),
              st.lists(st.integers(100, 104), min_size=1, max_size=6), st.integers(1, 4)),
    min_size=1, max_size=12,
)


@settings(deadline=None, max_examples=80)
@given(calls, st.sampled_from(["main", "chain-1"]), st.lists(st.integers(100, 104), min_size=1, max_size=6))
def test_a_log_rebuilt_from_its_records_places_the_next_call_as_the_live_log_does(steps, chain, tail) -> None:
    """A restarted gateway rebuilds the log from the stored records: it must give the next call the same index,
    parent, head and hint as the log that recorded them."""
    live, records = CallLog(), []
    for i, (chain_id, cut, extra, n) in enumerate(steps):
        base = live.sequences[-1] if live.sequences else np.zeros(0, dtype=np.int32)
        prompt = ids(base[: int(cut * len(base))], extra)
        completion = ids(range(1000 + 10 * i, 1000 + 10 * i + n))
        placement = _add(live, prompt, completion, chain_id)
        records.append(CallRecord(
            execution_id="e", call_id=f"c{i}", call_index=i, parent_call_index=placement.parent_call_index,
            parent_prefix_len=placement.parent_prefix_len, policy_version=0, chain_id=chain_id,
            tokens=CallTokens(new_prompt=placement.new_prompt, completion=completion,
                              logprobs=np.zeros(n, dtype=np.float32))))
    prompt = ids(live.sequences[-1], tail)
    expected, rebuilt = live.place(prompt, chain_id=chain), CallLog.from_records(records).place(prompt, chain_id=chain)
    assert (rebuilt.call_index, rebuilt.parent_call_index, rebuilt.parent_prefix_len, rebuilt.branch_hint,
            rebuilt.head_call_index, rebuilt.head_shared) == (
        expected.call_index, expected.parent_call_index, expected.parent_prefix_len, expected.branch_hint,
        expected.head_call_index, expected.head_shared)
    assert np.array_equal(rebuilt.new_prompt, expected.new_prompt)
