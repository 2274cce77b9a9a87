"""LitDataSource over directories written by LitData's own writer (``BinaryWriter``), raw and
in each of its zstd layouts, locally and on the loopback S3 server."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import Counter
from functools import partial
from operator import itemgetter
from pathlib import Path
from typing import Any

import litdata
import numpy as np
import pytest
from format_kit import (
    assert_a_changed_dataset_is_refused,
    assert_a_changed_object_is_refused,
    assert_a_copy_reads_the_same,
    assert_a_killed_worker_resumes_exactly,
    assert_a_shard_cache_bounds_decompressed_shards,
    assert_a_small_shard_cache_resumes_exactly_in_process_lanes,
    assert_columns_pick_and_order,
    assert_each_sample_twice,
    assert_resumes_exactly,
    assert_resumes_on_two_ranks_and_relanes,
    assert_same_values,
    every_sample,
    largest_decompressed_shard,
)
from litdata.streaming.writer import BinaryWriter
from PIL import Image

import zephon
from zephon.errors import FetchError, PlanError
from zephon.ops import batch, decode_images, fetch, random_resized_crop
from zephon.sources import LitDataSource, RawImage, ShardCache, open_source

N = 40
#: LitData's zstd layouts: framed (its default), whole-file ``.zstd.bin``, one frame per item.
LAYOUTS = {
    "raw": {},
    "batch": {"compression": "zstd"},
    "chunk": {"compression": "zstd", "compression_level": "chunk"},
    "sample": {"compression": "zstd", "compression_level": "sample"},
}


def sample(i: int) -> dict[str, Any]:
    return {
        "idx": i,
        "text": f"sample {i} é",
        "raw": bytes([i % 256]) * (1 + i % 4),
        "score": i / 3,
        "flag": i % 2 == 0,
        "tokens": np.arange(1 + i % 6, dtype=np.int32) + i,
        "grid": np.full((2, 1 + i % 3), i, dtype=np.float32),
    }


def write(root: Path, layout: str = "raw", n: int = N, **kw: Any) -> Path:
    writer = BinaryWriter(str(root), chunk_bytes=600, **{**LAYOUTS[layout], **kw})
    for i in range(n):
        writer[i] = sample(i)
    writer.done()
    writer.merge()
    return root


def assert_written(got: dict[str, Any]) -> None:
    want = sample(got["idx"])
    assert list(got) == list(want)
    assert_same_values(got, want)


# --------------------------------------------------------------------------- coverage


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("shuffle", [False, True])
def test_every_sample_once_per_pass_with_the_writers_values(tmp_path, layout, shuffle):
    root = write(tmp_path / "ld", layout)
    src = LitDataSource(root, chunk_size=7, shuffle=shuffle, passes=2, cache_dir=tmp_path / "c")
    assert len(src.files()) > 3, "the data should span several chunks"
    assert_each_sample_twice(src, N, itemgetter("idx"), assert_written)


def test_columns_pick_and_order_the_payload(tmp_path):
    assert_columns_pick_and_order(
        partial(LitDataSource, write(tmp_path)), {"text": "sample 0 é", "idx": 0}
    )


def test_a_pickled_column_is_refused_naming_it_and_its_serializer(tmp_path):
    writer = BinaryWriter(str(tmp_path), chunk_bytes=600)
    for i in range(5):
        writer[i] = {"idx": i, "meta": {1, i}}  # a set: LitData pickles it
    writer.done()
    writer.merge()
    with pytest.raises(PlanError, match=r"column 'meta' .* serializer 'pickle': unpickling"):
        LitDataSource(tmp_path).num_samples()
    src = LitDataSource(tmp_path, columns=["idx"])
    assert [p["idx"] for p in every_sample(src)] == list(range(5))


def test_a_truncated_chunk_is_a_fetch_error_naming_it(tmp_path):
    write(tmp_path)
    chunk = tmp_path / "chunk-0-1.bin"
    chunk.write_bytes(chunk.read_bytes()[:-7])
    with pytest.raises(FetchError, match=r"chunk-0-1\.bin.*holds \d+ bytes, its index"):
        LitDataSource(tmp_path).num_samples()


def test_a_damaged_item_is_a_fetch_error_naming_its_column(tmp_path):
    write(tmp_path)
    chunk = tmp_path / "chunk-0-0.bin"
    data = bytearray(chunk.read_bytes())
    n = int(np.frombuffer(data, "<u4", count=1)[0])
    first = int(np.frombuffer(data, "<u4", count=1, offset=4)[0])
    # Item 0: seven sizes, then idx, text, raw, score, flag and tokens before grid's dtype code.
    sizes = np.frombuffer(data, "<u4", count=7, offset=first)
    at = first + 4 * 7 + int(sizes[:6].sum())
    data[at : at + 4] = np.uint32(99).tobytes()
    chunk.write_bytes(bytes(data))
    src = LitDataSource(tmp_path, chunk_size=n)
    with pytest.raises(FetchError, match=r"chunk-0-0\.bin.*item 0, column 'grid' \(numpy\)"):
        src.read(src.chunk(0).pointers)
    assert len(LitDataSource(tmp_path, columns=["idx"]).read(src.chunk(0).pointers)) == n


def test_import_zephon_does_not_import_litdata():
    code = "import sys, zephon, zephon.sources; print('litdata' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_open_source_picks_litdata_for_the_directory_and_its_index(tmp_path):
    write(tmp_path, "batch")
    for given in (tmp_path, tmp_path / "index.json"):
        src = open_source(given, cache_dir=tmp_path / "c")
        assert type(src) is LitDataSource and src.num_samples() == N


# --------------------------------------------------------------------------- pipelines


def pipeline(
    root: Path | str, cache: Path, shards: ShardCache | None = None, **kw: Any
) -> zephon.Pipeline:
    src = LitDataSource(
        root, columns=["idx", "tokens"], chunk_size=5, shuffle=True, cache_dir=cache, cache=shards
    )
    return zephon.Pipeline(src, [fetch(), batch(3)], **kw)


def delivered(items: list[Any]) -> Counter:
    return Counter(r.payload["idx"] for item in items for r in item)


@pytest.mark.parametrize("layout", ["raw", "batch"])
def test_resumes_exactly_at_any_step(tmp_path, layout):
    root = write(tmp_path / "d", layout)
    assert_resumes_exactly(partial(pipeline, root, tmp_path / "c"), lambda n: (0, 3, 9, n - 1))


@pytest.mark.usefixtures("no_leftover_workers")
def test_a_killed_worker_resumes_exactly(tmp_path):
    root = write(tmp_path / "d", "batch")
    assert_a_killed_worker_resumes_exactly(partial(pipeline, root, tmp_path / "c"), 4)


def test_a_job_of_four_ranks_resumes_on_two_and_relanes(tmp_path):
    make = partial(pipeline, write(tmp_path / "d"), tmp_path / "c")
    assert_resumes_on_two_ranks_and_relanes(make, delivered, Counter(range(N)))


@pytest.mark.parametrize("layout", ["raw", "batch"])
def test_a_rewritten_chunk_is_a_checkpoint_mismatch(tmp_path, layout):
    root = write(tmp_path / "d", layout)

    def rewrite() -> None:
        shutil.rmtree(root)
        write(root, layout, n=N + 1)  # the same chunks but the last, which gains a sample

    make = partial(pipeline, root, tmp_path / "c")

    def last() -> str:
        return re.escape(sorted(p.name for p in root.glob("chunk-*"))[-1])

    assert_a_changed_dataset_is_refused(make, rewrite, last)


# --------------------------------------------------------------------------- a bounded cache


@pytest.mark.parametrize("layout", ["batch", "chunk"])
def test_a_shard_cache_bounds_the_decompressed_copies_of_compressed_chunks(tmp_path, layout):
    root = write(tmp_path / "d", layout)
    assert_a_shard_cache_bounds_decompressed_shards(
        partial(LitDataSource, root, chunk_size=7, shuffle=True), tmp_path, "idx", assert_written
    )


def test_a_bucket_copy_keeps_downloads_and_decompressed_copies_within_the_shard_cache(
    tmp_path, bucket
):
    uri = bucket.upload(write(tmp_path / "local", "batch"), "litdata-bounded")
    assert_a_shard_cache_bounds_decompressed_shards(
        partial(LitDataSource, uri, chunk_size=7, shuffle=True), tmp_path, "idx", assert_written
    )


@pytest.mark.usefixtures("no_leftover_workers")
def test_compressed_chunks_through_a_small_shard_cache_resume_exactly_in_process_lanes(tmp_path):
    root = write(tmp_path / "d", "batch")
    assert_a_small_shard_cache_resumes_exactly_in_process_lanes(
        partial(LitDataSource, root), partial(pipeline, root), tmp_path, 5
    )


def test_a_decompressed_chunk_larger_than_the_shard_cache_is_a_fetch_error_naming_it(tmp_path):
    root = write(tmp_path / "d", "batch")
    largest = largest_decompressed_shard(partial(LitDataSource, root), tmp_path / "plain")
    cache = ShardCache(tmp_path / "shards", max_bytes=largest - 1)
    with pytest.raises(
        FetchError,
        match=r"chunk-\d+-\d+\.bin.*decompresses to \d+ bytes, more than ShardCache\(.*"
        r"max_bytes=\d+.*raise max_bytes above the largest decompressed shard",
    ):
        LitDataSource(root, cache_dir=tmp_path / "c", cache=cache).num_samples()


# --------------------------------------------------------------------------- remote


@pytest.mark.parametrize("layout", ["raw", "batch", "sample"])
def test_a_bucket_copy_delivers_the_local_samples(tmp_path, bucket, layout):
    local = write(tmp_path / "local", layout)
    uri = bucket.upload(local, f"litdata-{layout}")
    here = LitDataSource(local, chunk_size=6, shuffle=True, cache_dir=tmp_path / "c1")
    there = LitDataSource(uri, chunk_size=6, shuffle=True, cache_dir=tmp_path / "c2")
    got = assert_a_copy_reads_the_same(here, there, "idx")
    for g in got:
        assert_written(g)


def test_a_bucket_copy_read_through_a_shard_cache_delivers_the_local_samples(tmp_path, bucket):
    local = write(tmp_path / "local")
    uri = bucket.upload(local, "litdata-cached")
    here = LitDataSource(local, chunk_size=6, shuffle=True, cache_dir=tmp_path / "c1")
    cache = ShardCache(tmp_path / "shards", max_bytes=1 << 30)
    there = LitDataSource(uri, chunk_size=6, shuffle=True, cache_dir=tmp_path / "c2", cache=cache)
    assert_a_copy_reads_the_same(here, there, "idx")
    assert there.io_counters()[there.root]["cache_misses"] == len(there.files())


def test_a_changed_remote_block_is_refused(tmp_path, bucket):
    assert_a_changed_object_is_refused(
        bucket,
        write(tmp_path / "local"),
        "litdata-changed",
        "chunk-0-0.bin",
        partial(LitDataSource, cache_dir=tmp_path / "c"),
        flip=-3,
        match=r"chunk-0-0\.bin.*no longer matches the digest",
    )


def test_a_bucket_copy_resumes_exactly(tmp_path, bucket):
    uri = bucket.upload(write(tmp_path / "local", "batch"), "litdata-resume")
    assert_resumes_exactly(partial(pipeline, uri, tmp_path / "c"), lambda n: (6,))


def test_chunks_stored_as_an_arrow_footer_are_refused(tmp_path):
    writer = BinaryWriter(str(tmp_path), chunk_bytes=1 << 20)
    for i in range(5):
        writer[i] = {"a": f"x{i}", "b": f"y{i}"}  # strings only: LitData stores Arrow rows
    writer.done()
    writer.merge()
    with pytest.raises(PlanError, match=r"chunk-0-0\.bin.* holds its rows as an Arrow IPC footer"):
        LitDataSource(tmp_path).num_samples()


def test_a_damaged_item_of_a_sample_compressed_chunk_is_named_with_its_pointer(tmp_path):
    write(tmp_path, "sample")
    chunk = tmp_path / "chunk-0-0.bin"
    data = bytearray(chunk.read_bytes())
    n = int(np.frombuffer(data, "<u4", count=1)[0])
    third = int(np.frombuffer(data, "<u4", count=1, offset=4 + 4 * 2)[0])
    data[third : third + 4] = b"XXXX"  # item 2's zstd frame header
    chunk.write_bytes(bytes(data))
    src = LitDataSource(tmp_path, chunk_size=n)
    with pytest.raises(FetchError, match=r"pointer \(0, 0, 2\) from .*chunk-0-0\.bin.*item 2 "):
        src.read(src.chunk(0).pointers)


# --------------------------------------------------------------------------- images

IMAGES = 18
MODES = ("RGB", "L", "RGBA")


def picture(seed: int, mode: str) -> Image.Image:
    """A small picture of random pixels in ``mode`` (RGB, L or RGBA), its size by ``seed``."""
    rng = np.random.default_rng(seed)
    shape = (7 + seed % 3, 9 + seed % 5) + (() if mode == "L" else (len(mode),))
    image = Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8))
    assert image.mode == mode
    return image


def image_files(where: Path, i: int) -> dict[str, Any]:
    """Sample ``i``'s files: a JPEG (RGB or L), a PNG (RGB, L or RGBA), and 1 to 3 JPEGs."""
    where.mkdir(parents=True, exist_ok=True)
    jpeg, png = where / f"{i}.jpg", where / f"{i}.png"
    picture(i, ("RGB", "L")[i % 2]).save(jpeg, format="JPEG")
    picture(i + 50, MODES[i % 3]).save(png, format="PNG")
    photos = [where / f"{i}-{k}.jpg" for k in range(1 + i % 3)]
    for k, path in enumerate(photos):
        picture(100 * i + k, "RGB").save(path, format="JPEG")
    return {"jpeg": jpeg, "png": png, "photos": photos}


