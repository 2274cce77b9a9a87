"""SampleCursor against an obviously-correct pure-Python model of its documented rules.

The model is a dataclass whose ``sort_key`` is the tuple ``(chunk_id, chunk_offset, lineage,
sample_id)``; every ordering, sorting and equality question about compiled cursors is answered by
comparing those tuples.
"""

from __future__ import annotations

import json
import operator
import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from zephon._core.cursor import argsort_cursors, cursors_for_chunk, digest_cursors, sort_cursors
from zephon.types import SampleCursor

INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class RefCursor:
    """The reference model: four plain fields and the tuple they sort by."""

    chunk_id: int
    chunk_offset: int
    sample_id: tuple[int, int, int]
    lineage: tuple[int, ...] = ()

    @property
    def sort_key(self) -> tuple[int, int, tuple[int, ...], tuple[int, int, int]]:
        return (self.chunk_id, self.chunk_offset, self.lineage, self.sample_id)

    def build(self) -> SampleCursor:
        return SampleCursor(self.chunk_id, self.chunk_offset, self.sample_id, self.lineage)


# Small pools make shared prefixes, equal fields and prefix lineages common; the extremes check
# that comparisons use the whole signed 64-bit range without overflow.
fields = st.one_of(st.integers(0, 3), st.sampled_from([INT64_MAX, INT64_MAX - 1, 2**32, 2**31]))
lineages = st.lists(st.integers(0, 2) | st.just(INT64_MAX), max_size=4).map(tuple)
sample_ids = st.tuples(fields, fields, fields)
ref_cursors = st.builds(RefCursor, fields, fields, sample_ids, lineages)


@st.composite
def related_pairs(draw: st.DrawFn) -> tuple[RefCursor, RefCursor]:
    """Two cursors that differ in one controlled way (often only deep in the sort key)."""
    a = draw(ref_cursors)
    how = draw(st.sampled_from(["same", "child", "prefix", "lineage", "sample", "offset", "any"]))
    if how == "same":
        b = RefCursor(a.chunk_id, a.chunk_offset, a.sample_id, a.lineage)
    elif how == "child":
        b = RefCursor(a.chunk_id, a.chunk_offset, a.sample_id, a.lineage + draw(lineages))
    elif how == "prefix":
        cut = draw(st.integers(0, len(a.lineage)))
        b = RefCursor(a.chunk_id, a.chunk_offset, draw(sample_ids), a.lineage[:cut])
    elif how == "lineage":
        b = RefCursor(a.chunk_id, a.chunk_offset, a.sample_id, draw(lineages))
    elif how == "sample":
        b = RefCursor(a.chunk_id, a.chunk_offset, draw(sample_ids), a.lineage)
    elif how == "offset":
        b = RefCursor(a.chunk_id, draw(fields), a.sample_id, a.lineage)
    else:
        b = draw(ref_cursors)
    return (b, a) if draw(st.booleans()) else (a, b)


COMPARISONS: list[Callable[[Any, Any], bool]] = [
    operator.lt,
    operator.le,
    operator.gt,
    operator.ge,
    operator.eq,
    operator.ne,
]


# --- ordering and equality -------------------------------------------------------------------


@given(related_pairs())
def test_every_comparison_follows_the_sort_key_tuple_order(pair: tuple[RefCursor, RefCursor]):
    a, b = pair
    ca, cb = a.build(), b.build()
    for compare in COMPARISONS:
        assert compare(ca, cb) == compare(a.sort_key, b.sort_key), compare.__name__


@given(related_pairs())
def test_equal_cursors_have_equal_hashes_and_stable_hashes(pair: tuple[RefCursor, RefCursor]):
    a, b = pair
    ca, cb = a.build(), b.build()
    assert (ca == cb) == (a == b)
    if ca == cb:
        assert hash(ca) == hash(cb)
        assert ca.stable_hash == cb.stable_hash


