"""MappedFiles: maps kept between reads, at most ``keep``, each read refused once the file no
longer has the size and mtime it was indexed at."""

from __future__ import annotations

import os
import pickle

import pytest

from zephon.sources.mapped_files import ChangedFile, MappedFiles, map_bytes


def stat_of(path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


def test_a_kept_map_is_reused_and_the_least_recently_used_is_dropped(tmp_path):
    paths = []
    for k in range(3):
        paths.append(tmp_path / f"{k}.bin")
        paths[-1].write_bytes(bytes([k]) * 10)
    maps = MappedFiles(keep=2)
    made: list[int] = []

    def get(k: int):
        def make():
            made.append(k)
            return map_bytes(str(paths[k]))

        return maps.get(k, str(paths[k]), stat_of(paths[k]), make)

    assert get(0).tobytes() == bytes(10)
    get(1), get(0), get(2)  # 1 is the least recently used when 2 comes
    get(0), get(1)
    assert made == [0, 1, 2, 1]
    maps.clear()
    get(0)
    assert made[-1] == 0


def test_a_changed_file_is_refused_and_none_means_any_mtime(tmp_path):
    path = tmp_path / "a.bin"
    path.write_bytes(b"abc")
    indexed = stat_of(path)
    maps = MappedFiles()
    maps.get(0, str(path), indexed, lambda: map_bytes(str(path)))
    os.utime(path, ns=(1, 1))
    with pytest.raises(ChangedFile, match="size 3, mtime_ns 1") as caught:
        maps.get(0, str(path), indexed, lambda: map_bytes(str(path)))
    assert caught.value.now == (3, 1)
    assert maps.get(0, str(path), (3, None), lambda: map_bytes(str(path))).tobytes() == b"abc"
    path.write_bytes(b"abcd")
    with pytest.raises(ChangedFile):
        maps.get(0, str(path), (3, None), lambda: map_bytes(str(path)))


def test_a_copy_sent_to_another_process_holds_no_map(tmp_path):
    path = tmp_path / "a.bin"
    path.write_bytes(b"abc")
    maps = MappedFiles(keep=3)
    maps.get(0, str(path), stat_of(path), lambda: map_bytes(str(path)))
    copy = pickle.loads(pickle.dumps(maps))
    assert copy.keep == 3 and not copy._maps
