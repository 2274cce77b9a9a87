"""MDSSource over directories written by Mosaic's own MDSWriter (streaming-community), raw and
zstd-compressed, locally and on the loopback S3 server."""

from __future__ import annotations

import io
import pickle
import re
import shutil
from collections import Counter
from decimal import Decimal
from functools import partial
from operator import itemgetter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from format_kit import (
    assert_a_changed_dataset_is_refused,
    assert_a_changed_object_is_refused,
    assert_a_copy_reads_the_same,
    assert_a_file_rewritten_under_a_reader_is_refused,
    assert_a_killed_worker_resumes_exactly,
    assert_a_shard_cache_bounds_decompressed_shards,
    assert_a_small_shard_cache_resumes_exactly_in_process_lanes,
    assert_columns_pick_and_order,
    assert_each_sample_twice,
    assert_resumes_exactly,
    assert_resumes_on_two_ranks_and_relanes,
    assert_same_values,
    every_sample,
    kept_decompressed_bytes,
    largest_decompressed_shard,
)
from mds_kit import mds_writer
from PIL import Image
from worker_kit import wait_until

import zephon
from zephon.errors import FetchError, PlanError
from zephon.ops import batch, decode_images, fetch, random_resized_crop
from zephon.sources import MDSSource, RawImage, ShardCache, open_source

N = 60
COLUMNS = {
    "idx": "int",
    "text": "str",
    "raw": "bytes",
    "small": "int8",
    "count": "uint32",
    "big": "uint64",
    "half": "float16",
    "score": "float64",
    "digits": "str_int",
    "ratio": "str_float",
    "price": "str_decimal",
    "meta": "json",
    "tokens": "ndarray",
    "pair": "ndarray:int32:2",
    "row": "ndarray:float32",
}


def sample(i: int) -> dict[str, Any]:
    return {
        "idx": i,
        "text": f"sample {i} é",
        "raw": bytes([i % 256]) * (1 + i % 4),
        "small": np.int8(-i % 100),
        "count": np.uint32(i * 1000),
        "big": np.uint64(2**63 + i),
        "half": np.float16(i / 4),
        "score": np.float64(i / 3),
        "digits": 10**20 + i,
        "ratio": i / 7,
        "price": Decimal(f"{i}.25"),
        "meta": {"i": i, "tags": ["a"] * (i % 3)},
        "tokens": np.arange(1 + i % 9, dtype=np.int64).reshape(-1, 1) + i,
        "pair": np.array([i, -i], dtype=np.int32),
        "row": np.full(1 + i % 4, i, dtype=np.float32),
    }


def write(root: Path, compression: str | None = None, n: int = N, **columns: str) -> Path:
    writer = mds_writer()
    with writer(
        out=str(root), columns=columns or COLUMNS, compression=compression, size_limit=2048
    ) as out:
        for i in range(n):
            row = sample(i)
            out.write({k: row[k] for k in columns or COLUMNS})
    return root


def assert_written(got: dict[str, Any]) -> None:
    want = sample(got["idx"])
    assert list(got) == sorted(COLUMNS)
    assert_same_values(got, want)


# --------------------------------------------------------------------------- coverage


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_every_sample_once_per_pass_with_the_writers_values(tmp_path, compression, shuffle):
    root = write(tmp_path / "mds", compression)
    src = MDSSource(root, chunk_size=7, shuffle=shuffle, passes=2, cache_dir=tmp_path / "c")
    assert len(src.files()) > 3, "the data should span several shards"
    assert_each_sample_twice(src, N, itemgetter("idx"), assert_written)


def test_columns_pick_and_order_the_payload(tmp_path):
    assert_columns_pick_and_order(
        partial(MDSSource, write(tmp_path)), {"text": "sample 0 é", "idx": 0}
    )


