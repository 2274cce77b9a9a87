"""``training_collate(pixel_layout="patches")``: the batch's images as the flattened patches of a
Qwen2-VL-style vision tower (``zephon.ops.patches``). Against transformers' own Qwen2-VL image
processor on pictures drawn with Pillow (normalized and raw), against a patch-by-patch reference
over random arrays, through a real pipeline from Parquet whose image tokens are the patches'
windows, and refusing an image whose size is not its grid's instead of resizing it."""

from __future__ import annotations

import functools
import io
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from chat_kit import EOT, tiny_qwen2_vl_config, vision_bpe
from hypothesis import given, settings
from hypothesis import strategies as st

import zephon
from zephon.errors import PatchLayoutError, ZephonError
from zephon.identity import identify
from zephon.ops import (
    TrainingCollate,
    batch,
    decode_images,
    fetch,
    normalize,
    pack_sequences,
    resize_images,
    tokenize_interleaved,
    training_collate,
)
from zephon.sources import ArrowSource, ListSource
from zephon.types import SampleCursor, SampleMeta, SampleRecord

Image = pytest.importorskip("PIL.Image")
ImageDraw = pytest.importorskip("PIL.ImageDraw")
pytestmark = pytest.mark.usefixtures("no_leftover_workers")

MEAN, STD = [0.48, 0.46, 0.41], [0.27, 0.26, 0.28]


