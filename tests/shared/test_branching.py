"""The one branch classifier (shared/branching.py), case by case and as properties."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from shared.branching import classify_branch


def kind(*, shared: int, prompt: int, head: int, in_completion: bool = False, new_chain: bool = False) -> str:
    return classify_branch(new_chain=new_chain, shared=shared, prompt_len=prompt, head_len=head,
                           diverges_in_completion=in_completion)


def test_a_prompt_that_extends_the_whole_head_is_a_continuation() -> None:
    assert kind(shared=100, prompt=140, head=100) == "continuation"


def test_a_prompt_that_lies_on_the_heads_path_is_a_retry() -> None:
    assert kind(shared=60, prompt=60, head=100) == "retry"


def test_leaving_the_head_inside_generated_text_is_a_fork() -> None:
    assert kind(shared=80, prompt=90, head=100, in_completion=True) == "fork"


def test_a_shorter_prompt_that_leaves_the_head_in_its_context_is_a_compaction() -> None:
    assert kind(shared=30, prompt=50, head=100) == "compaction"


def test_a_shorter_prompt_that_goes_back_to_a_siblings_context_is_a_fork_not_a_compaction() -> None:
    # It leaves the head at 30 tokens but follows another earlier call for 45: the head's history was not
    # replaced by something new, the agent took up another line of it.
    assert classify_branch(new_chain=False, shared=30, prompt_len=50, head_len=100, diverges_in_completion=False,
                           sibling_shared=45) == "fork"
    assert classify_branch(new_chain=False, shared=30, prompt_len=50, head_len=100, diverges_in_completion=False,
                           sibling_shared=30) == "compaction"


def test_a_longer_rewrite_of_the_heads_context_is_a_fork() -> None:
    assert kind(shared=30, prompt=150, head=100) == "fork"


def test_the_first_call_of_a_new_chain_is_a_delegation_whatever_it_shares() -> None:
    assert kind(shared=100, prompt=140, head=100, new_chain=True) == "delegation"


@given(st.integers(0, 500), st.integers(0, 500), st.integers(1, 500), st.booleans())
def test_a_continuation_is_exactly_a_prompt_that_contains_the_whole_head(shared: int, prompt: int, head: int,
                                                                           in_completion: bool) -> None:
    shared = min(shared, prompt, head)
    got = kind(shared=shared, prompt=prompt, head=head, in_completion=in_completion)
    assert (got == "continuation") == (shared == head and prompt >= head)
    assert got != "delegation"
