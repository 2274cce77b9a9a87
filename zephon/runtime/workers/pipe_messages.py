"""Messages between the loader and a worker process, over a pipe: a small header, then one body
holding the pickle and its out-of-band buffers. A numpy array's data is never copied on either
side: the worker's array goes from its own memory into the pipe (one gathered write), and the
loader reads it from the pipe straight into the buffer its received array is made on. A lane's
large item lists leave their arrays in the worker's shared ring instead (``shared_ring``): the
header then says where they lie, and the body is the pickle alone."""

from __future__ import annotations

import os
import pickle
import select
import struct
import sys
import time
import types
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from zephon.runtime.workers.shared_ring import RingReader, RingWriter

ACK = "ack"  # from the loader: it took an item list, so one more may be sent
READY = "ready"  # from a worker: it runs (a death after this is not a failed start)
END = "end"  # the runner is exhausted: next() raises StopIteration from now on
THREADS = "threads"  # from the loader: thread variables to set (other workers have finished)
WARNINGS = "warnings"  # from a worker: warnings its lanes raised, for the loader to raise again
STORAGE = "storage"  # from a worker: its lane waits on storage (a StorageWait), or no more (None)
HELD = "held"  # from a worker: its lane holds max_inflight_bytes ahead and waits (acks it had)
RING = "ring"  # from a worker: its lane's shared ring (its size; the descriptor follows)
# From the loader: an acknowledgement that also names the ring regions it released.
RELEASED = "released"


class LoaderGone(Exception):
    """The loader closed its end of the pipe: the worker stops."""


def _parts_of(value: Any) -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [(f"[{k!r}]", v) for k, v in value.items()]
    if isinstance(value, (list, tuple)):
        return [(f"[{i}]", v) for i, v in enumerate(value)]
    attrs = getattr(value, "__dict__", None)
    if isinstance(attrs, dict) and not isinstance(value, (type, types.ModuleType)):
        return [(f".{name}", v) for name, v in attrs.items()]
    return []


def pickle_error(value: Any, dumps: Callable[[Any], Any] | None = None) -> Exception | None:
    """Why ``value`` cannot be pickled (by ``dumps``; ``pickle``'s protocol 5 unless given), or
    None when it can."""
    try:
        if dumps is None:
            pickle.dumps(value, protocol=5)
        else:
            dumps(value)
    except Exception as exc:
        return exc
    return None


def unpicklable_part(
    value: Any, path: str = "", depth: int = 4, dumps: Callable[[Any], Any] | None = None
) -> tuple[str, Exception] | None:
    """The deepest attribute or item path (``settings['guard']``) under ``value`` that cannot be
    pickled (by ``dumps``), with the error, or None."""
    for name, part in _parts_of(value):
        error = pickle_error(part, dumps)
        if error is not None:
            here = f"{path}{name}"
            deeper = unpicklable_part(part, here, depth - 1, dumps) if depth > 1 else None
            return deeper or (here, error)
    return None


def encode(kind: str, value: Any) -> tuple[tuple, list[Any]]:
    """Pickle protocol 5 with out-of-band buffers (numpy data is not copied into the pickle):
    a header, then the pickle and the buffers, to be sent as one body."""
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers]
    return (kind, len(data), [r.nbytes for r in raws]), [data, *raws]


def body_size(message: tuple[tuple, list[Any]]) -> int:
    """The bytes of an ``encode``d message's body: its pickle and out-of-band buffers (in the
    pipe or in the ring)."""
    header, _ = message
    return int(header[1] + sum(header[2]))


def through_ring(message: tuple[tuple, list[Any]], ring: RingWriter) -> tuple[tuple, list[Any]]:
    """An ``encode``d message with its out-of-band buffers copied into ``ring``: the header says
    where they lie, the body is the pickle alone. The message as it was when the ring has no free
    region for them."""
    (kind, size, sizes), parts = message
    offsets = ring.place(parts[1:])
    if offsets is None:
        return message
    return (kind, size, sizes, offsets), parts[:1]


def announce_ring(conn: Connection, ring: RingWriter) -> None:
    """Pass ``ring`` to the loader (its size, then its descriptor); ``LoaderGone`` when the other
    end has closed the pipe."""
    try:
        conn.send((RING, ring.size, []))
        ring.send_descriptor(conn)
    except (OSError, EOFError):
        raise LoaderGone from None


