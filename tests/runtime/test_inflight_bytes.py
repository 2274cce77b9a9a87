"""``Pipeline(max_inflight_bytes=...)``: a lane's read-ahead stops growing once the item lists it
has ready hold that many payload bytes, one list larger than the bound still goes, and the stream
and its resumes are the same as without the bound."""

from __future__ import annotations

import numpy as np
import pytest
from pipeline_kit import assert_resumes_at, run, run_with_timeout
from worker_kit import wait_until

import zephon
from zephon.errors import PlanError
from zephon.ops.basic import fetch, map_transform
from zephon.ops.batching import batch
from zephon.runtime.workers.inflight_bytes import item_list_bytes, payload_bytes
from zephon.sources import RawImage
from zephon.sources.memory import RangeSource

pytestmark = pytest.mark.usefixtures("no_leftover_workers")

PIXELS = 10_000  # bytes of one sample's array
MICRO = 4  # samples per item list


def with_pixels(payload):
    i = payload["idx"]
    return {"idx": i, "pixels": np.full(PIXELS, i % 251, dtype=np.uint8), "name": f"s{i}"}


def pipeline(
    workers="inline", *, n=200, lanes=1, prefetch=2, bound=None, batch_size=None, processes=None
):
    ops = [fetch(), map_transform(with_pixels)]
    if batch_size:
        ops.append(batch(batch_size))
    return zephon.Pipeline(
        RangeSource(n, chunk_size=40),
        ops,
        lanes=lanes,
        workers=workers,
        micro_batch=MICRO,
        prefetch=prefetch,
        max_inflight_bytes=bound,
        processes=processes,
    )


def test_item_list_bytes_counts_arrays_bytes_and_str_of_the_payloads():
    loader = pipeline().iter()
    next(loader)
    items = loader.lanes[0].feed.buf
    names = sum(len(f"s{r.payload['idx']}") for r in items if hasattr(r, "payload"))
    assert item_list_bytes(items) == MICRO * PIXELS + names
    assert item_list_bytes([]) == 0
    loader.close()


def test_raw_images_count_their_pixels():
    # What MDS and LitData give of a "pil" column before decode_images: its pixels are held.
    raw = RawImage("RGB", 4, 5, bytes(60))
    assert payload_bytes({"image": raw, "images": [raw, raw], "caption": "abc"}) == 3 * 60 + 3


# One worker per lane, and two lanes sharing one worker (one thread; one process).
SHARED = [("thread", 1), ("thread", 2), ("process", 1), ("process", 2)]


@pytest.mark.parametrize(("workers", "lanes"), SHARED)
def test_the_read_ahead_stops_growing_at_the_byte_bound(workers, lanes):
    # prefetch alone would let the lane run 50 lists ahead; 2 lists of ~40 kB reach the bound.
    bound = 2 * MICRO * PIXELS + 1
    loader = pipeline(workers, lanes=lanes, prefetch=50, bound=bound, processes=1).iter()
    try:
        first = next(loader)
        lane = loader.lanes[0].feed.runner
        assert wait_until(lane.held_by_bytes, 60), "the lane never reached its byte bound"
        # The worker said it waits on the bound: everything it made before is here, untaken.
        one_list = MICRO * PIXELS + 4096  # a list's payloads, with room for the pickle around them
        assert bound <= lane.queued_bytes() < bound + one_list
        assert 2 <= lane.queued() < 50  # two lists reach the bound; the next waits in the worker
        rest = run(loader)
    finally:
        loader.close()
    assert [first.meta.cursor, *(c for _, c, _ in rest)] == [
        r.meta.cursor for r in pipeline(lanes=lanes).iter()
    ]


@pytest.mark.parametrize(("workers", "processes"), [("inline", None), *SHARED])
def test_one_item_list_larger_than_the_bound_is_still_delivered(workers, processes):
    expected = run(pipeline(lanes=2, batch_size=6).iter())
    bounded = pipeline(workers, lanes=2, bound=1, batch_size=6, processes=processes)
    assert run_with_timeout(lambda: run(bounded.iter()), 120) == expected


@pytest.mark.parametrize("workers", ["inline", "thread", "process"])
def test_a_resume_is_exact_with_the_bound_on(workers):
    full = run(pipeline(n=120, lanes=2, batch_size=5).iter())
    bounded = pipeline(workers, n=120, lanes=2, bound=3 * PIXELS, batch_size=5)
    assert run(bounded.iter()) == full
    assert_resumes_at(bounded, [0, 7, 23], full)


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "1GB"])
def test_max_inflight_bytes_must_be_a_positive_int(value):
    with pytest.raises(PlanError, match=r"max_inflight_bytes must be (an int|>= 1)"):
        pipeline(bound=value).compile()


def test_the_plan_names_the_byte_bound_and_the_fingerprint_ignores_it():
    plan = pipeline("thread", bound=64 << 20).compile()
    assert "67,108,864 payload bytes per lane" in plan.describe()
    assert plan.fingerprint == pipeline("thread").compile().fingerprint
