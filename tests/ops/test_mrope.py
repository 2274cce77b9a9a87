"""M-RoPE positions (``training_collate(positions="mrope")``): packed rows of documents with images
of random grids, several to a row and cut by the real packer, against a token-by-token reference
of the scheme Qwen2-VL's ``get_rope_index`` defines; single documents against transformers' own
``get_rope_index``; bad grids and ids refused naming the row; and the positions of a real
pipeline of images tokenized by a real BPE."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import numpy as np
import pytest
from chat_kit import EOT, tiny_qwen2_vl_config, vision_bpe
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

import zephon
from zephon.ops import (
    batch,
    fetch,
    pack_sequences,
    tokenize_interleaved,
    training_collate,
)
from zephon.sources import ListSource
from zephon.types import SampleCursor, SampleMeta, SampleRecord

IMAGE, START, END, PAD = 7, 8, 9, 0


def reference(row: dict[str, Any], merge: int, image_token_id: int = IMAGE) -> list[list[int]]:
    """The three position lists of one packed row, token by token: a counter that restarts at
    every new segment, advances by one per text token, and jumps past each image, whose tokens
    are ``(start + t, start + h, start + w)`` over its merged grid in ``t, h, w`` order."""
    tokens = row["tokens"].tolist()
    segments = row["segment_ids"].tolist()
    images = {}  # first image token -> (t, h, w)
    for (lo, _), (t, gh, gw) in zip(row["image_spans"].tolist(), row["image_grid_thw"].tolist()):
        first = lo if tokens[lo] == image_token_id else lo + 1
        images[first] = (t, gh // merge, gw // merge)
    out: list[list[int]] = [[], [], []]
    i, p = 0, 0
    while i < len(tokens):
        if i == 0 or segments[i] != segments[i - 1]:
            p = 0
        if segments[i] == 0:  # padding keeps the packer's 1-D position
            for axis in out:
                axis.append(int(row["positions"][i]))
            i += 1
        elif i in images:
            t, h, w = images[i]
            for ti in range(t):
                for hi in range(h):
                    for wi in range(w):
                        out[0].append(p + ti)
                        out[1].append(p + hi)
                        out[2].append(p + wi)
            p = max(p + t - 1, p + h - 1, p + w - 1) + 1
            i += t * h * w
        else:
            for axis in out:
                axis.append(p)
            p += 1
            i += 1
    return out


def documents(
    parts: list[list[tuple[int, tuple[int, int, int]]]], merge: int, start: bool, end: bool
) -> list[SampleRecord]:
    """One record per document: each part is ``(text tokens, grid)`` — that much text, then an
    image of patch grid ``grid`` (``(t, gh, gw)`` with sides in merges) between its optional start
    and end tokens."""
    out = []
    for i, doc in enumerate(parts):
        tokens: list[int] = []
        spans: list[tuple[int, int]] = []
        grids: list[tuple[int, int, int]] = []
        images: list[np.ndarray] = []
        for text, (t, mh, mw) in doc:
            tokens += [100 + i % 50] * text
            lo = len(tokens)
            tokens += [START] * start + [IMAGE] * (t * mh * mw) + [END] * end
            spans.append((lo, len(tokens)))
            grids.append((t, mh * merge, mw * merge))
            images.append(np.full((2, 2, 3), len(images), np.uint8))
        tokens += [100 + i % 50] * (1 + i % 3)
        payload = {
            "tokens": np.array(tokens, dtype=np.int32),
            "image_spans": np.array(spans, dtype=np.int32).reshape(-1, 2),
            "image_grid_thw": np.array(grids, dtype=np.int32).reshape(-1, 3),
            "images": images,
        }
        out.append(SampleRecord(SampleMeta(SampleCursor(0, i, (0, 0, i))), payload))
    return out


def packed(records: list[SampleRecord], seq_len: int, **kw: Any) -> list[SampleRecord]:
    packer = pack_sequences(seq_len, pad_id=PAD, images="images", **kw)
    out: list[SampleRecord] = []
    for at in range(0, len(records), 4):
        out += packer.process_many(records[at : at + 4])
    return out + packer.flush()


def mrope(**kw: Any) -> Any:
    return training_collate(
        mask_field=None, images="images", positions="mrope", image_token_id=IMAGE, **kw
    )


grids = st.tuples(st.integers(1, 2), st.integers(1, 4), st.integers(1, 4))
docs = st.lists(
    st.lists(st.tuples(st.integers(0, 6), grids), min_size=0, max_size=3), min_size=1, max_size=12
)


@settings(max_examples=150, deadline=None)
@given(
    parts=docs,
    merge=st.integers(1, 3),
    start=st.booleans(),
    end=st.booleans(),
    extra=st.integers(0, 30),
    cut=st.booleans(),
    open_bins=st.integers(1, 3),
    flat=st.booleans(),
)
def test_packed_rows_get_the_positions_of_the_reference(
    parts: list[list[tuple[int, tuple[int, int, int]]]],
    merge: int,
    start: bool,
    end: bool,
    extra: int,
    cut: bool,
    open_bins: int,
    flat: bool,
) -> None:
    records = documents(parts, merge, start, end)
    longest_span = max((hi - lo for r in records for lo, hi in r.payload["image_spans"]), default=1)
    rows = packed(records, longest_span + extra, cut_to_fill=cut, open_bins=open_bins)
    collate = mrope(merge=merge, layout="flat" if flat else "rows")
    for at in range(0, len(rows), 3):
        group = rows[at : at + 3]
        out = collate(group)
        n, length = len(group), len(group[0].payload["tokens"])
        position_ids = out["position_ids"].reshape(3, n, length)
        for r, row in enumerate(group):
            assert position_ids[:, r].tolist() == reference(row.payload, merge)
        assert out["position_ids"].shape == ((3, 1, n * length) if flat else (3, n, length))
        assert np.array_equal(
            out["text_position_ids"].reshape(n, length),
            np.stack([row.payload["positions"] for row in group]),
        )


def test_an_image_takes_its_grid_and_the_text_after_it_continues_past_its_largest_side() -> None:
    # two text tokens, an image of 4 x 6 patches merged 2 x 2 (2 x 3 tokens) between its start
    # and end tokens, one text token; then a second document in the same row
    (first, second) = documents([[(2, (1, 2, 3))], [(1, (1, 1, 1))]], 2, True, True)
    rows = packed([first, second], 32, open_bins=1)
    (row,) = rows
    out = mrope(merge=2)(rows)["position_ids"][:, 0]
    # text 0 1, start 2, image from 3: t 3, h 3 3 3 4 4 4, w 3 4 5 3 4 5; end at 3 + 3, text 7
    assert out[:, :11].tolist() == [
        [0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7],
        [0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7],
        [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7],
    ]
    # the second document starts at 0 again: text 0, start 1, one image token at 2, end 3, text 4
    assert row.payload["segment_ids"][11] == 2
    assert out[:, 11:17].tolist() == [[0, 1, 2, 3, 4, 5]] * 3
    assert (out[:, 17:] == 0).all()  # padding


def test_text_only_rows_have_the_same_position_on_every_component() -> None:
    rows = packed(documents([[], [], []], 2, True, True), 8)
    out = mrope(merge=2)(rows)
    for axis in out["position_ids"]:
        assert np.array_equal(axis, out["text_position_ids"])


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"merge": 1}, r"record .*\(0, 0, 0\).*does not hold the 16 image tokens"),
        ({"merge": 3}, r"record .*\(0, 0, 0\).*not a grid of whole 3 x 3 merges"),
        ({"merge": 2, "image_token_id": START}, r"does not hold the 4 image tokens \(id 8\)"),
    ],
)
def test_a_grid_or_an_id_the_tokenizer_did_not_use_is_refused_naming_the_row(
    kw: dict[str, Any], message: str
) -> None:
    rows = packed(documents([[(1, (1, 2, 2))]], 2, True, True), 16)
    collate = training_collate(
        mask_field=None, images="images", positions="mrope", **{"image_token_id": IMAGE, **kw}
    )
    with pytest.raises(ValueError, match=message):
        collate(rows)


def test_images_without_a_grid_are_refused() -> None:
    (row,) = packed(documents([[(1, (1, 1, 1))]], 1, True, True), 8)
    gridless = SampleRecord(
        row.meta, {k: v for k, v in row.payload.items() if k != "image_grid_thw"}
    )
    with pytest.raises(ValueError, match=r"patch grid \(image_grid_thw\).*1 image spans but 0"):
        mrope(merge=1)([gridless])


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match="positions must be one of '1d', 'mrope'"):
        training_collate(positions="3d")
    with pytest.raises(ValueError, match="needs merge= and image_token_id="):
        training_collate(positions="mrope", merge=2)
    with pytest.raises(ValueError, match="go with positions='mrope'"):
        training_collate(merge=2)
    with pytest.raises(ValueError, match="merge"):
        training_collate(positions="mrope", merge=0, image_token_id=1)


def test_the_default_collate_keeps_its_identity() -> None:
    assert "positions" not in training_collate().__getstate__()
    assert "positions='mrope'" in repr(mrope(merge=2))


# ------------------------------------------------------------------- a real pipeline
def token_id(tok: Tokenizer, name: str) -> int:
    found = tok.token_to_id(name)
    assert found is not None
    return int(found)


def test_a_pipeline_of_real_images_gets_the_reference_positions() -> None:
    tok = vision_bpe()
    image = token_id(tok, "<|image|>")
    rng = np.random.default_rng(0)
    items: list[dict[str, Any]] = []
    for i in range(40):
        sides = [
            (int(rng.integers(8, 40)), int(rng.integers(8, 40))) for _ in range((1 + i % 5) // 2)
        ]
        items.append(
            {
                "content": ["a red square", None, "and", None, "a blue circle"][: 1 + i % 5],
                "images": [rng.integers(0, 255, (h, w, 3)).astype(np.uint8) for h, w in sides],
            }
        )
    ops = [
        fetch(),
        tokenize_interleaved(
            tok,
            image_token_id=image,
            image_start_id=token_id(tok, "<|vision_start|>"),
            image_end_id=token_id(tok, "<|vision_end|>"),
            patch_size=4,
            merge=2,
            eos_id=token_id(tok, EOT),
        ),
        pack_sequences(48, pad_id=0, extra_fields={"loss_mask": 0}, images="images"),
    ]
    with zephon.Pipeline(ListSource(items), ops).iter() as loader:
        rows = [r.payload for r in loader]
    assert sum(len(row["images"]) for row in rows) == sum(len(i["images"]) for i in items) > 0
    collate = training_collate(
        mask_field=None, images="images", positions="mrope", merge=2, image_token_id=image
    )
    with zephon.Pipeline(ListSource(items), [*ops, batch(4, collate=collate)]).iter() as loader:
        got = np.concatenate([b.payload["position_ids"] for b in loader], axis=1)
    assert got.shape == (3, len(rows), 48)
    for r, row in enumerate(rows):
        assert got[:, r].tolist() == reference(row, 2, image)


# ------------------------------------------------------------------- the model's own
@functools.cache
def qwen2_vl(merge: int) -> Any:
    """A tiny Qwen2-VL of transformers (random weights): its ``get_rope_index`` is the scheme."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    config = tiny_qwen2_vl_config(
        vocab_size=256,
        image=IMAGE,
        start=START,
        end=END,
        text={"bos_token_id": 1, "eos_token_id": 2},
        vision={"spatial_merge_size": merge},
        video_token_id=10,
    )
    return Qwen2VLModel(config)


