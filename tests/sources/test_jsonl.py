"""Specification of JsonlSource over real JSON Lines files, and of its line index (.zidx)."""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pipeline_kit import canonical, run_with_timeout

import zephon
import zephon.sources.jsonl as jsonl_module
from zephon.errors import CheckpointMismatchError, FetchError
from zephon.ops import batch, fetch
from zephon.sources import JsonlSource
from zephon.sources.jsonl import scan_line_starts


def write_lines(path: Path, start: int, n: int, *, trailing_newline: bool = True) -> Path:
    """Rows ``start .. start+n-1`` as JSON objects, one per line."""
    lines = [
        json.dumps({"idx": i, "text": f"row {i}", "tokens": [i] * (i % 3)})
        for i in range(start, start + n)
    ]
    text = "\n".join(lines) + ("\n" if trailing_newline and lines else "")
    path.write_text(text)
    return path


def dataset(tmp_path: Path, sizes: list[int]) -> list[Path]:
    paths = []
    start = 0
    for k, n in enumerate(sizes):
        paths.append(
            write_lines(tmp_path / f"part{k}.jsonl", start, n, trailing_newline=k % 2 == 0)
        )
        start += n
    return paths


def read_all(src: JsonlSource) -> list[list[Any]]:
    total = src.total_chunks()
    assert total is not None
    return [src.read(src.chunk(p).pointers) for p in range(total)]


# --------------------------------------------------------------------------- coverage


@pytest.mark.parametrize("shuffle", [False, True])
def test_every_line_of_every_file_is_read_exactly_once_per_pass(tmp_path, shuffle):
    sizes = [17, 0, 30, 6]
    src = JsonlSource(dataset(tmp_path, sizes), chunk_size=5, shuffle=shuffle, seed=3, passes=2)
    assert src.num_samples() == sum(sizes)
    chunks = read_all(src)
    per_pass = src.num_chunks()
    orders = []
    for q in range(2):
        rows = [p for c in chunks[q * per_pass : (q + 1) * per_pass] for p in c]
        for p in rows:
            assert p == {
                "idx": p["idx"],
                "text": f"row {p['idx']}",
                "tokens": [p["idx"]] * (p["idx"] % 3),
            }
        orders.append([p["idx"] for p in rows])
        assert sorted(orders[-1]) == list(range(sum(sizes)))
    if shuffle:
        assert orders[0] != orders[1] and orders[0] != sorted(orders[0])
    else:
        assert orders[0] == orders[1] == list(range(sum(sizes)))


def test_pointers_carry_the_file_index_and_the_global_line(tmp_path):
    src = JsonlSource(dataset(tmp_path, [3, 0, 2]), dataset_id=4, chunk_size=10)
    assert src.chunk(0).pointers.tolist() == [[4, 0, 0], [4, 0, 1], [4, 0, 2], [4, 2, 3], [4, 2, 4]]
    with pytest.raises(FetchError, match=r"\(4, 0, 3\)"):
        src.read(np.array([[4, 0, 3]]))


def test_blank_lines_anywhere_are_not_samples(tmp_path):
    path = tmp_path / "blank.jsonl"
    path.write_bytes(b'\n{"a": 1}\n\n  \t \n{"a": 2}\r\n\r\n[3]\n"four"\n\n\n  ')
    src = JsonlSource(path)
    assert src.num_samples() == 4
    assert src.read(src.chunk(0).pointers) == [{"a": 1}, {"a": 2}, [3], "four"]


def test_empty_and_blank_files_hold_no_samples(tmp_path):
    (tmp_path / "empty.jsonl").write_bytes(b"")
    (tmp_path / "blank.jsonl").write_bytes(b"\n \n\r\n")
    src = JsonlSource([tmp_path / "empty.jsonl", tmp_path / "blank.jsonl"])
    assert src.num_samples() == 0 and src.total_chunks() == 0


def reference_starts(data: bytes) -> list[int]:
    out = []
    pos = 0
    for line in data.split(b"\n"):
        if line.strip(b" \t\r"):
            out.append(pos)
        pos += len(line) + 1
    return out