def write_images(root: Path, layout: str = "raw") -> Path:
    """Image samples written by LitData's BinaryWriter with its image serializers: a Pillow
    image (``pil``: raw pixels), a JPEG opened from its file (``jpeg``: the file's bytes),
    ``litdata.Image(path=)`` (``image:png``) and ``litdata.JpegArray`` of encoded bytes."""
    writer = BinaryWriter(str(root), chunk_bytes=8000, **LAYOUTS[layout])
    for i in range(IMAGES):
        files = image_files(root.parent / "files", i)
        with Image.open(files["jpeg"]) as jpeg:
            writer[i] = {
                "idx": i,
                "pil": picture(i + 1, MODES[(i + 1) % 3]),
                "jpeg": jpeg,
                "png": litdata.Image(path=str(files["png"])),
                "photos": litdata.JpegArray(images=[p.read_bytes() for p in files["photos"]]),
            }
    writer.done()
    writer.merge()
    return root


def pillow_pixels(path: Path, mode: str) -> np.ndarray:
    """What Pillow itself decodes of the file at ``path``, in ``mode``."""
    with Image.open(path) as image:
        return np.asarray(image.convert(mode))


@pytest.mark.parametrize("layout", ["raw", "sample"])
def test_image_columns_decode_to_the_pixels_pillow_gives(tmp_path, layout):
    root = write_images(tmp_path / "d", layout)
    src = partial(LitDataSource, root, chunk_size=5, shuffle=True, cache_dir=tmp_path / "c")
    serializers = [["idx", "int"], ["pil", "pil"], ["jpeg", "jpeg"], ["png", "image:png"]]
    assert src().describe()["columns"] == [*serializers, ["photos", "jpeg_array"]]
    assert len(src().files()) > 2, "the data should span several chunks"
    stored = {p["idx"]: p for p in every_sample(src())}
    assert sorted(stored) == list(range(IMAGES))
    for i, got in stored.items():
        files = image_files(tmp_path / "want", i)  # the same pictures, encoded the same way
        assert got["jpeg"] == files["jpeg"].read_bytes()
        assert got["png"] == files["png"].read_bytes()
        assert got["photos"] == [p.read_bytes() for p in files["photos"]]
        image = picture(i + 1, MODES[(i + 1) % 3])
        assert got["pil"] == RawImage(image.mode, image.width, image.height, image.tobytes())

    modes = {"pil": "RGBA", "jpeg": "RGB", "png": "RGBA", "photos": "L"}
    ops = [fetch(), *(decode_images(field, mode=mode) for field, mode in modes.items())]
    with zephon.Pipeline(src(), ops, lanes=2).iter() as loader:
        pixels = {r.payload["idx"]: r.payload for r in loader}
    assert sorted(pixels) == list(range(IMAGES))
    for i, got in pixels.items():
        files = image_files(tmp_path / "want", i)
        expected: dict[str, Any] = {
            "pil": np.asarray(picture(i + 1, MODES[(i + 1) % 3]).convert("RGBA")),
            "jpeg": pillow_pixels(files["jpeg"], "RGB"),
            "png": np.asarray(picture(i + 50, MODES[i % 3]).convert("RGBA")),
            "photos": [pillow_pixels(p, "L") for p in files["photos"]],
        }
        for field, value in expected.items():
            values = value if isinstance(value, list) else [value]
            decoded = got[field] if isinstance(value, list) else [got[field]]
            assert len(decoded) == len(values), (i, field)
            for a, b in zip(decoded, values, strict=True):
                assert a.dtype == b.dtype and np.array_equal(a, b), (i, field)


