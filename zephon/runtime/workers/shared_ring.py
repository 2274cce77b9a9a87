"""A worker's ring of shared memory for the arrays of its lane's item lists.

The worker copies a list's out-of-band buffers (numpy data) into the ring and sends only where
they lie over the pipe; the loader makes the arrays it gets on the same pages, which it mapped
once. A region is used again once every array made on it is gone: the loader notes it as the
last one is collected and tells the worker beside its next acknowledgement. The pages stay
mapped, and warm, in both processes, so a list costs the worker one copy and the loader none:
arrays of a list that a batch stacks are, there, one view of the region (the default collate
knows its pages), not a copy.

The ring is an anonymous memory file (``memfd``): it has no name to leave behind, and its memory
goes back to the OS once both processes have unmapped it, however either of them ended. Where
there is no ``memfd`` (or the pipe is no socket to pass it over), every list takes the pipe.
"""

from __future__ import annotations

import collections
import mmap
import os
import socket
import sys
import weakref
from multiprocessing.connection import Connection
from multiprocessing.reduction import recvfds, sendfds
from typing import Any

import numpy as np

from zephon._core.shared_pages import shared_region

#: The ring's least size. Untouched pages cost nothing; the pages used stay with the ring.
RING_BYTES = 64 << 20
#: An item list whose arrays hold fewer bytes takes the pipe: copying it costs less than the
#: bookkeeping of a region.
MIN_RING_MESSAGE = 64 << 10
#: Arrays start at multiples of this, as numpy's own allocations do.
ALIGN = 64


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def ring_possible(conn: Connection) -> bool:
    """Whether a ring can be shared over ``conn``: a ``memfd`` exists, and the pipe is a socket
    that carries a descriptor."""
    if not (sys.platform.startswith("linux") and hasattr(os, "memfd_create")):
        return False
    try:
        with socket.socket(fileno=os.dup(conn.fileno())) as sock:
            return sock.family == socket.AF_UNIX
    except (OSError, ValueError):
        return False


class RingWriter:
    """The worker's side: regions taken first-fit from the ring's start (so the same pages come
    back), each held until the loader has released it."""

    def __init__(self, size: int):
        fd = os.memfd_create("zephon-ring", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self.fd: int | None = fd  # until sent to the loader
        self.size = size
        self._view = memoryview(self._map)
        self._used: dict[int, int] = {}  # start -> end of the regions the loader still holds

    @classmethod
    def for_message(cls, sizes: list[int]) -> RingWriter:
        """A ring for lists like this one: room for at least four of them."""
        return cls(max(RING_BYTES, 4 * sum(map(_aligned, sizes))))

    def fits(self, sizes: list[int]) -> bool:
        """Whether a list of arrays of ``sizes`` bytes should go through the ring (at most half
        of it, so a list in use never keeps the next out)."""
        total = sum(sizes)
        return total >= MIN_RING_MESSAGE and 2 * sum(map(_aligned, sizes)) <= self.size

    def place(self, buffers: list[Any]) -> list[int] | None:
        """Copy ``buffers`` (contiguous bytes, as ``pickle`` hands them out of band) into a free
        region; the offset of each, or None when no region is free (the list takes the pipe)."""
        need = sum(_aligned(memoryview(b).nbytes) for b in buffers)
        start = self._free_region(need)
        if start is None:
            return None
        offsets = []
        at = start
        for b in buffers:
            view = memoryview(b).cast("B")
            self._view[at : at + view.nbytes] = view
            offsets.append(at)
            at += _aligned(view.nbytes)
        self._used[start] = start + need
        return offsets

    def _free_region(self, need: int) -> int | None:
        at = 0
        for start, end in sorted(self._used.items()):
            if start - at >= need:
                return at
            at = end
        return at if self.size - at >= need else None

    def release(self, starts: list[int]) -> None:
        """The loader holds no array on the regions starting at ``starts`` any more."""
        for start in starts:
            self._used.pop(start, None)

    def send_descriptor(self, conn: Connection) -> None:
        """Pass the ring's descriptor over ``conn`` (after the message announcing it), then close
        it here: the mapping keeps the ring."""
        fd, self.fd = self.fd, None
        assert fd is not None
        try:
            with socket.socket(fileno=os.dup(conn.fileno())) as sock:
                sendfds(sock, [fd])
        finally:
            os.close(fd)


class RingReader:
    """The loader's side: the ring mapped once; the arrays of a list are made on their region,
    which is released when the last of them is collected."""

    def __init__(self, conn: Connection, size: int):
        with socket.socket(fileno=os.dup(conn.fileno())) as sock:
            try:
                (fd,) = recvfds(sock, 1)
            except RuntimeError as exc:  # the worker stopped between the announcement and it
                raise OSError(f"the worker's shared ring did not arrive ({exc})") from exc
        try:
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._released: collections.deque[int] = collections.deque()

    def buffers(self, offsets: list[int], sizes: list[int]) -> list[np.ndarray]:
        """The buffers of a list the worker placed at ``offsets``: views of one region, which
        stays taken while any array made on them lives."""
        start = offsets[0]
        region = shared_region(self._map, start, offsets[-1] + sizes[-1] - start)
        weakref.finalize(region, self._released.append, start).atexit = False
        return [region[at - start : at - start + n] for at, n in zip(offsets, sizes)]

    def take_released(self) -> list[int]:
        """The regions released since the last call (by any thread), for the worker."""
        released = self._released
        return [released.popleft() for _ in range(len(released))]