def test_pickled_columns_need_allow_pickle(tmp_path):
    write(tmp_path, idx="int", meta="pkl")
    with pytest.raises(PlanError, match=r"'meta' .* is pickled; .*allow_pickle=True"):
        MDSSource(tmp_path).num_samples()
    assert MDSSource(tmp_path, columns=["idx"]).num_samples() == N
    src = MDSSource(tmp_path, allow_pickle=True)
    assert [p["meta"] for p in every_sample(src)] == [sample(i)["meta"] for i in range(N)]


def test_a_truncated_shard_is_a_fetch_error_naming_it(tmp_path):
    write(tmp_path)
    shard = tmp_path / "shard.00001.mds"
    shard.write_bytes(shard.read_bytes()[:-7])
    with pytest.raises(FetchError, match=r"shard\.00001\.mds.*holds \d+ bytes, its index"):
        MDSSource(tmp_path).num_samples()


def test_open_source_picks_mds_for_the_directory_and_its_index(tmp_path):
    write(tmp_path, "zstd")
    for given in (tmp_path, tmp_path / "index.json"):
        src = open_source(given, cache_dir=tmp_path / "c")
        assert type(src) is MDSSource and src.num_samples() == N


# --------------------------------------------------------------------------- pipelines


def pipeline(
    root: Path | str, cache: Path, shards: ShardCache | None = None, **kw: Any
) -> zephon.Pipeline:
    src = MDSSource(
        root, columns=["idx", "tokens"], chunk_size=5, shuffle=True, cache_dir=cache, cache=shards
    )
    return zephon.Pipeline(src, [fetch(), batch(3)], **kw)


def delivered(items: list[Any]) -> Counter:
    return Counter(r.payload["idx"] for item in items for r in item)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_resumes_exactly_at_any_step(tmp_path, compression):
    root = write(tmp_path / "d", compression)
    assert_resumes_exactly(partial(pipeline, root, tmp_path / "c"), lambda n: (0, 3, 9, n - 1))


@pytest.mark.usefixtures("no_leftover_workers")
def test_a_killed_worker_resumes_exactly(tmp_path):
    root = write(tmp_path / "d", "zstd")
    assert_a_killed_worker_resumes_exactly(partial(pipeline, root, tmp_path / "c"), 4)


def test_a_job_of_four_ranks_resumes_on_two_and_relanes(tmp_path):
    make = partial(pipeline, write(tmp_path / "d"), tmp_path / "c")
    assert_resumes_on_two_ranks_and_relanes(make, delivered, Counter(range(N)))


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_rewritten_shard_is_a_checkpoint_mismatch(tmp_path, compression):
    root = write(tmp_path / "d", compression)

    def rewrite() -> None:
        shutil.rmtree(root)
        write(root, compression, n=N + 1)  # the same shards but the last, which gains a sample

    make = partial(pipeline, root, tmp_path / "c")

    def last() -> str:
        return re.escape(sorted(p.name for p in root.glob("shard.*"))[-1])

    assert_a_changed_dataset_is_refused(make, rewrite, last)


# --------------------------------------------------------------------------- a bounded cache


def test_a_shard_cache_bounds_the_decompressed_copies_of_compressed_shards(tmp_path):
    root = write(tmp_path / "d", "zstd")
    assert_a_shard_cache_bounds_decompressed_shards(
        partial(MDSSource, root, chunk_size=7, shuffle=True), tmp_path, "idx", assert_written
    )


def test_a_bucket_copy_keeps_downloads_and_decompressed_copies_within_the_shard_cache(
    tmp_path, bucket
):
    uri = bucket.upload(write(tmp_path / "local", "zstd"), "mds-bounded")
    assert_a_shard_cache_bounds_decompressed_shards(
        partial(MDSSource, uri, chunk_size=7, shuffle=True), tmp_path, "idx", assert_written
    )


