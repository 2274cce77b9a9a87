"""WebDatasetSource over shards written by WebDataset's own TarWriter, locally, on the loopback S3
server and through fsspec."""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import webdataset as wds
from format_kit import (
    assert_a_changed_dataset_is_refused,
    assert_a_changed_object_is_refused,
    assert_a_copy_reads_the_same,
    assert_a_file_rewritten_under_a_reader_is_refused,
    assert_a_killed_worker_resumes_exactly,
    assert_each_sample_twice,
    assert_resumes_exactly,
    assert_resumes_on_two_ranks_and_relanes,
    every_sample,
)
from pipeline_kit import run
from worker_kit import script_env

import zephon
from zephon.errors import FetchError, PlanError
from zephon.ops import batch, fetch
from zephon.sources import ShardCache, WebDatasetSource, open_source

N = 60
PER_SHARD = 16
BIG = 7  # this sample's "bin" field spans more than one digest block


def sample(i: int) -> dict[str, bytes]:
    """Sample ``i`` as the writer stores it: every field's bytes; some samples lack a field."""
    out = {
        "jpg": bytes((i * 7 + k) % 256 for k in range(1 + (i * 131) % 3000)),
        "txt": f"caption {i} é".encode(),
        "cls": str(i % 10).encode(),
    }
    if i % 3 == 0:
        out["json"] = json.dumps({"i": i}).encode()
    if i == BIG:
        out["bin"] = bytes(range(256)) * 6000  # 1.5 MB
    return out


def key(i: int) -> str:
    return f"part/{i:05d}"


def write(root: Path, n: int = N, mtime: float = 1) -> Path:
    """``n`` samples in shards of ``PER_SHARD`` written by ``webdataset.TarWriter`` (a float
    ``mtime``, as the writer's default of now, gives every member a PAX header)."""
    root.mkdir(parents=True, exist_ok=True)
    for s, first in enumerate(range(0, n, PER_SHARD)):
        with wds.TarWriter(str(root / f"shard-{s:04d}.tar"), encoder=False, mtime=mtime) as out:
            for i in range(first, min(first + PER_SHARD, n)):
                out.write({"__key__": key(i), **sample(i)})
    return root


