"""The image pipeline: JPEGs in Parquet -> decode -> resize -> crop -> batch, against baselines
run in the same process.

- the data: pictures drawn with Pillow (gradients, rectangles and lines, a few sizes), encoded as
  JPEG and written to Parquet (row groups of 512) under a temporary directory;
- in one lane: the pipeline's images/s against a bare loop making the same Pillow calls on the
  same row groups (``bare_images``), for the evaluation chain (resize, center crop) and the
  training chain (random resized crop);
- two process lanes against one inline lane on the same pipeline (the machine's two-process
  ceiling is ``pipeline.process_ceiling``);
- against ``torch.utils.data.DataLoader(num_workers=2)`` doing the same Pillow calls on the same
  rows and batching them with its default collate;
- memory: the peak RSS of the loader's process plus its workers (sampled every few batches), in
  fresh processes, delivering ``n`` and ``10 n`` images;
- the handover: bytes/s of decoded 224x224x3 batches through two process lanes.

Functions only; ``zephon bench`` (``report.py``) and the asv suite call them.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

import zephon
from zephon.ops import batch, center_crop, decode_images, fetch, random_resized_crop, resize_images
from zephon.ops.base import Operator
from zephon.sources.arrow import ArrowSource

__all__ = [
    "BATCH",
    "CROP",
    "alternating",
    "bare_images",
    "handover_rate",
    "image_pipeline",
    "make_images",
    "peak_rss",
    "pipeline_rate",
    "torch_rate",
]

BATCH = 64
CROP = 224
SHORT_EDGE = 256
ROW_GROUP = 512
#: (width, height) of the pictures drawn, in turns: a photo's usual shapes, small to medium.
SIZES = ((320, 240), (500, 375), (640, 480), (375, 500))
#: Distinct pictures; row ``i`` holds picture ``i % DISTINCT``.
DISTINCT = 64


def _picture(i: int, size: tuple[int, int]) -> Any:
    from PIL import Image, ImageDraw

    w, h = size
    x = np.linspace(0, 255, w, dtype=np.float32)
    y = np.linspace(0, 255, h, dtype=np.float32)[:, None]
    rgb = np.stack(
        [(x + i * 37) % 256 + 0 * y, (y + i * 91) % 256 + 0 * x, ((x + y) / 2 + i * 53) % 256],
        axis=-1,
    ).astype(np.uint8)
    image = Image.fromarray(rgb)
    draw = ImageDraw.Draw(image)
    draw.rectangle([i % (w // 4), i % (h // 4), w // 2, h // 2], fill=(255 - i % 256, 20, 200))
    draw.line([0, h - 1, w - 1, 0], fill=(0, 255, 0), width=3)
    return image


def make_images(n: int, directory: str, sizes: tuple[tuple[int, int], ...] = SIZES) -> str:
    """A Parquet file of ``n`` JPEG images (column ``image``, and ``label``) in ``directory``;
    made once per ``(n, sizes)``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = os.path.join(directory, f"images-{n}-{len(sizes)}-{sizes[0][0]}.parquet")
    if os.path.exists(path):
        return path
    encoded = []
    for i in range(min(n, DISTINCT)):
        buf = io.BytesIO()
        _picture(i, sizes[i % len(sizes)]).save(buf, format="JPEG", quality=90)
        encoded.append(buf.getvalue())
    table = pa.table(
        {
            "image": pa.array([encoded[i % len(encoded)] for i in range(n)], pa.binary()),
            "label": pa.array([i % 1000 for i in range(n)], pa.int64()),
        }
    )
    pq.write_table(table, path + ".part", row_group_size=ROW_GROUP)
    os.replace(path + ".part", path)
    return path


