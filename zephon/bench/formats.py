"""Reading other loaders' formats: ``fetch -> batch`` over ``TokenShardSource``, ``MDSSource``,
``WebDatasetSource``, ``LanceSource`` and ``LitDataSource`` against a bare loop doing the same
reads with the format's own reader.

- token shards: a Megatron ``.bin``/``.idx`` pair (written with numpy in the documented layout);
  the baseline slices a numpy memmap of the ``.bin`` at the index's pointers and converts each
  document to int32, in batches of the same size, each dropped when the next starts;
- MDS: shards written by Mosaic's ``MDSWriter``; the baseline is Mosaic's own ``MDSReader``
  (``get_item`` of every sample, shard by shard), loaded without the ``streaming`` package's
  ``__init__`` (it imports torchvision). Without streaming-community installed the baseline is
  missing and the row says so.
- WebDataset: ``.tar`` shards written by WebDataset's ``TarWriter`` (an image-sized ``jpg`` of
  random bytes, a ``txt`` and a ``cls`` per sample); the baseline iterates
  ``webdataset.WebDataset(urls)`` over the same shards, in batches of the same size. Without the
  ``webdataset`` package the baseline is missing and the row says so.
- Lance: a dataset written by ``lance.write_dataset``; the baseline takes the same rows, a chunk
  at a time, with ``LanceDataset.take`` and makes them Python rows (``to_pylist``);
- LitData: chunks written by LitData's ``BinaryWriter``; the baseline iterates LitData's own
  ``StreamingDataset`` over the directory (it imports torch, not torchvision).

Every baseline groups its rows into lists of ``BATCH``, as ``batch`` does.

Functions only; ``zephon bench`` (``report.py``) calls them.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import struct
import sys
import time
import types
from pathlib import Path
from typing import Any

import numpy as np

import zephon
from zephon.ops import batch, fetch
from zephon.sources import (
    LanceSource,
    LitDataSource,
    MDSSource,
    TokenShardSource,
    WebDatasetSource,
)

__all__ = [
    "lance_rates",
    "litdata_rates",
    "mds_rates",
    "token_shard_rates",
    "webdataset_rates",
    "write_lance",
    "write_litdata",
    "write_mds",
    "write_megatron",
    "write_webdataset",
]

BATCH = 32


def write_megatron(prefix: Path, docs: int, seed: int = 0) -> Path:
    """A uint16 Megatron pair of ``docs`` documents of 64..1023 tokens; the ``.idx`` path."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(64, 1024, size=docs).astype("<i4")
    tokens = rng.integers(0, 50_000, size=int(lengths.sum()), dtype=np.uint16)
    pointers = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)[:-1])) * 2
    Path(f"{prefix}.bin").write_bytes(tokens.tobytes())
    header = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, docs, docs + 1)
    body = lengths.tobytes() + pointers.astype("<i8").tobytes()
    Path(f"{prefix}.idx").write_bytes(header + body + np.arange(docs + 1, dtype="<i8").tobytes())
    return Path(f"{prefix}.idx")


def _pipeline_rate(source: Any, field: str) -> tuple[float, int]:
    # Samples/s of fetch -> batch(BATCH) over the whole source (metadata loaded before).
    source.num_samples()
    n = 0
    began = time.perf_counter()
    with zephon.Pipeline(source, [fetch(), batch(BATCH)]).iter() as loader:
        for b in loader:
            n += len(b.payload[field])
    return n / (time.perf_counter() - began), n


def _samples(samples: int) -> Any:
    # The rows every format bench writes: a token array of 64..511 int32, a text, an int.
    rng = np.random.default_rng(0)
    for i in range(samples):
        size = int(rng.integers(64, 512))
        yield {
            "tokens": rng.integers(0, 50_000, size, dtype=np.int32),
            "text": f"sample {i}",
            "idx": i,
        }


def _batched_rate(rows: Any) -> tuple[float, int]:
    # Rows/s of a baseline's rows grouped into lists of BATCH.
    seen = 0
    current: list[Any] = []
    began = time.perf_counter()
    for row in rows:
        current.append(row)
        if len(current) == BATCH:
            seen += len(current)
            current = []
    seen += len(current)
    return seen / (time.perf_counter() - began), seen


def token_shard_rates(idx: Path) -> tuple[float, float]:
    """``(ours, baseline)`` documents/s over the Megatron pair at ``idx``."""
    ours, n = _pipeline_rate(TokenShardSource(idx, chunk_size=1024), "tokens")
    raw = idx.read_bytes()
    docs = struct.unpack_from("<Q", raw, 18)[0]
    lengths = np.frombuffer(raw, "<i4", count=docs, offset=34)
    pointers = np.frombuffer(raw, "<i8", count=docs, offset=34 + 4 * docs) // 2
    began = time.perf_counter()
    tokens = np.memmap(idx.with_suffix(".bin"), dtype=np.uint16, mode="r").view(np.ndarray)
    # Each batch is dropped when the next starts, as a training loop drops what it trained on.
    current: list[np.ndarray] = []
    for start, length in zip(pointers.tolist(), lengths.tolist(), strict=True):
        current.append(tokens[start : start + length].astype(np.int32))
        if len(current) == BATCH:
            current = []
    baseline = docs / (time.perf_counter() - began)
    assert n == docs
    return ours, baseline