@given(
    lines=st.lists(
        st.sampled_from([b"", b" ", b"\r", b"\t \r", b"{}", b"1", b'"x y"', b" [1, 2] "]),
        max_size=40,
    ),
    trailing=st.booleans(),
    block=st.integers(1, 9),
)
def test_the_line_scan_finds_every_non_blank_line_across_block_boundaries(lines, trailing, block):
    data = b"\n".join(lines) + (b"\n" if trailing else b"")
    starts = scan_line_starts(io.BytesIO(data), block_size=block)
    assert starts.dtype == np.int64
    assert starts.tolist() == reference_starts(data)


# --------------------------------------------------------------------------- the index file


def no_scan(*args: Any, **kwargs: Any) -> np.ndarray:
    raise AssertionError("the stored index should have been used")


def test_the_index_is_stored_beside_the_file_and_reused(tmp_path, monkeypatch):
    path = write_lines(tmp_path / "a.jsonl", 0, 9)
    src = JsonlSource(path)
    assert src.num_samples() == 9
    assert src.index_locations() == [str(path) + ".zidx"]
    assert os.path.exists(str(path) + ".zidx")

    monkeypatch.setattr(jsonl_module, "scan_line_starts", no_scan)
    again = JsonlSource(path)
    assert again.num_samples() == 9
    assert again.read(np.array([[0, 0, 8]])) == [{"idx": 8, "text": "row 8", "tokens": [8, 8]}]
    assert again.describe() == src.describe()


@pytest.mark.parametrize("same_size", [False, True])
def test_a_stale_index_is_rebuilt_after_the_file_changes(tmp_path, same_size):
    path = write_lines(tmp_path / "a.jsonl", 0, 9)
    assert JsonlSource(path).num_samples() == 9
    if same_size:  # same length, other content: only the mtime tells
        data = path.read_bytes()
        first = data.split(b"\n")[0]
        path.write_bytes(b" " * len(first) + data[len(first) :])  # line 1 becomes blank
        st = path.stat()
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        assert path.stat().st_size == len(data)
        expected = 8
    else:
        write_lines(path, 100, 4)
        expected = 4
    src = JsonlSource(path)
    assert src.num_samples() == expected
    assert src.index_locations() == [str(path) + ".zidx"]
    assert len(src.read(src.chunk(0).pointers)) == expected


def test_a_corrupt_index_file_is_rebuilt(tmp_path, monkeypatch):
    path = write_lines(tmp_path / "a.jsonl", 0, 5)
    Path(str(path) + ".zidx").write_bytes(b"\x93NUMPY garbage")
    src = JsonlSource(path)
    assert src.num_samples() == 5
    monkeypatch.setattr(jsonl_module, "scan_line_starts", no_scan)  # the rewritten index is used
    again = JsonlSource(path)
    assert again.num_samples() == 5 and again.index_locations() == [str(path) + ".zidx"]
    assert [p["idx"] for p in again.read(again.chunk(0).pointers)] == list(range(5))


def test_index_dir_holds_the_index_and_an_unwritable_place_keeps_it_in_memory(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    path = write_lines(data / "a.jsonl", 0, 6)
    (tmp_path / "idx").mkdir()
    src = JsonlSource(path, index_dir=tmp_path / "idx")
    [where] = src.index_locations()
    assert where is not None and Path(where).parent == tmp_path / "idx"
    assert Path(where).name.startswith("a.jsonl.") and where.endswith(".zidx")
    assert not os.path.exists(str(path) + ".zidx")
    nowhere = JsonlSource(path, index_dir=tmp_path / "missing")
    assert nowhere.num_samples() == 6 and nowhere.index_locations() == [None]
    assert nowhere.read(np.array([[0, 0, 5]]))[0]["idx"] == 5


# --------------------------------------------------------------------------- errors


def test_a_malformed_line_is_a_fetch_error_naming_file_line_and_pointer(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2}\n{"a": oops}\n{"a": 4}\n')
    src = JsonlSource(path)
    assert src.read(np.array([[0, 0, 0], [0, 0, 1], [0, 0, 3]])) == [{"a": 1}, {"a": 2}, {"a": 4}]
    with pytest.raises(
        FetchError, match=r"pointer \(0, 0, 2\) from '.*bad\.jsonl': line 4 is not valid JSON"
    ):
        src.read(np.array([[0, 0, 0], [0, 0, 2]]))


def test_invalid_utf8_is_a_fetch_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"a": 1}\n{"a": "\xff\xfe"}\n')
    with pytest.raises(FetchError, match=r"line 2"):
        JsonlSource(path).read(np.array([[0, 0, 1]]))