@pytest.mark.usefixtures("no_leftover_workers")
def test_compressed_shards_through_a_small_shard_cache_resume_exactly_in_process_lanes(tmp_path):
    root = write(tmp_path / "d", "zstd")
    assert_a_small_shard_cache_resumes_exactly_in_process_lanes(
        partial(MDSSource, root), partial(pipeline, root), tmp_path, 7
    )


def test_a_decompressed_copy_is_not_evicted_while_bytes_read_from_it_are_alive(tmp_path):
    root = write(tmp_path / "d", "zstd")
    largest = largest_decompressed_shard(partial(MDSSource, root), tmp_path / "plain")
    cache = ShardCache(tmp_path / "shards", max_bytes=2 * largest)
    src = MDSSource(root, chunk_size=7, shuffle=True, cache_dir=tmp_path / "c", cache=cache)
    src.num_samples()
    shard = src._shard(0)
    view = src._mapped(0, shard, src.chunk(0).pointers[0]).data[:64]
    key = cache.key(
        src.files()[0].uri + MDSSource.INFLATED_SUFFIX, shard.stored.identity(), shard.raw_size
    )
    entry = Path(cache.shard_path(key))
    head = entry.read_bytes()[:64]
    cache.let_go()  # only the view holds the entry now
    other = pickle.loads(pickle.dumps(src))  # its own cache object: as another process
    every_sample(other)  # evicts every other copy, again and again
    assert entry.read_bytes()[:64] == bytes(view) == head
    del view
    assert not cache._live, "the entry is still open with nothing read from it alive"