@settings(max_examples=40, deadline=None)
@given(
    parts=st.lists(st.tuples(st.integers(0, 6), grids.map(lambda g: (1, g[1], g[2]))), max_size=3),
    merge=st.integers(1, 3),
)
def test_one_document_gets_the_positions_of_transformers_qwen2_vl(
    parts: list[tuple[int, tuple[int, int, int]]], merge: int
) -> None:
    import torch

    (doc,) = documents([parts], merge, True, True)
    (row,) = packed([doc], len(doc.payload["tokens"]))
    assert (row.payload["segment_ids"] == 1).all()
    ours = mrope(merge=merge)([row])["position_ids"][:, 0]
    model = qwen2_vl(merge)
    ids = torch.from_numpy(row.payload["tokens"].astype(np.int64))[None]
    grid = torch.from_numpy(row.payload["image_grid_thw"].astype(np.int64)).reshape(-1, 3)
    images = grid if len(grid) else None
    if "mm_token_type_ids" in inspect.signature(model.get_rope_index).parameters:
        theirs, _ = model.get_rope_index(ids, (ids == IMAGE).int(), images)
    else:  # transformers 4 finds the images by their start token
        theirs, _ = model.get_rope_index(ids, images)
    assert ours.tolist() == theirs[:, 0].tolist()