def test_a_missing_file_is_a_fetch_error_naming_it(tmp_path):
    path = write_lines(tmp_path / "a.jsonl", 0, 4)
    with pytest.raises(FetchError, match=r"nope\.jsonl.*FileNotFoundError"):
        JsonlSource([path, tmp_path / "nope.jsonl"]).num_samples()
    src = JsonlSource(path)
    src.num_samples()
    os.unlink(path)
    with pytest.raises(FetchError, match=r"pointer \(0, 0, 1\) from '.*a\.jsonl'"):
        src.read(np.array([[0, 0, 1]]))


def test_a_file_changed_after_indexing_is_a_fetch_error_not_shifted_lines(tmp_path):
    path = write_lines(tmp_path / "a.jsonl", 0, 6)
    src = JsonlSource(path)
    src.num_samples()
    path.write_text('{"x": 0}\n' + path.read_text())
    with pytest.raises(FetchError, match=r"changed since its line index was built"):
        src.read(np.array([[0, 0, 2]]))


def test_a_transient_os_error_is_left_to_fetch_to_retry(tmp_path, monkeypatch):
    path = write_lines(tmp_path / "a.jsonl", 0, 10)
    src = JsonlSource(path, chunk_size=4)
    src.num_samples()
    failures = [1]
    real_open = open

    def flaky_open(*args: Any, **kwargs: Any) -> Any:
        if failures[0]:
            failures[0] -= 1
            raise OSError(errno.EIO, "Input/output error")
        return real_open(*args, **kwargs)

    monkeypatch.setattr(jsonl_module, "open", flaky_open, raising=False)
    with pytest.raises(OSError, match=r"a\.jsonl") as info:
        src.read(src.chunk(0).pointers)
    assert not isinstance(info.value, FetchError) and info.value.errno == errno.EIO
    failures[0] = 2
    got = [i for b in zephon.Pipeline(src, [fetch(), batch(4)]) for i in b.payload["idx"]]
    assert got == list(range(10))


# --------------------------------------------------------------------------- changed data


def rewrite_line(path: Path, idx: int, *, keep_mtime: bool) -> None:
    """Upper-case the text of row ``idx`` in place: same size, other content."""
    st = path.stat()
    data = path.read_bytes()
    old = f'"text": "row {idx}"'.encode()
    assert data.count(old) == 1
    path.write_bytes(data.replace(old, old.upper()))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_file_rewritten_in_the_middle_gets_a_new_fingerprint(tmp_path):
    path = write_lines(tmp_path / "a.jsonl", 0, 4000)
    assert path.stat().st_size > 3 * (1 << 16)  # the middle is far from both ends
    desc = JsonlSource(path).describe()
    rewrite_line(path, 2000, keep_mtime=False)
    assert JsonlSource(path).describe()["files"] != desc["files"]


@pytest.mark.parametrize("fresh_source", [False, True])
def test_a_middle_rewrite_that_kept_size_and_mtime_is_refused_when_read(tmp_path, fresh_source):
    path = write_lines(tmp_path / "a.jsonl", 0, 4000)
    src = JsonlSource(path)
    assert src.read(np.array([[0, 0, 2000]])) == [
        {"idx": 2000, "text": "row 2000", "tokens": [2000, 2000]}
    ]
    rewrite_line(path, 2000, keep_mtime=True)
    if fresh_source:  # the stored index still matches size and mtime: only the read can tell
        src = JsonlSource(path)
    assert src.read(np.array([[0, 0, 10], [0, 0, 3990]]))[1]["idx"] == 3990  # other blocks
    with pytest.raises(
        FetchError, match=r"pointer \(0, 0, 2000\) from '.*a\.jsonl': block \d+ .*changed"
    ):
        src.read(np.array([[0, 0, 2000]]))
    # As the message says: without the stale index, a new source reads the new line.
    zidx = str(path) + ".zidx"
    with pytest.raises(FetchError, match=rf"delete '{re.escape(zidx)}'"):
        JsonlSource(path).read(np.array([[0, 0, 2000]]))
    os.unlink(zidx)
    assert JsonlSource(path).read(np.array([[0, 0, 2000]]))[0]["TEXT"] == "ROW 2000"


