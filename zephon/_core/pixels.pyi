"""Pixels out of Pillow's own memory (compiled)."""

import numpy as np
import numpy.typing as npt

def rgb_of_rgbx(
    values: npt.NDArray[np.uint8] | bytes, height: int, width: int
) -> npt.NDArray[np.uint8]:
    """A new ``(height, width, 3)`` uint8 array of the first three of every four bytes of
    ``values`` (at least ``height * width * 4``)."""
