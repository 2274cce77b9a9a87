"""Specification of the in-memory sources (RangeSource, ListSource) and of IndexedSource."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import zephon
from zephon.errors import FetchError, PlanError
from zephon.ops import fetch
from zephon.sources import IndexedSource, ListSource, MixtureSource, RangeSource, WorkSource
from zephon.types import WorkChunk


def chunks_by_pass(src: IndexedSource) -> list[list[WorkChunk]]:
    total = src.total_chunks()
    assert total is not None
    per_pass = src.num_chunks()
    chunks = [src.chunk(p) for p in range(total)]
    return [chunks[q * per_pass : (q + 1) * per_pass] for q in range(total // max(per_pass, 1))]


def pass_order(chunks: list[WorkChunk]) -> list[int]:
    return [int(i) for c in chunks for i in c.pointers[:, 2]]


@given(
    n=st.integers(0, 300),
    chunk_size=st.integers(1, 40),
    shuffle=st.booleans(),
    seed=st.integers(-(2**40), 2**40),
    passes=st.integers(1, 3),
)
def test_every_pass_holds_every_sample_exactly_once(n, chunk_size, shuffle, seed, passes):
    src = RangeSource(n, chunk_size=chunk_size, shuffle=shuffle, seed=seed, passes=passes)
    assert src.num_chunks() == -(-n // chunk_size)
    assert src.total_chunks() == src.num_chunks() * passes
    by_pass = chunks_by_pass(src)
    assert len(by_pass) == (passes if n else 0)
    for chunks in by_pass:
        assert sorted(pass_order(chunks)) == list(range(n))
        assert all(1 <= len(c) <= chunk_size for c in chunks)
        assert sorted(len(c) for c in chunks) == sorted(
            min(chunk_size, n - k * chunk_size) for k in range(len(chunks))
        )


def test_chunk_positions_run_across_passes_and_are_recorded_in_the_chunk():
    src = RangeSource(10, chunk_size=4, passes=2)
    chunks = [src.chunk(p) for p in range(6)]
    assert [c.position for c in chunks] == list(range(6))
    assert [c.pointers[:, 2].tolist() for c in chunks] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9],
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9],
    ]
    assert (chunks[0].pointers[:, :2] == 0).all()


def test_chunk_is_deterministic_and_independent_of_call_order():
    def make() -> RangeSource:
        return RangeSource(1000, chunk_size=64, shuffle=True, seed=11, passes=3)

    forward = [make().chunk(p) for p in range(48)]
    fresh = make()
    backward = {p: fresh.chunk(p) for p in reversed(range(48))}
    assert all(forward[p] == backward[p] for p in range(48))
    assert all(forward[p] == fresh.chunk(p) for p in (47, 0, 23, 0))


def test_shuffled_passes_are_reordered_and_unshuffled_passes_repeat():
    shuffled = chunks_by_pass(RangeSource(200, chunk_size=16, shuffle=True, seed=3, passes=3))
    orders = [pass_order(chunks) for chunks in shuffled]
    assert len({tuple(o) for o in orders}) == 3
    assert orders[0] != list(range(200))
    # Not only the chunk order: which samples share a chunk changes from pass to pass too.
    groups = [{frozenset(c.pointers[:, 2].tolist()) for c in chunks} for chunks in shuffled]
    assert groups[0] != groups[1] and groups[1] != groups[2]
    plain = chunks_by_pass(RangeSource(200, chunk_size=16, passes=3))
    assert all(pass_order(chunks) == list(range(200)) for chunks in plain)


def test_shuffle_reorders_samples_across_the_whole_pass_not_only_within_chunks():
    first = RangeSource(1000, chunk_size=100, shuffle=True, seed=1).chunk(0)
    assert first.pointers[:, 2].max() - first.pointers[:, 2].min() > 500


def test_seed_changes_the_order():
    a = pass_order(chunks_by_pass(RangeSource(100, chunk_size=8, shuffle=True, seed=1))[0])
    b = pass_order(chunks_by_pass(RangeSource(100, chunk_size=8, shuffle=True, seed=2))[0])
    assert a != b and sorted(a) == sorted(b)


def test_unbounded_passes_reach_any_position():
    src = RangeSource(10, chunk_size=3, shuffle=True, passes=None)
    assert src.num_chunks() == 4
    assert src.total_chunks() is None
    far = 10**15 + 2
    chunk = src.chunk(far)
    assert chunk.position == far
    assert chunk == RangeSource(10, chunk_size=3, shuffle=True, passes=None).chunk(far)
    first = (far // 4) * 4
    whole = [int(i) for p in range(first, first + 4) for i in src.chunk(p).pointers[:, 2]]
    assert sorted(whole) == list(range(10))


@pytest.mark.parametrize("shuffle", [False, True])
def test_each_chunk_is_a_chunk_size_block_of_its_pass_order(shuffle):
    src = RangeSource(23, chunk_size=5, shuffle=shuffle, seed=8, passes=2)
    for pass_idx in range(2):
        order = src.samples(pass_idx, 0, 23).tolist()
        assert sorted(order) == list(range(23))
        assert src.samples(pass_idx, 7, 12).tolist() == order[7:12]
        blocks = []
        for c in range(5):
            rows = src.chunk(pass_idx * 5 + c).pointers[:, 2].tolist()
            k = order.index(rows[0]) // 5
            assert rows == order[k * 5 : k * 5 + 5]
            blocks.append(k)
        assert sorted(blocks) == list(range(5))
        assert (blocks != list(range(5))) == shuffle


def test_positions_past_the_end_raise_index_error_and_negative_ones_value_error():
    src = RangeSource(10, chunk_size=4, passes=2)
    assert src.chunk(5).position == 5
    with pytest.raises(IndexError, match="past the end"):
        src.chunk(6)
    with pytest.raises(ValueError, match=">= 0"):
        src.chunk(-1)
    with pytest.raises(IndexError):
        RangeSource(0).chunk(0)
    with pytest.raises(IndexError, match="pass 2"):
        src.samples(2, 0, 1)


def test_an_empty_source_has_no_chunks_even_when_unbounded():
    assert RangeSource(0).total_chunks() == 0
    assert RangeSource(0, passes=None).total_chunks() == 0
    assert ListSource([], passes=None).num_chunks() == 0


def test_range_source_reads_make_of_idx_or_an_idx_dict_in_row_order():
    rows = np.array([[4, 0, 3], [4, 0, 0], [4, 0, 3]], dtype=np.int64)
    assert RangeSource(5, dataset_id=4).read(rows) == [{"idx": 3}, {"idx": 0}, {"idx": 3}]
    assert RangeSource(5, dataset_id=4, make=lambda i: i * 10).read(rows) == [30, 0, 30]
    assert RangeSource(5).read(np.zeros((0, 3), dtype=np.int64)) == []


def test_list_source_reads_items_of_the_chunk_pointers():
    items = [f"item-{i}" for i in range(50)]
    src = ListSource(items, dataset_id=2, chunk_size=8, shuffle=True, seed=5)
    for p in range(src.num_chunks()):
        chunk = src.chunk(p)
        assert (chunk.pointers[:, 0] == 2).all()
        assert src.read(chunk.pointers) == [items[i] for i in chunk.pointers[:, 2]]
    assert src.components(src.chunk(0).pointers) == [2] * 8


def test_reading_a_pointer_the_source_never_produced_is_a_fetch_error():
    src = ListSource(["a", "b"], dataset_id=1)
    with pytest.raises(FetchError, match=r"\(1, 0, 2\)"):
        src.read(np.array([[1, 0, 0], [1, 0, 2]]))
    with pytest.raises(FetchError, match="dataset_id 1"):
        src.read(np.array([[0, 0, 0]]))
    with pytest.raises(ValueError, match="shape"):
        src.read(np.array([1, 0, 0]))


def test_a_list_that_shrank_after_the_source_was_made_is_an_index_error_not_a_bad_read():
    items = ["a", "b", "c"]
    src = ListSource(items)
    del items[1:]  # the source holds the list by reference
    with pytest.raises(IndexError, match="3 samples, but the list holds 1"):
        src.read(np.array([[0, 0, 0]]))


def test_list_source_accepts_any_sized_indexable_and_materializes_iterators():
    assert ListSource(np.arange(5) * 2).read(np.array([[0, 0, 4]])) == [8]
    assert ListSource(x for x in "abc").read(np.array([[0, 0, 2]])) == ["c"]


def _describes(**changes):
    base = dict(dataset_id=0, chunk_size=8, shuffle=False, seed=0, passes=1)
    return RangeSource(10, **{**base, **changes}).describe()


def test_describe_is_json_and_differs_by_every_parameter():
    variants = [
        _describes(),
        _describes(dataset_id=1),
        _describes(chunk_size=9),
        _describes(shuffle=True),
        _describes(seed=1),
        _describes(passes=2),
        _describes(passes=None),
        RangeSource(11, chunk_size=8).describe(),
        RangeSource(10, chunk_size=8, make=str).describe(),
        ListSource(list(range(10)), chunk_size=8).describe(),
    ]
    assert len({json.dumps(v, sort_keys=True) for v in variants}) == len(variants)
    assert _describes() == _describes()


def test_list_fingerprint_tracks_length_and_the_items_at_both_ends():
    items = list(range(100))
    same = ListSource(list(items)).describe()
    assert ListSource(items).describe() == same
    assert same["len"] == 100
    for changed in (items[:-1], [*items[:99], -1], [-1, *items[1:]], [*items[:5], -1, *items[6:]]):
        assert ListSource(changed).describe()["fingerprint"] != same["fingerprint"]


def test_list_items_are_identified_by_the_parameter_rule():
    def fp(items):
        return ListSource(items).describe()["fingerprint"]

    arrays = [np.zeros(4), np.ones(4)]
    assert fp(arrays) == fp([a.copy() for a in arrays])
    changed = [np.zeros(4), np.array([1.0, 1.0, 2.0, 1.0])]
    assert fp(arrays) != fp(changed)
    assert fp([lambda: 1]) != fp([lambda: 2])  # callables by their code, as operator parameters


def test_a_list_item_with_hidden_state_is_refused_naming_its_index():
    with pytest.raises(PlanError, match=r"source ListSource item 1 .*describe\(\)"):
        ListSource([{"a": 1}, threading.Lock()])


def test_range_source_make_is_identified_by_code_and_refused_when_it_cannot_be():
    def describe(make):
        return RangeSource(5, make=make).describe()

    assert describe(lambda i: i) == describe(lambda i: i)
    assert describe(lambda i: i) != describe(lambda i: -i)
    rng = np.random.default_rng(0)
    with pytest.raises(PlanError, match=r"source RangeSource parameter 'make'.*rng"):
        RangeSource(5, make=lambda i: rng.random()).describe()


def test_sources_never_import_operators_runtime_or_planner():
    # Data flows sources -> ops -> runtime: a source must not reach up to the layers above it.
    package = Path(zephon.__file__).parent / "sources"
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                assert not name.startswith(("zephon.ops", "zephon.runtime", "zephon.planner")), (
                    f"{path.name} imports {name}"
                )


def test_describe_and_chunks_are_equal_across_processes():
    # Different PYTHONHASHSEEDs and fresh interpreters: nothing may hinge on hash() or addresses.
    script = textwrap.dedent(
        """
        import json
        from zephon.sources import ListSource, RangeSource
        items = [{"k": i, "s": {"a", "b", str(i)}} for i in range(30)] + [object()]
        src = ListSource(items, chunk_size=4, shuffle=True, seed=9, passes=2)
        rng = RangeSource(50, chunk_size=8, shuffle=True, seed=-4, passes=None)
        print(json.dumps([src.describe(), rng.describe(),
                          src.chunk(13).pointers.tolist(), rng.chunk(10**9).pointers.tolist()]))
        """
    )
    outputs = set()
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        done = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
        )
        outputs.add(done.stdout)
    assert len(outputs) == 1


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"chunk_size": 0}, ValueError, "chunk_size must be >= 1"),
        ({"passes": 0}, ValueError, "passes must be >= 1"),
        ({"dataset_id": -1}, ValueError, "dataset_id must be >= 0"),
        ({"chunk_size": 2.5}, TypeError, "chunk_size must be an int"),
        ({"shuffle": 1}, TypeError, "shuffle must be a bool"),
        ({"seed": "x"}, TypeError, "seed must be an int"),
        ({"passes": True}, TypeError, "passes must be an int"),
    ],
)
def test_bad_constructor_arguments_are_refused_with_the_parameter_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        RangeSource(10, **kwargs)
    with pytest.raises(error, match=match):
        ListSource([1, 2, 3], **kwargs)


def test_bad_sizes_and_make_are_refused():
    with pytest.raises(ValueError, match="n must be >= 0"):
        RangeSource(-1)
    with pytest.raises(TypeError, match="n must be an int"):
        RangeSource(3.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="make must be callable"):
        RangeSource(3, make=5)  # type: ignore[arg-type]


def test_a_work_source_must_implement_the_protocol():
    with pytest.raises(TypeError):
        WorkSource()  # type: ignore[abstract]

    class Tiny(IndexedSource):
        def num_samples(self) -> int:
            return 3

        def read(self, pointers):
            return list(pointers[:, 2])

        def describe(self):
            return {"class": "Tiny"}

    tiny = Tiny(chunk_size=2, dataset_id=7)
    assert tiny.total_chunks() == 2
    assert tiny.chunk(1).pointers.tolist() == [[7, 0, 2]]


@pytest.mark.parametrize("failures", [0, 1, 2, 3, 4])
def test_fetch_tries_a_read_that_raises_os_error_retries_plus_one_times(failures):
    source = RangeSource(4, chunk_size=4)
    calls = []

    def reader(pointers):
        calls.append(len(pointers))
        if len(calls) <= failures:
            raise OSError(f"transient {len(calls)}")
        return source.read(pointers)

    pipeline = zephon.Pipeline(source, [fetch(reader, retries=3)])
    if failures <= 3:
        assert [r.payload["idx"] for r in pipeline] == [0, 1, 2, 3]
        assert calls == [4] * (failures + 1)
    else:
        with pytest.raises(FetchError, match=r"after 4 attempts: transient 4"):
            list(pipeline)
        assert calls == [4] * 4


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize(("n", "chunk_size"), [(95, 10), (100, 10), (7, 3), (5, 8)])
def test_chunk_lengths_are_the_chunks_lengths_without_reading_them(n, chunk_size, shuffle):
    source = RangeSource(n, chunk_size=chunk_size, shuffle=shuffle, seed=5, passes=3)
    total = source.total_chunks()
    assert total is not None
    positions = np.arange(total, dtype=np.int64)[::-1]
    expected = [len(source.chunk(int(p)).pointers) for p in positions]
    assert source.chunk_lengths(positions).tolist() == expected
    mixed = MixtureSource(
        {"a": source, "b": RangeSource(30, dataset_id=1)}, {"a": 0.5, "b": 0.5}, chunk_size=16
    )
    mixed_total = mixed.total_chunks()
    assert mixed_total is not None
    every = np.arange(mixed_total, dtype=np.int64)
    lengths = [len(mixed.chunk(int(p)).pointers) for p in every]
    assert mixed.chunk_lengths(every).tolist() == lengths  # the default builds each chunk