@given(st.lists(ref_cursors, max_size=30))
def test_a_set_of_cursors_deduplicates_exactly_like_the_reference(refs: list[RefCursor]):
    built = {r.build() for r in refs}
    assert {c.sort_key for c in built} == {r.sort_key for r in refs}
    assert len(built) == len(set(refs))


def test_a_lineage_sorts_before_its_extensions_and_after_its_prefixes():
    def c(*lineage: int) -> SampleCursor:
        return SampleCursor(7, 2, (9, 9, 9), lineage)

    assert c() < c(0) < c(0, 0) < c(0, 1) < c(1) < c(1, 0) < c(2)


def test_lineage_sorts_before_sample_id_so_children_of_one_offset_stay_together():
    low_sample_late_child = SampleCursor(7, 2, (0, 0, 0), (1,))
    high_sample_early_child = SampleCursor(7, 2, (5, 5, 5), (0,))
    assert high_sample_early_child < low_sample_late_child


def test_cursors_of_different_sample_ids_are_different_but_share_a_base_offset():
    a = SampleCursor(7, 2, (0, 5, 42))
    b = SampleCursor(7, 2, (0, 5, 43))
    assert a != b
    assert a < b
    assert a.base_offset == b.base_offset


# --- sorting ----------------------------------------------------------------------------------

ref_lists = st.lists(ref_cursors, max_size=40) | st.lists(
    st.sampled_from([RefCursor(0, 0, (0, 0, 0)), RefCursor(0, 0, (0, 0, 0), (0,))]), max_size=10
)


@given(ref_lists)
def test_sorted_and_sort_cursors_equal_the_reference_sort(refs: list[RefCursor]):
    expected = [r.sort_key for r in sorted(refs, key=lambda r: r.sort_key)]
    built = [r.build() for r in refs]
    assert [c.sort_key for c in sorted(built)] == expected
    assert [c.sort_key for c in sort_cursors(built)] == expected


@given(ref_lists)
def test_argsort_cursors_is_the_stable_reference_argsort(refs: list[RefCursor]):
    # Python's sorted is stable, so equal cursors must keep their input order here too.
    expected = sorted(range(len(refs)), key=lambda i: refs[i].sort_key)
    order = argsort_cursors([r.build() for r in refs])
    assert order.dtype == np.int64
    assert order.tolist() == expected


def test_sort_cursors_keeps_equal_cursors_in_input_order():
    equal = [SampleCursor(1, 1, (0, 0, 0)) for _ in range(3)]
    smaller = SampleCursor(0, 9, (0, 0, 0))
    result = sort_cursors([equal[0], equal[1], smaller, equal[2]])
    assert result[0] is smaller
    assert [id(c) for c in result[1:]] == [id(c) for c in equal]


def test_sorting_thousands_of_numpy_made_cursors_matches_the_reference():
    rng = np.random.default_rng(1)
    n = 5000
    refs = [
        RefCursor(
            int(rng.integers(0, 4)),
            int(rng.integers(0, 8)),
            (int(rng.integers(0, 2)), int(rng.integers(0, 2)), int(rng.integers(0, 50))),
            tuple(int(x) for x in rng.integers(0, 3, int(rng.integers(0, 3)))),
        )
        for _ in range(n)
    ]
    built = [r.build() for r in refs]
    expected = sorted(range(n), key=lambda i: refs[i].sort_key)
    assert argsort_cursors(built).tolist() == expected
    assert sort_cursors(built) == [built[i] for i in expected]
    assert sorted(built) == [built[i] for i in expected]


def test_sort_cursors_accepts_any_iterable_and_returns_a_new_list():
    cursors = [SampleCursor(1, 0, (0, 0, 0)), SampleCursor(0, 0, (0, 0, 0))]
    assert sort_cursors(iter(cursors)) == cursors[::-1]
    assert sort_cursors([]) == []
    assert argsort_cursors([]).tolist() == []