def test_a_shard_finding_no_room_in_the_shard_cache_is_decompressed_in_memory_that_time(tmp_path):
    root = write(tmp_path / "d", "zstd")
    largest = largest_decompressed_shard(partial(MDSSource, root), tmp_path / "plain")
    plain = every_sample(MDSSource(root, chunk_size=7, shuffle=True, cache_dir=tmp_path / "plain"))
    cache = ShardCache(tmp_path / "shards", max_bytes=largest * 3 // 2)
    src = MDSSource(root, chunk_size=7, shuffle=True, cache_dir=tmp_path / "c", cache=cache)
    src.num_samples()
    view = src._mapped(0, src._shard(0), src.chunk(0).pointers[0]).data[:64]
    cache.let_go()
    other = pickle.loads(pickle.dumps(src))  # no other copy fits beside the one held open
    got = every_sample(other)
    assert [g["idx"] for g in got] == [g["idx"] for g in plain]
    assert len(list(Path(cache.dir).glob("*.shard"))) == 1
    assert kept_decompressed_bytes(tmp_path / "c", cache) <= cache.max_bytes
    del view


def test_a_decompressed_shard_larger_than_the_shard_cache_is_a_fetch_error_naming_it(tmp_path):
    root = write(tmp_path / "d", "zstd")
    largest = largest_decompressed_shard(partial(MDSSource, root), tmp_path / "plain")
    cache = ShardCache(tmp_path / "shards", max_bytes=largest - 1)
    with pytest.raises(
        FetchError,
        match=r"shard\.\d+\.mds\.zstd.*decompresses to \d+ bytes, more than ShardCache\(.*"
        r"max_bytes=\d+.*raise max_bytes above the largest decompressed shard",
    ):
        MDSSource(root, cache_dir=tmp_path / "c", cache=cache).num_samples()


# --------------------------------------------------------------------------- remote


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_bucket_copy_delivers_the_local_samples(tmp_path, bucket, compression):
    local = write(tmp_path / "local", compression)
    uri = bucket.upload(local, f"mds-{compression}")
    here = MDSSource(local, chunk_size=6, shuffle=True, cache_dir=tmp_path / "c1")
    there = MDSSource(uri, chunk_size=6, shuffle=True, cache_dir=tmp_path / "c2")
    got = assert_a_copy_reads_the_same(here, there, "idx")
    for g in got:
        assert_written(g)


def test_a_changed_remote_block_is_refused(tmp_path, bucket):
    assert_a_changed_object_is_refused(
        bucket,
        write(tmp_path / "local"),
        "mds-changed",
        "shard.00000.mds",
        partial(MDSSource, cache_dir=tmp_path / "c"),
        flip=-3,
        match=r"shard\.00000\.mds.*no longer matches the digest",
    )


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_bucket_copy_resumes_exactly(tmp_path, bucket, compression):
    uri = bucket.upload(write(tmp_path / "local", compression), f"mds-resume-{compression}")
    assert_resumes_exactly(partial(pipeline, uri, tmp_path / "c"), lambda n: (6,))


def test_a_local_shard_rewritten_since_it_was_indexed_is_refused_on_read(tmp_path):
    root = write(tmp_path)
    assert_a_file_rewritten_under_a_reader_is_refused(
        MDSSource(root, chunk_size=5),
        root / "shard.00000.mds",
        flip=-2,
        match=r"shard\.00000\.mds.*changed since it was indexed",
    )


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_bucket_copy_read_through_a_shard_cache_and_ahead_of_its_reads(
    tmp_path, bucket, compression
):
    local = write(tmp_path / "local", compression)
    uri = bucket.upload(local, f"mds-cached-{compression}")
    here = MDSSource(local, chunk_size=6, shuffle=True, cache_dir=tmp_path / "c1")
    cache = ShardCache(tmp_path / "shards", max_bytes=1 << 30, prefetch_shards=64)
    there = MDSSource(uri, chunk_size=6, shuffle=True, cache_dir=tmp_path / "c2", cache=cache)
    assert there.describe() == here.describe()
    for entry in Path(cache.dir).glob("*.shard"):
        entry.unlink()  # the metadata reads cached every shard: start from an empty cache
    # Announced chunks have their shards downloaded in the background, before any read.
    there.upcoming(list(range(there.num_chunks())))
    shards = len(there.files())
    assert wait_until(lambda: len(list(Path(cache.dir).glob("*.shard"))) == shards, 60)
    there.drop_read_caches()
    got = every_sample(there)
    assert [g["idx"] for g in got] == [g["idx"] for g in every_sample(here)]
    assert there.io_counters()[there.root]["cache_misses"] == 2 * shards  # metadata, then ahead


def test_a_shard_rewritten_at_its_size_on_a_store_without_mtime_or_version_is_read_anew(
    tmp_path,
):
    # A memory:// store gives no mtime and no version: the sidecar in the cache directory cannot
    # tell the rewrite, so a new source digests the shard again (and inflates the new content)
    # rather than reading what the old digests named.
    import fsspec

    memory = fsspec.filesystem("memory")

    def text(letter: str) -> Path:
        root = tmp_path / letter
        columns = {"idx": "int", "text": "str"}
        with mds_writer()(out=str(root), columns=columns, compression="zstd") as out:
            for i in range(20):
                out.write({"idx": i, "text": f"{letter}{i:04d}"})
        return root

    by_size: dict[int, Path] = {}
    for letter in "abcdefghijkl":  # two datasets whose compressed shards have one size
        root = text(letter)
        size = (root / "shard.00000.mds.zstd").stat().st_size
        if size in by_size:
            first, second = by_size[size], root
            break
        by_size[size] = root
    else:
        pytest.fail("no two shards of one compressed size")

    def put(root: Path) -> None:
        for path in root.iterdir():
            memory.pipe(f"/{tmp_path.name}/{path.name}", path.read_bytes())

    uri = f"memory:///{tmp_path.name}"
    put(first)
    before = MDSSource(uri, cache_dir=tmp_path / "c")
    assert before.read(before.chunk(0).pointers[:1])[0]["text"] == f"{first.name}0000"
    put(second)
    after = MDSSource(uri, cache_dir=tmp_path / "c")
    assert after.read(after.chunk(0).pointers[:1])[0]["text"] == f"{second.name}0000"
    assert after.describe() != before.describe()


def test_an_ndarray_value_cut_to_nothing_is_a_fetch_error_naming_its_shard_and_column(tmp_path):
    columns = {"arr": "ndarray", "idx": "int"}
    with mds_writer()(out=str(tmp_path), columns=columns) as out:
        for i in range(3):
            out.write({"arr": np.arange(i + 1, dtype=np.int32), "idx": i})
    shard = tmp_path / "shard.00000.mds"
    data = bytearray(shard.read_bytes())
    at = int(np.frombuffer(data, "<u4", count=1, offset=4 + 4 * 2)[0])  # sample 2
    data[at : at + 4] = np.uint32(0).tobytes()  # its array's size: no dtype code, no shape
    shard.write_bytes(bytes(data))
    src = MDSSource(tmp_path, chunk_size=3)
    with pytest.raises(FetchError, match=r"shard\.00000\.mds.*sample 2, column 'arr' \(ndarray\)"):
        src.read(src.chunk(0).pointers)


def test_a_shard_the_index_names_answering_503_is_retried_then_named(
    tmp_path, bucket, failing_proxy
):
    uri = bucket.upload(write(tmp_path / "local"), "mds-503")
    bucket.point_at(failing_proxy.endpoint)
    failing_proxy.fail_paths = {"/shard.00002.mds": 1}  # its HEAD, while the index is listed
    assert MDSSource(uri, cache_dir=tmp_path / "c").num_samples() == N
    assert failing_proxy.failed == 1
    failing_proxy.fail_paths = {"/shard.00002.mds": 100}
    with pytest.raises(FetchError, match=rf"{uri}/shard\.00002\.mds.*gave up after 4 attempts"):
        MDSSource(uri, cache_dir=tmp_path / "c").num_samples()


# --------------------------------------------------------------------------- images

IMAGE_COLUMNS = {
    "idx": "int",
    "jpeg": "jpeg",
    "png": "png",
    "pil": "pil",
    "jpegs": "list[jpeg]",
    "pngs": "list[png]",
    "pils": "list[pil]",
    "jpeg_array": "jpeg_array",
    "jpegarray": "jpegarray",
}
IMAGES = 24
MODES = ("RGB", "L", "RGBA")


def picture(seed: int, mode: str) -> Image.Image:
    """A small picture of random pixels in ``mode`` (RGB, L or RGBA), its size by ``seed``."""
    rng = np.random.default_rng(seed)
    shape = (7 + seed % 3, 9 + seed % 5) + (() if mode == "L" else (len(mode),))
    image = Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8))
    assert image.mode == mode
    return image


