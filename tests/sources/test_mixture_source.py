"""Specification of MixtureSource: sample-level interleave by weight, random access, clean end."""

from __future__ import annotations

import json
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from zephon.errors import FetchError
from zephon.sources import IndexedSource, ListSource, MixtureSource, RangeSource


def stream(src: IndexedSource, length: int) -> np.ndarray:
    """The first ``length`` pointer rows of a component's stream: its passes concatenated."""
    n = src.num_samples()
    rows: list[np.ndarray] = []
    q = 0
    while sum(len(r) for r in rows) < length:
        rows.append(src.pointer_rows(src.samples(q, 0, n)))
        q += 1
    return np.concatenate(rows)[:length] if rows else np.zeros((0, 3), dtype=np.int64)


def stream_slice(src: IndexedSource, start: int, count: int) -> np.ndarray:
    """Stream positions ``[start, start + count)`` of a component, one sample at a time."""
    n = src.num_samples()
    picked = [src.samples(j // n, j % n, j % n + 1) for j in range(start, start + count)]
    return src.pointer_rows(np.concatenate(picked))


def all_rows(mix: MixtureSource) -> np.ndarray:
    total = mix.num_chunks()
    assert total is not None
    chunks = [mix.chunk(p) for p in range(total)]
    return np.concatenate([c.pointers for c in chunks]) if chunks else np.zeros((0, 3), np.int64)


def available(src: IndexedSource) -> float:
    return float("inf") if src.passes is None else src.num_samples() * src.passes


@st.composite
def mixtures(draw):
    """Small mixtures of 1-4 RangeSources, some shuffled, multi-pass or endless, with at least one
    weighted component finite (so the mixture ends)."""
    k = draw(st.integers(1, 4))
    weights = draw(st.lists(st.integers(0, 9), min_size=k, max_size=k))
    passes = draw(st.lists(st.sampled_from([1, 1, 2, None]), min_size=k, max_size=k))
    assume(any(w and p for w, p in zip(weights, passes, strict=True)))
    chunk_size = draw(st.integers(1, 40))
    assume(all(w == 0 or w * chunk_size >= sum(weights) for w in weights))
    comps = {
        f"c{i}": RangeSource(
            draw(st.integers(1, 60)),
            dataset_id=10 + i,
            shuffle=draw(st.booleans()),
            seed=i,
            passes=passes[i],
            chunk_size=7,
        )
        for i in range(k)
    }
    ws = {f"c{i}": float(w) for i, w in enumerate(weights)}
    return MixtureSource(comps, ws, seed=draw(st.integers(0, 5)), chunk_size=chunk_size)


@given(mix=mixtures())
def test_each_whole_chunk_prefix_holds_each_component_within_one_sample_of_its_weight(mix):
    rows = all_rows(mix)
    desc = mix.describe()
    total_w = sum(Fraction(w) for w in desc["weights"].values())
    ids = {desc["components"][n]["dataset_id"]: n for n in mix.names}
    cs = mix.chunk_size
    for k in range(len(rows) // cs + 1):
        prefix = rows[: k * cs, 0].tolist()
        for did, name in ids.items():
            exact = Fraction(desc["weights"][name]) / total_w * k * cs
            assert abs(prefix.count(did) - exact) < 1, (name, k)


@given(mix=mixtures())
def test_each_component_appears_in_its_own_stream_order_without_reading_past_its_end(mix):
    rows = all_rows(mix)
    assert len(rows) == mix.total_samples()
    for src in mix._sources:
        mine = rows[rows[:, 0] == src.dataset_id]
        assert len(mine) <= available(src)
        assert np.array_equal(mine, stream(src, len(mine)))


@given(mix=mixtures())
def test_the_mixture_ends_exactly_when_the_first_weighted_component_runs_out(mix):
    rows = all_rows(mix)
    # The same mixture with endless components has the same layout: it must agree on the prefix,
    # and its next sample must belong to a weighted component that the finite mixture used up.
    endless = MixtureSource(
        {
            n: RangeSource(
                s.num_samples(),
                dataset_id=s.dataset_id,
                shuffle=s.shuffle,
                seed=s.seed,
                passes=None,
            )
            for n, s in zip(mix.names, mix._sources, strict=True)
        },
        mix.describe()["weights"],
        seed=mix.seed,
        chunk_size=mix.chunk_size,
    )
    assert endless.num_chunks() is None
    total = len(rows)
    cs = mix.chunk_size
    longer = np.concatenate([endless.chunk(p).pointers for p in range(total // cs + 1)])
    assert np.array_equal(longer[:total], rows)
    next_id = int(longer[total, 0])
    src = next(s for s in mix._sources if s.dataset_id == next_id)
    assert int((rows[:, 0] == next_id).sum()) == available(src)


@given(mix=mixtures(), data=st.data())
def test_random_access_equals_sequential_reading(mix, data):
    total = mix.num_chunks()
    assert total is not None
    assume(total > 0)
    sequential = [mix.chunk(p) for p in range(total)]
    again = MixtureSource(
        dict(zip(mix.names, mix._sources, strict=True)),
        mix.describe()["weights"],
        seed=mix.seed,
        chunk_size=mix.chunk_size,
    )
    for p in data.draw(st.lists(st.integers(0, total - 1), max_size=10)):
        assert again.chunk(p) == sequential[p]
        assert again.chunk(p).position == p
    assert all(len(c) == mix.chunk_size for c in sequential[:-1])
    assert 1 <= len(sequential[-1]) <= mix.chunk_size


@given(mix=mixtures(), data=st.data())
def test_component_counts_equal_counting_the_chunks(mix, data):
    total = mix.total_samples()
    assert total is not None
    rows = all_rows(mix)
    slots = data.draw(st.integers(0, total))
    counts = mix.component_counts(slots)
    ids = {n: s.dataset_id for n, s in zip(mix.names, mix._sources, strict=True)}
    assert counts == {n: int((rows[:slots, 0] == ids[n]).sum()) for n in mix.names}


def test_zero_weight_components_never_appear():
    mix = MixtureSource(
        {
            "a": RangeSource(100, dataset_id=0),
            "b": RangeSource(100, dataset_id=1),
            "z": RangeSource(5, dataset_id=2),
        },
        {"a": 1, "b": 3, "z": 0},
        chunk_size=16,
    )
    rows = all_rows(mix)
    assert 2 not in rows[:, 0]
    assert mix.total_samples() == len(rows) > 5  # the tiny zero-weight component does not end it


def test_unbounded_components_make_an_unbounded_mixture_with_far_random_access():
    mix = MixtureSource(
        {
            "a": RangeSource(7, passes=None),
            "b": RangeSource(3, dataset_id=1, passes=None, shuffle=True),
        },
        {"a": 2.0, "b": 1.0},
        chunk_size=30,
    )
    assert mix.num_chunks() is None and mix.total_chunks() is None
    assert mix.total_samples() is None
    far = 10**12
    chunk = mix.chunk(far)
    assert chunk.position == far and len(chunk) == 30
    counts = mix.component_counts((far + 1) * 30)
    assert counts == {"a": (far + 1) * 20, "b": (far + 1) * 10}
    b_rows = chunk.pointers[chunk.pointers[:, 0] == 1]
    assert np.array_equal(b_rows, stream_slice(mix._sources[1], far * 10, 10))


def test_a_short_component_crosses_several_passes_within_one_chunk():
    small = RangeSource(3, dataset_id=1, shuffle=True, seed=4, passes=None)
    mix = MixtureSource(
        {"big": RangeSource(1000), "small": small}, {"big": 1, "small": 1}, chunk_size=40
    )
    rows = mix.chunk(0).pointers
    mine = rows[rows[:, 0] == 1]
    assert len(mine) == 20
    assert np.array_equal(mine, stream(small, 20))


def test_read_returns_each_component_payload_in_row_order():
    letters = ListSource([f"L{i}" for i in range(40)], dataset_id=3, shuffle=True)
    numbers = RangeSource(40, dataset_id=5, make=lambda i: i * 100)
    mix = MixtureSource(
        {"letters": letters, "numbers": numbers}, {"letters": 1, "numbers": 2}, chunk_size=9
    )
    for p in range(mix.num_chunks() or 0):
        rows = mix.chunk(p).pointers
        expected = [f"L{r[2]}" if r[0] == 3 else r[2] * 100 for r in rows.tolist()]
        assert mix.read(rows) == expected
        assert mix.components(rows) == [
            "letters" if r[0] == 3 else "numbers" for r in rows.tolist()
        ]
        assert mix.read(rows[::-1]) == expected[::-1]
    assert mix.read(np.zeros((0, 3), dtype=np.int64)) == []
    with pytest.raises(FetchError, match="dataset_id 4"):
        mix.read(np.array([[3, 0, 0], [4, 0, 0]]))
    with pytest.raises(ValueError, match="no component"):
        mix.components(np.array([[4, 0, 0]]))


def test_each_chunk_mixes_components_evenly():
    mix = MixtureSource(
        {"a": RangeSource(10**6), "b": RangeSource(10**6, dataset_id=1)},
        {"a": 1, "b": 1},
        chunk_size=64,
    )
    ids = mix.chunk(3).pointers[:, 0]
    for start in range(0, 64, 8):
        assert 3 <= int(ids[start : start + 8].sum()) <= 5  # about half of every window is b


def test_seed_changes_the_interleave_but_not_the_counts_per_chunk():
    comps = {"a": RangeSource(500), "b": RangeSource(500, dataset_id=1)}
    one = MixtureSource(comps, {"a": 1, "b": 2}, seed=1, chunk_size=32)
    two = MixtureSource(comps, {"a": 1, "b": 2}, seed=2, chunk_size=32)
    assert not np.array_equal(one.chunk(0).pointers, two.chunk(0).pointers)
    for p in range(5):
        assert sorted(one.chunk(p).pointers.tolist()) == sorted(two.chunk(p).pointers.tolist())


def test_describe_names_weights_components_seed_and_chunk_size():
    def make(
        weights: dict[str, float] | None = None, seed: int = 0, chunk_size: int = 16, n: int = 50
    ) -> MixtureSource:
        comps = {"a": RangeSource(n), "b": RangeSource(50, dataset_id=1)}
        return MixtureSource(
            comps, weights or {"a": 1.0, "b": 2.0}, seed=seed, chunk_size=chunk_size
        )

    base = make().describe()
    assert base == make().describe()
    assert base["names"] == ["a", "b"] and base["weights"] == {"a": 1.0, "b": 2.0}
    assert base["components"]["b"] == RangeSource(50, dataset_id=1).describe()
    variants = [
        base,
        make(weights={"a": 1.0, "b": 3.0}).describe(),
        make(seed=1).describe(),
        make(chunk_size=17).describe(),
        make(n=51).describe(),
    ]
    assert len({json.dumps(v, sort_keys=True) for v in variants}) == len(variants)


@pytest.mark.parametrize(
    ("weights", "match"),
    [
        ({"a": 1, "b": 1, "c": 1}, "'c' names no component"),
        ({"a": 1}, "'b' has no weight"),
        ({"a": 1, "b": -1}, "'b' must be finite and >= 0"),
        ({"a": 1, "b": float("nan")}, "'b' must be finite"),
        ({"a": 0, "b": 0}, "at least one weight"),
        ({"a": 1000, "b": 1}, "'b' gives it"),
    ],
)
def test_bad_weights_are_refused_naming_the_key(weights, match):
    comps = {"a": RangeSource(10), "b": RangeSource(10, dataset_id=1)}
    with pytest.raises(ValueError, match=match):
        MixtureSource(comps, weights, chunk_size=64)


def test_components_must_be_indexed_sources_with_distinct_dataset_ids():
    with pytest.raises(ValueError, match="share dataset_id 0"):
        MixtureSource({"a": RangeSource(5), "b": RangeSource(5)}, {"a": 1, "b": 1})
    with pytest.raises(TypeError, match="IndexedSource"):
        MixtureSource({"a": [1, 2]}, {"a": 1})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="non-empty"):
        MixtureSource({}, {})
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        MixtureSource({"a": RangeSource(5)}, {"a": 1}, chunk_size=0)


def test_a_tied_leftover_sample_goes_to_the_first_component_by_name():
    comps = {"b": RangeSource(100, dataset_id=1), "a": RangeSource(100)}
    mix = MixtureSource(comps, {"b": 1, "a": 1}, chunk_size=3)
    assert mix.names == ("a", "b")
    assert mix.component_counts(3) == {"a": 2, "b": 1}
    assert mix.component_counts(6) == {"a": 3, "b": 3}
    assert mix.chunk(0).pointers[:, 0].tolist().count(0) == 2


# ------------------------------------------------------------------------------ end of data


@st.composite
def finite_mixtures(draw, on_exhausted: str):
    """Small mixtures whose weighted components are all finite, with an end-of-data policy."""
    k = draw(st.integers(1, 4))
    weights = draw(st.lists(st.integers(0, 9), min_size=k, max_size=k))
    assume(any(weights))
    chunk_size = draw(st.integers(1, 40))
    assume(all(w == 0 or w * chunk_size >= sum(weights) for w in weights))
    comps = {
        f"c{i}": RangeSource(
            draw(st.integers(1, 60)),
            dataset_id=10 + i,
            shuffle=draw(st.booleans()),
            seed=i,
            passes=draw(st.sampled_from([1, 2])),
            chunk_size=7,
        )
        for i in range(k)
    }
    ws = {f"c{i}": float(w) for i, w in enumerate(weights)}
    seed = draw(st.integers(0, 5))
    return MixtureSource(comps, ws, seed=seed, chunk_size=chunk_size, on_exhausted=on_exhausted)


def weighted(mix: MixtureSource) -> list[IndexedSource]:
    weights = mix.describe()["weights"]
    return [s for n, s in zip(mix.names, mix._sources, strict=True) if weights[n]]


def check_layout(mix: MixtureSource, data: st.DataObject) -> np.ndarray:
    """What every policy keeps: random access equals sequential reading, counts equal counting,
    and the rows are the chunks' concatenation."""
    rows = all_rows(mix)
    assert len(rows) == mix.total_samples()
    n_chunks = mix.num_chunks()
    assert n_chunks is not None
    fresh = MixtureSource(
        dict(zip(mix.names, mix._sources, strict=True)),
        mix.describe()["weights"],
        seed=mix.seed,
        chunk_size=mix.chunk_size,
        on_exhausted=mix.on_exhausted,
    )
    starts = np.cumsum([0] + [len(mix.chunk(p)) for p in range(n_chunks)])
    for p in data.draw(st.lists(st.integers(0, max(n_chunks - 1, 0)), max_size=5)):
        if p < n_chunks:
            assert np.array_equal(fresh.chunk(p).pointers, rows[starts[p] : starts[p + 1]])
    slots = data.draw(st.integers(0, len(rows)))
    ids = {n: s.dataset_id for n, s in zip(mix.names, mix._sources, strict=True)}
    assert mix.component_counts(slots) == {
        n: int((rows[:slots, 0] == ids[n]).sum()) for n in mix.names
    }
    return rows


@given(mix=finite_mixtures("redistribute"), data=st.data())
def test_redistribute_reads_every_weighted_component_to_its_end_exactly_once(mix, data):
    rows = check_layout(mix, data)
    for src in weighted(mix):
        mine = rows[rows[:, 0] == src.dataset_id]
        assert np.array_equal(mine, stream(src, int(available(src))))
    assert len(rows) == sum(int(available(s)) for s in weighted(mix))
    # Until the first component runs out, the shares are the weights' (as with "stop").
    stop = MixtureSource(
        dict(zip(mix.names, mix._sources, strict=True)),
        mix.describe()["weights"],
        seed=mix.seed,
        chunk_size=mix.chunk_size,
    )
    first = all_rows(stop)
    assert np.array_equal(
        rows[: len(first) // mix.chunk_size * mix.chunk_size],
        first[: len(first) // mix.chunk_size * mix.chunk_size],
    )


@given(mix=finite_mixtures("repeat"), data=st.data())
def test_repeat_reads_components_again_until_the_last_one_is_read_through(mix, data):
    rows = check_layout(mix, data)
    counts = []
    for src in weighted(mix):
        mine = rows[rows[:, 0] == src.dataset_id]
        avail = int(available(src))
        assert len(mine) >= avail  # every weighted component is read through at least once
        again = np.concatenate([stream(src, avail)] * (len(mine) // avail + 1))[: len(mine)]
        assert np.array_equal(mine, again)  # ... and then again from its first pass
        counts.append(len(mine) / avail)
    # The mixture ends where the component that takes longest would start over.
    assert (
        min(counts) < 1 + 1 / min(int(available(s)) for s in weighted(mix)) + 1e-9
        or len(counts) == 1
    )
    desc = mix.describe()
    total_w = sum(Fraction(w) for w in desc["weights"].values())
    cs = mix.chunk_size
    ids = {desc["components"][n]["dataset_id"]: n for n in mix.names}
    for k in range(len(rows) // cs + 1):  # the shares hold to the end
        prefix = rows[: k * cs, 0].tolist()
        for did, name in ids.items():
            assert abs(prefix.count(did) - Fraction(desc["weights"][name]) / total_w * k * cs) < 1


def test_each_policy_delivers_its_documented_counts():
    comps = {
        "a": RangeSource(100, dataset_id=0, passes=2),
        "b": RangeSource(300, dataset_id=1, passes=2),
    }
    counts = {}
    for policy in ("stop", "redistribute", "repeat"):
        mix = MixtureSource(comps, {"a": 1, "b": 1}, chunk_size=16, on_exhausted=policy)
        rows = all_rows(mix)
        counts[policy] = (int((rows[:, 0] == 0).sum()), int((rows[:, 0] == 1).sum()))
    assert counts["stop"] == (200, 200)  # a's two passes end it
    assert counts["redistribute"] == (200, 600)  # then b alone, to its end
    assert counts["repeat"][1] == 600 and 600 <= counts["repeat"][0] <= 601  # a read three times
    assert "on_exhausted" not in MixtureSource(comps, {"a": 1, "b": 1}).describe()
    with pytest.raises(ValueError, match="on_exhausted must be one of"):
        MixtureSource(comps, {"a": 1, "b": 1}, on_exhausted="cycle")
    with pytest.raises(ValueError, match="cannot repeat the empty component"):
        MixtureSource(
            {"a": RangeSource(0, dataset_id=0), "b": RangeSource(3, dataset_id=1)},
            {"a": 1, "b": 1},
            chunk_size=4,
            on_exhausted="repeat",
        )


@pytest.mark.parametrize("policy", ["redistribute", "repeat"])
def test_a_pipeline_resumes_exactly_around_the_point_a_component_runs_out(policy):
    import zephon
    from zephon.ops import batch, fetch, shuffle
    from zephon.testing import check_resume

    mix = MixtureSource(
        {
            "a": RangeSource(60, dataset_id=0, shuffle=True, seed=1),
            "b": RangeSource(200, dataset_id=1),
        },
        {"a": 1, "b": 1},
        chunk_size=8,
        on_exhausted=policy,
    )
    pipeline = zephon.Pipeline(
        mix, [fetch(), shuffle(5, seed=3), batch(3)], lanes=2, epoch_chunks=2
    )
    # a runs out after about 120 samples: 40 batches over both lanes
    check_resume(pipeline, steps=[0, 17, 18, 19, 20, 21, 22, 35, 41, 60])


class Unlisted(RangeSource):
    """A component that refuses to list its samples: only its size may be asked."""

    def samples(self, pass_idx: int, start: int, stop: int) -> np.ndarray:
        raise AssertionError(f"samples({pass_idx}, {start}, {stop}) was asked for")


@pytest.mark.parametrize("policy", ["stop", "redistribute", "repeat"])
def test_chunk_lengths_follow_from_the_layout_alone(policy):
    # Every rank of a job ending its ranks together asks for the length of every chunk of the
    # mixture when its loader starts: the answer must not build them.
    sizes = {"a": 37, "b": 90, "c": 0}
    weights = {"a": 1, "b": 2, "c": 0}

    def mixture(kind: type[RangeSource]) -> MixtureSource:
        comps = {n: kind(size, dataset_id=i) for i, (n, size) in enumerate(sizes.items())}
        return MixtureSource(comps, weights, chunk_size=8, on_exhausted=policy)

    total = mixture(RangeSource).num_chunks()
    assert total is not None
    lengths = mixture(Unlisted).chunk_lengths(np.arange(total, dtype=np.int64))
    assert lengths.dtype == np.int64
    assert lengths.tolist() == [len(mixture(RangeSource).chunk(p)) for p in range(total)]
    with pytest.raises(IndexError, match="past the end"):
        mixture(Unlisted).chunk_lengths(np.array([total]))


@given(mix=finite_mixtures("redistribute"))
def test_chunk_lengths_equal_the_chunks_of_a_redistributed_mixture(mix):
    total = mix.num_chunks()
    assert total is not None
    lengths = mix.chunk_lengths(np.arange(total, dtype=np.int64)).tolist()
    assert lengths == [len(mix.chunk(p)) for p in range(total)]