def image_pipeline(
    path: str,
    *,
    train: bool = False,
    lanes: int = 1,
    workers: str = "inline",
    passes: int = 1,
    crop: int = CROP,
    max_inflight_bytes: int | None = None,
) -> zephon.Pipeline:
    """Decode, resize and center-crop (``train=False``) or random-resized-crop (``train``) to
    ``crop``, in batches of ``BATCH``."""
    chain: list[Operator]
    if train:
        chain = [random_resized_crop(crop, seed=7)]
    else:
        chain = [resize_images(crop * SHORT_EDGE // CROP), center_crop(crop)]
    return zephon.Pipeline(
        ArrowSource(path, columns=["image"], chunk_size=BATCH, passes=passes),
        [fetch(), decode_images("image"), *chain, batch(BATCH)],
        lanes=lanes,
        workers=workers,
        micro_batch=BATCH,
        max_inflight_bytes=max_inflight_bytes,
    )


# ------------------------------------------------------------------------------ the bare loop


def _decode(data: bytes) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return np.asarray(image.convert("RGB"), dtype=np.uint8).copy()


def _resize(image: np.ndarray, height: int, width: int) -> np.ndarray:
    from PIL import Image

    if image.shape[:2] == (height, width):
        return image
    resized = Image.fromarray(image).resize((width, height), Image.Resampling.BICUBIC)
    return np.asarray(resized, dtype=np.uint8)


def _center(image: np.ndarray, crop: int) -> np.ndarray:
    h, w = image.shape[:2]
    top, left = (h - crop) // 2, (w - crop) // 2
    out = np.zeros((crop, crop, 3), dtype=np.uint8)
    out[:] = image[top : top + crop, left : left + crop]
    return out


def eval_transform(data: bytes, rng: np.random.Generator, crop: int = CROP) -> np.ndarray:
    """Decode, resize the shorter edge to 256/224 of ``crop``, center-crop ``crop``."""
    image = _decode(data)
    h, w = image.shape[:2]
    scale = (crop * SHORT_EDGE // CROP) / min(h, w)
    return _center(_resize(image, round(h * scale), round(w * scale)), crop)


def train_transform(data: bytes, rng: np.random.Generator, crop: int = CROP) -> np.ndarray:
    """Decode, crop a random area (8-100 %) and aspect (3/4-4/3), resize it to ``crop``."""
    image = _decode(data)
    h, w = image.shape[:2]
    for _ in range(10):
        target = h * w * rng.uniform(0.08, 1.0)
        aspect = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
        cw, ch = round(np.sqrt(target * aspect)), round(np.sqrt(target / aspect))
        if 0 < cw <= w and 0 < ch <= h:
            top, left = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
            return _resize(image[top : top + ch, left : left + cw], crop, crop)
    return _resize(image, crop, crop)


def bare_images(path: str, *, train: bool = False, crop: int = CROP) -> Iterator[np.ndarray]:
    """The same Pillow calls as ``image_pipeline`` on the same row groups, batched with
    ``np.stack``: no records, no lanes, no bookkeeping."""
    import pyarrow.parquet as pq

    transform = train_transform if train else eval_transform
    rng = np.random.default_rng(7)
    pending: list[np.ndarray] = []
    with pq.ParquetFile(path) as f:
        for g in range(f.num_row_groups):
            for data in f.read_row_group(g, columns=["image"]).column(0).to_pylist():
                pending.append(transform(data, rng, crop))
                if len(pending) == BATCH:
                    yield np.stack(pending)
                    pending = []
    if pending:
        yield np.stack(pending)


def _images_per_second(batches: Iterator[Any], count: Callable[[Any], int]) -> float:
    start = time.perf_counter()
    n = sum(count(b) for b in batches)
    return n / (time.perf_counter() - start)


def pipeline_rate(pipeline: zephon.Pipeline, cpu: list[float] | None = None) -> float:
    """Images/s of ``pipeline`` from its first batch (worker start-up left out) to its end; the
    CPU seconds this process spent per image meanwhile are appended to ``cpu``."""
    loader = pipeline.iter()
    try:
        first = len(next(loader).payload["image"])
        start, spent = time.perf_counter(), time.process_time()
        n = sum(len(b.payload["image"]) for b in loader)
        elapsed, spent = time.perf_counter() - start, time.process_time() - spent
    finally:
        loader.close()
    if cpu is not None and n:
        cpu.append(spent / n)
    return (n or first) / max(elapsed, 1e-9)


def bare_rate(path: str, *, train: bool = False) -> float:
    """Images/s of ``bare_images`` over the file."""
    return _images_per_second(bare_images(path, train=train), len)


class _TorchImages:
    """A map-style torch ``Dataset`` over the Parquet file: each worker opens the file itself and
    makes the same Pillow calls on a row's bytes."""

    def __init__(self, path: str, train: bool):
        import pyarrow.parquet as pq

        self.path = path
        self.train = train
        self.n = pq.ParquetFile(path).metadata.num_rows
        self._column: Any = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        import pyarrow.parquet as pq

        if self._column is None:  # once per worker: the file's image column, memory-mapped
            self._column = pq.read_table(self.path, columns=["image"], memory_map=True).column(0)
            self._rng = np.random.default_rng(7 + i)
        data = self._column[i].as_py()
        transform = train_transform if self.train else eval_transform
        return transform(data, self._rng)


def torch_loader(path: str, *, train: bool = False, workers: int = 2) -> Any:
    """``torch.utils.data.DataLoader`` over the same images, ``num_workers=workers``, batches of
    ``BATCH`` by its default collate (a uint8 tensor per batch)."""
    import torch.utils.data as tud

    dataset: Any = _TorchImages(path, train)  # map-style: __len__ and __getitem__
    return tud.DataLoader(
        dataset,
        batch_size=BATCH,
        num_workers=workers,
        persistent_workers=False,
        multiprocessing_context="forkserver" if workers else None,
    )


def torch_rate(
    path: str, *, train: bool = False, workers: int = 2, cpu: list[float] | None = None
) -> float:
    """Images/s of ``torch_loader`` from its first batch (worker start-up left out) to its end;
    the CPU seconds this process spent per image meanwhile are appended to ``cpu``."""
    batches = iter(torch_loader(path, train=train, workers=workers))
    first = len(next(batches))
    start, spent = time.perf_counter(), time.process_time()
    n = sum(len(b) for b in batches)
    elapsed, spent = time.perf_counter() - start, time.process_time() - spent
    if cpu is not None and n:
        cpu.append(spent / n)
    return (n or first) / elapsed


def alternating(rounds: int, **runs: Callable[[], float]) -> dict[str, float]:
    """``rounds`` rounds of every run in turns (so each sees the machine as it was that round):
    the median of each, and the median of each round's ratio of every run to every other, named
    ``"<name>/<other>"``."""
    seen: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            seen[name].append(run())
    out = {name: statistics.median(v) for name, v in seen.items()}
    for name, values in seen.items():
        for other, others in seen.items():
            if other != name:
                out[f"{name}/{other}"] = statistics.median(
                    a / b for a, b in zip(values, others, strict=True)
                )
    return out


# ------------------------------------------------------------------------------ memory


def _rss_child(path: str, passes: int, workers: str, bound: int | None) -> None:
    """Run in a fresh interpreter: deliver ``passes`` passes over the images through two lanes,
    print the peak RSS of this process plus its workers (sampled every 8 batches) as JSON."""
    import psutil

    me = psutil.Process()

    def rss() -> int:
        total = me.memory_info().rss
        for child in me.children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):  # it ended meanwhile
                total += child.memory_info().rss
        return total

    pipeline = image_pipeline(
        path, lanes=2, workers=workers, passes=passes, crop=64, max_inflight_bytes=bound
    )
    loader = pipeline.iter()
    peak = n = 0
    for i, b in enumerate(loader):
        n += len(b.payload["image"])
        if i % 8 == 0:
            peak = max(peak, rss())
    loader.close()
    print(json.dumps({"images": n, "peak_rss": peak}))


def peak_rss(path: str, passes: int, workers: str = "process", bound: int | None = None) -> dict:
    """Peak RSS (bytes; the loader's process and its workers) of a fresh process delivering
    ``passes`` passes over ``path``, cropped to 64x64, through two lanes."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = (
        f"import sys; sys.path.insert(0, {here!r}); from zephon.bench.images import _rss_child; "
        f"_rss_child({path!r}, {int(passes)}, {workers!r}, {bound!r})"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ
    )
    result: dict = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# ------------------------------------------------------------------------------ the handover


def _decoded(payload: dict) -> dict:
    """A decoded 224x224x3 picture per sample, made without Pillow: the handover alone."""
    i = payload["idx"]
    return {"image": np.full((CROP, CROP, 3), i % 251, dtype=np.uint8)}


def handover_rate(n: int, workers: str = "process") -> float:
    """Bytes/s of ``n`` decoded 224x224x3 uint8 images through two lanes, batched by 64: what
    crossing from the workers to the loader costs, with nothing else to do."""
    from zephon.ops import map_transform
    from zephon.sources.memory import RangeSource

    pipeline = zephon.Pipeline(
        RangeSource(n, chunk_size=1024),
        [fetch(), map_transform(_decoded), batch(BATCH)],
        lanes=2,
        workers=workers,
        micro_batch=BATCH,
    )
    return pipeline_rate(pipeline) * CROP * CROP * 3


def data_directory() -> str:
    """Where the benchmark's Parquet files are kept between sections of one run."""
    path = os.path.join(tempfile.gettempdir(), "zephon-bench-images")
    os.makedirs(path, exist_ok=True)
    return path
