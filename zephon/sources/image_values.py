"""Image values of shard formats, read without Pillow: an image stored as raw pixels (the
``pil`` encoding of Mosaic MDS and LitData) becomes a ``RawImage``, and a list of encoded images
the list of their bytes. ``zephon.ops.decode_images`` decodes both, as it does encoded bytes.

Layouts (little-endian uint32 throughout). Raw pixels: width, height and the length of the mode's
name, the name (UTF-8), then the pixels as Pillow's ``Image.tobytes()`` gives them. A list of
encoded images: its count, one size per image, then the images back to back.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["RawImage", "encoded_images", "raw_image"]

#: Bits per pixel of Pillow's modes whose raw pixels have a known size; the pixels of an image
#: of another mode are handed to Pillow unchecked.
_MODE_BITS = {
    "1": 1,
    "L": 8,
    "P": 8,
    "LA": 16,
    "La": 16,
    "PA": 16,
    "I;16": 16,
    "I;16L": 16,
    "I;16B": 16,
    "I;16N": 16,
    "RGB": 24,
    "YCbCr": 24,
    "LAB": 24,
    "HSV": 24,
    "RGBA": 32,
    "RGBa": 32,
    "RGBX": 32,
    "CMYK": 32,
    "I": 32,
    "F": 32,
}


@dataclass(frozen=True, repr=False)
class RawImage:
    """An image as raw pixels: ``pixels`` are what Pillow's ``Image.tobytes()`` gives for an
    image of ``mode`` (a Pillow mode: ``"RGB"``, ``"L"``, ``"RGBA"``...) and size ``width`` x
    ``height``. ``decode_images`` turns it into an array as it does an encoded file;
    ``to_pil()`` gives the Pillow image."""

    mode: str
    width: int
    height: int
    pixels: bytes

    def __repr__(self) -> str:  # the pixels by their count: a photo's would fill a screen
        return (
            f"RawImage(mode={self.mode!r}, width={self.width}, height={self.height}, "
            f"pixels=<{len(self.pixels)} bytes>)"
        )

    @property
    def size(self) -> tuple[int, int]:
        """``(width, height)``, as Pillow gives an image's size."""
        return self.width, self.height

    def to_pil(self) -> Any:
        """The Pillow image of these pixels (needs Pillow: ``pip install
        "zephon-loader[images]"``)."""
        from PIL import Image

        return Image.frombytes(self.mode, self.size, self.pixels)


def raw_image(data: memoryview) -> RawImage:
    """The ``RawImage`` a raw-pixels value holds (a copy of its pixels); ValueError when its
    head or its pixels do not fit the value's bytes."""
    if len(data) < 12:
        raise ValueError(
            f"the value holds {len(data)} bytes, fewer than the 12 of a raw image's width, "
            "height and mode"
        )
    width, height, named = (int(v) for v in np.frombuffer(data, "<u4", count=3))
    if 12 + named > len(data):
        raise ValueError(
            f"its mode's name of {named} bytes runs past the end of the value ({len(data)} bytes)"
        )
    mode = str(data[12 : 12 + named], "utf-8")
    pixels = data[12 + named :]
    bits = _MODE_BITS.get(mode)
    if bits is not None:
        want = -(-width * bits // 8) * height  # each row padded to whole bytes
        if len(pixels) != want:
            raise ValueError(
                f"a {width}x{height} {mode} image has {want} bytes of pixels, the value "
                f"holds {len(pixels)}"
            )
    return RawImage(mode, width, height, bytes(pixels))


def encoded_images(data: memoryview, at: int = 0) -> list[memoryview]:
    """The encoded images of a list of them starting at byte ``at`` of ``data`` (its count,
    their sizes, the images), as views of ``data``; ValueError when the count or the sizes do
    not fit the value's bytes exactly."""
    if at + 4 > len(data):
        raise ValueError(f"the value holds {len(data)} bytes, too few for the count of its images")
    (count,) = np.frombuffer(data, "<u4", count=1, offset=at).tolist()
    at += 4
    if at + 4 * count > len(data):
        raise ValueError(
            f"it counts {count} images, whose sizes run past its end ({len(data)} bytes)"
        )
    sizes = np.frombuffer(data, "<u4", count=count, offset=at).astype(np.int64)
    at += 4 * count
    total = int(sizes.sum())
    if at + total != len(data):
        raise ValueError(
            f"its {count} images take {total} bytes, {len(data) - at} follow their sizes"
        )
    bounds = [at, *(at + np.cumsum(sizes)).tolist()]
    return [data[a:e] for a, e in itertools.pairwise(bounds)]
