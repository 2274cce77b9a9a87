"""The members of a tar archive, found in one sequential pass over its bytes without the
``tarfile`` module, so that a source can later read any member by its byte range.

``MemberScan`` is fed the archive's bytes in order, in pieces of any size (it keeps nothing of a
piece but a header cut by the piece's end), and collects each regular member's name, data offset
and size. It reads what Python's ``tarfile`` and GNU tar write: POSIX ustar headers (a name
longer than 100 bytes split into prefix and name), GNU long names (``L``) and PAX extended
headers (``x`` for the next member, ``g`` for every later one; their ``path`` and ``size``
records), sizes in octal or GNU base-256. Directories, links and devices have no data and are
passed over; members of types it does not know are passed over with their data. An archive ends
at its first all-zero block, which it must have.

Anything else is a ``TarFormatError`` giving the byte offset and the last member read before: a
header whose checksum does not match (a damaged archive, or not a tar at all), a compressed
archive (no random access into it), a sparse member, a member whose data runs past the end of the
file, or no end-of-archive block (a truncated archive).
"""

from __future__ import annotations

from typing import Any

__all__ = ["BLOCK", "MemberScan", "TarFormatError"]

#: Tar's unit: headers are one block, data is padded to whole blocks.
BLOCK = 512
#: Longest GNU long name or PAX header accepted: a real one is a few hundred bytes.
_META_LIMIT = 1 << 20
_ZERO_BLOCK = bytes(BLOCK)
_REGULAR = frozenset(b"07\x00")
_NO_DATA = frozenset(b"123456")  # links, devices, directories, fifos: tarfile reads no data
_POSIX_MAGIC = b"ustar\x00"
_GZIP_MAGIC = b"\x1f\x8b"


class TarFormatError(ValueError):
    """The bytes are not a tar archive this reader can index; the message says where and why."""