def mosaic_writer_and_reader() -> tuple[Any, Any] | None:
    """``(MDSWriter, reader_from_json)`` of streaming-community, without the package's
    ``__init__``; None when it is not installed."""
    if "streaming" not in sys.modules:
        spec = importlib.util.find_spec("streaming")
        if spec is None or not spec.submodule_search_locations:
            return None
        (base,) = spec.submodule_search_locations
        for name, where in (("streaming", base), ("streaming.base", f"{base}/base")):
            stub = types.ModuleType(name)
            stub.__path__ = [where]
            sys.modules[name] = stub
    fmt = importlib.import_module("streaming.base.format")
    return fmt.MDSWriter, fmt.reader_from_json


def write_mds(root: Path, samples: int) -> bool:
    """``samples`` raw MDS samples (a token array, a text, an int) written at ``root`` by
    Mosaic's ``MDSWriter``; False without streaming-community."""
    found = mosaic_writer_and_reader()
    if found is None:
        return False
    writer = found[0]
    columns = {"tokens": "ndarray:int32", "text": "str", "idx": "int"}
    with writer(out=str(root), columns=columns, size_limit=1 << 24) as out:
        for row in _samples(samples):
            out.write(row)
    return True


def mds_rates(root: Path) -> tuple[float, float]:
    """``(ours, Mosaic's MDSReader)`` samples/s over the MDS directory ``write_mds`` wrote."""
    found = mosaic_writer_and_reader()
    assert found is not None
    reader_from_json = found[1]
    ours, n = _pipeline_rate(MDSSource(root, chunk_size=1024), "idx")
    index = json.loads((root / "index.json").read_text())

    def rows() -> Any:
        for entry in index["shards"]:
            reader = reader_from_json(str(root), None, entry)
            for j in range(reader.samples):
                yield reader.get_item(j)

    baseline, seen = _batched_rate(rows())
    assert n == seen
    return ours, baseline


def write_webdataset(root: Path, samples: int, per_shard: int = 2000) -> bool:
    """``samples`` WebDataset samples (``jpg``: 2..20 kB of random bytes, ``txt``, ``cls``) in
    ``.tar`` shards of ``per_shard`` written at ``root`` by WebDataset's ``TarWriter``; False
    without the ``webdataset`` package."""
    try:
        import webdataset
    except ImportError:
        return False
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for s, first in enumerate(range(0, samples, per_shard)):
        with webdataset.TarWriter(str(root / f"shard-{s:05d}.tar"), encoder=False) as out:
            for i in range(first, min(first + per_shard, samples)):
                size = int(rng.integers(2_000, 20_000))
                jpg = rng.bytes(size)
                out.write(
                    {
                        "__key__": f"{i:08d}",
                        "jpg": jpg,
                        "txt": f"caption {i}".encode(),
                        "cls": str(i % 1000).encode(),
                    }
                )
    return True


def webdataset_rates(root: Path) -> tuple[float, float]:
    """``(ours, webdataset.WebDataset)`` samples/s over the shards ``write_webdataset`` wrote."""
    import webdataset

    ours, n = _pipeline_rate(WebDatasetSource(root, chunk_size=1024), "__key__")
    urls = sorted(str(p) for p in root.glob("*.tar"))
    baseline, seen = _batched_rate(webdataset.WebDataset(urls, shardshuffle=False))
    assert n == seen
    return ours, baseline


def write_lance(root: Path, samples: int) -> bool:
    """``samples`` rows written at ``root`` by ``lance.write_dataset`` (fragments of 16,384
    rows); False without pylance."""
    try:
        import lance
        import pyarrow as pa
    except ImportError:
        return False
    rows = list(_samples(samples))
    table = pa.table(
        {
            "tokens": pa.array([r["tokens"] for r in rows], pa.list_(pa.int32())),
            "text": [r["text"] for r in rows],
            "idx": [r["idx"] for r in rows],
        }
    )
    lance.write_dataset(table, str(root), max_rows_per_file=16_384)
    return True


def lance_rates(root: Path) -> tuple[float, float]:
    """``(ours, LanceDataset.take)`` samples/s over the dataset ``write_lance`` wrote."""
    import lance

    chunk = 1024
    ours, n = _pipeline_rate(LanceSource(root, chunk_size=chunk), "idx")
    ds = lance.dataset(str(root))
    columns = ["tokens", "text", "idx"]

    def rows() -> Any:
        total = ds.count_rows()
        for start in range(0, total, chunk):
            yield from ds.take(list(range(start, min(total, start + chunk))), columns).to_pylist()

    baseline, seen = _batched_rate(rows())
    assert n == seen
    return ours, baseline


def write_litdata(root: Path, samples: int) -> bool:
    """``samples`` items written at ``root`` by LitData's ``BinaryWriter`` (raw chunks of
    16 MB); False without litdata."""
    try:
        from litdata.streaming.writer import BinaryWriter
    except ImportError:
        return False
    writer = BinaryWriter(str(root), chunk_bytes=16 << 20)
    for i, row in enumerate(_samples(samples)):
        writer[i] = row
    writer.done()
    writer.merge()
    return True


def litdata_rates(root: Path, cache: Path) -> tuple[float, float]:
    """``(ours, LitData's StreamingDataset)`` samples/s over the chunks ``write_litdata``
    wrote (``cache``: the cache directory both may use)."""
    from litdata import StreamingDataset

    ours, n = _pipeline_rate(LitDataSource(root, chunk_size=1024, cache_dir=cache), "idx")
    dataset = StreamingDataset(str(root), shuffle=False)
    baseline, seen = _batched_rate(iter(dataset))
    assert n == seen
    return ours, baseline
