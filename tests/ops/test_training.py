"""``training_collate``: labels against a plain-Python reference, ``cu_seqlens`` against the
segment ids, for random packed rows, and the refusals."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zephon.ops import training_collate
from zephon.types import SampleCursor, SampleMeta, SampleRecord


@st.composite
def packed_rows(draw: Any) -> list[SampleRecord]:
    """Rows shaped like a packer's: segments 1, 2, ... back to back, then padding (segment 0)."""
    length = draw(st.integers(1, 24))
    rows = []
    for r in range(draw(st.integers(1, 4))):
        sizes = draw(st.lists(st.integers(1, length), max_size=5))
        segments: list[int] = []
        positions: list[int] = []
        for s, size in enumerate(sizes, 1):
            size = min(size, length - len(segments))
            segments += [s] * size
            positions += list(range(size))
        pad = length - len(segments)
        segments += [0] * pad
        positions += [0] * pad
        tokens = draw(st.lists(st.integers(0, 2**31 - 1), min_size=length, max_size=length))
        mask = draw(st.lists(st.integers(0, 1), min_size=length, max_size=length))
        payload = {
            "tokens": np.array(tokens, np.int32),
            "segment_ids": np.array(segments, np.int32),
            "positions": np.array(positions, np.int32),
            "loss_mask": np.array(mask, np.int32),
        }
        rows.append(SampleRecord(SampleMeta(SampleCursor(0, r, (0, 0, r))), payload))
    return rows


def reference_labels(payload: dict, ignore: int, use_mask: bool) -> list[int]:
    tokens = payload["tokens"].tolist()
    seg = payload["segment_ids"].tolist()
    mask = payload["loss_mask"].tolist()
    out = []
    for t in range(len(tokens)):
        nxt = t + 1
        if (
            nxt < len(tokens)
            and seg[nxt] != 0
            and seg[nxt] == seg[t]
            and (mask[nxt] == 1 or not use_mask)
        ):
            out.append(tokens[nxt])
        else:
            out.append(ignore)
    return out


def reference_cu_seqlens(rows: list[SampleRecord]) -> list[int]:
    """Runs of equal segment ids, row after row, in the flattened batch."""
    cu = [0]
    at = 0
    for rec in rows:
        seg = rec.payload["segment_ids"].tolist()
        run = 1
        for t in range(1, len(seg) + 1):
            if t == len(seg) or seg[t] != seg[t - 1]:
                at += run
                cu.append(at)
                run = 1
            else:
                run += 1
    return cu


@settings(max_examples=200)
@given(
    rows=packed_rows(),
    ignore=st.sampled_from([-100, -1, 0]),
    use_mask=st.booleans(),
)
def test_labels_and_cu_seqlens_match_the_plain_python_reference(rows, ignore, use_mask):
    collate = training_collate(mask_field="loss_mask" if use_mask else None, ignore_index=ignore)
    out = collate(rows)
    assert [r.tolist() for r in out["labels"]] == [
        reference_labels(r.payload, ignore, use_mask) for r in rows
    ]
    assert out["cu_seqlens"].tolist() == reference_cu_seqlens(rows)
    assert out["cu_seqlens"].dtype == np.int32 and out["labels"].dtype == np.int64
    assert out["max_seqlen"] == max(np.diff(reference_cu_seqlens(rows)))
    assert out["input_ids"].tolist() == [r.payload["tokens"].tolist() for r in rows]
    assert out["position_ids"].tolist() == [r.payload["positions"].tolist() for r in rows]
    # cu_seqlens agree with segment_ids: inside each span the id is constant, and it changes
    # (or a row starts) at each boundary.
    flat = out["segment_ids"].reshape(-1)
    length = out["segment_ids"].shape[1]
    cu = out["cu_seqlens"].tolist()
    for lo, hi in itertools.pairwise(cu):
        assert len(set(flat[lo:hi].tolist())) == 1 and lo // length == (hi - 1) // length
        assert lo % length == 0 or flat[lo] != flat[lo - 1]


def test_a_first_token_after_a_segment_boundary_is_never_a_target():
    payload = {
        "tokens": np.array([5, 6, 7, 8, 9, 0], np.int32),
        "segment_ids": np.array([1, 1, 2, 2, 2, 0], np.int32),
        "positions": np.array([0, 1, 0, 1, 2, 0], np.int32),
        "loss_mask": np.array([1, 1, 1, 0, 1, 7], np.int32),
    }
    out = training_collate()([SampleRecord(SampleMeta(SampleCursor(0, 0, (0, 0, 0))), payload)])
    assert out["labels"].tolist() == [[6, -100, -100, 9, -100, -100]]
    assert out["cu_seqlens"].tolist() == [0, 2, 5, 6] and out["max_seqlen"] == 3


def record(payload: Any) -> SampleRecord:
    return SampleRecord(SampleMeta(SampleCursor(3, 1, (0, 0, 9))), payload)


ROW = {
    "tokens": np.zeros(4, np.int32),
    "segment_ids": np.ones(4, np.int32),
    "positions": np.arange(4, dtype=np.int32),
}


@pytest.mark.parametrize(
    ("payloads", "match"),
    [
        ([ROW], r"SampleCursor\(3, 1.*no field 'loss_mask'.*mask_field=None"),
        ([{"tokens": ROW["tokens"]}], "no field 'segment_ids'.*packed rows"),
        ([{**ROW, "loss_mask": np.ones(3, np.int32)}], "'loss_mask' has shape"),
        (
            [{**ROW, "loss_mask": np.ones(4)}, {**ROW, "tokens": np.zeros(5, np.int32)}],
            "one length",
        ),
        ([], "empty batch"),
    ],
)
def test_bad_batches_are_refused_naming_the_record(payloads, match):
    with pytest.raises(ValueError, match=match):
        training_collate()([record(p) for p in payloads])