class MemberScan:
    """A tar archive's regular members, collected while its bytes are fed in order.

    Invariant: ``names``, ``offsets`` (of each member's data) and ``sizes`` have one entry per
    regular member, in archive order; after ``finish`` every member's data lies inside the file.
    """

    def __init__(self) -> None:
        self.names: list[str] = []
        self.offsets: list[int] = []
        self.sizes: list[int] = []
        self._at = 0  # the next header's offset
        self._fed = 0
        self._tail = b""  # bytes from ``_tail_at`` to ``_fed`` still needed (a cut header)
        self._tail_at = 0
        self._ended = False
        self._next: dict[str, Any] = {}  # what a GNU long name or PAX header says of the next
        self._global: dict[str, Any] = {}  # what PAX global headers say of every later member

    def feed(self, piece: Any) -> None:
        """Take the next ``piece`` (any bytes-like) of the archive."""
        if self._fed == 0 and bytes(piece[:2]) == _GZIP_MAGIC:
            raise TarFormatError(
                "it is gzip-compressed; a compressed archive cannot be read at random: store "
                "the shards as plain .tar (e.g. gunzip them)"
            )
        if self._tail:
            data: Any = self._tail + bytes(piece)
            base = self._tail_at
        else:
            data = memoryview(piece)
            base = self._fed
        self._fed += len(piece)
        self._tail = b""
        end = base + len(data)
        while not self._ended and self._at < end:
            at = self._at
            rel = at - base
            if at + BLOCK > end:
                self._keep(data, rel, at)
                return
            header = bytes(data[rel : rel + BLOCK])
            if header == _ZERO_BLOCK:
                self._ended = True
                return
            kind, size = self._check(header, at)
            data_at = at + BLOCK
            if kind in b"LKxg":
                if size > _META_LIMIT:
                    raise TarFormatError(
                        f"the {chr(kind)!r} header at byte {at} claims {size} bytes of "
                        f"metadata{self._after()}; the archive is damaged"
                    )
                if data_at + size > end:
                    self._keep(data, rel, at)
                    return
                self._meta(kind, bytes(data[rel + BLOCK : rel + BLOCK + size]), at)
            else:
                size = self._member(header, kind, size, data_at, at)
            self._at = data_at + -(-size // BLOCK) * BLOCK

    def finish(self, size: int) -> None:
        """Check the archive, ``size`` bytes in all, ended properly."""
        if self._fed == 0:
            raise TarFormatError("the file is empty, not a tar archive")
        if self._ended:
            return
        if self._at > size:
            raise TarFormatError(
                f"the data of {self._last()} runs past the end of the file ({size} bytes): the "
                "archive is truncated"
            )
        raise TarFormatError(
            f"it ends at byte {size} without the end-of-archive block{self._after()}: the "
            "archive is truncated"
        )

    # ------------------------------------------------------------------------- headers
    def _keep(self, data: Any, rel: int, at: int) -> None:
        # A header (or its metadata) cut by the piece's end: kept for the next piece.
        self._tail = bytes(data[rel:])
        self._tail_at = at

    def _check(self, header: bytes, at: int) -> tuple[int, int]:
        # (type flag, size) of a header whose checksum matches.
        try:
            stored = _octal(header[148:156])
        except ValueError:
            stored = -1
        unsigned = sum(header) - sum(header[148:156]) + 8 * 32
        if stored != unsigned and stored != _signed_sum(header):
            raise TarFormatError(
                f"the header at byte {at}{self._after()} fails its checksum: the archive is "
                "damaged, or the file is not a tar archive"
            )
        field = header[124:136]
        if field[0] & 0x80:  # GNU base-256: a size too large for 11 octal digits
            if field[0] != 0x80:
                raise TarFormatError(f"the header at byte {at} holds a negative size")
            size = int.from_bytes(field[1:], "big")
        else:
            try:
                size = _octal(field)
            except ValueError:
                raise TarFormatError(
                    f"the header at byte {at}{self._after()} holds no valid size ({field!r})"
                ) from None
        return header[156], size

    def _meta(self, kind: int, payload: bytes, at: int) -> None:
        if kind == ord("L"):
            self._next["path"] = _text(payload.split(b"\x00", 1)[0])
        elif kind in b"xg":
            records = _pax_records(payload, at)
            (self._next if kind == ord("x") else self._global).update(records)
        # "K" (a long link target) says nothing of a regular member's data.

    def _member(self, header: bytes, kind: int, size: int, data_at: int, at: int) -> int:
        # Records a regular member; the size of the data that follows the header.
        said = {**self._global, **self._next}
        self._next = {}
        if "size" in said:
            size = said["size"]
        name = said.get("path")
        if name is None:
            name = _text(header[:100].split(b"\x00", 1)[0])
            if header[257:263] == _POSIX_MAGIC:
                prefix = header[345:500].split(b"\x00", 1)[0]
                if prefix:
                    name = _text(prefix) + "/" + name
        if kind == ord("S"):
            raise TarFormatError(
                f"{name!r} (header at byte {at}) is a GNU sparse member, which cannot be read "
                "by byte range; write the archive without --sparse"
            )
        if kind in _NO_DATA:
            return 0
        if kind in _REGULAR and not (kind == 0 and name.endswith("/")):
            self.names.append(name)
            self.offsets.append(data_at)
            self.sizes.append(size)
        return size

    def _last(self) -> str:
        return repr(self.names[-1]) if self.names else "the first member"

    def _after(self) -> str:
        return f" (after member {self.names[-1]!r})" if self.names else ""


def _octal(field: bytes) -> int:
    digits = field.split(b"\x00", 1)[0].strip(b" ")
    return int(digits, 8) if digits else 0


def _signed_sum(header: bytes) -> int:
    # Some old tars summed the header as signed chars.
    total = 8 * 32
    for i, b in enumerate(header):
        if not 148 <= i < 156:
            total += b - 256 if b > 127 else b
    return total


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


def _pax_records(payload: bytes, at: int) -> dict[str, Any]:
    # ``"<length> <key>=<value>\n"`` records; the ``path`` and ``size`` ones.
    out: dict[str, Any] = {}
    pos = 0
    while pos < len(payload) and payload[pos] != 0:
        space = payload.find(b" ", pos)
        try:
            length = int(payload[pos:space])
            if length <= 0:
                raise ValueError(length)
            record = payload[space + 1 : pos + length]
            key, value = record.rstrip(b"\n").split(b"=", 1)
            if key == b"path":
                out["path"] = _text(value)
            elif key == b"size":
                out["size"] = int(value)
        except ValueError:
            raise TarFormatError(
                f"the PAX header at byte {at} holds a malformed record at {pos}"
            ) from None
        pos += length
    return out