def reference(
    images: list[np.ndarray], grids: list[tuple[int, int, int]], p: int, m: int, frames: int
) -> np.ndarray:
    """The patches one at a time, from what the vision tower takes: for each ``m x m`` window
    (row by row), for each patch in it (row by row), the ``p x p`` pixels of channel 0 ``frames``
    times, then channel 1, ... Images are CHW when float, else HWC (or HW, one channel)."""
    out = []
    for image, (_, gh, gw) in zip(images, grids, strict=True):
        if image.ndim == 2:
            chw = image[None]
        elif image.dtype.kind == "f":
            chw = image
        else:
            chw = np.moveaxis(image, -1, 0)
        for wy in range(gh // m):
            for wx in range(gw // m):
                for dy in range(m):
                    for dx in range(m):
                        y, x = (wy * m + dy) * p, (wx * m + dx) * p
                        values: list[Any] = []
                        for c in range(chw.shape[0]):
                            for _ in range(frames):
                                values += chw[c, y : y + p, x : x + p].ravel().tolist()
                        out.append(values)
    return np.array(out).reshape(len(out), -1)


def packed_row(i: int, images: list[np.ndarray], grids: list[tuple[int, int, int]], m: int) -> Any:
    """A packed row of one document: a text token, then each image's span of ``gh*gw/m**2``
    image tokens (id 7), then padding."""
    tokens: list[int] = [100]
    spans = []
    for _, gh, gw in grids:
        spans.append((len(tokens), len(tokens) + gh * gw // m**2))
        tokens += [7] * (gh * gw // m**2)
    tokens += [101, 0]
    n = len(tokens)
    payload = {
        "tokens": np.array(tokens, np.int32),
        "segment_ids": np.array([1] * (n - 1) + [0], np.int32),
        "positions": np.array([*range(n - 1), 0], np.int32),
        "images": images,
        "image_spans": np.array(spans, np.int32).reshape(-1, 2),
        "image_grid_thw": np.array(grids, np.int32).reshape(-1, 3),
    }
    return SampleRecord(SampleMeta(SampleCursor(0, i, (0, 0, i))), payload)


def same_length(rows: list[SampleRecord]) -> list[SampleRecord]:
    """The rows padded to one length, as a packer makes them."""
    longest = max(len(r.payload["tokens"]) for r in rows)
    out = []
    for r in rows:
        extra = longest - len(r.payload["tokens"])
        fields = {
            k: np.pad(r.payload[k], (0, extra)) for k in ("tokens", "segment_ids", "positions")
        }
        out.append(SampleRecord(r.meta, {**r.payload, **fields}))
    return out


def patches(**kw: Any) -> Any:
    return training_collate(mask_field=None, images="images", pixel_layout="patches", **kw)


# ------------------------------------------------------------------------------- the processor
def drawn(i: int, height: int, width: int) -> np.ndarray:
    """An RGB picture drawn with Pillow: a background, a box and a circle that differ per i."""
    image = Image.new("RGB", (width, height), ((40 * i) % 256, 200, (90 * i) % 256))
    draw = ImageDraw.Draw(image)
    draw.rectangle([i % 7, i % 5, width // 2, height // 3], fill=(250, 30 + i, 20))
    draw.ellipse([width // 3, height // 2, width - 1, height - 1], fill=(10, 20, 240 - i))
    draw.line([0, height - 1, width - 1, 0], fill=(255, 255, 255), width=3)
    return np.asarray(image)


@functools.cache
def qwen2_vl_processor(**kw: Any) -> Any:
    """transformers' Qwen2-VL image processor (its Pillow variant: the other needs
    torchvision), resizing nothing."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil(do_resize=False, **kw)


SIZES = [(28, 28), (56, 84), (112, 56), (84, 140), (28, 196)]


@pytest.mark.parametrize("normalized", [True, False])
def test_patches_equal_the_qwen2_vl_image_processor_s(normalized: bool) -> None:
    pictures = [drawn(i, h, w) for i, (h, w) in enumerate(SIZES)]
    if normalized:  # our normalize against the processor's rescale and normalize
        theirs = qwen2_vl_processor(image_mean=tuple(MEAN), image_std=tuple(STD))
        steps = [normalize(MEAN, STD, field="images")]
    else:  # raw pixels: uint8 HWC patches, the processor's values without rescale and normalize
        theirs = qwen2_vl_processor(do_rescale=False, do_normalize=False)
        steps = []
    expected = theirs([Image.fromarray(p) for p in pictures], return_tensors="np")
    items = [{"content": [f"picture {i}", None], "images": [p]} for i, p in enumerate(pictures)]
    ops = [
        fetch(),
        *steps,
        tokenize_interleaved(
            vision_bpe(),
            image_token_id=token_id("<|image|>"),
            patch_size=14,
            merge=2,
            eos_id=token_id(EOT),
        ),
        pack_sequences(24, open_bins=1, extra_fields={"loss_mask": 0}, images="images"),
        batch(2, collate=patches(patch_size=14, merge=2)),
    ]
    with zephon.Pipeline(ListSource(items), ops).iter() as loader:
        batches = [b.payload for b in loader]
    assert len(batches) > 1
    sizes = np.concatenate([b["image_sizes"] for b in batches])
    assert sizes.tolist() == [list(size) for size in SIZES]  # the pictures in their order
    got = np.concatenate([b["pixel_values"] for b in batches])
    assert got.dtype == (np.float32 if normalized else np.uint8)
    assert got.shape == expected["pixel_values"].shape
    assert got.shape == (sum(h * w for h, w in SIZES) // 14**2, 3 * 2 * 14 * 14)
    np.testing.assert_allclose(got, expected["pixel_values"], rtol=1e-5, atol=1e-5)
    grids = np.concatenate([b["image_grid_thw"] for b in batches])
    assert grids.tolist() == expected["image_grid_thw"].tolist()


# ------------------------------------------------------------------------------- the reference
@st.composite
def batches(draw: Any) -> tuple[list[list[np.ndarray]], list[list[tuple[int, int, int]]], int, int]:
    """Rows of small random images on grids of whole windows, one kind of image per batch."""
    p, m = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    kind = draw(st.sampled_from(["float chw", "uint8 hwc", "uint8 hw"]))
    channels = 1 if kind == "uint8 hw" else draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    images: list[list[np.ndarray]] = []
    grids: list[list[tuple[int, int, int]]] = []
    for _ in range(draw(st.integers(1, 3))):
        row_images, row_grids = [], []
        for _ in range(draw(st.integers(0, 3))):
            gh, gw = m * draw(st.integers(1, 3)), m * draw(st.integers(1, 3))
            h, w = gh * p, gw * p
            image: np.ndarray
            if kind == "float chw":
                image = rng.standard_normal((channels, h, w)).astype(np.float32)
            elif kind == "uint8 hwc":
                image = rng.integers(0, 256, (h, w, channels), dtype=np.uint8)
            else:
                image = rng.integers(0, 256, (h, w), dtype=np.uint8)
            row_images.append(image)
            row_grids.append((1, gh, gw))
        images.append(row_images)
        grids.append(row_grids)
    return images, grids, p, m


@settings(max_examples=150, deadline=None)
@given(batch_of=batches(), frames=st.integers(1, 3))
def test_patches_equal_a_patch_by_patch_reference(
    batch_of: tuple[list[list[np.ndarray]], list[list[tuple[int, int, int]]], int, int],
    frames: int,
) -> None:
    images, grids, p, m = batch_of
    rows = same_length([packed_row(r, im, g, m) for r, (im, g) in enumerate(zip(images, grids))])
    out = patches(patch_size=p, merge=m, temporal_patch_size=frames)(rows)
    flat_images = [image for row in images for image in row]
    flat_grids = [grid for row in grids for grid in row]
    if not flat_images:
        assert out["pixel_values"].shape == (0, 3 * frames * p * p)
        assert out["image_grid_thw"].shape == (0, 3)
        return
    expected = reference(flat_images, flat_grids, p, m, frames)
    assert out["pixel_values"].dtype == flat_images[0].dtype
    assert out["pixel_values"].shape == expected.shape
    assert np.array_equal(out["pixel_values"], expected)
    assert out["image_grid_thw"].tolist() == [list(g) for g in flat_grids]
    assert out["image_to_row"].tolist() == [r for r, row in enumerate(images) for _ in row]
    # each image's patches are its image tokens times merge**2
    tokens_of_rows = (out["input_ids"] == 7).sum(axis=1)
    windows = [sum(gh * gw for _, gh, gw in row) for row in grids]
    assert (tokens_of_rows * m * m).tolist() == windows
    assert len(out["pixel_values"]) == sum(windows)


# ------------------------------------------------------------------------------- a pipeline
def token_id(name: str) -> int:
    found = vision_bpe().token_to_id(name)
    assert found is not None
    return int(found)


def png(image: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def documents(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """60 captioned-picture documents in Parquet, pictures of sides whose shorter edge resizes to
    16 and longer to 16, 24 or 32: multiples of patch_size * merge = 8."""
    rows = []
    sides = [(32, 32), (32, 48), (48, 32), (32, 64), (24, 48), (16, 16)]
    for i in range(60):
        n = 1 + i % 3
        pictures = [drawn(i + k, *sides[(i + 2 * k) % len(sides)]) for k in range(n)]
        content: list[str | None] = []
        for k in range(n):
            content += [f"picture {k} of document {i}: a box and a circle", None]
        rows.append({"content": content, "images": [png(p) for p in pictures]})
    path = tmp_path_factory.mktemp("patches") / "documents.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=20)
    return path


def pipeline(path: Path, collate: Any, **kw: Any) -> zephon.Pipeline:
    ops = [
        fetch(),
        decode_images("images"),
        resize_images(16, field="images"),
        normalize(MEAN, STD, field="images"),
        tokenize_interleaved(
            vision_bpe(),
            image_token_id=token_id("<|image|>"),
            image_start_id=token_id("<|vision_start|>"),
            image_end_id=token_id("<|vision_end|>"),
            patch_size=4,
            merge=2,
            eos_id=token_id(EOT),
        ),
        pack_sequences(64, open_bins=2, extra_fields={"loss_mask": 0}, images="images"),
        batch(3, collate=collate),
    ]
    source = ArrowSource([str(path)], chunk_size=8, shuffle=True, seed=2)
    return zephon.Pipeline(source, ops, **{"lanes": 2, "epoch_chunks": 2, **kw})


def test_a_pipeline_s_image_tokens_are_the_patches_merged(documents: Path) -> None:
    collate = patches(patch_size=4, merge=2)
    with pipeline(documents, collate).iter() as loader:
        batches = [b.payload for b in loader]
    with pipeline(documents, training_collate(images="images")).iter() as loader:
        plain = [b.payload for b in loader]
    image = token_id("<|image|>")
    assert sum(len(b["image_to_row"]) for b in batches) == sum(1 + i % 3 for i in range(60))
    for got, images in zip(batches, plain, strict=True):
        grids = got["image_grid_thw"]
        assert {(t, gh * 4, gw * 4) for t, gh, gw in grids.tolist()} <= {
            (1, 16, 16),
            (1, 16, 24),
            (1, 24, 16),
            (1, 16, 32),
            (1, 32, 16),
        }
        windows = grids[:, 1] * grids[:, 2]
        assert got["pixel_values"].shape == (windows.sum(), 3 * 2 * 4 * 4)
        for r in range(len(got["input_ids"])):
            of_row = got["image_to_row"] == r
            assert (got["input_ids"][r] == image).sum() * 2 * 2 == windows[of_row].sum()
        # the same pixels as the images the plain collate hands over, cut into patches
        pixels = images["pixel_values"]
        if pixels.ndim == 4:  # of one size: stacked
            pictures = list(pixels)
        else:  # of different sizes: flattened one after the other
            pictures, at = [], 0
            for h, w in images["image_sizes"].tolist():
                pictures.append(pixels[at : at + 3 * h * w].reshape(3, h, w))
                at += 3 * h * w
        expected = reference(pictures, [tuple(g) for g in grids.tolist()], 4, 2, 2)
        assert np.array_equal(got["pixel_values"], expected.astype(np.float32))


def test_the_patches_are_the_same_on_process_lanes_and_after_a_resume(documents: Path) -> None:
    collate = patches(patch_size=4, merge=2)
    with pipeline(documents, collate).iter() as loader:
        full = [b.payload["pixel_values"] for b in loader]
    with pipeline(documents, collate).iter() as loader:
        for _ in range(4):
            next(loader)
        state = loader.state_dict()
    with pipeline(documents, collate, workers="process").iter(state=state) as loader:
        resumed = [b.payload["pixel_values"] for b in loader]
    assert len(resumed) == len(full) - 4
    for a, b in zip(resumed, full[4:], strict=True):
        assert np.array_equal(a, b)


def test_a_qwen2_vl_model_takes_the_batch_as_it_is(documents: Path) -> None:
    import torch
    import transformers

    image = token_id("<|image|>")
    config = tiny_qwen2_vl_config(
        vocab_size=512,
        image=image,
        start=token_id("<|vision_start|>"),
        end=token_id("<|vision_end|>"),
        vision={
            "hidden_size": 16,
            "patch_size": 4,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
    )
    torch.manual_seed(0)
    model = transformers.Qwen2VLForConditionalGeneration(config).eval()
    collate = patches(
        patch_size=4, merge=2, positions="mrope", image_token_id=image, shift_labels=False
    )
    with pipeline(documents, collate).iter() as loader:
        got = next(loader).payload
    keys = ("input_ids", "labels", "pixel_values", "image_grid_thw", "position_ids")
    inputs = {key: torch.from_numpy(got[key]) for key in keys}
    with torch.no_grad():  # the tower's features must fill the image tokens one for one
        assert torch.isfinite(model(**inputs).loss)


# ------------------------------------------------------------------------------- refusals
def test_an_image_whose_size_is_not_its_grid_s_is_refused_naming_it_never_resized() -> None:
    tok = vision_bpe()
    # 30 x 44 pixels: the tokenizer rounds up to whole 14-pixel windows, a 6 x 8 grid of 7-pixel
    # patches, 42 x 56 pixels the image does not have
    fits, does_not = np.zeros((28, 56, 3), np.uint8), np.zeros((30, 44, 3), np.uint8)
    items = [
        {"content": ["a", None], "images": [np.zeros((28, 28, 3), np.uint8)]},
        {"content": ["b", None, "c", None], "images": [fits, does_not]},
    ]
    ops = [
        fetch(),
        tokenize_interleaved(
            tok, image_token_id=token_id("<|image|>"), patch_size=7, merge=2, eos_id=token_id(EOT)
        ),
        pack_sequences(32, pad_id=0, open_bins=1, extra_fields={"loss_mask": 0}, images="images"),
    ]
    with zephon.Pipeline(ListSource(items), ops).iter() as loader:
        rows = list(loader)
    collate = patches(patch_size=7, merge=2)
    with pytest.raises(PatchLayoutError) as refused:
        collate(rows)
    message = str(refused.value)
    # both documents share the packed row: its third image
    assert "image 2 in 'images' of record SampleCursor(0, 0, (0, 0, 0)" in message
    assert (
        "is 30 x 44 pixels" in message and "6 x 8 grid of 7-pixel patches covers 42 x 56" in message
    )
    assert "multiples of patch_size * merge = 14" in message
    assert isinstance(refused.value, ValueError) and isinstance(refused.value, ZephonError)
    (row,) = rows
    fine = {**row.payload, "images": row.payload["images"][:2]}
    fine["image_grid_thw"] = fine["image_grid_thw"][:2]
    assert len(collate([SampleRecord(row.meta, fine)])["pixel_values"]) == 4 * 4 + 4 * 8
    # through a pipeline the error reaches the loop, never a resized image
    refusing = zephon.Pipeline(ListSource(items), [*ops, batch(2, collate=collate)])
    with pytest.raises(ZephonError, match=r"is 30 x 44 pixels"), refusing.iter() as loader:
        next(loader)


def test_a_patch_size_other_than_the_tokenizer_s_is_refused() -> None:
    rows = same_length([packed_row(0, [np.zeros((3, 8, 8), np.float32)], [(1, 2, 2)], 2)])
    patches(patch_size=4, merge=2)(rows)
    with pytest.raises(PatchLayoutError, match=r"is 8 x 8 pixels, but its 2 x 2 grid of 2-pixel"):
        patches(patch_size=2, merge=2)(rows)
    with pytest.raises(PatchLayoutError, match=r"grid \(t, h, w\) = \(1, 2, 2\), not one frame of"):
        patches(patch_size=4, merge=4)(rows)


@pytest.mark.parametrize(
    ("second", "match"),
    [
        (np.zeros((8, 8, 3), np.uint8), r"image 0 .* has 3 channel\(s\) of uint8, .* 3 of float32"),
        (np.zeros((1, 8, 8), np.float32), r"has 1 channel\(s\) of float32, .* 3 of float32"),
    ],
)
def test_images_of_a_batch_that_differ_in_kind_are_refused(second: np.ndarray, match: str) -> None:
    rows = same_length(
        [
            packed_row(0, [np.zeros((3, 8, 8), np.float32)], [(1, 2, 2)], 2),
            packed_row(1, [second], [(1, 2, 2)], 2),
        ]
    )
    with pytest.raises(PatchLayoutError, match=match):
        patches(patch_size=4, merge=2)(rows)


def test_images_without_their_grids_are_refused() -> None:
    (row,) = same_length([packed_row(0, [np.zeros((3, 8, 8), np.float32)], [(1, 2, 2)], 2)])
    gridless = SampleRecord(
        row.meta, {k: v for k, v in row.payload.items() if k != "image_grid_thw"}
    )
    with pytest.raises(PatchLayoutError, match=r"holds 1 images in 'images' and 0 patch grids"):
        patches(patch_size=4, merge=2)([gridless])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"pixel_layout": "tiles"}, "pixel_layout must be one of 'images', 'patches'"),
        ({"pixel_layout": "patches", "patch_size": 14, "merge": 2}, "needs images= and the"),
        ({"pixel_layout": "patches", "images": "images", "merge": 2}, "needs images= and the"),
        ({"pixel_layout": "patches", "images": "images", "patch_size": 14}, "needs images= and"),
        ({"patch_size": 14}, "go with pixel_layout='patches'"),
        ({"temporal_patch_size": 1}, "go with pixel_layout='patches'"),
        ({"merge": 2}, "go with positions='mrope'"),
        (
            {"pixel_layout": "patches", "images": "i", "patch_size": 0, "merge": 2},
            "patch_size",
        ),
        (
            {"pixel_layout": "patches", "images": "i", "patch_size": 2, "merge": 2,
             "temporal_patch_size": 0},
            "temporal_patch_size",
        ),
    ],
)  # fmt: skip
def test_bad_options_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        training_collate(**kwargs)


def test_the_default_layout_keeps_the_identity_and_the_patches_one_is_named() -> None:
    assert identify(training_collate(images="images")) == {
        "object": "zephon.ops.training.TrainingCollate",
        "state": {"ignore_index": -100, "mask_field": "loss_mask", "images": "images"},
    }
    collate = patches(patch_size=14, merge=2)
    state = identify(collate)["state"]
    assert (state["pixel_layout"], state["patch_size"], state["merge"]) == ("patches", 14, 2)
    assert "temporal_patch_size" not in state  # 2, the default
    assert identify(patches(patch_size=14, merge=2, temporal_patch_size=1)) != identify(collate)
    again = pickle.loads(pickle.dumps(collate))
    assert (again.pixel_layout, again.patch_size, again.temporal_patch_size) == ("patches", 14, 2)
    assert "pixel_layout='patches', patch_size=14" in repr(collate)
    # a collate pickled before the option existed comes back with the images' own layout
    old = TrainingCollate.__new__(TrainingCollate)
    old.__setstate__({"mask_field": "loss_mask", "ignore_index": -100, "images": "images"})
    assert (old.pixel_layout, old.patch_size, old.temporal_patch_size) == ("images", None, 2)
    # one merge for both: the M-RoPE positions and the patches read the same tokenizer
    both = patches(patch_size=14, merge=2, positions="mrope", image_token_id=7)
    assert both.merge == 2