def test_sorting_a_list_with_a_non_cursor_raises_type_error_naming_the_item():
    with pytest.raises(TypeError, match="item 1"):
        argsort_cursors([SampleCursor(0, 0, (0, 0, 0)), (0, 0, (0, 0, 0))])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="item 0"):
        sort_cursors([None])  # type: ignore[list-item]


# --- hashing and digests ----------------------------------------------------------------------

PINNED = [
    SampleCursor(0, 0, (0, 0, 0)),
    SampleCursor(7, 2, (0, 5, 42)),
    SampleCursor(7, 2, (0, 5, 42), (1,)),
    SampleCursor(7, 2, (0, 5, 42), (1, 0)),
    SampleCursor(INT64_MAX, INT64_MAX, (INT64_MAX, 0, 1), (0, INT64_MAX)),
]

_HASH_SCRIPT = """
import json
from zephon.types import SampleCursor
rows = json.loads({rows!r})
print(json.dumps([SampleCursor(c, o, tuple(s), tuple(l)).stable_hash for c, o, s, l in rows]))
"""


def test_stable_hash_is_the_same_in_other_processes_whatever_their_hash_seed():
    rows = [[c.chunk_id, c.chunk_offset, list(c.sample_id), list(c.lineage)] for c in PINNED]
    script = _HASH_SCRIPT.format(rows=json.dumps(rows))
    expected = [c.stable_hash for c in PINNED]
    for seed in ("1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
        )
        assert json.loads(out.stdout) == expected


def test_stable_hash_of_a_known_cursor_never_changes():
    # Checkpoints store digests of stable hashes; changing the hash function breaks old checkpoints
    # and needs a checkpoint format version bump, not a silent update of this number.
    assert SampleCursor(7, 2, (0, 5, 42), (1,)).stable_hash == 15723088709189232086


def test_stable_hash_is_an_unsigned_64_bit_int_that_separates_distinct_cursors():
    hashes = [c.stable_hash for c in PINNED]
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in hashes)
    assert len(set(hashes)) == len(hashes)
    # lineage (0,) and sample_idx shifted must not collide with the root
    root = SampleCursor(1, 1, (0, 0, 0))
    family = [root, root.child(0), root.child(0).child(0)]
    assert len({c.stable_hash for c in family}) == 3


@given(st.lists(ref_cursors, max_size=20), st.randoms(use_true_random=False))
def test_digest_is_the_sum_of_stable_hashes_mod_2_64_in_any_order(refs: list[RefCursor], rnd: Any):
    built = [r.build() for r in refs]
    expected = sum(c.stable_hash for c in built) % 2**64
    shuffled = list(built)
    rnd.shuffle(shuffled)
    assert digest_cursors(built) == expected
    assert digest_cursors(iter(shuffled)) == expected


def test_digest_of_nothing_is_zero_and_rejects_non_cursors():
    assert digest_cursors([]) == 0
    with pytest.raises(TypeError):
        digest_cursors([SampleCursor(0, 0, (0, 0, 0)), "not a cursor"])  # type: ignore[list-item]


# --- the rest of the cursor's surface ---------------------------------------------------------


@given(ref_cursors)
def test_pickle_roundtrip_gives_an_equal_cursor_with_the_same_stable_hash(ref: RefCursor):
    c = ref.build()
    back = pickle.loads(pickle.dumps(c, protocol=pickle.HIGHEST_PROTOCOL))
    assert type(back) is SampleCursor
    assert back == c
    assert back.sort_key == c.sort_key
    assert back.stable_hash == c.stable_hash


@given(ref_cursors)
def test_attributes_and_derived_keys_mirror_the_constructor_arguments(ref: RefCursor):
    c = ref.build()
    assert c.chunk_id == ref.chunk_id
    assert c.chunk_offset == ref.chunk_offset
    assert c.sample_id == ref.sample_id and type(c.sample_id) is tuple
    assert c.lineage == ref.lineage and type(c.lineage) is tuple
    assert c.base_offset == (ref.chunk_id, ref.chunk_offset)
    assert c.sort_key == ref.sort_key


