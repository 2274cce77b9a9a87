"""Specification of ArrowSource over real Parquet and Arrow IPC files written by pyarrow."""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pipeline_kit import run_with_timeout

import zephon
from zephon.errors import CheckpointMismatchError, FetchError
from zephon.ops import batch, fetch
from zephon.sources import ArrowSource

FORMATS = ("parquet", "arrow_file", "feather", "arrow_stream")


def make_table(start: int, n: int) -> pa.Table:
    """Rows ``start .. start+n-1``: every column is a function of the global row number."""
    idx = np.arange(start, start + n, dtype=np.int64)
    return pa.table(
        {
            "idx": idx,
            "text": [f"row {i}" for i in idx.tolist()],
            "vec": pa.array([np.full(i % 4, i, dtype=np.float32) for i in idx.tolist()]),
        }
    )


def write(path: Path, table: pa.Table, fmt: str, group: int) -> Path:
    """Write ``table`` in ``fmt`` with groups (row groups / record batches) of ``group`` rows."""
    if fmt == "parquet":
        pq.write_table(table, path, row_group_size=group)
    elif fmt == "feather":
        feather.write_feather(table, str(path), chunksize=group)  # lz4-compressed Feather v2
    else:
        new = ipc.new_file if fmt == "arrow_file" else ipc.new_stream
        with new(str(path), table.schema) as writer:
            for b in table.to_batches(max_chunksize=group):
                writer.write_batch(b)
    return path


def dataset(tmp_path: Path, sizes: list[int], fmts: tuple[str, ...], group: int = 7) -> list[Path]:
    paths = []
    start = 0
    for k, (n, fmt) in enumerate(zip(sizes, fmts, strict=True)):
        paths.append(write(tmp_path / f"part{k}.{fmt}", make_table(start, n), fmt, group))
        start += n
    return paths


def read_all(src: ArrowSource) -> list[list[dict[str, Any]]]:
    """Payloads chunk by chunk over every pass."""
    total = src.total_chunks()
    assert total is not None
    return [src.read(src.chunk(p).pointers) for p in range(total)]


def expected_row(i: int) -> dict[str, Any]:
    return {"idx": i, "text": f"row {i}", "vec": np.full(i % 4, i, dtype=np.float32)}


def assert_payload(payload: dict[str, Any], i: int) -> None:
    want = expected_row(i)
    assert list(payload) == list(want)
    assert payload["idx"] == i and payload["text"] == want["text"]
    assert isinstance(payload["vec"], np.ndarray) and payload["vec"].dtype == np.float32
    np.testing.assert_array_equal(payload["vec"], want["vec"])


# --------------------------------------------------------------------------- coverage


@pytest.mark.parametrize("shuffle", [False, True])
def test_every_row_of_every_file_is_read_exactly_once_per_pass(tmp_path, shuffle):
    sizes = [23, 0, 40, 9]
    paths = dataset(tmp_path, sizes, ("parquet", "arrow_file", "feather", "arrow_stream"))
    src = ArrowSource(paths, chunk_size=6, shuffle=shuffle, seed=5, passes=2)
    assert src.num_samples() == sum(sizes)
    chunks = read_all(src)
    per_pass = src.num_chunks()
    orders = []
    for q in range(2):
        rows = [p for chunk in chunks[q * per_pass : (q + 1) * per_pass] for p in chunk]
        for payload in rows:
            assert_payload(payload, payload["idx"])
        orders.append([p["idx"] for p in rows])
        assert sorted(orders[-1]) == list(range(sum(sizes)))
    if shuffle:
        assert orders[0] != orders[1] and orders[0] != sorted(orders[0])
    else:
        assert orders[0] == orders[1] == list(range(sum(sizes)))


def test_pointers_carry_the_file_index_and_the_global_row(tmp_path):
    paths = dataset(tmp_path, [5, 0, 4], ("parquet", "parquet", "arrow_file"), group=2)
    src = ArrowSource(paths, dataset_id=3, chunk_size=100)
    rows = src.chunk(0).pointers
    assert rows.tolist() == [[3, 0, i] for i in range(5)] + [[3, 2, i] for i in range(5, 9)]
    assert [src.file_format(i) for i in range(3)] == ["parquet", "parquet", "arrow_file"]
    assert src.file_groups(0) == [2, 2, 1] and sum(src.file_groups(1)) == 0


