"""The compiled record model: ContributorRef, SampleMeta, SampleRecord, SampleBatch."""

from __future__ import annotations

import gc
import pickle
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from zephon._core.cursor import cursors_for_chunk
from zephon._core.records import (
    RecordRun,
    count_closing,
    cursors_of,
    map_payloads,
    records_for_chunk,
)
from zephon._core.records import make_batch as make_batch_unchecked
from zephon.types import ContributorRef, SampleBatch, SampleCursor, SampleMeta, SampleRecord

CURSOR = SampleCursor(7, 2, (0, 5, 42))
OTHER = SampleCursor(7, 3, (0, 5, 43))


def roundtrip(obj: Any) -> Any:
    return pickle.loads(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


# --- ContributorRef ---------------------------------------------------------------------------


def test_contributor_refs_are_equal_when_cursor_and_flag_are_equal():
    assert ContributorRef(CURSOR, True) == ContributorRef(SampleCursor(7, 2, (0, 5, 42)), True)
    assert ContributorRef(CURSOR, True) != ContributorRef(CURSOR, False)
    assert ContributorRef(CURSOR, True) != ContributorRef(OTHER, True)
    assert ContributorRef(CURSOR, True) != CURSOR
    assert (ContributorRef(CURSOR, True) == None) is False  # noqa: E711


def test_equal_contributor_refs_hash_equal_and_deduplicate_in_a_set():
    refs = {
        ContributorRef(CURSOR, True),
        ContributorRef(SampleCursor(7, 2, (0, 5, 42)), 1),  # type: ignore[arg-type]
        ContributorRef(CURSOR, False),
    }
    assert len(refs) == 2
    assert hash(ContributorRef(CURSOR, True)) == hash(ContributorRef(CURSOR, True))


def test_contributor_flag_is_stored_as_a_bool():
    ref = ContributorRef(CURSOR, 1)  # type: ignore[arg-type]
    assert ref.is_last_child is True
    assert ContributorRef(CURSOR, 0).is_last_child is False  # type: ignore[arg-type]


def test_contributor_ref_attributes_cannot_be_assigned():
    ref = ContributorRef(CURSOR, True)
    for name, value in (("cursor", OTHER), ("is_last_child", False), ("base_offset", (0, 0))):
        with pytest.raises(AttributeError):
            setattr(ref, name, value)
    assert ref.cursor == CURSOR and ref.is_last_child is True


def test_contributor_ref_base_offset_is_its_cursors():
    assert ContributorRef(CURSOR.child(3), False).base_offset == (7, 2)


@pytest.mark.parametrize("flag", [True, False])
def test_contributor_ref_survives_pickle(flag: bool):
    ref = ContributorRef(CURSOR.child(1), flag)
    back = roundtrip(ref)
    assert back == ref and back.is_last_child is flag and back.cursor == CURSOR.child(1)


def test_contributor_ref_needs_a_cursor():
    with pytest.raises(TypeError, match="cursor"):
        ContributorRef((7, 2, (0, 5, 42)), True)  # type: ignore[arg-type]


# --- SampleMeta -------------------------------------------------------------------------------


def test_meta_defaults_are_an_implicit_contributor_on_lane_zero():
    meta = SampleMeta(CURSOR)
    assert meta.cursor == CURSOR
    assert meta.lane_id == 0
    assert meta.contributors is None
    assert meta.tags == frozenset()
    assert meta.is_tombstone is False
    assert meta.component is None
    assert meta.component_sample_counts is None
    assert meta.component_token_counts is None


def test_implicit_contributors_mean_the_record_closes_its_own_cursor():
    assert SampleMeta(CURSOR).contribution_refs() == (ContributorRef(CURSOR, True),)


def test_explicit_contributors_are_returned_as_given_in_a_tuple():
    refs = [ContributorRef(CURSOR, False), ContributorRef(OTHER, True)]
    meta = SampleMeta(CURSOR.child(0), contributors=refs)
    assert meta.contributors == tuple(refs)
    assert meta.contribution_refs() == tuple(refs)


def test_explicit_empty_contributors_close_nothing():
    meta = SampleMeta(CURSOR, contributors=())
    assert meta.contributors == ()
    assert meta.contribution_refs() == ()


def test_tags_are_stored_as_a_frozenset():
    meta = SampleMeta(CURSOR, tags=["split", "long"])
    assert meta.tags == frozenset({"split", "long"})
    assert isinstance(meta.tags, frozenset)


def reference_tags(tags: Any) -> frozenset[str]:
    """What ``tags=`` means: None or a collection of str names; a mapping (its values would be
    lost), a lone string (it would become its characters) or a non-str name is a TypeError."""
    if tags is None:
        return frozenset()
    if isinstance(tags, (str, bytes, Mapping)) or not isinstance(tags, Iterable):
        raise TypeError
    out = frozenset(tags)
    if not all(isinstance(t, str) for t in out):
        raise TypeError
    return out


names = st.text(max_size=4)
tag_values = st.one_of(
    st.none(),
    st.lists(names, max_size=3),
    st.frozensets(names, max_size=3),
    st.sets(names, max_size=3).map(tuple),
    st.dictionaries(names, st.integers(), max_size=3),
    names,
    st.binary(max_size=3),
    st.lists(st.one_of(names, st.integers()), max_size=3),
    st.integers(),
)


@given(tag_values)
def test_tags_are_what_the_reference_makes_of_them_or_a_type_error_naming_them(tags: Any):
    try:
        expected = reference_tags(tags)
    except TypeError:
        with pytest.raises(TypeError, match="tags"):
            SampleMeta(CURSOR, tags=tags)
        with pytest.raises(TypeError, match="tags"):
            SampleMeta(CURSOR).replace(tags=tags)
        return
    meta = SampleMeta(CURSOR, tags=tags)
    assert meta.tags == expected and type(meta.tags) is frozenset


@pytest.mark.parametrize(
    ("tags", "said"),
    [({"split": 1}, "mapping"), ({}, "mapping"), ("split", "str"), ([1], "str"), (3, "iterable")],
)
def test_tags_that_would_lose_or_mangle_names_are_refused(tags: Any, said: str):
    with pytest.raises(TypeError, match=f"SampleMeta tags .*{said}"):
        SampleMeta(CURSOR, tags=tags)


META_FIELDS = [
    "cursor",
    "lane_id",
    "contributors",
    "tags",
    "is_tombstone",
    "component",
    "component_sample_counts",
    "component_token_counts",
]


@pytest.mark.parametrize("name", META_FIELDS)
def test_assigning_a_meta_attribute_raises_attribute_error(name: str):
    meta = SampleMeta(CURSOR, lane_id=1)
    before = getattr(meta, name)
    with pytest.raises(AttributeError):
        setattr(meta, name, None)
    assert getattr(meta, name) == before


def test_meta_has_no_instance_dict_to_hide_extra_attributes_in():
    with pytest.raises(AttributeError):
        SampleMeta(CURSOR).note = "x"  # type: ignore[attr-defined]


def full_meta() -> SampleMeta:
    return SampleMeta(
        CURSOR.child(0),
        lane_id=3,
        contributors=(ContributorRef(CURSOR, False), ContributorRef(OTHER, True)),
        tags={"packed"},
        is_tombstone=False,
        component="web",
        component_sample_counts={"web": 2},
        component_token_counts={"web": 100},
    )


def test_replace_returns_a_changed_copy_and_leaves_the_original_alone():
    meta = full_meta()
    changed = meta.replace(lane_id=5, tags={"x"}, cursor=OTHER)
    assert (changed.lane_id, changed.tags, changed.cursor) == (5, frozenset({"x"}), OTHER)
    assert changed.contributors == meta.contributors
    assert changed.component == "web" and changed.component_token_counts == {"web": 100}
    assert (meta.lane_id, meta.tags, meta.cursor) == (3, frozenset({"packed"}), CURSOR.child(0))


def test_replace_with_nothing_gives_an_equal_meta():
    assert full_meta().replace() == full_meta()


def test_replace_rejects_unknown_fields():
    with pytest.raises(TypeError, match="colour"):
        full_meta().replace(colour="red")


def test_replace_validates_like_the_constructor():
    with pytest.raises(ValueError, match="lane_id"):
        full_meta().replace(lane_id=-1)


def test_meta_equality_compares_every_field():
    assert full_meta() == full_meta()
    assert full_meta() != full_meta().replace(component="books")
    assert full_meta() != full_meta().replace(is_tombstone=True)
    assert SampleMeta(CURSOR) != SampleMeta(CURSOR, contributors=(ContributorRef(CURSOR, True),))
    assert SampleMeta(CURSOR) != CURSOR


def test_meta_survives_pickle_with_every_field():
    meta = full_meta()
    back = roundtrip(meta)
    assert back == meta
    assert back.contributors == meta.contributors
    assert back.tags == frozenset({"packed"})
    assert back.component_sample_counts == {"web": 2}


def test_implicit_meta_survives_pickle_still_implicit():
    back = roundtrip(SampleMeta(CURSOR, lane_id=2, component=0))
    assert back.contributors is None and back.lane_id == 2 and back.component == 0


@pytest.mark.parametrize(
    ("kwargs", "error", "named"),
    [
        ({"lane_id": -1}, ValueError, "lane_id"),
        ({"lane_id": 2**63}, ValueError, "lane_id"),
        ({"lane_id": 1.5}, TypeError, "lane_id"),
        ({"lane_id": "0"}, TypeError, "lane_id"),
        ({"contributors": [CURSOR]}, TypeError, "contributors"),
        ({"contributors": [ContributorRef(CURSOR, True), None]}, TypeError, r"contributors\[1\]"),
        ({"contributors": ContributorRef(CURSOR, True)}, TypeError, "contributors"),
    ],
)
def test_bad_meta_fields_raise_errors_naming_them(kwargs: dict[str, Any], error: type, named: str):
    with pytest.raises(error, match=named):
        SampleMeta(CURSOR, **kwargs)


def test_meta_needs_a_cursor_and_keyword_fields():
    with pytest.raises(TypeError, match="cursor"):
        SampleMeta((7, 2, (0, 5, 42)))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        SampleMeta(CURSOR, 1)  # type: ignore[call-arg]


# --- SampleRecord and SampleBatch -------------------------------------------------------------


def test_record_delegates_cursor_tombstone_flag_and_contributors_to_its_meta():
    meta = full_meta()
    record = SampleRecord(meta, {"text": "hi"})
    assert record.meta is meta
    assert record.cursor == meta.cursor
    assert record.is_tombstone is False
    assert record.contribution_refs() == meta.contribution_refs()
    assert SampleRecord(SampleMeta(CURSOR), None).contribution_refs() == (
        ContributorRef(CURSOR, True),
    )


def test_a_tombstone_record_has_no_payload_and_says_so():
    ref = ContributorRef(CURSOR, True)
    tomb = SampleRecord(SampleMeta(CURSOR, contributors=(ref,), is_tombstone=True), None)
    assert tomb.is_tombstone is True
    assert tomb.payload is None
    assert tomb.contribution_refs() == (ref,)


def test_with_payload_keeps_the_identity():
    record = SampleRecord(full_meta(), {"a": 1})
    other = record.with_payload({"b": 2})
    assert other.meta is record.meta and other.payload == {"b": 2}
    assert record.payload == {"a": 1}


def test_record_attributes_cannot_be_assigned():
    record = SampleRecord(SampleMeta(CURSOR), 1)
    for name in ("meta", "payload", "cursor", "is_tombstone"):
        with pytest.raises(AttributeError):
            setattr(record, name, None)


def test_record_needs_a_meta():
    with pytest.raises(TypeError, match="meta"):
        SampleRecord(CURSOR, {})  # type: ignore[arg-type]


def test_record_survives_pickle_with_an_array_payload():
    record = SampleRecord(full_meta(), {"tokens": np.arange(5, dtype=np.int32), "text": "x"})
    back = roundtrip(record)
    assert back.meta == record.meta
    assert back.payload["text"] == "x"
    np.testing.assert_array_equal(back.payload["tokens"], record.payload["tokens"])
    assert back.payload["tokens"].dtype == np.int32


FLAT_PAYLOADS = [{"a": 1, "text": "x", "tokens": np.arange(3)}, {}, "text", 7, None]
NESTED_PAYLOADS = [{"a": [1]}, {"a": {"b": 1}}, [1, 2], (1, [2])]


@pytest.mark.parametrize("payload", FLAT_PAYLOADS + NESTED_PAYLOADS, ids=repr)
def test_a_record_is_cycle_collected_as_its_payload_is(payload: Any):
    # A dict of strings, numbers and arrays is left to reference counting by CPython; so is a
    # record holding one, however it is made (its meta is left out already).
    expected = gc.is_tracked(payload)
    assert expected == (payload in NESTED_PAYLOADS)
    for record in (
        SampleRecord(full_meta(), payload),
        SampleRecord(full_meta(), {}).with_payload(payload),
        RecordRun(1, [[0, 0, 0]], [payload], 0, None)[0],
    ):
        assert gc.is_tracked(record) is expected


def test_a_record_made_from_the_freelist_is_tracked_again_when_its_payload_is():
    for _ in range(3):  # records freed untracked go back to the freelist and come out of it
        flat = [SampleRecord(full_meta(), {"i": i}) for i in range(2000)]
        assert not any(gc.is_tracked(r) for r in flat)
        del flat
        nested = [SampleRecord(full_meta(), {"i": [i]}) for i in range(2000)]
        assert all(gc.is_tracked(r) for r in nested)
        del nested


def test_a_cycle_through_a_record_whose_payload_is_tracked_is_collected():
    freed = []

    class Witness:
        def __del__(self) -> None:
            freed.append(True)

    loop: list[Any] = [Witness()]
    record = SampleRecord(full_meta(), {"loop": loop})
    loop.append(record)  # record -> payload -> loop -> record
    del loop, record
    gc.collect()
    assert freed == [True]


def make_batch() -> SampleBatch:
    records = [SampleRecord(SampleMeta(SampleCursor(1, i, (0, 0, i))), {"i": i}) for i in range(3)]
    return SampleBatch(iter(records), {"i": [0, 1, 2]})


def test_batch_holds_a_tuple_of_records_each_with_its_own_cursor():
    batch = make_batch()
    assert isinstance(batch.records, tuple)
    assert len(batch) == 3
    assert [r.cursor.chunk_offset for r in batch] == [0, 1, 2]
    assert batch[2].payload == {"i": 2}
    assert batch.payload == {"i": [0, 1, 2]}


def test_an_empty_batch_has_length_zero():
    batch = SampleBatch([], None)
    assert len(batch) == 0 and list(batch) == []


def test_batch_rejects_non_records_naming_the_position():
    with pytest.raises(TypeError, match=r"records\[1\]"):
        SampleBatch([SampleRecord(SampleMeta(CURSOR), 1), SampleMeta(CURSOR)], None)  # type: ignore[list-item]


def test_batch_attributes_cannot_be_assigned():
    batch = make_batch()
    for name in ("records", "payload"):
        with pytest.raises(AttributeError):
            setattr(batch, name, None)


def test_batch_survives_pickle():
    batch = make_batch()
    back = roundtrip(batch)
    assert len(back) == 3
    assert [r.meta for r in back] == [r.meta for r in batch]
    assert [r.payload for r in back] == [r.payload for r in batch]
    assert back.payload == batch.payload


# --- records_for_chunk ------------------------------------------------------------------------


def test_records_for_chunk_builds_root_records_for_a_chunk():
    pointers = np.array([[0, 5, 42], [1, 0, 7], [0, 5, 43]], dtype=np.int64)
    payloads = [{"i": 0}, {"i": 1}, {"i": 2}]
    records = records_for_chunk(7, pointers, payloads, 2, ["web", "books", "web"], 10)
    assert [r.cursor for r in records] == cursors_for_chunk(7, pointers, 10)
    assert [r.cursor.base_offset for r in records] == [(7, 10), (7, 11), (7, 12)]
    assert [r.meta.component for r in records] == ["web", "books", "web"]
    assert [r.payload for r in records] == payloads
    for r in records:
        assert r.meta.lane_id == 2
        assert r.meta.contributors is None and r.meta.tags == frozenset()
        assert r.is_tombstone is False
        assert r.contribution_refs() == (ContributorRef(r.cursor, True),)


def test_records_for_chunk_of_an_empty_chunk_is_empty():
    assert records_for_chunk(0, np.zeros((0, 3), dtype=np.int64), [], 0, []) == []


@pytest.mark.parametrize(("payloads", "components"), [([1], [None, None]), ([1, 2, 3], [0, 0])])
def test_records_for_chunk_rejects_lists_of_the_wrong_length(
    payloads: list[Any], components: list[Any]
):
    with pytest.raises(ValueError, match="2 pointers"):
        records_for_chunk(0, np.zeros((2, 3), dtype=np.int64), payloads, 0, components)


def test_records_for_chunk_rejects_negative_numbers():
    pointers = np.zeros((1, 3), dtype=np.int64)
    for args in ((-1, 0, 0), (0, -1, 0), (0, 0, -1)):
        chunk_id, lane, first = args
        with pytest.raises(ValueError):
            records_for_chunk(chunk_id, pointers, [None], lane, [None], first)
    with pytest.raises(ValueError, match="row 0"):
        records_for_chunk(0, np.array([[0, -1, 0]], dtype=np.int64), [None], 0, [None])
    with pytest.raises(ValueError, match="shape"):
        records_for_chunk(0, np.zeros((1, 2), dtype=np.int64), [None], 0, [None])


# --- count_closing ----------------------------------------------------------------------------

cursors = st.builds(
    SampleCursor,
    st.integers(0, 3),
    st.integers(0, 3),
    st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(0, 2)),
    st.lists(st.integers(0, 2), max_size=2).map(tuple),
)
refs = st.builds(ContributorRef, cursors, st.booleans())
metas = st.builds(
    SampleMeta,
    cursors,
    contributors=st.none() | st.lists(refs, max_size=4),
    is_tombstone=st.booleans(),
)
records = st.builds(SampleRecord, metas, st.none() | st.integers())