@given(ref_cursors, st.integers(0, 5) | st.just(INT64_MAX))
def test_child_appends_its_index_to_the_lineage_and_keeps_everything_else(ref: RefCursor, idx: int):
    parent = ref.build()
    child = parent.child(idx)
    assert child.lineage == (*ref.lineage, idx)
    assert child.sample_id == parent.sample_id
    assert child.base_offset == parent.base_offset
    same = SampleCursor(ref.chunk_id, ref.chunk_offset, ref.sample_id, (*ref.lineage, idx))
    assert child == same
    assert hash(child) == hash(same) and child.stable_hash == same.stable_hash
    assert parent < child
    assert parent.lineage == ref.lineage  # the parent is untouched


def test_child_rejects_a_negative_or_non_integer_index():
    c = SampleCursor(0, 0, (0, 0, 0))
    with pytest.raises(ValueError, match="child_idx"):
        c.child(-1)
    with pytest.raises(TypeError, match="child_idx"):
        c.child(1.0)  # type: ignore[arg-type]


def test_constructor_accepts_lists_and_numpy_integers():
    row = np.array([0, 5, 42], dtype=np.int64)
    c = SampleCursor(np.int64(7), np.int32(2), row, [np.int64(1)])  # type: ignore[arg-type]
    assert c == SampleCursor(7, 2, (0, 5, 42), (1,))
    assert type(c.chunk_id) is int and type(c.sample_id[0]) is int


def test_repr_reads_like_the_constructor_call():
    assert repr(SampleCursor(7, 2, (0, 5, 42), lineage=(1,))) == (
        "SampleCursor(7, 2, (0, 5, 42), lineage=(1,))"
    )
    assert repr(SampleCursor(7, 2, (0, 5, 42))) == "SampleCursor(7, 2, (0, 5, 42))"


@given(ref_cursors)
def test_repr_evaluates_back_to_an_equal_cursor(ref: RefCursor):
    c = ref.build()
    assert eval(repr(c), {"SampleCursor": SampleCursor}) == c


def test_cursor_attributes_cannot_be_assigned():
    c = SampleCursor(7, 2, (0, 5, 42), (1,))
    for name in ("chunk_id", "chunk_offset", "sample_id", "lineage", "base_offset", "stable_hash"):
        with pytest.raises(AttributeError):
            setattr(c, name, 0)
    with pytest.raises(AttributeError):
        c.extra = 1  # type: ignore[attr-defined]
    assert c == SampleCursor(7, 2, (0, 5, 42), (1,))


# --- bad input --------------------------------------------------------------------------------

GOOD: dict[str, Any] = {"chunk_id": 1, "chunk_offset": 2, "sample_id": (0, 5, 42), "lineage": ()}

BAD_INPUT = [
    ("chunk_id", -1, "chunk_id"),
    ("chunk_offset", -5, "chunk_offset"),
    ("chunk_id", 2**63, "chunk_id"),
    ("chunk_offset", 2**64 + 1, "chunk_offset"),
    ("chunk_id", 1.0, "chunk_id"),
    ("chunk_id", "1", "chunk_id"),
    ("chunk_offset", None, "chunk_offset"),
    ("chunk_id", True, "chunk_id"),
    ("sample_id", "abc", "sample_id"),
    ("sample_id", (0, 5), "sample_id"),
    ("sample_id", (0, 5, 42, 1), "sample_id"),
    ("sample_id", 42, "sample_id"),
    ("sample_id", 4.2, "sample_id"),
    ("sample_id", None, "sample_id"),
    ("sample_id", {0, 5, 42}, "sample_id"),
    ("sample_id", (0.0, 5, 42), "sample_id"),
    ("sample_id", ("0", 5, 42), "sample_id"),
    ("sample_id", (0, -5, 42), "sample_id"),
    ("sample_id", (0, 5, None), "sample_id"),
    ("sample_id", (0, 5, 2**63), "sample_id"),
    ("lineage", ("a",), "lineage"),
    ("lineage", (1, 1.5), "lineage"),
    ("lineage", (None,), "lineage"),
    ("lineage", (-1,), "lineage"),
    ("lineage", (2**63,), "lineage"),
    ("lineage", None, "lineage"),
    ("lineage", 3, "lineage"),
    ("lineage", "01", "lineage"),
    ("lineage", {1}, "lineage"),
]


