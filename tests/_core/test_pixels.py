"""Pillow's four-byte RGB pixels packed into (H, W, 3) arrays, against numpy's slicing; and
``pixels_of`` against ``numpy.asarray`` on real Pillow images."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from zephon._core.pixels import rgb_of_rgbx
from zephon.ops.images import pixels_of


@settings(max_examples=300, deadline=None)
@given(height=st.integers(0, 9), width=st.integers(0, 9), extra=st.integers(0, 7), data=st.data())
def test_packing_equals_dropping_every_fourth_byte(height, width, extra, data) -> None:
    n = height * width * 4 + extra
    values = np.frombuffer(data.draw(st.binary(min_size=n, max_size=n)), np.uint8)
    out = rgb_of_rgbx(values, height, width)
    expected = values[: height * width * 4].reshape(height, width, 4)[..., :3]
    assert out.shape == (height, width, 3) and out.dtype == np.uint8
    assert out.tolist() == expected.tolist()
    assert out.flags.writeable and out.flags.c_contiguous and out.flags.owndata


def test_too_few_bytes_or_a_negative_size_is_refused() -> None:
    with pytest.raises(ValueError, match="2 x 3 pixels need 24 bytes, got 23"):
        rgb_of_rgbx(np.zeros(23, np.uint8), 2, 3)
    with pytest.raises(ValueError, match="must be >= 0"):
        rgb_of_rgbx(np.zeros(8, np.uint8), -1, 2)
    with pytest.raises(ValueError):  # not one byte per item
        rgb_of_rgbx(np.zeros(8, np.float32), 1, 1)


def noise(mode: str, size: tuple[int, int], seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    bands = len(Image.new(mode, (1, 1)).getbands())
    shape = (size[1], size[0], bands) if bands > 1 else (size[1], size[0])
    return Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode=mode)


@settings(max_examples=60, deadline=None)
@given(
    mode=st.sampled_from(["RGB", "RGBA", "L"]),
    size=st.tuples(st.integers(1, 40), st.integers(1, 40)),
    seed=st.integers(0, 2**16),
)
def test_pixels_of_an_image_are_numpys_view_of_it_copied(mode, size, seed) -> None:
    image = noise(mode, size, seed)
    out = pixels_of(image)
    expected = np.asarray(image)
    assert out.dtype == np.uint8 and out.shape == expected.shape
    assert out.tolist() == expected.tolist()
    assert out.flags.writeable and out.flags.owndata


def test_an_image_larger_than_a_block_of_pillows_memory_still_comes_whole() -> None:
    # Pillow keeps a large image in several blocks, which it cannot export: numpy's way then.
    image = noise("RGB", (2100, 2100), 1)
    out = pixels_of(image)
    assert out.shape == (2100, 2100, 3) and np.array_equal(out, np.asarray(image))


def test_a_resized_and_a_cropped_image_come_as_their_own_pixels() -> None:
    image = noise("RGB", (64, 48), 2)
    for derived in (image.resize((33, 17), Image.Resampling.BICUBIC), image.crop((5, 7, 30, 40))):
        assert np.array_equal(pixels_of(derived), np.asarray(derived))