def test_bad_arguments():
    with pytest.raises(TypeError, match="mask_field"):
        training_collate(mask_field=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ignore_index"):
        training_collate(ignore_index=1.5)  # type: ignore[arg-type]
    assert repr(training_collate()) == "training_collate(mask_field='loss_mask', ignore_index=-100)"


def reference_targets(payload: dict, use_mask: bool, eos: int | None) -> list[bool]:
    """Whether token t is a target: real, not its segment's first, trained on, not the eos."""
    tokens = payload["tokens"].tolist()
    seg = payload["segment_ids"].tolist()
    mask = payload["loss_mask"].tolist()
    return [
        t > 0
        and seg[t] != 0
        and seg[t] == seg[t - 1]
        and (mask[t] == 1 or not use_mask)
        and tokens[t] != eos
        for t in range(len(tokens))
    ]


@settings(max_examples=100)
@given(
    rows=packed_rows(),
    use_mask=st.booleans(),
    shift=st.booleans(),
    eos=st.sampled_from([None, 0, 7]),
    layout=st.sampled_from(["rows", "flat"]),
    dtype=st.sampled_from(["int64", "int32"]),
)
def test_every_option_matches_the_plain_python_reference(rows, use_mask, shift, eos, layout, dtype):
    collate = training_collate(
        mask_field="loss_mask" if use_mask else None,
        shift_labels=shift,
        train_on_eos=eos is None,
        eos_id=eos,
        layout=layout,
        dtype=dtype,
    )
    out = collate(rows)
    expected = []
    for rec in rows:
        tokens = rec.payload["tokens"].tolist()
        targets = reference_targets(rec.payload, use_mask, eos)
        in_place = [tok if ok else -100 for tok, ok in zip(tokens, targets)]
        expected.append([*in_place[1:], -100] if shift else in_place)
    n, length = len(rows), len(expected[0])
    shape = (1, n * length) if layout == "flat" else (n, length)
    for name in ("input_ids", "labels", "position_ids", "segment_ids"):
        assert out[name].shape == shape, name
    assert out["labels"].reshape(n, length).tolist() == expected
    assert out["labels"].dtype == out["input_ids"].dtype == np.dtype(dtype)
    assert out["num_valid_tokens"] == sum(v != -100 for row in expected for v in row)
    assert out["cu_seqlens"].tolist() == reference_cu_seqlens(rows)


def test_rename_gives_the_outputs_the_model_s_names():
    row = {**ROW, "loss_mask": np.ones(4, np.int32)}
    out = training_collate(rename={"input_ids": "tokens", "num_valid_tokens": "n"})([record(row)])
    assert set(out) == {
        "tokens",
        "labels",
        "position_ids",
        "segment_ids",
        "cu_seqlens",
        "max_seqlen",
        "n",
    }
    assert out["n"] == 3


def test_default_options_keep_the_identity_pipelines_had_before_they_existed():
    import pickle

    from zephon.identity import identify

    assert identify(training_collate()) == {
        "object": "zephon.ops.training.TrainingCollate",
        "state": {"ignore_index": -100, "mask_field": "loss_mask"},
    }
    flat = training_collate(layout="flat", rename={"labels": "y"})
    assert identify(flat)["state"]["layout"] == "flat"
    again = pickle.loads(pickle.dumps(flat))
    assert (again.layout, again.rename, again.shift_labels) == ("flat", {"labels": "y"}, True)
    assert repr(flat) == (
        "training_collate(mask_field='loss_mask', ignore_index=-100, layout='flat', "
        "rename={'labels': 'y'})"
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"shift_labels": 1}, TypeError, "shift_labels must be True or False"),
        ({"train_on_eos": False}, ValueError, "needs eos_id="),
        ({"eos_id": -1}, ValueError, "eos_id"),
        ({"dtype": "float32"}, ValueError, "dtype must be"),
        ({"dtype": "int32", "ignore_index": -(2**31) - 1}, ValueError, "ignore_index .* int32"),
        ({"dtype": "int32", "ignore_index": 2**40}, ValueError, "ignore_index .* int32"),
        ({"layout": "cols"}, ValueError, "layout must be"),
        ({"rename": {"inputs": "x"}}, ValueError, "rename maps output names"),
        ({"rename": {"labels": "input_ids"}}, ValueError, "two outputs one name"),
    ],
)
def test_bad_options_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        training_collate(**kwargs)


def test_image_spans_are_never_targets_even_where_the_mask_is_one():
    payload: dict[str, Any] = {
        "tokens": np.arange(8, dtype=np.int32),
        "segment_ids": np.array([1, 1, 1, 1, 1, 1, 0, 0], np.int32),
        "positions": np.array([0, 1, 2, 3, 4, 5, 0, 0], np.int32),
        "loss_mask": np.ones(8, np.int32),
        "image_spans": np.array([[1, 3]], np.int32),
    }
    payload["images"] = [np.zeros((2, 2, 3), np.uint8)]
    out = training_collate(images="images")([record(payload)])
    # labels[t] is token t + 1: tokens 1 and 2 are the image, 6 and 7 padding
    assert out["labels"].tolist() == [[-100, -100, 3, 4, 5, -100, -100, -100]]
    assert out["num_valid_tokens"] == 3
    with pytest.raises(ValueError, match=r"the rows carry images .* pass images="):
        training_collate()([record(payload)])  # never a batch without the pixels


def test_images_stay_out_of_the_identity_until_asked_for():
    from zephon.identity import identify

    assert "images" not in identify(training_collate())["state"]
    assert identify(training_collate(images="images"))["state"]["images"] == "images"
