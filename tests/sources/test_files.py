"""Specification of the file-source machinery: range digests, digest tables and sidecars."""

from __future__ import annotations

import hashlib
import io
import itertools
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from zephon.sources import JsonlSource
from zephon.sources.files import (
    DigestTable,
    content_digest,
    digest_ranges,
    read_sidecar,
    write_sidecar,
)


def sha64(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little", signed=True)


@st.composite
def files_and_ranges(draw):
    """Random bytes and sorted, disjoint, non-empty ranges inside them."""
    data = draw(st.binary(min_size=1, max_size=300))
    cuts = sorted(set(draw(st.lists(st.integers(0, len(data)), max_size=12))) | {0, len(data)})
    ranges = [(a, b) for a, b in itertools.pairwise(cuts) if draw(st.booleans())]
    return data, ranges


def reader(data: bytes):
    f = io.BytesIO(data)

    def read_at(offset: int, nbytes: int) -> bytes:
        f.seek(offset)
        return f.read(nbytes)

    return read_at


@given(files_and_ranges(), st.integers(1, 64))
def test_range_digests_are_the_sha256_of_each_range_whatever_the_read_size(case, piece):
    data, ranges = case
    starts = [a for a, _ in ranges]
    lengths = [b - a for a, b in ranges]
    got = digest_ranges(reader(data), starts, lengths, piece=piece)
    assert got.dtype == np.int64
    assert got.tolist() == [sha64(data[a:b]) for a, b in ranges]
    assert [content_digest(data[a:b]) for a, b in ranges] == got.tolist()


def test_a_file_shorter_than_its_ranges_is_an_eof_error():
    with pytest.raises(EOFError, match=r"bytes 4\.\.20"):
        digest_ranges(reader(b"x" * 10), [4], [16])
    with pytest.raises(EOFError):
        digest_ranges(reader(b"x" * 10), [0, 4], [2, 16], piece=8)


@given(files_and_ranges(), st.integers(0, 310), st.integers(0, 40))
def test_a_table_finds_the_ranges_of_any_span(case, start, width):
    data, ranges = case
    table = DigestTable.build(reader(data), [a for a, _ in ranges], [b - a for a, b in ranges])
    assert table.is_well_formed(len(data))
    end = start + width
    assert list(table.overlapping(start, end)) == [
        k for k, (a, b) in enumerate(ranges) if a < end and start < b
    ]
    holding = [k for k, (a, b) in enumerate(ranges) if a <= start < b]
    assert table.find(start) == (holding[0] if holding else -1)
    for k, (a, b) in enumerate(ranges):
        assert table.matches(k, data[a:b])
        assert not table.matches(k, data[a:b] + b"!")


def test_a_table_identity_covers_ranges_and_digests_but_not_where_they_came_from():
    table = DigestTable([0, 10], [10, 5], [1, 2])
    assert table.identity() == DigestTable([0, 10], [10, 5], [1, 2]).identity()
    assert len({table.identity(), DigestTable([0, 10], [10, 5], [1, 3]).identity()}) == 2
    assert len({table.identity(), DigestTable([0, 11], [11, 5], [1, 2]).identity()}) == 2
    assert not DigestTable([0, 5], [10, 5], [1, 2]).is_well_formed(100)  # overlap
    assert not DigestTable([0], [10], [1]).is_well_formed(9)  # past the end
    assert not DigestTable([0], [0], [1]).is_well_formed(9)  # empty


SECTIONS = [np.array([7], np.int64), np.arange(5, dtype=np.int64), np.zeros(0, np.int64)]


def stored(sections: list[np.ndarray] | None) -> list[list[int]] | None:
    return None if sections is None else [s.tolist() for s in sections]


def test_a_sidecar_reads_back_only_for_its_tag_size_and_mtime(tmp_path):
    where = str(tmp_path / "f.zsum")
    assert write_sidecar(where, b"ZEPHTST1", 100, 5, SECTIONS) == where
    assert stored(read_sidecar(where, b"ZEPHTST1", 100, 5)) == stored(SECTIONS)
    assert read_sidecar(where, b"ZEPHTST2", 100, 5) is None
    assert read_sidecar(where, b"ZEPHTST1", 101, 5) is None
    assert read_sidecar(where, b"ZEPHTST1", 100, 6) is None
    assert read_sidecar(str(tmp_path / "missing"), b"ZEPHTST1", 100, 5) is None


def test_any_damaged_byte_of_a_sidecar_is_refused(tmp_path):
    where = tmp_path / "f.zsum"
    write_sidecar(str(where), b"ZEPHTST1", 100, 5, SECTIONS)
    data = where.read_bytes()
    for at in range(len(data)):
        for mask in (0x01, 0x80):
            bad = bytearray(data)
            bad[at] ^= mask
            where.write_bytes(bytes(bad))
            back = stored(read_sidecar(str(where), b"ZEPHTST1", 100, 5))
            # A flip in the .npy header's padding can be harmless; anything else is refused.
            assert back is None or back == stored(SECTIONS), f"byte {at}"
    where.write_bytes(data[:-8])
    assert read_sidecar(str(where), b"ZEPHTST1", 100, 5) is None


def test_a_sidecar_that_cannot_be_written_is_none(tmp_path):
    assert write_sidecar(str(tmp_path / "no" / "f.zsum"), b"ZEPHTST1", 1, 1, SECTIONS) is None
    assert not any(p.name.startswith(".zephon-") for p in tmp_path.iterdir())


def test_sidecars_in_index_dir_are_named_after_the_file_and_its_absolute_path(
    tmp_path, monkeypatch
):
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "x.jsonl").write_text("1\n")
    src = JsonlSource(
        [tmp_path / "a" / "x.jsonl", tmp_path / "b" / "x.jsonl"], index_dir=tmp_path / "idx"
    )
    names = [Path(src.sidecar_path(i, ".zsum")).name for i in range(2)]
    assert all(n.startswith("x.jsonl.") and n.endswith(".zsum") for n in names)
    assert names[0] != names[1]
    assert src.sidecar_path(0, ".zidx") == src.index_path(0)
    monkeypatch.chdir(tmp_path)  # a relative path names the same file: same sidecar
    again = JsonlSource([os.path.join("a", "x.jsonl")], index_dir=tmp_path / "idx")
    assert again.sidecar_path(0, ".zsum") == src.sidecar_path(0, ".zsum")
