"""Arrays on pages shared with a worker (``SharedPages``) that lie back to back collate into one
view of those pages, equal to the rule's stack; anything else is copied, as before."""

from __future__ import annotations

import gc
import mmap
import pickle
import weakref
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon._core.shared_pages import SharedPages, shared_region
from zephon.ops.batching import collate_by_rule, collate_payloads

ALIGN = 64  # where the ring starts each array, as the worker places them


def through_pages(arrays: list[np.ndarray], gaps: list[int]) -> tuple[list[np.ndarray], Any]:
    """``arrays`` pickled as a worker sends them and made again on one region of shared pages,
    array ``i`` after ``gaps[i]`` bytes of room (as ``RingReader.buffers`` does); and the region."""
    buffers: list[Any] = []
    data = pickle.dumps(arrays, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    offsets, at = [], 0
    for raw, gap in zip(raws, gaps, strict=True):
        at += gap
        offsets.append(at)
        at += -(-raw.nbytes // ALIGN) * ALIGN
    pages = mmap.mmap(-1, max(at, 1))
    region = shared_region(pages, 0, max(at, 1))
    for raw, start in zip(raws, offsets, strict=True):
        region[start : start + raw.nbytes] = np.frombuffer(raw, np.uint8)
    views = [region[start : start + raw.nbytes] for raw, start in zip(raws, offsets, strict=True)]
    return pickle.loads(data, buffers=views), region


shapes = st.lists(st.integers(1, 5), min_size=0, max_size=3).map(tuple)
dtypes = st.sampled_from(["u1", "<i4", "<f8", "?", ">i4", "<U2"])


@settings(max_examples=300, deadline=None)
@given(
    shape=shapes,
    dtype=dtypes,
    n=st.integers(1, 5),
    gapped=st.booleans(),
    order=st.sampled_from(["as-sent", "reversed"]),
)
def test_arrays_on_shared_pages_collate_as_the_rule_and_back_to_back_ones_as_a_view(
    shape: tuple[int, ...], dtype: str, n: int, gapped: bool, order: str
) -> None:
    arrays = [np.full(shape, i, dtype=dtype) for i in range(n)]
    gaps = [ALIGN if gapped and i else 0 for i in range(n)]
    made, region = through_pages(arrays, gaps)
    if order == "reversed":
        made = made[::-1]
    payloads = [{"x": a} for a in made]
    out = collate_payloads(payloads)["x"]
    rule = collate_by_rule(payloads)["x"]
    assert out.dtype == rule.dtype and out.shape == rule.shape and out.tobytes() == rule.tobytes()
    itemsize = np.dtype(dtype).itemsize * int(np.prod(shape))
    back_to_back = (
        (n == 1 or (not gapped and itemsize % ALIGN == 0 and order == "as-sent"))
        and np.dtype(dtype).isnative
        and np.dtype(dtype).kind != "U"
    )
    assert np.shares_memory(out, region) == back_to_back
    assert out.flags.writeable and out.flags.c_contiguous


def test_the_region_outlives_its_arrays_while_a_batch_of_them_lives() -> None:
    made, region = through_pages([np.full((8, 8), i, np.uint8) for i in range(4)], [0] * 4)
    released: list[int] = []
    weakref.finalize(region, released.append, 1)
    out = collate_payloads([{"x": a} for a in made])["x"]
    assert np.shares_memory(out, region)
    del made, region
    gc.collect()
    assert released == [] and out[3].tolist() == [[3] * 8] * 8
    del out
    gc.collect()
    assert released == [1]


def test_back_to_back_views_of_a_users_array_are_still_copied() -> None:
    # Only the pages a worker wrote once are known never to change: a user's buffer may.
    data = np.arange(24, dtype=np.int64).reshape(3, 8)
    out = collate_payloads([{"x": row} for row in data])["x"]
    assert out.tolist() == data.tolist() and not np.shares_memory(out, data)


def test_read_only_arrays_on_shared_pages_are_copied_into_a_writeable_batch() -> None:
    made, region = through_pages([np.full(16, i, np.int32) for i in range(3)], [0] * 3)
    for a in made:
        a.flags.writeable = False
    out = collate_payloads([{"x": a} for a in made])["x"]
    assert out.flags.writeable and not np.shares_memory(out, region)


def test_pages_outside_the_mapping_are_refused_and_never_pickled() -> None:
    pages = mmap.mmap(-1, 4096)
    with pytest.raises(ValueError, match="outside a mapping of 4096 bytes"):
        shared_region(pages, 4000, 200)
    with pytest.raises(ValueError):
        SharedPages(pages, -1, 10)
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(SharedPages(pages, 0, 10))
    with pytest.raises(BufferError):
        shared_region(b"read only", 0, 4)  # type: ignore[arg-type]
