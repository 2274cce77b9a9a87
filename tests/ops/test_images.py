"""Images as samples: real images drawn and encoded with Pillow (JPEG, PNG, WebP) in a Parquet
file, decoded and augmented through pipelines; the pixels are a pure function of the seed and
the sample's cursor, whatever the lanes, workers or resumes."""

from __future__ import annotations

import io
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pipeline_kit import assert_resumes_at, run

import zephon
from zephon.errors import OperatorError
from zephon.ops import (
    batch,
    center_crop,
    decode_images,
    fetch,
    map_transform,
    normalize,
    random_flip,
    random_resized_crop,
    resize_images,
)
from zephon.ops.base import introduce_neighbours
from zephon.ops.images import ImageTransform
from zephon.sources import ArrowSource, ListSource, RawImage
from zephon.testing import check_operator

Image = pytest.importorskip("PIL.Image")
ImageDraw = pytest.importorskip("PIL.ImageDraw")
ImageOps = pytest.importorskip("PIL.ImageOps")
pytestmark = pytest.mark.usefixtures("no_leftover_workers")

FORMATS = ("PNG", "JPEG", "WEBP")


def drawn(i: int) -> Any:
    """A picture that differs per index: a colored background, a rectangle and a line."""
    w, h = 40 + (i * 7) % 50, 30 + (i * 11) % 40
    image = Image.new("RGB", (w, h), ((i * 37) % 256, (i * 91) % 256, (i * 53) % 256))
    draw = ImageDraw.Draw(image)
    draw.rectangle([i % 10, i % 7, w // 2, h // 2], fill=(255 - i % 256, 20, 200))
    draw.line([0, h - 1, w - 1, 0], fill=(0, 255, 0), width=2)
    return image


def encoded(i: int, fmt: str) -> bytes:
    buf = io.BytesIO()
    drawn(i).save(buf, format=fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    return buf.getvalue()


@pytest.fixture
def images(tmp_path: Path) -> Path:
    n = 120
    table = pa.table(
        {
            "image": [encoded(i, FORMATS[i % 3]) for i in range(n)],
            "caption": [f"picture {i}" for i in range(n)],
        }
    )
    path = tmp_path / "images.parquet"
    pq.write_table(table, path, row_group_size=25)
    return path


def captions_and_images(records):
    return [(r.payload["caption"], r.payload["image"]) for r in records]


def augmented(path: Path, **kw) -> zephon.Pipeline:
    ops = [
        fetch(),
        decode_images(),
        resize_images(48, max_size=80),
        random_resized_crop(32, scale=(0.3, 1.0), seed=7),
        random_flip(seed=7),
        batch(4, collate=captions_and_images),
    ]
    return zephon.Pipeline(ArrowSource([str(path)], chunk_size=16, shuffle=True, seed=3), ops, **kw)


def by_caption(p: zephon.Pipeline, state=None) -> dict[str, bytes]:
    with p.iter(state=state) as loader:
        return {caption: image.tobytes() for b in loader for caption, image in b.payload}


def test_decoding_gives_the_writers_pixels(images: Path):
    p = zephon.Pipeline(ArrowSource([str(images)]), [fetch(), decode_images()])
    got = {r.payload["caption"]: r.payload["image"] for r in p}
    assert len(got) == 120
    for i in (0, 3, 5):  # PNG and lossless WebP are exact
        assert np.array_equal(got[f"picture {i}"], np.asarray(drawn(i)))
    jpeg = got["picture 1"]
    assert jpeg.shape == np.asarray(drawn(1)).shape and jpeg.dtype == np.uint8


@pytest.mark.parametrize(("lanes", "workers"), [(3, "inline"), (2, "process"), (4, "thread")])
def test_the_same_sample_gets_the_same_pixels_on_any_lanes_and_workers(images, lanes, workers):
    reference = by_caption(augmented(images))
    got = by_caption(augmented(images, lanes=lanes, workers=workers))
    assert got == reference
    shapes = {np.frombuffer(v, np.uint8).size for v in got.values()}
    assert shapes == {32 * 32 * 3}


def test_a_resumed_run_continues_with_bitwise_equal_pixels(images):
    p = augmented(images, lanes=2, workers="process")
    with p.iter() as loader:
        head = [b.payload for _, b in zip(range(7), loader)]
        state = loader.state_dict()
    with p.iter(state=state) as resumed:
        tail = [b.payload for b in resumed]
    with p.iter() as full:
        everything = [b.payload for b in full]
    flat = lambda batches: [(c, img.tobytes()) for b in batches for c, img in b]  # noqa: E731
    assert flat(head) + flat(tail) == flat(everything)


def test_random_draws_differ_across_samples_and_seeds(images):
    a = by_caption(augmented(images))
    p = zephon.Pipeline(
        ArrowSource([str(images)], chunk_size=16, shuffle=True, seed=3),
        [fetch(), decode_images(), resize_images(48, max_size=80),
         random_resized_crop(32, scale=(0.3, 1.0), seed=8), random_flip(seed=8)],
    )  # fmt: skip
    b = {r.payload["caption"]: r.payload["image"].tobytes() for r in p}
    assert sum(a[k] != b[k] for k in a) > 100  # another seed, other crops


@pytest.mark.parametrize("augmented", [False, True])
def test_a_corrupt_image_is_named_or_dropped_with_its_tombstone(tmp_path: Path, augmented):
    good = [encoded(i, "PNG") for i in range(10)]
    good[4] = b"\x89PNG this is not an image"
    path = tmp_path / "some-bad.parquet"
    pq.write_table(pa.table({"image": good, "caption": [str(i) for i in range(10)]}), path)
    # With augmentations after it, decode_images applies them inside: it still names and drops.
    after = [resize_images(16), random_flip(seed=1)] if augmented else []
    raising = zephon.Pipeline(ArrowSource([str(path)]), [fetch(), decode_images(), *after])
    with pytest.raises(OperatorError, match=r"decode_images\(image\).*\(0, 0, 4\)"):
        list(raising)
    dropping = zephon.Pipeline(
        ArrowSource([str(path)]), [fetch(), decode_images(on_error="drop"), *after]
    )
    with dropping.iter() as loader:
        kept = [(r.payload["caption"], r.payload["image"].shape) for r in loader]
        assert loader.stats()["tombstones"] == 1
    assert [caption for caption, _ in kept] == [str(i) for i in range(10) if i != 4]
    assert not augmented or all(min(shape[:2]) == 16 for _, shape in kept)


def test_max_pixels_scales_large_images_down(images):
    p = zephon.Pipeline(ArrowSource([str(images)]), [fetch(), decode_images(max_pixels=500)])
    assert all(r.payload["image"].shape[0] * r.payload["image"].shape[1] <= 500 for r in p)


def test_center_crop_and_normalize_shape_the_encoder_input(images):
    p = zephon.Pipeline(
        ArrowSource([str(images)]),
        [fetch(), decode_images(), center_crop(24), normalize([0.5, 0.5, 0.5], [0.25, 0.25, 0.25])],
    )
    out = [r.payload["image"] for r in p]
    assert all(x.shape == (3, 24, 24) and x.dtype == np.float32 for x in out)
    raw = np.asarray(drawn(0))
    top, left = (raw.shape[0] - 24) // 2, (raw.shape[1] - 24) // 2
    expected = (raw[top : top + 24, left : left + 24].transpose(2, 0, 1) / 255.0 - 0.5) / 0.25
    assert np.allclose(out[0], expected, atol=1e-6)


def test_a_list_of_images_gets_one_draw_per_image():
    from zephon.types import SampleCursor, SampleMeta, SampleRecord

    frames = [np.full((10, 12, 3), v, np.uint8) for v in range(4)]
    rec = SampleRecord(SampleMeta(SampleCursor(0, 0, (0, 0, 0))), {"image": frames})
    flip = random_flip(p=0.5, seed=1)
    flip.start_epoch(0, 0)
    (out,) = flip.process_many([rec])
    assert len(out.payload["image"]) == 4
    check_operator(random_flip(seed=2), [rec])


# ------------------------------------------------------------------ augmenting as each is decoded
def _unchanged(payload: dict) -> dict:
    return payload


def _pixels(source: Any, between: list, chain: list, **kw) -> list[Any]:
    """The images a pipeline decoding ``source``'s images delivers, ``between`` right after
    ``decode_images`` and ``chain`` after them."""
    p = zephon.Pipeline(source, [fetch(), decode_images(**kw), *between, *chain])
    with p.iter() as loader:
        return [r.payload["image"] for r in loader]


def _equal(a: list[Any], b: list[Any]) -> bool:
    def flat(v: Any) -> list[Any]:
        return [x for item in v for x in flat(item)] if isinstance(v, list) else [v]

    left, right = flat(a), flat(b)
    return len(left) == len(right) and all(
        x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y)
        for x, y in zip(left, right)
    )


CHAINS: dict[str, Callable[[], list[Any]]] = {
    "resize, center crop": lambda: [resize_images(48, max_size=80), center_crop(24)],
    "same size": lambda: [resize_images(max_size=10_000)],  # every image keeps its size
    "crop, flip, normalize": lambda: [
        random_resized_crop(32, scale=(0.3, 1.0), seed=7),
        random_flip(seed=7),
        normalize([0.5, 0.4, 0.3], [0.2, 0.2, 0.2]),
    ],
    "flip first": lambda: [random_flip(p=0.5, seed=3), resize_images(20)],
}


@pytest.mark.parametrize("mode", ["RGB", "L", "RGBA"])
@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_augmentations_applied_as_each_image_is_decoded_give_the_same_pixels(images, mode, chain):
    def make() -> list[Any]:
        ops = CHAINS[chain]()
        # normalize's mean and std are for three channels
        return ops if mode == "RGB" else [op for op in ops if op.kind != "normalize"]

    def source() -> ArrowSource:
        return ArrowSource([str(images)], chunk_size=16)

    kw: dict[str, Any] = {"mode": mode, "max_pixels": 2_000 if mode == "L" else None}
    augmented = _pixels(source(), [], make(), **kw)
    # An operator in between takes the decoded images as arrays: each augmentation runs alone.
    alone = _pixels(source(), [map_transform(_unchanged)], make(), **kw)
    assert len(augmented) == 120 and _equal(augmented, alone)


def test_lists_of_images_and_images_by_path_are_augmented_as_decoded(tmp_path: Path):
    rows = []
    for i in range(12):
        paths = []
        for k, fmt in enumerate(FORMATS[: 1 + i % 3]):
            path = tmp_path / f"{i}-{k}.{fmt.lower()}"
            drawn(i + k).save(path, format=fmt)
            paths.append(str(path))
        rows.append({"image": paths if i % 2 else paths[0]})
    chain = lambda: [random_resized_crop(16, seed=1), random_flip(seed=2)]  # noqa: E731
    augmented = _pixels(ListSource(rows), [], chain())
    alone = _pixels(ListSource(rows), [map_transform(_unchanged)], chain())
    assert _equal(augmented, alone)


class _OwnAugmentation(ImageTransform):
    """An augmentation of one's own: a subclass naming its field, with ``transform`` only."""

    def __init__(self, field: str = "image"):
        self._named(field)


class _Stamped(_OwnAugmentation):
    """Fails on images 30 pixels high; keeps the first 10 columns of any other."""

    kind = "stamped"

    def transform(self, image: np.ndarray, rng: Any) -> np.ndarray:
        if image.shape[0] == 30:
            raise ValueError("30 pixels high")
        return image[:, :10].copy()


class _OwnBatches(_Stamped):
    """One that handles its micro-batches itself: decode_images leaves it to run alone."""

    def process_many(self, records: list) -> list:
        return super().process_many(records)


class _LaneStamp(_OwnAugmentation):
    """Writes the lane that started it (``start_epoch``) into the pixels."""

    kind = "lane_stamp"

    def transform(self, image: np.ndarray, rng: Any) -> np.ndarray:
        return np.full((1, 1), 100 + self.lane_id, np.uint8)


class _PillowSeen(_OwnAugmentation):
    """Takes Pillow images too, and says which it got: 1 for Pillow's."""

    kind = "pillow_seen"
    takes_pillow = True

    def transform(self, image: Any, rng: Any) -> np.ndarray:
        return np.full((1, 1), not isinstance(image, np.ndarray), np.uint8)


@pytest.mark.parametrize("workers", ["inline", "thread", "process"])
def test_the_augmentation_right_after_decoding_gets_pillows_image(workers):
    def seen(between: list) -> set[int]:
        ops = [fetch(), decode_images(), *between, _PillowSeen()]
        p = zephon.Pipeline(ListSource(rows, chunk_size=2), ops, lanes=2, workers=workers)
        return {int(r.payload["image"][0, 0]) for r in p}

    rows = [{"image": encoded(i, "PNG")} for i in range(8)]
    assert seen([]) == {1}
    assert seen([map_transform(_unchanged)]) == {0}


@pytest.mark.parametrize("workers", ["inline", "thread", "process"])
def test_an_augmentation_applied_inside_decoding_is_the_one_its_lane_started(workers):
    rows = [{"image": encoded(i, "PNG")} for i in range(8)]
    ops = [fetch(), decode_images(), _LaneStamp()]
    p = zephon.Pipeline(ListSource(rows, chunk_size=2), ops, lanes=2, workers=workers)
    stamps = {int(r.payload["image"][0, 0]) for r in p}
    assert stamps == {100, 101}


def test_which_operators_join_the_decoding():
    decode, resize, other_field = decode_images(), resize_images(20), resize_images(20, field="x")
    crop, own, stamped = center_crop(8), _OwnBatches(), _Stamped()

    def joined(*chain: Any, skips: tuple[bool, ...] | None = None) -> list:
        introduce_neighbours(chain, skips or (False,) * len(chain))
        return list(decode._then)

    assert joined(decode, resize, crop, stamped) == [resize, crop, stamped]
    assert joined(decode, other_field, resize) == []  # another field comes between
    assert joined(decode, own, resize) == []  # its own process_many: it runs alone
    assert joined(decode, resize, own, crop) == [resize]
    # Not across operators that skip failing records differently.
    assert joined(decode, resize, crop, skips=(False, True, True)) == []
    assert resize._applied_by is None and crop._applied_by is None


def test_the_pipelines_own_operators_are_left_as_they_were(images):
    decode, resize = decode_images(), resize_images(20)
    p = zephon.Pipeline(ArrowSource([str(images)], chunk_size=16), [fetch(), decode, resize])
    assert all(r.payload["image"].shape[0] == 20 or r.payload["image"].shape[1] == 20 for r in p)
    # Only each lane's copies were joined: these run on their own as before.
    assert decode._then == [] and resize._applied_by is None
    rec = next(iter(zephon.Pipeline(ArrowSource([str(images)]), [fetch(), decode_images()])))
    (out,) = resize.process_many([rec])
    assert min(out.payload["image"].shape[:2]) == 20


def test_an_augmentation_failing_inside_decoding_is_named_and_never_dropped(images):
    for on_error in ("raise", "drop"):
        p = zephon.Pipeline(
            ArrowSource([str(images)], chunk_size=16),
            [fetch(), decode_images(on_error=on_error), resize_images(max_size=999), _Stamped()],
        )  # images 0, 40 and 80 are 30 pixels high
        with pytest.raises(OperatorError, match=r"'stamped\(image\)'.*30 pixels high") as info:
            list(p)
        assert info.value.operator == "stamped(image)"


def test_skipping_an_augmentation_inside_decoding_skips_the_same_samples(images):
    def kept(between: list) -> tuple[list[bytes], int]:
        p = zephon.Pipeline(
            ArrowSource([str(images)], chunk_size=16),
            [fetch(), decode_images(), *between, _Stamped()],
            on_error="skip",
        )
        with p.iter() as loader:
            out = [r.payload["image"].tobytes() for r in loader]
            return out, loader.stats()["skipped"]

    joined, skipped = kept([])
    alone, skipped_alone = kept([map_transform(_unchanged)])
    assert joined == alone and skipped == skipped_alone > 0


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="mode"):
        decode_images(mode="CMYK")
    with pytest.raises(ValueError, match="on_error"):
        decode_images(on_error="skip")
    with pytest.raises(ValueError, match="shortest_edge"):
        resize_images()
    with pytest.raises(ValueError, match="scale"):
        random_resized_crop(8, scale=(0.5, 0.2))
    with pytest.raises(ValueError, match="p must be"):
        random_flip(1.5)
    with pytest.raises(ValueError, match="std"):
        normalize([0.5], [0.0])


# ------------------------------------------------------------------ images by URI
def _by_uri_and_inline(store: Any, n: int) -> tuple[list[dict], list[dict]]:
    """The same ``n`` encoded images twice: as objects in the bucket, by URI, and inline."""
    inline, by_uri = [], []
    for i in range(n):
        data = encoded(i, FORMATS[i % 3])
        store.overwrite(f"images/{i}.img", data)
        inline.append({"image": data, "caption": f"picture {i}"})
        uri = f"{store.scheme}://{store.name}/images/{i}.img"
        by_uri.append({"image": uri, "caption": f"picture {i}"})
    return by_uri, inline


def _decoded(items: list[dict], **kw: Any) -> dict[str, bytes]:
    ops = [fetch(), decode_images(), resize_images(24)]
    p = zephon.Pipeline(ListSource(items, chunk_size=4), ops, **kw)
    with p.iter() as loader:
        return {r.payload["caption"]: r.payload["image"].tobytes() for r in loader}


@pytest.mark.parametrize(("lanes", "workers"), [(1, "inline"), (2, "process")])
def test_images_by_uri_decode_to_the_pixels_of_the_same_bytes_inline(store, lanes, workers):
    by_uri, inline = _by_uri_and_inline(store, 12)
    reference = _decoded(inline)
    assert len(reference) == 12
    assert _decoded(by_uri, lanes=lanes, workers=workers) == reference


def test_a_missing_image_object_is_named_or_dropped_with_its_tombstone(store):
    by_uri, _ = _by_uri_and_inline(store, 6)
    missing = f"{store.scheme}://{store.name}/images/gone.png"
    by_uri[2]["image"] = missing
    raising = zephon.Pipeline(ListSource(by_uri), [fetch(), decode_images()])
    with pytest.raises(OperatorError, match=r"\(0, 0, 2\).*FetchError.*gone\.png.*does not exist"):
        list(raising)
    dropping = zephon.Pipeline(ListSource(by_uri), [fetch(), decode_images(on_error="drop")])
    with dropping.iter() as loader:
        kept = [r.payload["caption"] for r in loader]
        assert loader.stats()["tombstones"] == 1
    assert kept == [f"picture {i}" for i in range(6) if i != 2]


def test_an_image_the_storage_keeps_failing_is_never_skipped(bucket, failing_proxy):
    # A read that gave up on a storage outage may well pass on the next run: skipping it would
    # make the stream depend on the outage, so it raises as on_error="raise" would.
    by_uri, _ = _by_uri_and_inline(bucket, 4)
    bucket.point_at(failing_proxy.endpoint)
    failing_proxy.fail_paths = {"/images/2.img": 100}
    pipeline = zephon.Pipeline(ListSource(by_uri), [fetch(), decode_images()], on_error="skip")
    with pytest.raises(OperatorError, match=r"\(0, 0, 2\).*images/2\.img.*gave up"):
        list(pipeline)


@pytest.mark.parametrize(("lanes", "workers"), [(1, "inline"), (2, "process")])
def test_images_by_uri_resume_exactly(store, lanes, workers):
    by_uri, _ = _by_uri_and_inline(store, 16)
    by_uri[5]["image"] = f"{store.scheme}://{store.name}/images/gone.png"  # dropped on every run
    ops = [
        fetch(),
        decode_images(on_error="drop"),
        random_resized_crop(16, scale=(0.5, 1.0), seed=3),
        batch(3, collate=captions_and_images),
    ]
    pipeline = zephon.Pipeline(
        ListSource(by_uri, chunk_size=4, shuffle=True, seed=2), ops, lanes=lanes, workers=workers
    )
    with pipeline.iter() as loader:
        full = run(loader)
    assert sum(len(item[2]) for item in full) == 15
    assert_resumes_at(pipeline, [1, 3], full)


def test_a_skipped_augmentation_inside_decoding_is_reported_under_its_own_name(images):
    # Run inside decode_images or on its own, the skip report names the augmentation that failed.
    def reports(between: list) -> list[tuple[str, str]]:
        p = zephon.Pipeline(
            ArrowSource([str(images)], chunk_size=16),
            [fetch(), decode_images(), *between, _Stamped()],
            on_error="skip",
        )
        with p.iter() as loader:
            list(loader)
            return [(s["operator"], s["error"]) for s in loader.skipped()]

    joined, alone = reports([]), reports([map_transform(_unchanged)])
    assert joined == alone
    assert joined and {operator for operator, _ in joined} == {"stamped(image)"}


def test_an_undecodable_image_is_named_by_its_path_and_its_place_in_the_list(tmp_path: Path):
    paths = []
    for i in range(3):
        paths.append(str(tmp_path / f"photo-{i}.jpg"))
        drawn(i).save(paths[-1], format="JPEG")
    whole = Path(paths[1]).read_bytes()
    Path(paths[1]).write_bytes(whole[: len(whole) // 2])  # truncated: Pillow names no file
    rows = [{"images": [paths[0]], "image": paths[0]}, {"images": paths, "image": paths[1]}]
    for field, which in (("images", f"image 1 of field 'images' ({paths[1]!r})"),
                         ("image", f"image {paths[1]!r}")):  # fmt: skip
        ops = [fetch(), decode_images(field)]
        with pytest.raises(OperatorError) as info:
            list(zephon.Pipeline(ListSource(rows), ops))
        assert f"(sample_id=(0, 0, 1)): {which}: OSError" in str(info.value)
        with zephon.Pipeline(ListSource(rows), ops, on_error="skip").iter() as loader:
            assert len(list(loader)) == 1
            (skipped,) = loader.skipped()
        assert skipped["error"].startswith(f"{which}: OSError")


@pytest.mark.parametrize("max_pixels", [None, 200])
@pytest.mark.parametrize("mode", ["L", "RGB", "RGBA"])
def test_a_16_bit_grayscale_image_decodes_to_its_8_bit_values_not_white(mode, max_pixels):
    deep = (np.arange(24 * 36, dtype=np.uint16).reshape(24, 36) * 75).astype(np.uint16)
    shallow = (deep >> 8).astype(np.uint8)  # what a viewer shows of it, in 8 bits
    files = []
    for pixels in (deep, shallow):
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="PNG")
        files.append(buf.getvalue())
    assert Image.open(io.BytesIO(files[0])).mode == "I;16"
    ops = [fetch(), decode_images(mode=mode, max_pixels=max_pixels)]
    p = zephon.Pipeline(ListSource([{"image": data} for data in files]), ops)
    got, expected = (r.payload["image"] for r in p)
    assert np.array_equal(got, expected)
    assert max_pixels is not None or np.array_equal(got[..., 0] if mode != "L" else got, shallow)


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("mode", ["RGB", "L"])
def test_a_photo_with_an_exif_orientation_decodes_upright(mode, orientation):
    # As a viewer, Pillow's ImageOps.exif_transpose and Hugging Face datasets show it.
    photo = drawn(3)  # 61 x 63, not symmetric
    exif = photo.getexif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    photo.save(buf, format="PNG", exif=exif)
    upright = ImageOps.exif_transpose(Image.open(io.BytesIO(buf.getvalue()))).convert(mode)
    rows = [{"image": buf.getvalue()}]
    (got,) = (
        r.payload["image"]
        for r in zephon.Pipeline(ListSource(rows), [fetch(), decode_images(mode=mode)])
    )
    assert np.array_equal(got, np.asarray(upright))
    ops = [fetch(), decode_images(mode=mode, max_pixels=1000), resize_images(20)]
    (small,) = (r.payload["image"] for r in zephon.Pipeline(ListSource(rows), ops))
    assert small.shape[:2] == (20, round(20 * upright.width / upright.height)) or (
        small.shape[:2] == (round(20 * upright.height / upright.width), 20)
    )
    assert (small.shape[0] > small.shape[1]) == (upright.height > upright.width)


def test_a_left_right_and_a_top_bottom_flip_with_the_default_seed_are_drawn_apart():
    # With one draw for both, an image was flipped both ways or not at all, never mirrored once.
    image = np.arange(12, dtype=np.uint8).reshape(3, 4)
    outcomes = {
        "neither": image,
        "left-right": image[:, ::-1],
        "top-bottom": image[::-1],
        "both": image[::-1, ::-1],
    }
    ops = [fetch(), random_flip(), random_flip(horizontal=False)]
    seen: Counter[str] = Counter()
    for r in zephon.Pipeline(ListSource([{"image": image}] * 200), ops):
        (which,) = [k for k, v in outcomes.items() if np.array_equal(r.payload["image"], v)]
        seen[which] += 1
    assert set(seen) == set(outcomes) and min(seen.values()) > 20


@pytest.mark.parametrize("max_pixels", [None, 40])
@pytest.mark.parametrize("mode", ["L", "RGB", "RGBA"])
def test_raw_pixels_decode_as_the_same_picture_encoded(mode, max_pixels):
    # A RawImage (an MDS or LitData "pil" value) goes the way of an encoded file: the same mode
    # conversion, scaling down and augmentations; a 16-bit one becomes its high bytes.
    pictures = [drawn(4), drawn(5).convert("L"), drawn(6).convert("RGBA"), drawn(7).convert("1")]
    deep = (np.arange(8 * 11, dtype=np.uint16).reshape(8, 11) * 700).astype(np.uint16)
    pictures.append(Image.fromarray(deep))
    assert pictures[-1].mode == "I;16"
    rows = [
        {
            "raw": [RawImage(p.mode, p.width, p.height, p.tobytes()) for p in pictures],
            "png": [encoded_picture(p) for p in pictures],
        }
    ]
    augmentations: list[Callable[..., Any]] = [
        partial(resize_images, 6),
        partial(random_flip, seed=2),
    ]

    def decoded(field: str, chain: list[Callable[..., Any]]) -> list[np.ndarray]:
        ops = [fetch(), decode_images(field, mode=mode, max_pixels=max_pixels)]
        ops += [make(field=field) for make in chain]
        (payload,) = (r.payload for r in zephon.Pipeline(ListSource(rows), ops))
        return list(payload[field])

    for chain in ([], augmentations):
        got, want = decoded("raw", chain), decoded("png", chain)
        assert len(got) == len(want) == len(pictures)
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b)
    short = RawImage("RGB", 4, 4, bytes(47))  # one byte short of its pixels
    with pytest.raises(OperatorError, match=r"\(sample_id=\(0, 0, 0\)\): ValueError: not enough"):
        list(zephon.Pipeline(ListSource([{"image": short}]), [fetch(), decode_images()]))


def encoded_picture(image: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()