def jpeg_file(where: Path, seed: int) -> Path:
    """A JPEG file of ``picture(seed)`` in RGB or L (JPEG has no alpha)."""
    path = where / f"{seed}.jpg"
    picture(seed, ("RGB", "L")[seed % 2]).save(path, format="JPEG")
    return path


def image_sample(where: Path, i: int) -> dict[str, Any]:
    """Sample ``i``: its pictures (Pillow images), its JPEG files (paths) and, for
    ``jpeg_array``, encoded bytes. Every third sample's lists are empty."""
    listed = range(i % 3)
    jpegs = [jpeg_file(where, 1000 * i + k) for k in listed]
    return {
        "idx": i,
        "jpeg": jpeg_file(where, 1000 * i + 999),
        "png": picture(i, MODES[i % 3]),
        "pil": picture(i + 1, MODES[(i + 1) % 3]),
        "jpegs": jpegs,
        "pngs": [picture(100 * i + k, MODES[k]) for k in listed],
        "pils": [picture(100 * i + k + 50, MODES[(k + i) % 3]) for k in listed],
        "jpeg_array": [path.read_bytes() for path in jpegs],
        "jpegarray": [path.read_bytes() for path in reversed(jpegs)],
    }


def write_images(root: Path, compression: str | None = None) -> Path:
    """The image samples written by MDSWriter; each JPEG is given opened from its file, so the
    writer stores that file's bytes."""
    where = root.parent / "jpegs"
    where.mkdir(parents=True, exist_ok=True)
    with mds_writer()(
        out=str(root), columns=IMAGE_COLUMNS, compression=compression, size_limit=4096
    ) as out:
        for i in range(IMAGES):
            row = image_sample(where, i)
            opened = [Image.open(path) for path in [row["jpeg"], *row["jpegs"]]]
            out.write({**row, "jpeg": opened[0], "jpegs": opened[1:]})
            for image in opened:
                image.close()
    return root


