"""Backoff delays stay within the bounds of their jitter, for any attempt and any draw."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from django_idempotency.backoff import (
    decorrelated_jitter,
    equal_jitter,
    exponential_bound,
    full_jitter,
)

attempts = st.integers(min_value=1, max_value=10**6)
seconds = st.floats(min_value=0, max_value=1e6, allow_nan=False, allow_infinity=False)
# A draw in [0, 1), as random.random returns, including both ends of the range.
draws = st.one_of(
    st.just(0.0),
    st.just(math.nextafter(1.0, 0.0)),
    st.floats(min_value=0, max_value=1, exclude_max=True),
)


@st.composite
def base_and_cap(draw):
    base = draw(seconds)
    return base, base + draw(seconds)


@given(attempts, base_and_cap())
def test_the_exponential_bound_doubles_up_to_the_cap(attempt, limits):
    base, cap = limits
    bound = exponential_bound(attempt, base, cap)
    assert bound <= cap
    assert bound == (min(cap, base * 2.0 ** (attempt - 1)) if attempt <= 1024 else cap)
    assert exponential_bound(attempt + 1, base, cap) >= bound


@given(st.integers(min_value=1025, max_value=10**100), base_and_cap())
def test_a_huge_attempt_number_gives_the_cap_without_overflowing(attempt, limits):
    base, cap = limits
    assert exponential_bound(attempt, base, cap) == cap
    assert 0 <= full_jitter(attempt, base, cap, lambda: 0.5) <= cap
    assert cap / 2 <= equal_jitter(attempt, base, cap, lambda: 0.5) <= cap


@pytest.mark.parametrize("jitter", [full_jitter, equal_jitter])
@pytest.mark.parametrize("attempt", [0, -1])
def test_attempts_count_from_one(jitter, attempt):
    with pytest.raises(ValueError, match="attempt counts from 1"):
        jitter(attempt, 0.1, 10.0)


@given(attempts, base_and_cap(), draws)
def test_full_jitter_is_between_zero_and_the_bound(attempt, limits, draw):
    base, cap = limits
    delay = full_jitter(attempt, base, cap, lambda: draw)
    assert 0 <= delay <= exponential_bound(attempt, base, cap)


@given(attempts, base_and_cap(), draws)
def test_equal_jitter_is_between_half_the_bound_and_the_bound(attempt, limits, draw):
    base, cap = limits
    bound = exponential_bound(attempt, base, cap)
    delay = equal_jitter(attempt, base, cap, lambda: draw)
    assert bound / 2 <= delay <= bound


@given(base_and_cap(), seconds, draws)
def test_decorrelated_jitter_is_between_base_and_three_times_the_previous_delay(
    limits, extra, draw
):
    base, cap = limits
    previous = min(cap, base + extra)
    delay = decorrelated_jitter(previous, base, cap, lambda: draw)
    assert base <= delay <= min(cap, 3 * previous)


@given(base_and_cap(), st.lists(draws, min_size=1, max_size=30))
def test_a_chain_of_decorrelated_delays_stays_between_base_and_cap(limits, sequence):
    base, cap = limits
    previous = base
    for draw in sequence:
        delay = decorrelated_jitter(previous, base, cap, lambda draw=draw: draw)
        assert base <= delay <= min(cap, max(base, 3 * previous))
        previous = delay


@given(base_and_cap(), draws)
def test_a_previous_delay_below_base_still_gives_at_least_base(limits, draw):
    base, cap = limits
    assert decorrelated_jitter(0.0, base, cap, lambda: draw) == base


def test_each_jitter_reaches_both_ends_of_its_range():
    assert full_jitter(3, 1.0, 100.0, lambda: 0.0) == 0.0
    assert full_jitter(3, 1.0, 100.0, lambda: 0.5) == 2.0
    assert equal_jitter(3, 1.0, 100.0, lambda: 0.0) == 2.0
    assert equal_jitter(3, 1.0, 100.0, lambda: 0.5) == 3.0
    assert decorrelated_jitter(2.0, 1.0, 100.0, lambda: 0.0) == 1.0
    assert decorrelated_jitter(2.0, 1.0, 100.0, lambda: 0.5) == 3.5
    assert decorrelated_jitter(50.0, 1.0, 100.0, lambda: 0.9) == 100.0


def test_the_default_draw_is_random():
    assert len({full_jitter(10, 1.0, 1000.0) for _ in range(20)}) > 1
    assert len({equal_jitter(10, 1.0, 1000.0) for _ in range(20)}) > 1
    assert len({decorrelated_jitter(10.0, 1.0, 1000.0) for _ in range(20)}) > 1