@given(st.lists(records, max_size=20))
def test_count_closing_counts_every_closing_contributor_like_the_reference(
    batch: list[SampleRecord],
):
    expected = sum(ref.is_last_child for r in batch for ref in r.contribution_refs())
    assert count_closing(batch) == expected
    assert count_closing(iter(batch)) == expected


def test_count_closing_rejects_things_that_are_not_records():
    with pytest.raises(TypeError):
        count_closing([SampleMeta(CURSOR)])  # type: ignore[list-item]


# --- map_payloads and make_batch (the hot paths of map_transform and delivery) ----------------


def _roots(n: int) -> list[SampleRecord]:
    pointers = np.array([[0, 0, i] for i in range(n)], dtype=np.int64)
    return records_for_chunk(3, pointers, [{"idx": i} for i in range(n)], 0, [0] * n)


def test_map_payloads_keeps_each_meta_and_replaces_the_payload():
    records = _roots(5)
    out: list[SampleRecord] = []
    assert map_payloads(lambda p: {"y": p["idx"] * 2}, records, 0, out) == (5, None)
    assert [r.payload for r in out] == [{"y": 2 * i} for i in range(5)]
    assert all(new.meta is old.meta for new, old in zip(out, records))


def test_map_payloads_stops_at_the_first_none_and_resumes_after_it():
    records = _roots(6)
    out: list[SampleRecord] = []
    fn = lambda p: None if p["idx"] % 3 == 1 else p  # noqa: E731
    assert map_payloads(fn, records, 0, out) == (1, None)
    assert map_payloads(fn, records, 2, out) == (4, None)
    assert [r.payload["idx"] for r in out] == [0, 2, 3]


