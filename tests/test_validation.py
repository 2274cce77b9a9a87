"""One validator for every public argument: a bool where an int is meant is refused by the
pipeline, the sources and the operators alike, with an error naming the argument and the
component that took it (``zephon/validation.py``, and ``_core/_ints.pxd`` for the kernels)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import zephon
from zephon.errors import PlanError
from zephon.ops import (
    batch,
    decode_images,
    ensure_mixture,
    fetch,
    map_batch,
    map_transform,
    pack_flat,
    pack_sequences,
    random_flip,
    random_resized_crop,
    resize_images,
    shuffle,
    tokenize,
    training_collate,
)
from zephon.sources.memory import ListSource, RangeSource
from zephon.sources.mixture import MixtureSource
from zephon.types import SampleCursor, SampleMeta
from zephon.validation import check_int


def _pipeline(**kw: Any) -> Any:
    return zephon.Pipeline(RangeSource(10, chunk_size=2), [fetch()], **kw).compile()


def _mixture(**kw: Any) -> Any:
    return MixtureSource({"a": ListSource([{"text": "x"}] * 4)}, {"a": 1.0}, **kw)


# (component, argument, how to build it with that argument set to ``value``)
ARGUMENTS: list[tuple[str, str, Callable[[Any], Any]]] = [
    *[
        ("Pipeline", name, lambda v, name=name: _pipeline(**{name: v}))
        for name in (
            "lanes",
            "epoch_chunks",
            "prefetch",
            "micro_batch",
            "carry_warn_bytes",
            "processes",
            "world_size",
        )
    ],
    ("Pipeline", "rank", lambda v: _pipeline(rank=v, world_size=2, lanes=2)),
    ("RangeSource", "n", lambda v: RangeSource(v)),
    ("RangeSource", "chunk_size", lambda v: RangeSource(10, chunk_size=v)),
    ("RangeSource", "seed", lambda v: RangeSource(10, seed=v)),
    ("RangeSource", "passes", lambda v: RangeSource(10, passes=v)),
    ("RangeSource", "dataset_id", lambda v: RangeSource(10, dataset_id=v)),
    ("ListSource", "chunk_size", lambda v: ListSource([1, 2], chunk_size=v)),
    ("MixtureSource", "seed", lambda v: _mixture(seed=v)),
    ("MixtureSource", "chunk_size", lambda v: _mixture(chunk_size=v)),
    ("MixtureSource", "added_tokens", lambda v: _mixture(added_tokens=v)),
    ("MixtureSource", "estimate_size", lambda v: _mixture(estimate_size=v)),
    ("MixtureSource", "calibration_size", lambda v: _mixture(calibration_size=v)),
    ("tokenize", "eos_id", lambda v: tokenize(eos_id=v)),
    ("training_collate", "eos_id", lambda v: training_collate(eos_id=v)),
    ("batch", "batch_size", lambda v: batch(v)),
    ("shuffle", "buffer_size", lambda v: shuffle(v)),
    ("shuffle", "seed", lambda v: shuffle(8, seed=v)),
    ("tokenize", "max_len", lambda v: tokenize(max_len=v)),
    ("tokenize", "workers", lambda v: tokenize(workers=v)),
    ("map_transform", "workers", lambda v: map_transform(abs, workers=v)),
    ("map_batch", "workers", lambda v: map_batch(list, workers=v)),
    ("pack_sequences", "seq_len", lambda v: pack_sequences(v)),
    ("pack_sequences", "open_bins", lambda v: pack_sequences(8, open_bins=v)),
    ("pack_sequences", "pad_id", lambda v: pack_sequences(8, pad_id=v)),
    ("pack_sequences", "max_segments", lambda v: pack_sequences(8, max_segments=v)),
    ("pack_flat", "seq_len", lambda v: pack_flat(v)),
    ("pack_flat", "pad_id", lambda v: pack_flat(8, pad_id=v)),
    ("ensure_mixture", "buffer_size", lambda v: ensure_mixture({"a": 1.0}, buffer_size=v)),
    ("fetch", "retries", lambda v: fetch(retries=v)),
    ("decode_images", "max_pixels", lambda v: decode_images(max_pixels=v)),
    ("resize_images", "shortest_edge", lambda v: resize_images(v)),
    ("random_flip", "seed", lambda v: random_flip(seed=v)),
    ("random_resized_crop", "seed", lambda v: random_resized_crop(8, seed=v)),
    ("training_collate", "ignore_index", lambda v: training_collate(ignore_index=v)),
    ("SampleCursor", "chunk_id", lambda v: SampleCursor(v, 0, (0, 0, 0))),
    ("SampleMeta", "lane_id", lambda v: SampleMeta(SampleCursor(0, 0, (0, 0, 0)), lane_id=v)),
]


@pytest.mark.parametrize("value", [True, False, np.True_])
@pytest.mark.parametrize(
    ("component", "argument", "build"), ARGUMENTS, ids=[f"{c}-{a}" for c, a, _ in ARGUMENTS]
)
def test_a_bool_is_refused_where_an_int_is_meant(component, argument, build, value):
    with pytest.raises((TypeError, PlanError)) as caught:
        build(value)
    message = str(caught.value)
    assert argument in message, message
    assert component.split("_")[0].lower() in message.lower(), message


@pytest.mark.parametrize("value", [1, np.int64(1)])
@pytest.mark.parametrize(
    ("component", "argument", "build"), ARGUMENTS, ids=[f"{c}-{a}" for c, a, _ in ARGUMENTS]
)
def test_an_int_is_taken_where_an_int_is_meant(component, argument, build, value):
    build(value)


def test_a_plan_holds_python_ints_whatever_integers_it_was_given():
    plan = _pipeline(lanes=np.int64(2), epoch_chunks=np.int32(3), micro_batch=np.int16(4))
    assert (plan.lanes, plan.epoch_chunks, plan.micro_batch) == (2, 3, 4)
    assert {type(plan.lanes), type(plan.epoch_chunks), type(plan.micro_batch)} == {int}


def test_the_caller_chooses_the_error_class_and_the_message_stays_the_same():
    with pytest.raises(PlanError, match=r"^Pipeline: lanes must be an int, got True$"):
        check_int(True, "lanes", "Pipeline", error=PlanError)
    with pytest.raises(TypeError, match=r"^Pipeline: lanes must be an int, got True$"):
        check_int(True, "lanes", "Pipeline")
    with pytest.raises(ValueError, match=r"^Pipeline: lanes must be >= 1, got 0$"):
        check_int(0, "lanes", "Pipeline", minimum=1)


@pytest.mark.parametrize("name", ["strict", "relane"])
def test_a_pipeline_flag_must_be_a_bool(name):
    with pytest.raises(PlanError, match=rf"Pipeline: {name} must be a bool, got 1"):
        _pipeline(**{name: 1})