@pytest.mark.parametrize(("field", "value", "named"), BAD_INPUT)
def test_bad_input_raises_an_error_naming_the_field(field: str, value: Any, named: str):
    kwargs = {**GOOD, field: value}
    with pytest.raises((TypeError, ValueError), match=named):
        SampleCursor(**kwargs)


def test_the_largest_int64_values_are_accepted():
    c = SampleCursor(INT64_MAX, INT64_MAX, (INT64_MAX,) * 3, (INT64_MAX,))
    assert c.sort_key == (INT64_MAX, INT64_MAX, (INT64_MAX,), (INT64_MAX,) * 3)


# --- comparing with other types ---------------------------------------------------------------


@pytest.mark.parametrize("other", [None, 3, "c", (7, 2, (), (0, 5, 42)), (7, 2, (0, 5, 42), ())])
def test_a_cursor_never_equals_a_non_cursor(other: object):
    c = SampleCursor(7, 2, (0, 5, 42))
    assert (c == other) is False
    assert (c != other) is True
    assert (other == c) is False


@pytest.mark.parametrize("compare", [operator.lt, operator.le, operator.gt, operator.ge])
def test_ordering_against_a_non_cursor_raises_type_error(compare: Callable[[Any, Any], bool]):
    c = SampleCursor(7, 2, (0, 5, 42))
    for other in (None, 3, (7, 2, (), (0, 5, 42))):
        with pytest.raises(TypeError):
            compare(c, other)
        with pytest.raises(TypeError):
            compare(other, c)


# --- cursors_for_chunk ------------------------------------------------------------------------


@given(
    st.integers(0, INT64_MAX),
    st.lists(st.tuples(fields, fields, fields), max_size=20),
    st.integers(0, 1000) | st.just(INT64_MAX - 20),
)
def test_cursors_for_chunk_makes_one_root_cursor_per_pointer_row(
    chunk_id: int, rows: list[tuple[int, int, int]], first: int
):
    pointers = np.array(rows, dtype=np.int64).reshape(-1, 3)
    cursors = cursors_for_chunk(chunk_id, pointers, first)
    assert cursors == [SampleCursor(chunk_id, first + i, row) for i, row in enumerate(rows)]
    assert all(c.lineage == () for c in cursors)


def test_cursors_for_chunk_starts_at_offset_zero_by_default():
    pointers = np.array([[0, 5, 42], [0, 5, 43]], dtype=np.int64)
    assert [c.base_offset for c in cursors_for_chunk(7, pointers)] == [(7, 0), (7, 1)]


def test_cursors_for_chunk_rejects_bad_pointers_and_offsets():
    good = np.zeros((2, 3), dtype=np.int64)
    with pytest.raises(ValueError, match="row 1"):
        cursors_for_chunk(0, np.array([[0, 0, 0], [0, -1, 0]], dtype=np.int64))
    with pytest.raises(ValueError, match="shape"):
        cursors_for_chunk(0, np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="chunk_id"):
        cursors_for_chunk(-1, good)
    with pytest.raises(ValueError, match="first_offset"):
        cursors_for_chunk(0, good, -1)
    with pytest.raises(ValueError, match="first_offset"):
        cursors_for_chunk(0, good, INT64_MAX)
    with pytest.raises((TypeError, ValueError)):
        cursors_for_chunk(0, good.astype(np.float64))