def test_map_payloads_returns_the_exception_and_the_index_of_the_failing_record():
    records = _roots(4)
    out: list[SampleRecord] = []

    def fn(payload: dict) -> dict:
        if payload["idx"] == 2:
            raise KeyError("boom")
        return payload

    i, exc = map_payloads(fn, records, 0, out)
    assert i == 2
    assert isinstance(exc, KeyError)
    assert exc.__traceback__ is not None  # the caller chains it, with fn's frames
    assert len(out) == 2


def test_make_batch_is_a_sample_batch_of_the_records():
    records = _roots(3)
    batch = make_batch_unchecked(records, {"idx": [0, 1, 2]})
    assert type(batch) is SampleBatch
    assert batch.records == tuple(records)
    assert batch.payload == {"idx": [0, 1, 2]}


@pytest.mark.parametrize("lineage", [(), (2, 0)])
def test_a_pickled_record_comes_back_equal_whether_or_not_its_cursor_has_a_lineage(lineage):
    cursor = SampleCursor(7, 2, (0, 5, 42), lineage)
    meta = SampleMeta(
        cursor,
        lane_id=3,
        contributors=[ContributorRef(cursor, True), ContributorRef(OTHER, False)],
        tags={"split"},
        component="web",
        component_sample_counts={"web": 2},
        component_token_counts={"web": 17},
    )
    for original in (SampleRecord(meta, {"x": np.arange(3)}), SampleRecord(meta.replace(), None)):
        back = roundtrip(original)
        assert back.meta == original.meta
        assert back.meta.cursor.stable_hash == cursor.stable_hash
        assert repr(back.payload) == repr(original.payload)


@given(st.lists(st.integers(0, 5), max_size=12))
def test_cursors_of_is_the_cursor_of_each_record(offsets: list[int]) -> None:
    records = [
        SampleRecord(SampleMeta(SampleCursor(1, off, (0, 0, off))), {"i": off}) for off in offsets
    ]
    got = cursors_of(records)
    assert got == [r.meta.cursor for r in records]
    assert all(a is r.meta.cursor for a, r in zip(got, records))


def test_cursors_of_refuses_what_is_not_a_record() -> None:
    with pytest.raises(TypeError):
        cursors_of([object()])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        cursors_of((1, 2))  # type: ignore[arg-type]