def test_a_resumed_pipeline_refuses_a_file_rewritten_in_the_middle(tmp_path):
    path = write_lines(tmp_path / "a.jsonl", 0, 4000)

    def pipeline() -> zephon.Pipeline:
        return zephon.Pipeline(JsonlSource(path, chunk_size=100), [fetch(), batch(50)])

    def scenario() -> None:
        loader = pipeline().iter()
        for _ in range(3):
            next(loader)
        state = json.loads(json.dumps(loader.state_dict()))
        loader.close()
        rewrite_line(path, 2000, keep_mtime=False)
        with pytest.raises(CheckpointMismatchError):
            pipeline().iter(state=state)

    run_with_timeout(scenario)


def damage_last_word(zidx: str, delta: int) -> None:
    """Add ``delta`` to the last int64 of an index file, rewriting it whole (a new inode)."""
    arr = np.load(zidx)
    arr[-1] += delta
    with open(zidx, "wb") as fh:
        np.save(fh, arr)


def test_a_damaged_index_is_rebuilt_not_blamed_on_the_data(tmp_path):
    path = write_lines(tmp_path / "a.jsonl", 0, 9)
    assert JsonlSource(path).num_samples() == 9
    damage_last_word(str(path) + ".zidx", 3)
    src = JsonlSource(path)
    assert src.read(src.chunk(0).pointers) == JsonlSource(path).read(src.chunk(0).pointers)
    assert [p["idx"] for p in src.read(src.chunk(0).pointers)] == list(range(9))


def test_any_damaged_byte_of_the_index_file_is_rebuilt_never_trusted(tmp_path):
    path = write_lines(tmp_path / "a.jsonl", 0, 9)
    want = JsonlSource(path).read(np.array([[0, 0, i] for i in range(9)]))
    zidx = Path(str(path) + ".zidx")
    data = zidx.read_bytes()
    for at in range(len(data)):
        bad = bytearray(data)
        bad[at] ^= 0x01
        zidx.write_bytes(bytes(bad))
        src = JsonlSource(path)
        assert src.read(np.array([[0, 0, i] for i in range(9)])) == want, f"byte {at}"


def test_an_index_damaged_while_in_use_is_named_in_the_error(tmp_path):
    path = write_lines(tmp_path / "a.jsonl", 0, 9)
    built = JsonlSource(path)  # builds the index (and keeps it in memory)
    built.num_samples()
    src = JsonlSource(path)  # maps the stored index
    assert src.read(np.array([[0, 0, 0]]))[0]["idx"] == 0
    zidx = str(path) + ".zidx"
    with open(zidx, "r+b") as fh:  # in place: the source's memory map sees it
        fh.seek(-8, os.SEEK_END)
        last = int.from_bytes(fh.read(8), "little", signed=True)
        fh.seek(-8, os.SEEK_END)
        fh.write((last + 3).to_bytes(8, "little", signed=True))
    with pytest.raises(FetchError, match=r"pointer \(0, 0, 8\).*a\.jsonl\.zidx"):
        src.read(np.array([[0, 0, 8]]))
    clone = pickle.loads(pickle.dumps(built))  # a worker reloads the index from its file
    with pytest.raises(FetchError, match=r"pointer \(0, 0, 8\).*a\.jsonl\.zidx"):
        clone.read(np.array([[0, 0, 8]]))


