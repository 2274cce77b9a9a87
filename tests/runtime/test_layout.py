"""The lane layout after re-lanings against a plain reference: the positions each generation's
lanes take, listed by brute force."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from zephon.runtime.checkpoint.layout import Layout


def reference_positions(total: int, generations: list[tuple[int, list[int]]], lanes: int) -> list:
    """Per lane of the running generation, its positions; each closed generation keeps, per lane,
    its first ``ends[g]`` positions of the ones left to it."""
    left = list(range(total))
    for n, ends in generations:
        kept = set()
        for g in range(n):
            kept.update(left[g::n][: ends[g]])
        left = [p for p in left if p not in kept]
    return [left[h::lanes] for h in range(lanes)]


@st.composite
def histories(draw):
    total = draw(st.integers(0, 120))
    generations = []
    size = total
    for _ in range(draw(st.integers(0, 3))):
        n = draw(st.integers(1, 9))
        ends = [draw(st.integers(0, max(0, -(-(size - g) // n)))) for g in range(n)]
        generations.append((n, ends))
        size -= sum(ends)
    return total, generations, draw(st.integers(1, 9))


@settings(max_examples=300, deadline=None)
@given(histories())
def test_geometry_matches_the_reference(history) -> None:
    total, generations, lanes = history
    layout = Layout([n for n, _ in generations] + [lanes], [e for _, e in generations], total)
    expected = reference_positions(total, generations, lanes)
    current = layout.current
    for h in range(lanes):
        geometry = layout.geometry(current, h)
        got = [geometry.position(k) for k in range(geometry.total or 0)]
        assert got == expected[h]
        for k, p in enumerate(got):
            assert geometry.local_index(p) == k
        for p in set(range(total)) - set(got):
            assert geometry.local_index(p) is None


@settings(max_examples=100, deadline=None)
@given(histories())
def test_unbounded_sources_agree_with_a_long_bounded_one(history) -> None:
    _, generations, lanes = history
    bounded = Layout([n for n, _ in generations] + [lanes], [e for _, e in generations], 10_000)
    unbounded = Layout([n for n, _ in generations] + [lanes], [e for _, e in generations], None)
    for h in range(lanes):
        a, b = bounded.geometry(bounded.current, h), unbounded.geometry(unbounded.current, h)
        assert b.total is None
        assert [a.position(k) for k in range(50)] == [b.position(k) for k in range(50)]


def test_seed_lanes_never_repeat_across_generations() -> None:
    layout = Layout([8, 3, 6], [[1] * 8, [0] * 3], 1000)
    seeds = [layout.seed_lane(gen, g) for gen, n in enumerate(layout.lanes) for g in range(n)]
    assert seeds == list(range(17))
