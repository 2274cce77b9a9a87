"""Pixels out of Pillow's own memory: its RGB images keep four bytes a pixel (red, green, blue
and a pad byte), which ``rgb_of_rgbx`` packs into a new ``(height, width, 3)`` array in one
pass. ``zephon.ops.images`` reads that memory through Pillow's Arrow export, instead of
``numpy.asarray(image)``, which has Pillow pack the pixels into a bytes object and numpy copy
them again."""

import numpy as np

cimport numpy as cnp

cnp.import_array()


def rgb_of_rgbx(const unsigned char[::1] values, Py_ssize_t height, Py_ssize_t width):
    """A new writable ``(height, width, 3)`` uint8 array of the first three of every four bytes
    of ``values`` (at least ``height * width * 4`` of them, row by row)."""
    if height < 0 or width < 0:
        raise ValueError(f"rgb_of_rgbx: height and width must be >= 0, got {height} x {width}")
    cdef Py_ssize_t n = height * width
    if values.shape[0] < 4 * n:
        raise ValueError(
            f"rgb_of_rgbx: {height} x {width} pixels need {4 * n} bytes, got {values.shape[0]}"
        )
    out = np.empty((height, width, 3), dtype=np.uint8)
    if n == 0:
        return out
    cdef unsigned char* dst = <unsigned char*>cnp.PyArray_DATA(<cnp.ndarray>out)
    cdef const unsigned char* src = &values[0]
    cdef Py_ssize_t i
    with nogil:
        for i in range(n):
            dst[3 * i] = src[4 * i]
            dst[3 * i + 1] = src[4 * i + 1]
            dst[3 * i + 2] = src[4 * i + 2]
    return out