def test_a_pointer_naming_the_wrong_file_or_an_unknown_row_is_a_fetch_error(tmp_path):
    paths = dataset(tmp_path, [5, 4], ("parquet", "parquet"))
    src = ArrowSource(paths)
    with pytest.raises(FetchError, match=r"\(0, 0, 6\).*file #1"):
        src.read(np.array([[0, 0, 6]]))
    with pytest.raises(FetchError, match=r"\(0, 1, 9\)"):
        src.read(np.array([[0, 1, 9]]))
    with pytest.raises(FetchError, match=r"dataset_id"):
        src.read(np.array([[1, 0, 0]]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_come_back_in_pointer_order_with_duplicates(tmp_path, fmt):
    path = write(tmp_path / f"t.{fmt}", make_table(0, 50), fmt, group=8)
    src = ArrowSource(path)
    want = [49, 0, 17, 17, 8, 3]
    out = src.read(np.array([[0, 0, i] for i in want]))
    for payload, i in zip(out, want, strict=True):
        assert_payload(payload, i)
    assert src.read(np.zeros((0, 3), dtype=np.int64)) == []


# --------------------------------------------------------------------------- payloads


def test_payload_rule_numeric_lists_become_arrays_everything_else_python(tmp_path):
    table = pa.table(
        {
            "ints": pa.array([[1, 2], None, [3, None], []], type=pa.list_(pa.int16())),
            "fixed": pa.array(
                [[1.0, 2.0], [3.0, 4.0], None, [5.0, 6.0]], type=pa.list_(pa.float64(), 2)
            ),
            "flags": pa.array([[True], [False, True], [], None], type=pa.large_list(pa.bool_())),
            "words": [["a"], ["b", "c"], [], None],
            "name": ["x", None, "z", "w"],
            "blob": [b"\x00", b"", None, b"q"],
            "nested": [{"k": 1}, {"k": 2}, None, {"k": 4}],
        }
    )
    path = tmp_path / "t.parquet"
    pq.write_table(table, path)
    out = ArrowSource(path).read(np.array([[0, 0, i] for i in range(4)]))
    assert out[0]["ints"].dtype == np.int16 and out[0]["ints"].tolist() == [1, 2]
    assert out[1]["ints"] is None
    assert out[2]["ints"] == [3, None]  # a list holding nulls stays a Python list
    assert isinstance(out[3]["ints"], np.ndarray) and out[3]["ints"].size == 0
    assert out[1]["fixed"].tolist() == [3.0, 4.0] and out[2]["fixed"] is None
    assert out[1]["flags"].dtype == np.bool_ and out[1]["flags"].tolist() == [False, True]
    assert out[1]["words"] == ["b", "c"]
    assert [p["name"] for p in out] == ["x", None, "z", "w"]
    assert [p["blob"] for p in out] == [b"\x00", b"", None, b"q"]
    assert out[0]["nested"] == {"k": 1} and out[2]["nested"] is None


def _mixed_rows(n: int) -> pa.Table:
    """Columns of every payload kind, nulls placed differently in each, in two record batches."""
    table = pa.table(
        {
            "ints": pa.array(
                [
                    None if i % 5 == 1 else [i, None] if i % 7 == 2 else list(range(i % 4))
                    for i in range(n)
                ],
                type=pa.list_(pa.int16()),
            ),
            "fixed": pa.array(
                [None if i % 6 == 3 else [float(i), -float(i)] for i in range(n)],
                type=pa.list_(pa.float64(), 2),
            ),
            "flags": pa.array(
                [[i % 2 == 0] * (i % 3) for i in range(n)], type=pa.large_list(pa.bool_())
            ),
            "name": [None if i % 4 == 0 else f"row {i}" for i in range(n)],
        }
    )
    return pa.concat_tables([table.slice(0, n // 2), table.slice(n // 2)])


def _same_payloads(got: list[dict], want: list[dict]) -> bool:
    def same(a: Any, b: Any) -> bool:
        if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
            return (
                isinstance(a, np.ndarray)
                and isinstance(b, np.ndarray)
                and a.dtype == b.dtype
                and np.array_equal(a, b)
            )
        return a == b

    return len(got) == len(want) and all(
        g.keys() == w.keys() and all(same(g[k], w[k]) for k in g) for g, w in zip(got, want)
    )


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 29), st.integers(1, 30))
def test_consecutive_rows_read_by_slicing_equal_rows_gathered_by_take(start, length):
    from zephon.sources.arrow import table_rows

    table = _mixed_rows(30)
    length = min(length, 30 - start)
    rows = np.arange(start, start + length)
    names = ["ints", "fixed", "flags", "name"]
    sliced = table_rows(table, rows, names)  # consecutive: a slice of the table
    # The same rows asked for in reverse are not consecutive: they go through take.
    gathered = table_rows(table, rows[::-1], names)[::-1]
    assert length == 1 or _same_payloads(sliced, gathered)
    assert _same_payloads(sliced, [table_rows(table, np.array([r, r]), names)[0] for r in rows])


def test_list_arrays_are_copies_that_do_not_pin_the_decoded_group(tmp_path):
    path = write(tmp_path / "t.parquet", make_table(0, 20), "parquet", group=20)
    payload = ArrowSource(path).read(np.array([[0, 0, 7]]))[0]
    assert payload["vec"].base is None and payload["vec"].flags.writeable


@pytest.mark.parametrize("fmt", FORMATS)
def test_columns_projects_and_orders_the_payload(tmp_path, fmt):
    path = write(tmp_path / f"t.{fmt}", make_table(0, 30), fmt, group=8)
    src = ArrowSource(path, columns=["text", "idx"])
    out = src.read(np.array([[0, 0, 11], [0, 0, 29]]))
    assert out == [{"text": "row 11", "idx": 11}, {"text": "row 29", "idx": 29}]
    assert src.describe()["columns"] == ["text", "idx"]
    assert ArrowSource(path, columns=[]).read(np.array([[0, 0, 1]])) == [{}]


def test_a_column_missing_from_a_file_is_a_fetch_error_naming_it(tmp_path):
    paths = dataset(tmp_path, [3, 3], ("parquet", "parquet"))
    pq.write_table(pa.table({"other": [1, 2]}), paths[1])
    with pytest.raises(FetchError, match=r"part1\.parquet.*no column\(s\) \['idx'\]"):
        ArrowSource(paths, columns=["idx"]).num_samples()


def test_bad_constructor_arguments_are_refused():
    with pytest.raises(ValueError, match="paths is empty"):
        ArrowSource([])
    with pytest.raises(TypeError, match="columns"):
        ArrowSource("x.parquet", columns="idx")
    with pytest.raises(ValueError, match="duplicates"):
        ArrowSource("x.parquet", columns=["a", "a"])
    with pytest.raises(ValueError, match="chunk_size"):
        ArrowSource("x.parquet", chunk_size=0)


# --------------------------------------------------------------------------- I/O


class CountingFile(io.FileIO):
    """A file that counts the bytes read through it."""

    def __init__(self, path: str, counter: list[int]):
        super().__init__(path, "r")
        self.counter = counter

    def read(self, size: int | None = -1) -> bytes:
        data = super().read(size)
        self.counter[0] += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        n = super().readinto(buffer)
        self.counter[0] += n
        return n


class CountingArrowSource(ArrowSource):
    """Counts every byte the source reads (it reads only through ``open_file``)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.bytes_read = [0]
        self.opened = 0

    def open_file(self, path: str) -> pa.NativeFile:
        self.opened += 1
        return pa.PythonFile(CountingFile(path, self.bytes_read), mode="r")


def random_table(n: int) -> pa.Table:
    # Incompressible values, so bytes on disk track the rows stored.
    rng = np.random.default_rng(0)
    return pa.table({f"c{k}": rng.random(n) for k in range(4)})


@pytest.mark.parametrize("fmt", ["parquet", "arrow_file"])
def test_reads_only_the_groups_the_pointers_need(tmp_path, fmt):
    path = write(tmp_path / f"big.{fmt}", random_table(20_000), fmt, group=2_000)
    size = path.stat().st_size
    group_bytes = size / 10
    ArrowSource(path).num_samples()  # the first open digests the file and caches the table
    src = CountingArrowSource(path)
    src.GROUP_CACHE = 0
    src.num_samples()
    footer = src.bytes_read[0]
    assert footer < group_bytes / 4  # then metadata comes from the footer (and the sidecar) only
    for group in (7, 2, 9):
        before = src.bytes_read[0]
        rows = np.array([[0, 0, group * 2000 + k] for k in (5, 1999, 700)])
        assert [p["c0"] for p in src.read(rows)] != []
        spent = src.bytes_read[0] - before
        assert group_bytes * 0.9 < spent < group_bytes * 1.5
    before = src.bytes_read[0]
    src.read(np.array([[0, 0, g * 2000] for g in range(10)]))
    assert src.bytes_read[0] - before > size * 0.9  # the measure sees a read of every group


@pytest.mark.parametrize("fmt", ["parquet", "arrow_file"])
def test_column_projection_reads_only_the_projected_columns(tmp_path, fmt):
    path = write(tmp_path / f"big.{fmt}", random_table(20_000), fmt, group=20_000)
    src = CountingArrowSource(path, columns=["c2"])
    src.num_samples()
    before = src.bytes_read[0]
    assert set(src.read(np.array([[0, 0, 3]]))[0]) == {"c2"}
    assert src.bytes_read[0] - before < path.stat().st_size * 0.35


def test_chunks_smaller_than_a_row_group_decode_it_once(tmp_path):
    path = write(tmp_path / "big.parquet", random_table(4_000), "parquet", group=1_000)
    src = CountingArrowSource(path, chunk_size=100)
    src.num_samples()
    before = src.bytes_read[0]
    assert sum(len(chunk) for chunk in read_all(src)) == 4_000
    assert src.bytes_read[0] - before < path.stat().st_size * 1.1  # not 10x
    assert src.opened == 1 + 4  # the metadata scan, then once per row group


def test_dropped_read_caches_are_read_again_with_the_same_rows(tmp_path):
    path = write(tmp_path / "big.parquet", random_table(4_000), "parquet", group=1_000)
    src = CountingArrowSource(path, chunk_size=100)
    rows = np.array([[0, 0, 1_500], [0, 0, 2_500]])  # two row groups, both kept decoded
    first = src.read(rows)
    opened = src.opened
    assert src.read(rows) == first and src.opened == opened  # from the decoded groups
    src.drop_read_caches()
    assert src.read(rows) == first
    assert src.opened == opened + 1  # read from the file again
    assert src.describe() == CountingArrowSource(path, chunk_size=100).describe()


def test_a_mixture_drops_the_read_caches_of_each_component(tmp_path):
    from zephon.sources.mixture import MixtureSource

    comps = {
        name: CountingArrowSource(
            write(tmp_path / f"{name}.parquet", random_table(400), "parquet", group=100),
            dataset_id=k,
            chunk_size=50,
        )
        for k, name in enumerate("ab")
    }
    mix = MixtureSource(comps, {"a": 0.5, "b": 0.5}, chunk_size=40)
    rows = mix.chunk(0).pointers
    first = mix.read(rows)
    opened = {name: c.opened for name, c in comps.items()}
    assert mix.read(rows) == first and {n: c.opened for n, c in comps.items()} == opened
    mix.drop_read_caches()
    assert mix.read(rows) == first
    assert {n: c.opened - opened[n] for n, c in comps.items()} == {"a": 1, "b": 1}


@pytest.mark.parametrize("how", ["end", "close"])
def test_a_loader_that_ends_or_closes_leaves_no_decoded_groups_behind(tmp_path, how):
    path = write(tmp_path / "t.parquet", make_table(0, 400), "parquet", group=100)
    src = CountingArrowSource(path, chunk_size=50)
    src.GROUP_CACHE = 1000  # every group read stays decoded, unless the caches are dropped
    with zephon.Pipeline(src, [fetch(), batch(10)]).iter() as loader:
        for step, _ in enumerate(loader, 1):
            if how == "close" and step == 3:
                loader.close()
                break
        opened = src.opened
        assert src.read(np.array([[0, 0, 0]]))[0]["idx"] == 0
        assert src.opened == opened + 1, "the loader's groups were still held"


def test_a_transient_os_error_is_left_to_fetch_to_retry(tmp_path):
    path = write(tmp_path / "t.parquet", make_table(0, 10), "parquet", group=4)

    class Flaky(ArrowSource):
        failures = 0

        def open_file(self, path: str) -> pa.NativeFile:
            if self.failures:
                self.failures -= 1
                raise OSError(errno.EIO, "Input/output error")
            return super().open_file(path)

    src = Flaky(path, chunk_size=4)
    src.num_samples()
    src.failures = 1
    with pytest.raises(OSError, match=r"t\.parquet") as info:
        src.read(src.chunk(0).pointers)
    assert not isinstance(info.value, FetchError) and info.value.errno == errno.EIO
    src.failures = 2  # fewer than fetch's 3 retries: the stream is complete
    got = [i for b in zephon.Pipeline(src, [fetch(), batch(4)]) for i in b.payload["idx"]]
    assert got == list(range(10))


# --------------------------------------------------------------------------- errors


def test_a_missing_file_is_a_fetch_error_naming_it(tmp_path):
    paths = dataset(tmp_path, [4], ("parquet",))
    with pytest.raises(FetchError, match=r"nope\.parquet.*FileNotFoundError"):
        ArrowSource([paths[0], tmp_path / "nope.parquet"]).num_samples()
    src = ArrowSource(paths)
    src.num_samples()
    os.unlink(paths[0])
    with pytest.raises(FetchError, match=r"pointer \(0, 0, 2\) from '.*part0\.parquet'"):
        src.read(np.array([[0, 0, 2]]))


@pytest.mark.parametrize(
    ("fmt", "cut", "message"),
    [
        ("parquet", 20, "no PAR1 magic at its end"),
        ("arrow_file", 3, "no ARROW1 magic at its end"),
        ("feather", 3, "no ARROW1 magic at its end"),
        ("arrow_stream", 8, "no end-of-stream marker"),
        ("arrow_stream", 100, "runs past the end"),
    ],
)
def test_a_truncated_file_is_a_fetch_error_naming_it(tmp_path, fmt, cut, message):
    path = write(tmp_path / f"t.{fmt}", make_table(0, 40), fmt, group=8)
    path.write_bytes(path.read_bytes()[:-cut])
    with pytest.raises(FetchError, match=rf"t\.{fmt}.*{message}"):
        ArrowSource(path).num_samples()


def test_a_file_that_is_not_parquet_or_arrow_is_a_fetch_error(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": 1}\n')
    with pytest.raises(FetchError, match=r"rows\.jsonl.*not a Parquet or Arrow IPC file"):
        ArrowSource(path).num_samples()
    (tmp_path / "empty.parquet").write_bytes(b"")
    with pytest.raises(FetchError, match=r"empty\.parquet"):
        ArrowSource(tmp_path / "empty.parquet").num_samples()


def test_a_corrupt_parquet_footer_is_a_fetch_error(tmp_path):
    path = write(tmp_path / "t.parquet", make_table(0, 40), "parquet", group=8)
    data = bytearray(path.read_bytes())
    data[-40:-8] = b"\xff" * 32  # inside the thrift footer, magic intact
    path.write_bytes(bytes(data))
    with pytest.raises(FetchError, match=r"t\.parquet"):
        ArrowSource(path).num_samples()


def test_a_corrupt_page_with_a_checksum_is_a_fetch_error_not_wrong_data(tmp_path):
    path = tmp_path / "t.parquet"
    pq.write_table(random_table(4000), path, row_group_size=1000, write_page_checksum=True)
    src = ArrowSource(path)
    src.num_samples()
    data = bytearray(path.read_bytes())
    data[1000:1400] = bytes(b ^ 0xFF for b in data[1000:1400])  # first row group's pages
    path.write_bytes(bytes(data))
    # Damaged after its digests were taken: the digest of the column chunk tells.
    with pytest.raises(FetchError, match=r"pointer \(0, 0, 5\).*t\.parquet.*row group 0"):
        src.read(np.array([[0, 0, 5]]))
    # A new source digests the file again (its mtime changed), so the digests are of the damaged
    # bytes: the page CRC the writer stored tells.
    with pytest.raises(FetchError, match=r"pointer \(0, 0, 5\).*t\.parquet.*CRC"):
        ArrowSource(path).read(np.array([[0, 0, 5]]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_file_rewritten_with_other_rows_after_the_metadata_read_is_a_fetch_error(tmp_path, fmt):
    path = write(tmp_path / f"t.{fmt}", make_table(0, 40), fmt, group=8)
    src = ArrowSource(path)
    src.num_samples()
    write(path, make_table(0, 33), fmt, group=8)
    with pytest.raises(FetchError, match=r"changed since its metadata was read"):
        src.read(np.array([[0, 0, 1]]))


def test_a_touched_but_identical_file_still_reads(tmp_path):
    path = write(tmp_path / "t.parquet", make_table(0, 10), "parquet", group=4)
    src = ArrowSource(path)
    src.num_samples()
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert src.read(np.array([[0, 0, 9]]))[0]["idx"] == 9


def test_a_stream_with_dictionary_columns_reads_every_batch(tmp_path):
    table = pa.table({"d": pa.array(["a", "b", "a", "c"] * 3).dictionary_encode(), "i": range(12)})
    path = tmp_path / "d.arrows"
    with ipc.new_stream(str(path), table.schema) as writer:
        for b in table.to_batches(max_chunksize=5):
            writer.write_batch(b)
    src = ArrowSource(path)
    out = src.read(np.array([[0, 0, 11], [0, 0, 0], [0, 0, 6]]))
    assert out == [{"d": "c", "i": 11}, {"d": "a", "i": 0}, {"d": "a", "i": 6}]


# --------------------------------------------------------------------------- changed data

SAME_FOOTER_FORMATS = ("parquet", "arrow_file", "arrow_stream")


def write_same_footer(path: Path, fmt: str, reordered: bool) -> Path:
    """40 rows in groups of 8, uncompressed; ``reordered`` reverses the rows inside each group,
    which keeps every size, offset and statistic, so the footer bytes stay the same."""
    order = list(range(40))
    if reordered:
        order = [j for s in range(0, 40, 8) for j in reversed(range(s, s + 8))]
    idx = np.asarray(order, dtype=np.int64)
    table = pa.table(
        {
            "idx": idx,
            "text": [f"row {i}" for i in order],
            "vec": pa.array([np.full(i % 4, i, dtype=np.float32) for i in order]),
        }
    )
    if fmt == "parquet":
        pq.write_table(table, path, row_group_size=8, compression="none", use_dictionary=False)
    else:
        write(path, table, fmt, group=8)
    return path


def footer_bytes(path: Path, fmt: str) -> bytes:
    data = path.read_bytes()
    if fmt == "parquet":
        return data[-8 - struct.unpack("<I", data[-8:-4])[0] :]
    if fmt == "arrow_file":
        return data[-10 - struct.unpack("<i", data[-10:-6])[0] :]
    return data[:200]  # a stream has no footer; its schema message comes first


@pytest.mark.parametrize("fmt", SAME_FOOTER_FORMATS)
def test_a_file_rewritten_with_the_same_footer_is_refused_while_running(tmp_path, fmt):
    path = write_same_footer(tmp_path / f"t.{fmt}", fmt, reordered=False)
    footer, size = footer_bytes(path, fmt), path.stat().st_size
    src = ArrowSource(path, chunk_size=8)
    assert src.read(np.array([[0, 0, 3]]))[0]["idx"] == 3  # group 0 is read (and kept)
    write_same_footer(path, fmt, reordered=True)
    assert footer_bytes(path, fmt) == footer and path.stat().st_size == size
    group = "row group 1" if fmt == "parquet" else "record batch 1"
    with pytest.raises(
        FetchError, match=rf"pointer \(0, 0, 10\) from '.*t\.{fmt}': {group}: .*changed"
    ):
        src.read(np.array([[0, 0, 10]]))


@pytest.mark.parametrize("fmt", SAME_FOOTER_FORMATS)
@pytest.mark.parametrize("keep_mtime", [False, True])
def test_a_same_footer_rewrite_is_refused_on_resume(tmp_path, fmt, keep_mtime):
    """With a new mtime the file is digested again and the fingerprint (its content) differs;
    kept behind the cached digests' back, the first read of a changed range refuses it."""
    path = write_same_footer(tmp_path / f"t.{fmt}", fmt, reordered=False)

    def pipeline() -> zephon.Pipeline:
        return zephon.Pipeline(ArrowSource(path, chunk_size=8), [fetch(), batch(4)])

    def scenario() -> list[int]:
        loader = pipeline().iter()
        got = [int(i) for _ in range(3) for i in next(loader).payload["idx"]]
        state = json.loads(json.dumps(loader.state_dict()))
        loader.close()
        st = path.stat()
        write_same_footer(path, fmt, reordered=True)
        if not keep_mtime:
            with pytest.raises(CheckpointMismatchError, match=rf"t\.{fmt}' changed .*content"):
                pipeline().iter(state=state)
            return got
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert pipeline().fingerprint == state["fingerprint"]
        with pytest.raises(FetchError, match=rf"t\.{fmt}.*changed since .*delete '.*zsum'"):
            for b in pipeline().iter(state=state):
                got += [int(i) for i in b.payload["idx"]]
        return got

    assert run_with_timeout(scenario) == list(range(12))


def test_a_touched_file_and_a_copied_dataset_keep_their_fingerprint(tmp_path):
    paths = dataset(tmp_path, [9, 6, 5], ("parquet", "arrow_file", "arrow_stream"))
    desc = ArrowSource(paths).describe()
    copies = []
    for p in paths:
        (tmp_path / "copy").mkdir(exist_ok=True)
        copies.append(Path(shutil.copy(p, tmp_path / "copy" / p.name)))
        st = p.stat()
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert ArrowSource(paths).describe() == desc
    assert ArrowSource(copies).describe()["files"] == desc["files"]


@pytest.mark.parametrize("fmt", ["parquet", "arrow_file"])
def test_one_flipped_footer_byte_is_a_fetch_error_naming_the_file(tmp_path, fmt):
    path = tmp_path / f"t.{fmt}"
    write(path, make_table(0, 6).select(["idx", "text"]), fmt, group=6)
    data = path.read_bytes()
    footer = len(footer_bytes(path, fmt))
    trailer = 8 if fmt == "parquet" else 10  # footer length and magic
    for at in range(len(data) - footer, len(data) - trailer):
        bad = bytearray(data)
        bad[at] ^= 0xFF
        path.write_bytes(bytes(bad))
        Path(str(path) + ".zsum").unlink(missing_ok=True)  # digest afresh every time
        src = ArrowSource(path)
        try:
            src.read(src.chunk(0).pointers) if src.num_samples() else None
        except FetchError as exc:
            assert str(path) in str(exc), f"byte {at}: {exc}"


FLIP_SCRIPT = textwrap.dedent(
    """
    import os
    import sys
    import numpy as np
    from zephon.errors import FetchError
    from zephon.sources import ArrowSource

    path, stride = sys.argv[1], int(sys.argv[2])
    data = open(path, "rb").read()
    for at in [*range(0, len(data), stride), *map(int, sys.argv[3:])]:
        bad = bytearray(data)
        bad[at] ^= 0xFF
        open(path, "wb").write(bytes(bad))
        if os.path.exists(path + ".zsum"):
            os.remove(path + ".zsum")  # digested afresh each time
        src = ArrowSource(path)
        try:
            n = src.num_samples()
            src.read(np.array([[0, 0, i] for i in range(n)]))
        except FetchError as exc:
            assert path in str(exc), f"byte {at}: {exc}"
    print("ok")
    """
)


@pytest.mark.parametrize("fmt", FORMATS)
def test_damaged_bytes_anywhere_are_read_or_a_fetch_error_never_a_crash(tmp_path, fmt):
    table = make_table(0, 12).append_column("d", pa.array(["a", "b", "c"] * 4).dictionary_encode())
    path = write(tmp_path / f"t.{fmt}", table, fmt, group=6)
    data = path.read_bytes()
    # The bytes around the dictionary's values hold its offsets: a bad one used to abort the
    # process inside pyarrow (IPC buffers are not validated when they are read).
    near = data.find(b"abc")
    extra = [str(at) for at in range(max(0, near - 24), near)] if fmt != "parquet" else []
    script = tmp_path / "flip.py"
    script.write_text(FLIP_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), str(path), "13", *extra],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.getcwd(),
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_an_undecodable_value_is_a_fetch_error_naming_the_batch_and_pointer(tmp_path):
    path = write(tmp_path / "t.arrow_file", make_table(0, 16), "arrow_file", group=8)
    data = path.read_bytes()
    at = data.index(b"row 12")
    path.write_bytes(data[:at] + b"\xff\xfe\xfd\xfc\xfb\xfa" + data[at + 6 :])  # not UTF-8
    src = ArrowSource(path)
    assert src.read(np.array([[0, 0, 3]]))[0]["text"] == "row 3"
    with pytest.raises(FetchError, match=r"pointer \(0, 0, 12\).*record batch 1.*UTF8"):
        src.read(np.array([[0, 0, 12]]))


# --------------------------------------------------------------------------- digest sidecars


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_first_open_digests_the_file_once_later_opens_read_the_footer(tmp_path, fmt):
    path = write(tmp_path / f"big.{fmt}", random_table(20_000), fmt, group=2_000)
    size = path.stat().st_size
    first = CountingArrowSource(path)
    first.num_samples()
    # Parquet: the digests read the column chunks once; IPC: the message walk reads them once
    # more (through a memory map, the default, both passes are zero-copy).
    passes = 1 if fmt == "parquet" else 2
    assert size * 0.9 * passes < first.bytes_read[0] < size * (passes + 0.1)
    [where] = first.digest_locations()
    assert where == str(path) + ".zsum"
    again = CountingArrowSource(path)
    assert again.describe() == first.describe()
    assert again.bytes_read[0] < size / 20


def test_a_damaged_digest_sidecar_is_rebuilt_not_trusted(tmp_path):
    path = write(tmp_path / "t.parquet", make_table(0, 40), "parquet", group=8)
    desc = ArrowSource(path).describe()
    sidecar = Path(str(path) + ".zsum")
    data = bytearray(sidecar.read_bytes())
    data[-3] ^= 0x40  # one digest bit
    sidecar.write_bytes(bytes(data))
    src = ArrowSource(path)
    assert src.describe() == desc
    assert src.read(np.array([[0, 0, 39]]))[0]["idx"] == 39
    assert sidecar.read_bytes() != bytes(data)  # rewritten


def test_index_dir_holds_the_digests_and_an_unwritable_place_keeps_them_in_memory(tmp_path):
    (tmp_path / "data").mkdir()
    path = write(tmp_path / "data" / "t.parquet", make_table(0, 10), "parquet", group=4)
    (tmp_path / "idx").mkdir()
    src = ArrowSource(path, index_dir=tmp_path / "idx")
    [where] = src.digest_locations()
    assert where is not None and Path(where).parent == tmp_path / "idx"
    assert not os.path.exists(str(path) + ".zsum")
    nowhere = ArrowSource(path, index_dir=tmp_path / "missing")
    assert (
        nowhere.digest_locations() == [None]
        and nowhere.describe()["files"] == (src.describe()["files"])
    )
    assert nowhere.read(np.array([[0, 0, 9]]))[0]["idx"] == 9


# --------------------------------------------------------------------------- identity


def test_describe_names_paths_sizes_footers_and_parameters(tmp_path):
    paths = dataset(tmp_path, [5, 6], ("parquet", "arrow_stream"))
    desc = ArrowSource(paths, columns=["idx"], chunk_size=3, shuffle=True, seed=9).describe()
    json.dumps(desc)
    assert [f["name"] for f in desc["files"]] == [p.name for p in paths]
    assert "paths" not in desc and str(tmp_path) not in json.dumps(desc)
    assert [f["size"] for f in desc["files"]] == [p.stat().st_size for p in paths]
    assert [f["rows"] for f in desc["files"]] == [5, 6]
    assert (desc["columns"], desc["chunk_size"], desc["shuffle"], desc["seed"]) == (
        ["idx"],
        3,
        True,
        9,
    )
    assert desc["passes"] == 1 and desc["dataset_id"] == 0
    assert (
        desc == ArrowSource(paths, columns=["idx"], chunk_size=3, shuffle=True, seed=9).describe()
    )
    write(paths[0], make_table(100, 5), "parquet", group=7)  # same rows count, other data
    assert desc["files"] != ArrowSource(paths, columns=["idx"]).describe()["files"]


def test_metadata_is_read_lazily_and_once(tmp_path):
    paths = dataset(tmp_path, [5, 6], ("parquet", "arrow_file"))
    src = CountingArrowSource(paths)
    assert src.opened == 0 and "part0" in repr(src)
    src.num_samples()
    src.describe()
    src.chunk(0)
    assert src.opened == 2


def test_a_pickled_source_reads_the_same_rows(tmp_path):
    paths = dataset(tmp_path, [9, 6], ("parquet", "feather"))
    src = ArrowSource(paths, chunk_size=4, shuffle=True, seed=2)
    first = read_all(src)
    clone = pickle.loads(pickle.dumps(src))
    assert clone.describe() == src.describe()
    again = read_all(clone)
    assert [[p["idx"] for p in c] for c in again] == [[p["idx"] for p in c] for c in first]


# --------------------------------------------------------------------------- pipelines


def batch_rows(item: Any) -> list[tuple[int, str, list[float]]]:
    p = item.payload
    return [(int(i), t, v.tolist()) for i, t, v in zip(p["idx"], p["text"], p["vec"], strict=True)]


@pytest.mark.parametrize(("shuffle", "lanes"), [(False, 1), (True, 2)])
def test_pipeline_checkpoint_and_resume_reproduce_the_stream(tmp_path, shuffle, lanes):
    paths = dataset(tmp_path, [30, 25, 14], ("parquet", "arrow_file", "arrow_stream"), group=6)

    def pipeline() -> zephon.Pipeline:
        src = ArrowSource(paths, chunk_size=8, shuffle=shuffle, seed=4, passes=2)
        return zephon.Pipeline(src, [fetch(), batch(4)], lanes=lanes)

    def scenario() -> tuple[list[Any], list[Any], list[Any]]:
        full = [batch_rows(b) for b in pipeline()]
        loader = pipeline().iter()
        head = [batch_rows(next(loader)) for _ in range(13)]
        state = json.loads(json.dumps(loader.state_dict()))
        loader.close()
        tail = [batch_rows(b) for b in pipeline().iter(state=state)]
        return full, head, tail

    full, head, tail = run_with_timeout(scenario)
    assert head + tail == full
    delivered = sorted(i for b in full for i, _, _ in b)
    assert delivered == sorted(list(range(69)) * 2)
    for b in full:
        for i, text, vec in b:
            assert text == f"row {i}" and vec == [float(i)] * (i % 4)


def test_a_file_deleted_mid_run_stops_the_pipeline_with_a_fetch_error(tmp_path):
    paths = dataset(tmp_path, [8, 8], ("parquet", "parquet"), group=4)
    src = ArrowSource(paths, chunk_size=4)

    def scenario() -> list[Any]:
        got = []
        loader = zephon.Pipeline(src, [fetch(), batch(4)]).iter()
        got.append(next(loader))
        os.unlink(paths[1])
        with pytest.raises(FetchError, match=r"part1\.parquet"):
            for b in loader:
                got.append(b)
        return got

    got = run_with_timeout(scenario)
    assert [list(b.payload["idx"]) for b in got] == [[0, 1, 2, 3], [4, 5, 6, 7]]


NO_PANDAS_SCRIPT = """
import sys
import zephon
from zephon.ops import batch, fetch
from zephon.sources import ArrowSource, JsonlSource

sources = [ArrowSource(sys.argv[1]), ArrowSource(sys.argv[2]), JsonlSource(sys.argv[3])]
for source in [*sources, ArrowSource(sys.argv[4])]:
    with zephon.Pipeline(source, [fetch(), batch(4)]).iter() as loader:
        for _ in loader:
            pass
print("pandas" in sys.modules)
"""


def test_reading_files_does_not_import_pandas(tmp_path):
    # pyarrow imports pandas (when it is installed) the first time pa.array() or pa.table() runs;
    # a worker process would pay that import (~0.4 s and tens of MiB) before its first batch.
    import importlib.util

    assert importlib.util.find_spec("pandas") is not None, "the test needs pandas installed"
    lists = pa.table(
        {
            "ints": pa.array([[1, None, 3], None, [4]] * 8, pa.list_(pa.int16())),
            "flags": pa.array([[True, False], [None], []] * 8, pa.list_(pa.bool_())),
            "pairs": pa.array([[1.5, 2.5]] * 24, pa.list_(pa.float64(), 2)),
        }
    )
    lists_path = tmp_path / "lists.parquet"
    pq.write_table(lists, lists_path, row_group_size=5)
    parquet = write(tmp_path / "t.parquet", make_table(0, 40), "parquet", group=16)
    arrow = write(tmp_path / "t.arrow_file", make_table(0, 40), "arrow_file", group=16)
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text("".join(json.dumps({"idx": i}) + "\n" for i in range(40)))
    script = tmp_path / "no_pandas.py"
    script.write_text(NO_PANDAS_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), str(parquet), str(arrow), str(jsonl), str(lists_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"


@pytest.mark.parametrize(
    "typ",
    [
        pa.bool_(),
        pa.int8(),
        pa.uint16(),
        pa.int32(),
        pa.int64(),
        pa.float16(),
        pa.float32(),
        pa.float64(),
    ],
    ids=str,
)
def test_arrays_read_from_their_buffers_equal_pyarrows_own_conversion(typ):
    from zephon.sources.arrow_rows import _to_numpy

    rng = np.random.default_rng(7)
    for n in (0, 1, 7, 8, 9, 100):
        raw = rng.integers(0, 2 if typ == pa.bool_() else 100, size=n)
        arr = pa.array(raw.astype(bool) if typ == pa.bool_() else raw).cast(typ)
        for at in {0, min(n, 1), min(n, 3), n}:
            piece = arr.slice(at, max(0, n - at - 1))
            got = _to_numpy(piece)
            assert got.dtype == piece.to_numpy(zero_copy_only=False).dtype
            np.testing.assert_array_equal(got, piece.to_numpy(zero_copy_only=False))


NO_THREADS_SCRIPT = """
import os, sys
import pyarrow as pa
import zephon
from zephon.sources import ArrowSource

# Room for one thread per column task on Arrow's CPU pool; its IO pool may start one thread.
pa.set_cpu_count(8)
pa.set_io_thread_count(1)

def threads():
    tasks = os.listdir("/proc/self/task")
    return {t: open(f"/proc/self/task/{t}/comm").read().strip() for t in tasks}

sources = [ArrowSource(path) for path in sys.argv[1:]]
for source in sources:
    source.total_chunks()  # a file's metadata (and its digest table) is read once, before this
before = threads()
for source in sources:
    for p in range(source.total_chunks()):
        source.read(source.chunk(p).pointers)
# pyarrow's jemalloc starts its background thread on first use, whichever pool is the default.
new = [name for t, name in threads().items() if t not in before]
print(sorted(name for name in new if name != "jemalloc_bg_thd"))
"""


def test_reading_decodes_on_the_calling_thread(tmp_path):
    # Decoding on Arrow's CPU pool adds threads beside the lanes, each with allocator heaps of its
    # own: two process lanes of the text benchmark held 25-30 MiB more with it.
    table = make_table(0, 400)
    paths = [
        write(tmp_path / f"t.{fmt}", table, fmt, group=50)
        # Not Feather: its first metadata pass decompresses batches on the pool, before the count.
        for fmt in ("parquet", "arrow_file", "arrow_stream")
    ]
    script = tmp_path / "no_threads.py"
    script.write_text(NO_THREADS_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() in ("[]", "['python']")  # at most the IO pool's thread