def image_pipeline(root: Path, cache: Path, **kw: Any) -> zephon.Pipeline:
    src = LitDataSource(
        root, columns=["idx", "pil", "photos"], chunk_size=4, shuffle=True, cache_dir=cache
    )
    ops = [
        fetch(),
        decode_images("pil"),
        random_resized_crop(6, seed=3, field="pil"),
        decode_images("photos", mode="L"),
        batch(3),
    ]
    return zephon.Pipeline(src, ops, **kw)


def test_an_image_pipeline_resumes_exactly_at_any_step(tmp_path):
    root = write_images(tmp_path / "d", "batch")
    assert_resumes_exactly(
        partial(image_pipeline, root, tmp_path / "c"), lambda n: (0, 2, n // 2, n - 1)
    )


MALFORMED = {  # serializer, value, where in it a uint32 is rewritten, to what, the error
    "pil-height": (
        "pil", picture(0, "RGB"), 4, 70,
        r"a 9x70 RGB image has 1890 bytes of pixels, the value holds 189",
    ),
    "jpeg-array-count": (
        "jpeg_array", litdata.JpegArray(images=[b"abc", b"defg"]), 0, 7,
        r"it counts 7 images, whose sizes run past its end \(19 bytes\)",
    ),
}  # fmt: skip


@pytest.mark.parametrize(
    ("serializer", "value", "at", "put", "error"), list(MALFORMED.values()), ids=list(MALFORMED)
)
def test_a_malformed_image_value_is_a_fetch_error_naming_its_chunk_item_and_column(
    tmp_path, serializer, value, at, put, error
):
    # One uint32 of item 2's value rewritten: a size or a count the value cannot hold.
    writer = BinaryWriter(str(tmp_path), chunk_bytes=1 << 20)
    for i in range(3):
        writer[i] = {"idx": i, "image": value}
    writer.done()
    writer.merge()
    chunk = tmp_path / "chunk-0-0.bin"
    data = bytearray(chunk.read_bytes())
    start = int(np.frombuffer(data, "<u4", count=1, offset=4 + 4 * 2)[0])  # item 2
    where = start + 4 * 2 + 8 + at  # past the item's two sizes and its idx
    data[where : where + 4] = np.uint32(put).tobytes()
    chunk.write_bytes(bytes(data))
    src = LitDataSource(tmp_path, chunk_size=3)
    assert src.describe()["columns"] == [["idx", "int"], ["image", serializer]]
    assert [p["idx"] for p in src.read(src.chunk(0).pointers[:2])] == [0, 1]
    with pytest.raises(FetchError) as info:
        src.read(src.chunk(0).pointers)
    message = re.escape(f"item 2, column 'image' ({serializer}) cannot be decoded: ValueError: ")
    assert re.search(rf"chunk-0-0\.bin.*{message}{error}", str(info.value)), info.value
