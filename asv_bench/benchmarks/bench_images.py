"""Images: decode -> resize -> crop -> batch(64) over JPEGs in Parquet (``zephon.bench.images``).

- one inline lane against a bare loop making the same Pillow calls (target ≥ 0.9x);
- two process lanes against one inline lane (target ≥ 1.6x on two free cores; the machine's own
  two-process ceiling is tracked beside it) and against torch's ``DataLoader(num_workers=2)``
  doing the same work (target ≥ 1x);
- peak RSS of the loader and its workers over 10x the images (target ≤ +10 %);
- decoded 224x224x3 uint8 batches through two process lanes, in bytes/s.
"""

from __future__ import annotations

import tempfile

from zephon.bench import images
from zephon.bench import pipeline as pb

IMAGES = 1024
ROUNDS = 3


class ImagePipeline:
    """Images/s ratios, each the median of interleaved rounds (higher is better)."""

    timeout = 900

    def setup_cache(self) -> dict[str, float]:
        with tempfile.TemporaryDirectory() as directory:
            path = images.make_images(IMAGES, directory)
            m = images.alternating(
                ROUNDS,
                bare=lambda: images.bare_rate(path),
                inline=lambda: images.pipeline_rate(images.image_pipeline(path)),
                process=lambda: images.pipeline_rate(
                    images.image_pipeline(path, lanes=2, workers="process")
                ),
                torch=lambda: images.torch_rate(path),
            )
        return {
            "inline_over_bare": m["inline/bare"],
            "process_over_inline": m["process/inline"],
            "process_over_torch": m["process/torch"],
            "ceiling": pb.process_ceiling(2048),
        }

    def track_inline_over_bare(self, m: dict[str, float]) -> float:
        return m["inline_over_bare"]

    track_inline_over_bare.unit = "x"  # type: ignore[attr-defined]

    def track_two_process_lanes_over_inline(self, m: dict[str, float]) -> float:
        return m["process_over_inline"]

    track_two_process_lanes_over_inline.unit = "x"  # type: ignore[attr-defined]

    def track_machine_ceiling(self, m: dict[str, float]) -> float:
        return m["ceiling"]

    track_machine_ceiling.unit = "x"  # type: ignore[attr-defined]

    def track_two_process_lanes_over_torch(self, m: dict[str, float]) -> float:
        return m["process_over_torch"]

    track_two_process_lanes_over_torch.unit = "x"  # type: ignore[attr-defined]


class ImageMemory:
    """Peak RSS growth of the loader and its two process lanes' workers over 10x the images."""

    timeout = 900

    def setup(self) -> None:
        self._tmp = tempfile.TemporaryDirectory()
        self.path = images.make_images(2_000, self._tmp.name, sizes=((96, 72), (72, 96)))

    def teardown(self) -> None:
        self._tmp.cleanup()

    def track_peak_rss_growth(self) -> float:
        small = images.peak_rss(self.path, 1)["peak_rss"]
        large = images.peak_rss(self.path, 10)["peak_rss"]
        return large / small - 1

    track_peak_rss_growth.unit = "fraction"  # type: ignore[attr-defined]


class PixelHandover:
    """Bytes/s of decoded 224x224x3 uint8 batches through two process lanes."""

    number = 1
    repeat = 3
    timeout = 300

    def track_bytes_per_second(self) -> float:
        return images.handover_rate(4096)

    track_bytes_per_second.unit = "B/s"  # type: ignore[attr-defined]
