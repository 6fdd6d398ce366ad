"""NgramProposer (prompt lookup): exact drafts on hand-written contexts, and a property test
against a naive pure-Python reference on random small-alphabet sequences.

Contexts are written as letters ("a b c") and mapped to token ids, so each test reads as text.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.spec_decode.ngram import NgramProposer


def ids(text: str) -> list[int]:
    return [ord(word) - ord("a") if len(word) == 1 else 100 + int(word[1:]) for word in text.split()]


def naive_propose(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The spec, spelled out: longest suffix n-gram first, its latest earlier start, k tokens after."""
    for n in range(max_n, min_n - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # len - n would be the suffix itself
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_finds_a_match_of_each_length(n):
    # Earlier span "a b c d e" followed by "x"; the context ends in its last n tokens, after a
    # token "z" that breaks any longer match.
    span = ids("a b c d e")
    context = span + ids("x y") + ids("z") + span[5 - n:]
    proposer = NgramProposer(min_n=1, max_n=5, num_speculative_tokens=2)
    assert proposer.propose(context) == ids("x y")


def test_longest_match_wins_over_a_more_recent_shorter_one():
    #          3-gram "a b c" -> p q     2-gram "b c" -> r s     suffix "a b c"
    context = ids("a b c p q   z b c r s   a b c")
    assert NgramProposer(2, 3, 2).propose(context) == ids("p q")


def test_most_recent_occurrence_wins():
    context = ids("a b p q   a b r s   a b")
    assert NgramProposer(2, 2, 2).propose(context) == ids("r s")


def test_no_match_returns_empty():
    assert NgramProposer(1, 3, 4).propose(ids("a b c d e f")) == []


def test_min_n_excludes_shorter_matches():
    context = ids("a x y   b a")  # only the 1-gram "a" occurred earlier
    assert NgramProposer(1, 3, 2).propose(context) == ids("x y")
    assert NgramProposer(2, 3, 2).propose(context) == []


def test_max_n_caps_the_match_length():
    # A 4-gram match (-> p) and a more recent 2-gram match (-> r). Allowed 4-grams, the longer
    # wins; capped at 2, both are 2-gram matches and the more recent wins.
    context = ids("a b c d p   z c d r   a b c d")
    assert NgramProposer(2, 4, 1).propose(context) == ids("p")
    assert NgramProposer(2, 2, 1).propose(context) == ids("r")


def test_num_speculative_tokens_and_max_tokens_cap_the_draft():
    context = ids("a b p q r s t   a b")
    assert NgramProposer(2, 2, 3).propose(context) == ids("p q r")
    assert NgramProposer(2, 2, 3).propose(context, max_tokens=2) == ids("p q")
    assert NgramProposer(2, 2, 3).propose(context, max_tokens=10) == ids("p q r")
    assert NgramProposer(2, 2, 3).propose(context, max_tokens=0) == []
    assert NgramProposer(2, 2, 3).propose(context, max_tokens=-1) == []


def test_continuation_may_overlap_the_suffix_but_stops_at_the_end():
    # "a b a b a": suffix "b a" (3-4) occurred at 1-2, followed by "b a" (3-4), then the end.
    context = ids("a b a b a")
    assert NgramProposer(2, 2, 5).propose(context) == ids("b a")
    assert NgramProposer(3, 3, 5).propose(context) == ids("b a")  # "a b a" at 0-2
    assert NgramProposer(2, 5, 5).propose(ids("a a a a")) == ids("a")  # most recent: 1 token left


def test_the_suffix_itself_is_not_an_occurrence():
    assert NgramProposer(1, 5, 4).propose(ids("a b c")) == []


@pytest.mark.parametrize("context", ["", "a", "a b"])
def test_contexts_shorter_than_min_n_plus_one_propose_nothing(context):
    assert NgramProposer(2, 4, 4).propose(ids(context)) == []


def test_shortest_context_that_can_match():
    assert NgramProposer(1, 4, 4).propose(ids("a a")) == ids("a")
    assert NgramProposer(2, 4, 4).propose(ids("a a a")) == ids("a")


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_numpy_input_matches_list_input(dtype):
    context = ids("a b p q r   c a b")
    draft = NgramProposer(2, 3, 3).propose(np.array(context, dtype=dtype))
    assert draft == NgramProposer(2, 3, 3).propose(context) == ids("p q r")
    assert all(type(token) is int for token in draft)


def test_only_the_lookback_window_is_searched():
    # 10 tokens: a window of 10 holds the earlier "a b" (positions 0-1); one of 9 cuts its "a".
    context = ids("a b p   x1 x2 x3 x4 x5   a b")
    assert NgramProposer(2, 2, 1, max_lookback=10).propose(context) == ids("p")
    assert NgramProposer(2, 2, 1, max_lookback=9).propose(context) == []
    assert NgramProposer(2, 2, 1, max_lookback=9).propose(np.array(context)) == []


@pytest.mark.parametrize("kwargs", [
    dict(min_n=0, max_n=2, num_speculative_tokens=1),
    dict(min_n=3, max_n=2, num_speculative_tokens=1),
    dict(min_n=1, max_n=2, num_speculative_tokens=0),
    dict(min_n=1, max_n=4, num_speculative_tokens=1, max_lookback=4),
])
def test_rejects_bad_configuration(kwargs):
    with pytest.raises(ValueError):
        NgramProposer(**kwargs)


@settings(max_examples=500, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=40),
    min_n=st.integers(1, 4),
    extra_n=st.integers(0, 3),
    k=st.integers(1, 6),
    max_tokens=st.none() | st.integers(-1, 7),
    extra_lookback=st.integers(1, 45),
    as_numpy=st.booleans(),
)
def test_matches_naive_reference(tokens, min_n, extra_n, k, max_tokens, extra_lookback, as_numpy):
    max_n = min_n + extra_n
    max_lookback = max_n + extra_lookback  # often shorter than the context, so the window is tested too
    cap = k if max_tokens is None else min(k, max_tokens)
    expected = naive_propose(tokens[-max_lookback:], min_n, max_n, cap) if cap > 0 else []
    proposer = NgramProposer(min_n, max_n, k, max_lookback=max_lookback)
    context = np.array(tokens, dtype=np.int64) if as_numpy else tokens
    assert proposer.propose(context, max_tokens=max_tokens) == expected