def write_with_tarfile(path: Path, names: list[str], fmt: int) -> Path:
    """Samples ``0..`` under these keys, written by ``tarfile`` in the format ``fmt`` (the
    ``TarWriter`` leaves it to tarfile's default)."""
    with tarfile.open(path, "w", format=fmt) as tar:
        for i, name in enumerate(names):
            for field, data in sample(i).items():
                info = tarfile.TarInfo(f"{name}.{field}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def webdatasets_samples(shards: list[str]) -> list[dict[str, Any]]:
    """What WebDataset's own tar iteration and grouping make of the shards (their files opened
    and closed here)."""
    out = []
    for shard in shards:
        with open(shard, "rb") as fh:
            found = wds.tariterators.tar_file_expander([{"url": shard, "stream": fh}])
            out += list(wds.tariterators.group_by_keys(found))
    return out


def index_of(payload: dict[str, Any]) -> int:
    return int(payload["__key__"].rsplit("/", 1)[1])


def assert_written(got: dict[str, Any], url: str | None = None) -> None:
    i = index_of(got)
    assert list(got)[:2] == ["__key__", "__url__"]
    assert {k: v for k, v in got.items() if not k.startswith("__")} == sample(i)
    if url is not None:
        assert got["__url__"] == f"{url}/shard-{i // PER_SHARD:04d}.tar"


# --------------------------------------------------------------------------- coverage


@pytest.mark.parametrize("shuffle", [False, True])
def test_every_sample_once_per_pass_with_the_writers_bytes(tmp_path, shuffle):
    root = write(tmp_path / "wds")
    src = WebDatasetSource(root, chunk_size=7, shuffle=shuffle, passes=2)
    assert len(src.files()) == 4 and src.num_samples() == N
    assert_each_sample_twice(src, N, index_of, partial(assert_written, url=str(root)))


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_long_and_non_ascii_keys_in_every_tar_format_match_webdatasets_reader(tmp_path, fmt):
    # 120 bytes of directory: a ustar prefix, a GNU long name, a PAX path record.
    names = [f"{'ü' * 60}/{i:05d}" for i in range(10)]
    shard = str(write_with_tarfile(tmp_path / "a.tar", names, fmt))
    ours = every_sample(WebDatasetSource(shard))
    assert ours == webdatasets_samples([shard])
    assert [o["__key__"] for o in ours] == names


def test_a_float_mtime_gives_each_member_a_pax_header_and_changes_nothing(tmp_path):
    plain = every_sample(WebDatasetSource(write(tmp_path / "a")))
    pax = every_sample(WebDatasetSource(write(tmp_path / "b", mtime=1.5)))
    assert [{**p, "__url__": ""} for p in pax] == [{**p, "__url__": ""} for p in plain]


def test_samples_are_grouped_by_key_as_webdataset_groups_them(tmp_path):
    # Members without a dot, metadata and directories belong to no sample; the field is the
    # name after the first dot, lowercased; a key met again later starts another sample.
    path = tmp_path / "odd.tar"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in [
            ("__meta__", b"m"),
            ("README", b"r"),
            ("a/x.seg.PNG", b"1"),
            ("a/x.txt", b"2"),
            ("b.txt", b"3"),
            ("a/x.cls", b"4"),
        ]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        tar.addfile(tarfile.TarInfo("dir/"))
    got = every_sample(WebDatasetSource(path))
    assert got == webdatasets_samples([str(path)])
    assert [g["__key__"] for g in got] == ["a/x", "b", "a/x"]
    assert got[0] == {"__key__": "a/x", "__url__": str(path), "seg.png": b"1", "txt": b"2"}


def test_columns_pick_and_order_the_fields(tmp_path):
    src = WebDatasetSource(write(tmp_path), columns=["txt", "cls"])
    first = src.read(src.chunk(0).pointers[:1])
    assert first == [
        {"__key__": key(0), "__url__": src.paths[0], "txt": sample(0)["txt"], "cls": b"0"}
    ]
    assert list(first[0]) == ["__key__", "__url__", "txt", "cls"]
    with pytest.raises(PlanError, match=r"holds a field \['nope'\]"):
        WebDatasetSource(tmp_path, columns=["nope"]).num_samples()


def test_decode_text_gives_strings_ints_and_json(tmp_path):
    src = WebDatasetSource(write(tmp_path), columns=["txt", "cls", "json", "jpg"], decode_text=True)
    (got,) = src.read(src.chunk(0).pointers[3:4])
    assert got["txt"] == "caption 3 é" and got["cls"] == 3 and got["json"] == {"i": 3}
    assert got["jpg"] == sample(3)["jpg"]
    assert src.describe()["decode_text"] is True
    assert (
        src.describe()
        != WebDatasetSource(tmp_path, columns=["txt", "cls", "json", "jpg"]).describe()
    )


def test_a_field_that_cannot_be_decoded_is_named(tmp_path):
    shard = tmp_path / "a.tar"
    with wds.TarWriter(str(shard), encoder=False) as out:
        out.write({"__key__": "k", "cls": b"seven", "txt": b"fine"})
    src = WebDatasetSource(shard, decode_text=True)
    assert src.column_names() == ["cls", "txt"]
    with pytest.raises(FetchError, match=r"a\.tar.*member 'k\.cls' cannot be decoded as number"):
        src.read(src.chunk(0).pointers)
    assert WebDatasetSource(shard).read(src.chunk(0).pointers)[0]["cls"] == b"seven"


def test_a_sample_missing_a_column_is_named_and_can_be_skipped(tmp_path):
    root = write(tmp_path / "d")
    src = WebDatasetSource(root, columns=["json"], chunk_size=4)
    with pytest.raises(
        FetchError, match=rf"shard-0000\.tar.*sample '{key(1)}' has no field \['json'\]"
    ):
        src.read(src.chunk(0).pointers)
    pipeline = zephon.Pipeline(src, [fetch(), batch(2)], on_error={"fetch": "skip"})
    with pipeline.iter() as loader:
        got = [k for b in loader for k in b.payload["__key__"]]
        assert loader.stats()["skipped"] == N - len(range(0, N, 3))
    assert got == [key(i) for i in range(0, N, 3)]


# --------------------------------------------------------------------------- malformed shards


def test_a_truncated_shard_is_a_fetch_error_naming_it_and_the_member(tmp_path):
    root = write(tmp_path)
    shard = root / "shard-0001.tar"
    data = shard.read_bytes()
    with tarfile.open(shard) as tar:
        last = tar.getmembers()[-1]
    shard.write_bytes(data[: last.offset_data + 3])
    with pytest.raises(FetchError, match=rf"shard-0001\.tar.*'{key(31)}\.txt'.*truncated"):
        WebDatasetSource(root).num_samples()


def test_a_damaged_header_a_compressed_shard_and_a_repeated_field_are_named(tmp_path):
    shard = write(tmp_path / "a", n=3) / "shard-0000.tar"
    data = bytearray(shard.read_bytes())
    with tarfile.open(shard) as tar:
        second = tar.getmembers()[1]
    data[second.offset + 10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(
        FetchError, match=rf"shard-0000\.tar.*after member '{key(0)}\.\w+'.*checksum"
    ):
        WebDatasetSource(shard).num_samples()

    gz = tmp_path / "b.tar"
    with wds.TarWriter(str(gz), compress=True) as out:
        out.write({"__key__": "k", "txt": "x"})
    with pytest.raises(FetchError, match=r"b\.tar.*gzip-compressed"):
        WebDatasetSource(gz).num_samples()

    twice = tmp_path / "c.tar"
    with tarfile.open(twice, "w") as tar:
        for name in ("k.txt", "k.txt"):
            tar.addfile(tarfile.TarInfo(name))
    with pytest.raises(
        FetchError, match=r"c\.tar.*member 'k\.txt' repeats field 'txt' of sample 'k'"
    ):
        WebDatasetSource(twice).num_samples()


def test_the_member_index_is_built_once_and_kept_beside_the_shard(tmp_path):
    root = write(tmp_path / "d")
    src = WebDatasetSource(root)
    src.num_samples()
    index = Path(src.index_path(0))
    assert index == root / "shard-0000.tar.zidx" and index.exists()
    built = index.stat().st_mtime_ns
    again = WebDatasetSource(root)
    assert again.describe() == src.describe()
    assert index.stat().st_mtime_ns == built
    (tmp_path / "ix").mkdir()
    elsewhere = WebDatasetSource(root, index_dir=tmp_path / "ix")
    elsewhere.num_samples()
    assert len(list((tmp_path / "ix").glob("shard-0000.tar.*.zidx"))) == 1


def test_a_damaged_index_is_built_again(tmp_path):
    root = write(tmp_path / "d")
    src = WebDatasetSource(root)
    want = every_sample(src)
    index = Path(src.index_path(1))
    raw = bytearray(index.read_bytes())
    raw[-5] ^= 0xFF
    index.write_bytes(bytes(raw))
    assert every_sample(WebDatasetSource(root)) == want


def test_open_source_picks_webdataset_for_tar_shards(tmp_path):
    root = write(tmp_path / "d")
    for given in (root, root / "shard-0002.tar", str(root / "*.tar"), sorted(root.glob("*.tar"))):
        src = open_source(given, columns=["txt"])
        assert type(src) is WebDatasetSource and src.columns == ["txt"]
    assert open_source(root).num_samples() == N


def test_import_zephon_reads_shards_without_webdataset(tmp_path):
    root = write(tmp_path / "d")
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["webdataset"] = None  # importing it would fail
        from zephon.sources import WebDatasetSource
        print(WebDatasetSource({str(root)!r}).num_samples())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], env=script_env(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(N)]


# --------------------------------------------------------------------------- pipelines


def pipeline(root: Path | str, **kw: Any) -> zephon.Pipeline:
    src = WebDatasetSource(root, columns=["cls", "jpg"], chunk_size=5, shuffle=True)
    return zephon.Pipeline(src, [fetch(), batch(3)], **kw)


def delivered(items: list[Any]) -> Counter:
    return Counter(index_of({"__key__": k}) for item in items for k in item.payload["__key__"])


def test_resumes_exactly_at_any_step(tmp_path):
    root = write(tmp_path / "d")
    assert_resumes_exactly(partial(pipeline, root), lambda n: (0, 3, 9, n - 1))


@pytest.mark.usefixtures("no_leftover_workers")
def test_a_killed_worker_resumes_exactly(tmp_path):
    assert_a_killed_worker_resumes_exactly(partial(pipeline, write(tmp_path / "d")), 4)


def test_a_job_of_four_ranks_resumes_on_two_and_relanes(tmp_path):
    make = partial(pipeline, write(tmp_path / "d"))
    assert_resumes_on_two_ranks_and_relanes(make, delivered, Counter(range(N)))


def test_a_rewritten_shard_is_refused_at_resume_naming_it(tmp_path):
    root = write(tmp_path / "d")

    def rewrite() -> None:
        shutil.rmtree(root)
        write(root, n=N + 1)  # the same shards but the last, which gains a sample

    assert_a_changed_dataset_is_refused(
        partial(pipeline, root), rewrite, re.escape("shard-0003.tar")
    )


def test_a_shard_rewritten_with_the_same_size_is_refused_at_resume_by_content(tmp_path):
    root = write(tmp_path / "d")
    shard = root / "shard-0001.tar"

    def flip() -> None:
        data = bytearray(shard.read_bytes())
        with tarfile.open(shard) as tar:
            data[tar.getmembers()[4].offset_data] ^= 1  # one byte of one member, same size
        shard.write_bytes(bytes(data))

    match = r"shard-0001\.tar.*content_sha256"
    assert_a_changed_dataset_is_refused(partial(pipeline, root), flip, match)


def test_a_local_shard_rewritten_while_read_is_refused(tmp_path):
    root = write(tmp_path)
    assert_a_file_rewritten_under_a_reader_is_refused(
        WebDatasetSource(root, chunk_size=5),
        root / "shard-0000.tar",
        flip=700,
        match=r"shard-0000\.tar.*changed since it was indexed",
    )


# --------------------------------------------------------------------------- remote


def test_a_bucket_copy_delivers_the_local_samples(tmp_path, bucket):
    local = write(tmp_path / "local")
    uri = bucket.upload(local, "wds")
    here = WebDatasetSource(local, chunk_size=6, shuffle=True, cache_dir=tmp_path / "c1")
    there = WebDatasetSource(uri, chunk_size=6, shuffle=True, cache_dir=tmp_path / "c2")
    got = assert_a_copy_reads_the_same(here, there, "__key__")
    for g in got:
        assert_written(g, uri)


def test_a_bucket_copy_read_through_a_shard_cache_delivers_the_local_samples(tmp_path, bucket):
    local = write(tmp_path / "local")
    uri = bucket.upload(local, "wds-cached")
    here = WebDatasetSource(local, chunk_size=6, shuffle=True, cache_dir=tmp_path / "c1")
    cache = ShardCache(tmp_path / "shards", max_bytes=1 << 30)
    there = WebDatasetSource(
        uri, chunk_size=6, shuffle=True, cache_dir=tmp_path / "c2", cache=cache
    )
    assert_a_copy_reads_the_same(here, there, "__key__")
    counts = there.io_counters()[there.root]
    assert counts["cache_misses"] == len(there.files()) and counts["cache_hits"] > 0


def test_a_changed_remote_block_is_refused(tmp_path, bucket):
    assert_a_changed_object_is_refused(
        bucket,
        write(tmp_path / "local"),
        "wds-changed",
        "shard-0000.tar",
        partial(WebDatasetSource, cache_dir=tmp_path / "c"),
        flip=-2000,
        match=r"shard-0000\.tar.*(no longer matches|changed since)",
    )


def test_a_bucket_copy_resumes_exactly(tmp_path, bucket):
    uri = bucket.upload(write(tmp_path / "local"), "wds-resume")
    assert_resumes_exactly(partial(pipeline, uri), lambda n: (6,))
    assert open_source(uri).num_samples() == N


@pytest.mark.usefixtures("no_leftover_workers")
def test_process_lanes_over_a_bucket_deliver_the_inline_stream(tmp_path, bucket):
    uri = bucket.upload(write(tmp_path / "local"), "wds-process")
    full = run(iter(pipeline(uri, lanes=2)))
    assert run(iter(pipeline(uri, lanes=2, workers="process"))) == full


def test_an_fsspec_store_delivers_the_local_samples(tmp_path):
    import fsspec

    memory = fsspec.filesystem("memory")
    local = write(tmp_path / "local")
    for path in sorted(local.glob("*.tar")):
        memory.pipe(f"/{tmp_path.name}/{path.name}", path.read_bytes())
    there = WebDatasetSource(f"memory:///{tmp_path.name}", chunk_size=6, shuffle=True)
    here = WebDatasetSource(local, chunk_size=6, shuffle=True)
    got = assert_a_copy_reads_the_same(here, there, "__key__")
    for g in got:
        assert_written(g)