def pillow_pixels(image: Any, mode: str) -> np.ndarray:
    """What Pillow itself gives of ``image`` (a Pillow image, or JPEG bytes) in ``mode``."""
    if isinstance(image, bytes):
        image = Image.open(io.BytesIO(image))
    return np.asarray(image.convert(mode))


@pytest.mark.parametrize(("compression", "workers"), [(None, "inline"), ("zstd", "process")])
def test_image_columns_decode_to_the_pixels_pillow_gives(tmp_path, compression, workers):
    root = write_images(tmp_path / "mds", compression)
    src = partial(MDSSource, root, chunk_size=5, shuffle=True, cache_dir=tmp_path / "c")
    assert len(src().files()) > 2, "the data should span several shards"
    where = tmp_path / "jpegs"
    stored = {p["idx"]: p for p in every_sample(src())}
    assert sorted(stored) == list(range(IMAGES))
    for i, got in stored.items():
        want = image_sample(where, i)
        # The source gives what the writer stored: each JPEG file's bytes, each PNG's bytes,
        # raw pixels as Pillow's own tobytes() of the image.
        assert got["jpeg"] == want["jpeg"].read_bytes()
        assert got["jpegs"] == [path.read_bytes() for path in want["jpegs"]]
        assert got["jpeg_array"] == want["jpeg_array"]
        assert got["jpegarray"] == want["jpegarray"]
        assert all(type(v) is bytes for v in [got["jpeg"], got["png"], *got["pngs"]])
        for value, image in zip([got["pil"], *got["pils"]], [want["pil"], *want["pils"]]):
            assert value == RawImage(image.mode, image.width, image.height, image.tobytes())
        assert len(got["pngs"]) == len(got["pils"]) == len(got["jpegs"]) == i % 3
    raw = stored[0]["pil"]
    assert repr(raw) == f"RawImage(mode='L', width=10, height=8, pixels=<{8 * 10} bytes>)"
    assert np.array_equal(np.asarray(raw.to_pil()), np.asarray(picture(1, "L")))

    decoded = {"jpeg": "RGB", "jpegs": "L", "jpeg_array": "RGB", "jpegarray": "RGB"}
    decoded |= {"png": "RGBA", "pngs": "RGBA", "pil": "RGBA", "pils": "L"}
    ops = [fetch(), *(decode_images(field, mode=mode) for field, mode in decoded.items())]
    pipeline = zephon.Pipeline(src(), ops, lanes=2, workers=workers)
    with pipeline.iter() as loader:
        pixels = {r.payload["idx"]: r.payload for r in loader}
    assert sorted(pixels) == list(range(IMAGES))
    for i, got in pixels.items():
        want = stored[i]
        lossless = image_sample(where, i)  # the pictures PNG and raw pixels keep exactly
        expected: dict[str, Any] = {
            "jpeg": pillow_pixels(want["jpeg"], "RGB"),
            "jpegs": [pillow_pixels(v, "L") for v in want["jpegs"]],
            "jpeg_array": [pillow_pixels(v, "RGB") for v in want["jpeg_array"]],
            "jpegarray": [pillow_pixels(v, "RGB") for v in want["jpegarray"]],
            "png": pillow_pixels(lossless["png"], "RGBA"),
            "pngs": [pillow_pixels(v, "RGBA") for v in lossless["pngs"]],
            "pil": pillow_pixels(lossless["pil"], "RGBA"),
            "pils": [pillow_pixels(v, "L") for v in lossless["pils"]],
        }
        for field, value in expected.items():
            if isinstance(value, list):
                assert len(got[field]) == len(value), field
                for a, b in zip(got[field], value, strict=True):
                    assert a.dtype == b.dtype and np.array_equal(a, b), (i, field)
            else:
                assert got[field].dtype == value.dtype and np.array_equal(got[field], value)


