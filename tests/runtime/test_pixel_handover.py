"""Decoded pixels from a worker process: the arrays the loader gets are bitwise the worker's, and
the worker writes them from their own memory into the pipe, without joining a copy first."""

from __future__ import annotations

import io
import os
import pickle
import struct
import sys
import threading
import tracemalloc

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import zephon
from zephon.ops import batch, center_crop, decode_images, fetch, resize_images
from zephon.sources import ArrowSource

Image = pytest.importorskip("PIL.Image")
pytestmark = pytest.mark.usefixtures("no_leftover_workers")


def _pictures(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    return [rng.integers(0, 256, (224, 224, 3), dtype=np.uint8) for _ in range(n)]


@pytest.mark.skipif(sys.platform == "win32", reason="the gathered write is POSIX's")
def test_a_message_of_pixels_is_written_without_a_joined_copy_and_arrives_bitwise():
    from zephon.runtime.workers.pipe_messages import encode, write

    pictures = _pictures(32)  # 4.8 MB: many times what the pipe holds
    message = encode("items", [*pictures, "end"])
    total = sum(len(part) for part in message[1])
    reader, writer = os.pipe()
    sink = bytearray(total + 4096)  # everything the pipe carries, allocated before counting
    got = [0]

    def drain() -> None:
        view = memoryview(sink)
        while n := os.readv(reader, [view[got[0] :]]):
            got[0] += n

    from multiprocessing.connection import Connection

    conn = Connection(writer, readable=False)
    tracemalloc.start()
    try:
        thread = threading.Thread(target=drain)
        thread.start()
        write(conn, message)
        conn.close()
        thread.join()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        os.close(reader)
    assert peak < total // 8, f"writing {total:,} bytes allocated {peak:,} on the way"
    # The stream: the header (Connection's framing around its pickle), then the body.
    (n,) = struct.unpack("!i", sink[:4])
    kind, size, sizes = pickle.loads(sink[4 : 4 + n])
    at = 4 + n
    assert kind == "items" and struct.unpack("!i", sink[at : at + 4])[0] == total
    at += 4
    data, at = sink[at : at + size], at + size
    buffers = []
    for length in sizes:
        buffers.append(sink[at : at + length])
        at += length
    assert at == got[0]
    value = pickle.loads(data, buffers=buffers)
    assert value[-1] == "end"
    for received, sent in zip(value, pictures, strict=False):
        assert received.dtype == np.uint8 and received.shape == sent.shape
        assert received.tobytes() == sent.tobytes()


def _jpegs(path: str, n: int) -> str:
    rows = []
    for i, picture in enumerate(_pictures(n)):
        buf = io.BytesIO()
        Image.fromarray(np.roll(picture, i, axis=1)).save(buf, format="JPEG", quality=90)
        rows.append(buf.getvalue())
    pq.write_table(pa.table({"image": pa.array(rows, pa.binary())}), path, row_group_size=16)
    return path


def _pixels(path: str, **lanes) -> list[np.ndarray]:
    pipeline = zephon.Pipeline(
        ArrowSource(path, chunk_size=16),
        [fetch(), decode_images("image"), resize_images(240), center_crop(224), batch(16)],
        micro_batch=16,
        **lanes,
    )
    return [b.payload["image"] for b in pipeline.iter()]


def test_process_lanes_deliver_the_decoded_pixels_bitwise(tmp_path):
    path = _jpegs(str(tmp_path / "pictures.parquet"), 64)
    inline = _pixels(path, lanes=2)
    process = _pixels(path, lanes=2, workers="process")
    bounded = _pixels(path, lanes=2, workers="process", max_inflight_bytes=1)
    assert len(inline) == len(process) == len(bounded) == 4
    for a, b, c in zip(inline, process, bounded, strict=True):
        assert a.shape == b.shape == c.shape == (16, 224, 224, 3) and b.dtype == np.uint8
        assert a.tobytes() == b.tobytes() == c.tobytes()
