"""MemberScan against Python's tarfile: the same regular members, at the same data offsets,
whatever pieces the archive is fed in."""

from __future__ import annotations

import io
import tarfile

import pytest

from zephon.sources.tar_members import MemberScan, TarFormatError


def archive(fmt: int) -> bytes:
    """Members of every kind tarfile writes: long and non-ASCII names, empty files, a
    directory, a symlink, a hard link, and a PAX header of a regular member."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
        for k, name in enumerate(
            ["a.txt", "d/" + "n" * 150 + ".bin", "é/ü.json", "empty.txt", "x" * 99 + ".y"]
        ):
            data = bytes([k]) * (k * 700)
            info = tarfile.TarInfo(name)
            info.size = len(data)
            if fmt == tarfile.PAX_FORMAT:
                info.pax_headers = {"comment": "c" * k * 50}
            tar.addfile(info, io.BytesIO(data))
        tar.addfile(tarfile.TarInfo("dir/"))
        tar.addfile(tarfile.TarInfo("dir"), None)
        link = tarfile.TarInfo("link.txt")
        link.type = tarfile.SYMTYPE
        link.linkname = "a.txt"
        tar.addfile(link)
        hard = tarfile.TarInfo("hard.txt")
        hard.type = tarfile.LNKTYPE
        hard.linkname = "a.txt"
        tar.addfile(hard)
        last = tarfile.TarInfo("z.txt")
        last.size = 3
        tar.addfile(last, io.BytesIO(b"end"))
    return out.getvalue()


def scanned(data: bytes, piece: int) -> MemberScan:
    scan = MemberScan()
    for at in range(0, len(data), piece):
        scan.feed(data[at : at + piece])
    scan.finish(len(data))
    return scan


@pytest.mark.parametrize("fmt", ["ustar", "gnu", "pax"])
@pytest.mark.parametrize("piece", [1, 100, 511, 512, 513, 4096, 1 << 20])
def test_the_members_and_offsets_are_tarfiles_in_any_pieces(fmt, piece):
    # USTAR holds no base name over 100 bytes (a long path is split into prefix and name).
    data = {
        "ustar": _ustar,
        "gnu": lambda: archive(tarfile.GNU_FORMAT),
        "pax": lambda: archive(tarfile.PAX_FORMAT),
    }[fmt]()
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        want = [(m.name, m.offset_data, m.size) for m in tar.getmembers() if m.isreg()]
    scan = scanned(data, piece)
    assert list(zip(scan.names, scan.offsets, scan.sizes, strict=True)) == want


def _ustar() -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for k, name in enumerate(["a.txt", "p" * 80 + "/" + "q" * 90 + ".bin", "é.json"]):
            info = tarfile.TarInfo(name)
            info.size = k * 600
            tar.addfile(info, io.BytesIO(bytes(info.size)))
    return out.getvalue()


def test_a_file_that_is_not_a_tar_fails_its_first_checksum():
    with pytest.raises(TarFormatError, match="header at byte 0 fails its checksum"):
        scanned(b"{" * 2048, 512)


def test_an_archive_without_its_end_block_is_truncated():
    data = _ustar()
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        last = tar.getmembers()[-1]
    end = last.offset_data + -(-last.size // 512) * 512
    with pytest.raises(TarFormatError, match=f"ends at byte {end} without the end-of-archive"):
        scanned(data[:end], 4096)
    with pytest.raises(TarFormatError, match=r"data of 'é\.json' runs past the end"):
        scanned(data[: last.offset_data + 5], 4096)
    with pytest.raises(TarFormatError, match="empty"):
        scanned(b"", 4096)
