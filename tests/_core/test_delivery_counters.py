"""DeliveryCounters.count_tombstone against a Python reference: counted tags per tag, and the
mixture heritage a counted tombstone carries added up per (tag, kind, component)."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from zephon._core.delivery import DeliveryCounters, heritage_key, parse_heritage_key
from zephon.types import SampleCursor, SampleMeta

COMPONENTS = st.one_of(st.sampled_from(["code", "docs"]), st.integers(0, 3), st.just(("a", "b")))
COUNTS = st.none() | st.dictionaries(COMPONENTS, st.integers(0, 1000), max_size=3)
TAGS = st.frozensets(st.sampled_from(["mixture_dropped", "counted", "other"]), max_size=3)


def reference(metas: list[SampleMeta], counted: frozenset[str]) -> Counter:
    out: Counter = Counter()
    for meta in metas:
        for tag in meta.tags & counted:
            out[tag] += 1
            for kind, counts in (
                ("tokens", meta.component_token_counts),
                ("samples", meta.component_sample_counts),
            ):
                for comp, n in (counts or {}).items():
                    if isinstance(comp, (str, int)):  # keys a JSON checkpoint keeps
                        out[(tag, kind, comp)] += n
    return out


@given(st.lists(st.tuples(TAGS, COUNTS, COUNTS), max_size=20))
def test_counted_tombstones_add_up_their_heritage_per_component(spec) -> None:
    cursor = SampleCursor(0, 0, (0, 0, 0))
    metas = [
        SampleMeta(
            cursor,
            is_tombstone=True,
            tags=tags,
            component_token_counts=tokens,
            component_sample_counts=samples,
        )
        for tags, tokens, samples in spec
    ]
    counted = frozenset({"mixture_dropped", "counted"})
    counters = DeliveryCounters()
    counters.counted_tags = counted
    for meta in metas:
        counters.count_tombstone(meta)
    assert counters.tombstones == len(metas)
    decoded = {}
    for key, n in counters.tag_counts.items():
        if n:
            decoded[parse_heritage_key(key) or key] = n
    assert decoded == {k: n for k, n in reference(metas, counted).items() if n}


def test_uncounted_tags_and_plain_tombstones_add_nothing() -> None:
    counters = DeliveryCounters()
    counters.counted_tags = frozenset({"mixture_dropped"})
    cursor = SampleCursor(0, 0, (0, 0, 0))
    counters.count_tombstone(
        SampleMeta(cursor, is_tombstone=True, tags={"other"}, component_token_counts={"a": 5})
    )
    counters.count_tombstone(SampleMeta(cursor, is_tombstone=True, component_token_counts={"a": 5}))
    assert counters.tag_counts == {}


@given(
    st.sampled_from(["mixture_dropped", "[x"]), st.sampled_from(["tokens", "samples"]), COMPONENTS
)
def test_heritage_keys_are_strings_that_parse_back(tag, kind, comp) -> None:
    if not isinstance(comp, (str, int)):
        return
    key = heritage_key(tag, kind, comp)
    assert isinstance(key, str)
    assert parse_heritage_key(key) == (tag, kind, comp)
    for other in ("mixture_dropped", "[", "[1, 2]", '["a","other","b"]', 3, ("a", "b")):
        assert parse_heritage_key(other) is None