def test_json_nested_too_deep_to_parse_is_a_fetch_error(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text('{"a": 1}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(FetchError, match=r"deep\.jsonl': line 2 is not valid JSON"):
        JsonlSource(path).read(np.array([[0, 0, 1]]))


@given(
    lines=st.lists(
        st.sampled_from(
            [
                b"",
                b" ",
                b"\r",
                b"\t \r",
                b"{}",
                b"1",
                b'"x y"',
                b" [1, 2] ",
                b"[" + b"0, " * 20 + b"0]",
            ]
        ),
        max_size=60,
    ),
    trailing=st.booleans(),
    block=st.integers(1, 40),
)
def test_every_sample_is_read_back_whatever_the_block_size(
    tmp_path_factory, lines, trailing, block
):
    path = tmp_path_factory.mktemp("blocks") / "a.jsonl"
    data = b"\n".join(lines) + (b"\n" if trailing else b"")
    path.write_bytes(data)

    class Small(JsonlSource):
        BLOCK_BYTES = block

    src = Small(path, index_dir=tmp_path_factory.mktemp("idx"), chunk_size=7)
    want = [json.loads(data[s:].split(b"\n")[0]) for s in reference_starts(data)]
    assert src.num_samples() == len(want)
    assert [p for c in read_all(src) for p in c] == want


# --------------------------------------------------------------------------- identity


def test_describe_names_paths_sizes_fingerprints_and_parameters(tmp_path):
    paths = dataset(tmp_path, [4, 5])
    desc = JsonlSource(paths, chunk_size=2, shuffle=True, seed=8, passes=3).describe()
    json.dumps(desc)
    assert [f["name"] for f in desc["files"]] == [p.name for p in paths]
    assert "paths" not in desc and str(tmp_path) not in json.dumps(desc)
    assert [f["size"] for f in desc["files"]] == [p.stat().st_size for p in paths]
    assert [f["lines"] for f in desc["files"]] == [4, 5]
    assert (desc["chunk_size"], desc["shuffle"], desc["seed"], desc["passes"]) == (2, True, 8, 3)
    write_lines(paths[1], 50, 5, trailing_newline=False)
    assert JsonlSource(paths).describe()["files"] != desc["files"]


def test_a_touched_file_keeps_its_index_and_a_copied_file_its_fingerprint(tmp_path):
    paths = dataset(tmp_path, [4, 5])
    desc = JsonlSource(paths).describe()
    (tmp_path / "copy").mkdir()
    copies = [Path(shutil.copy(p, tmp_path / "copy" / p.name)) for p in paths]
    assert JsonlSource(copies).describe()["files"] == desc["files"]


def test_a_pickled_source_reads_the_same_lines(tmp_path):
    paths = dataset(tmp_path, [7, 4])
    for index_dir in (None, tmp_path / "missing"):  # a mapped .zidx, and an index in memory
        src = JsonlSource(paths, chunk_size=3, shuffle=True, seed=1, index_dir=index_dir)
        first = read_all(src)
        clone = pickle.loads(pickle.dumps(src))
        assert clone.describe() == src.describe()
        assert read_all(clone) == first


# --------------------------------------------------------------------------- pipelines


@pytest.mark.parametrize(("shuffle", "lanes"), [(False, 1), (True, 2)])
def test_pipeline_checkpoint_and_resume_reproduce_the_stream(tmp_path, shuffle, lanes):
    paths = dataset(tmp_path, [21, 18, 9])

    def pipeline() -> zephon.Pipeline:
        src = JsonlSource(paths, chunk_size=7, shuffle=shuffle, seed=6, passes=2)
        return zephon.Pipeline(src, [fetch(), batch(4)], lanes=lanes)

    def scenario() -> tuple[list[Any], list[Any], list[Any]]:
        full = [b.payload for b in pipeline()]
        loader = pipeline().iter()
        head = [next(loader).payload for _ in range(9)]
        state = json.loads(json.dumps(loader.state_dict()))
        loader.close()
        tail = [b.payload for b in pipeline().iter(state=state)]
        return full, head, tail

    full, head, tail = run_with_timeout(scenario)
    assert [canonical(p) for p in head + tail] == [canonical(p) for p in full]
    assert sorted(i for b in full for i in b["idx"]) == sorted(list(range(48)) * 2)
    for b in full:
        assert b["text"] == [f"row {i}" for i in b["idx"]]


def test_a_malformed_line_stops_the_pipeline_with_a_fetch_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps({"idx": i}) + "\n" for i in range(6)) + "{oops\n")

    def scenario() -> list[Any]:
        got = []
        with pytest.raises(FetchError, match=r"bad\.jsonl': line 7"):
            for b in zephon.Pipeline(JsonlSource(path, chunk_size=4), [fetch(), batch(4)]):
                got.append(b.payload["idx"].tolist())
        return got

    assert run_with_timeout(scenario) == [[0, 1, 2, 3]]