def image_pipeline(root: Path, cache: Path, **kw: Any) -> zephon.Pipeline:
    src = MDSSource(
        root, columns=["idx", "pil", "pngs"], chunk_size=5, shuffle=True, cache_dir=cache
    )
    ops = [
        fetch(),
        decode_images("pil"),
        random_resized_crop(6, seed=3, field="pil"),
        decode_images("pngs", mode="L"),
        batch(3),
    ]
    return zephon.Pipeline(src, ops, **kw)


def test_an_image_pipeline_resumes_exactly_at_any_step(tmp_path):
    root = write_images(tmp_path / "d", "zstd")
    assert_resumes_exactly(
        partial(image_pipeline, root, tmp_path / "c"), lambda n: (0, 2, n // 2, n - 1)
    )


MALFORMED = {  # encoding, value, where in it a uint32 is rewritten, to what, the error
    "pil-width": (
        "pil", picture(0, "RGB"), 0, 99,
        r"a 99x7 RGB image has 2079 bytes of pixels, the value holds 189",
    ),
    "pil-mode": ("pil", picture(0, "L"), 8, 500, r"its mode's name of 500 bytes runs past"),
    "pil-in-a-list": (
        "list[pil]", [picture(0, "L"), picture(1, "RGBA")], 16 + 76, 3,
        r"image 1 of the list: a 3x8 RGBA image has 96 bytes of pixels, the value holds 320",
    ),
    "png-count": (
        "list[png]", [picture(0, "L")], 4, 1000,
        r"it counts 1000 images, whose sizes run past its end \(\d+ bytes\)",
    ),
    "empty-list-count": (
        "list[jpeg]", [], 4, 1, r"it counts 1 images, whose sizes run past its end \(8 bytes\)"
    ),
    "jpeg-array-size": (
        "jpeg_array", [b"abc", b"defg"], 4, 5, r"its 2 images take 9 bytes, 7 follow their sizes"
    ),
}  # fmt: skip


@pytest.mark.parametrize(
    ("encoding", "value", "at", "put", "error"), list(MALFORMED.values()), ids=list(MALFORMED)
)
def test_a_malformed_image_value_is_a_fetch_error_naming_its_shard_sample_and_column(
    tmp_path, encoding, value, at, put, error
):
    # One uint32 of sample 2's value rewritten: a size or a count the value cannot hold.
    columns = {"image": encoding, "idx": "int"}
    with mds_writer()(out=str(tmp_path), columns=columns) as out:
        for i in range(3):
            out.write({"image": value, "idx": i})
    shard = tmp_path / "shard.00000.mds"
    data = bytearray(shard.read_bytes())
    start = int(np.frombuffer(data, "<u4", count=1, offset=4 + 4 * 2)[0])  # sample 2
    where = start + 4 + 8 + at  # past the image column's size and "idx" (the writer sorts)
    data[where : where + 4] = np.uint32(put).tobytes()
    shard.write_bytes(bytes(data))
    src = MDSSource(tmp_path, chunk_size=3)
    assert [p["idx"] for p in src.read(src.chunk(0).pointers[:2])] == [0, 1]
    with pytest.raises(FetchError) as info:
        src.read(src.chunk(0).pointers)
    message = re.escape(f"sample 2, column 'image' ({encoding}) cannot be decoded: ValueError: ")
    assert re.search(rf"shard\.00000\.mds.*{message}{error}", str(info.value)), info.value