def write(conn: Connection, message: tuple[tuple, list[Any]]) -> None:
    """Send an ``encode``d message; ``LoaderGone`` when the other end has closed the pipe."""
    header, parts = message
    try:
        conn.send(header)
        if sys.platform == "win32":
            # One body, however many arrays: a message of packed rows holds hundreds of them.
            conn.send_bytes(parts[0] if len(parts) == 1 else b"".join(parts))
        else:
            _write_gathered(conn.fileno(), parts)
    except (OSError, EOFError):
        raise LoaderGone from None


def _write_gathered(fd: int, parts: list[Any]) -> None:
    """One body of all ``parts`` in ``Connection``'s framing (what ``send_bytes`` of their join
    would write), gathered from where each part lies: no array is copied into a joined body."""
    total = sum(memoryview(p).nbytes for p in parts)
    framing = struct.pack("!i", total) if total <= 0x7FFFFFFF else struct.pack("!iQ", -1, total)
    views = [memoryview(framing), *(memoryview(p).cast("B") for p in parts if len(p))]
    i = 0
    while i < len(views):
        n = os.writev(fd, views[i : i + _IOV_MAX])
        while i < len(views) and n >= len(views[i]):
            n -= len(views[i])
            i += 1
        if n:
            views[i] = views[i][n:]


class MessageStalled(Exception):
    """The rest of a message did not arrive before the deadline (its sender stopped mid-way)."""


def receive(
    conn: Connection, patience: float | None = None, ring: RingReader | None = None
) -> tuple[str, Any, int]:
    """One message (``encode``'s header, then its body): its kind, value and body bytes. With
    ``patience``, ``MessageStalled`` when the body has not arrived that many seconds after the
    header. A message whose arrays lie in the worker's ``ring`` gets them from there; a ring
    announced (``RING``) is mapped and returned as the value."""
    header = conn.recv()  # small: written to the pipe in one piece
    kind, size, sizes = header[:3]
    if kind == RING:
        return kind, RingReader(conn, size), 0
    deadline = None if patience is None else time.monotonic() + patience
    data = bytearray(size)
    buffers: list[Any]
    if len(header) > 3:  # the arrays are in the ring, on pages both processes keep mapped
        if ring is None:
            raise OSError("a message in a shared ring that was never announced")
        _recv_body_into(conn, [data], deadline)
        buffers = ring.buffers(header[3], sizes)
    else:
        # Each buffer its own bytearray: writable, so arrays arrive as ordinary writable numpy
        # arrays, and holding one array holds no other.
        buffers = [bytearray(n) for n in sizes]
        _recv_body_into(conn, [data, *buffers], deadline)
    return kind, pickle.loads(data, buffers=buffers), size + sum(sizes)


def _recv_body_into(conn: Connection, parts: list[bytearray], deadline: float | None) -> None:
    """One message of exactly ``sum(map(len, parts))`` bytes into ``parts``, in order, giving up
    at ``deadline``. On POSIX the pipe is read here, in ``Connection``'s framing (a 4-byte
    big-endian length, or -1 and an 8-byte one, then the bytes), scattered into the parts."""
    total = sum(map(len, parts))
    if sys.platform == "win32":
        body = conn.recv_bytes()
        if len(body) != total:
            raise OSError(f"a message of {len(body)} bytes where {total} were announced")
        at = 0
        for part in parts:
            part[:] = body[at : at + len(part)]
            at += len(part)
        return
    fd = conn.fileno()
    head = bytearray(4)
    _read_exactly(fd, [memoryview(head)], deadline)
    (n,) = struct.unpack("!i", head)
    if n == -1:
        head = bytearray(8)
        _read_exactly(fd, [memoryview(head)], deadline)
        (n,) = struct.unpack("!Q", head)
    if n != total:
        raise OSError(f"a message of {n} bytes where {total} were announced")
    _read_exactly(fd, [memoryview(p) for p in parts if len(p)], deadline)


#: The most buffers one ``readv`` may fill.
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 16


def _read_exactly(fd: int, views: list[memoryview], deadline: float | None) -> None:
    """Fill ``views`` from ``fd``, in order; without a ``deadline`` as long as that takes."""
    total = sum(map(len, views))
    got = i = 0
    while i < len(views):
        if deadline is not None:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                raise MessageStalled(f"{got} of {total} bytes arrived")
        n = os.readv(fd, views[i : i + _IOV_MAX])
        if n == 0:
            raise EOFError("the pipe closed inside a message")
        got += n
        while i < len(views) and n >= len(views[i]):
            n -= len(views[i])
            i += 1
        if n:
            views[i] = views[i][n:]
