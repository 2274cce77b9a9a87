"""Images cut into the flattened patches a Qwen2-VL-style vision tower takes as ``pixel_values``,
in the layout and order of its image processor.

An image of patch grid ``(1, gh, gw)`` (``patch_size=p``, as ``tokenize_interleaved`` and
``tokenize_chat`` report it in ``image_grid_thw``) is exactly ``gh*p`` x ``gw*p`` pixels and
becomes ``gh * gw`` rows of ``C * T * p * p`` values (``T`` the tower's temporal patch size):

- rows go by ``merge x merge`` window, the windows row by row, and within a window its patches
  row by row, so the ``m*m`` patches that merge into one image token are consecutive rows;
- a row holds, channel by channel, the patch's ``p x p`` pixels ``T`` times over (an image is
  one frame; the tower's temporal patch takes it ``T`` times).

The values are the image's own, in its dtype: ``normalize``'s float32 CHW pixels, or ``uint8``
HWC ones as decoded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from zephon.errors import PatchLayoutError
from zephon.ops.vision import channels_first, image_size

__all__ = ["image_patches"]

#: The channels of an empty batch's ``(0, C*T*p*p)`` patches: the RGB of the vision towers.
EMPTY_CHANNELS = 3


def image_patches(
    images: Sequence[np.ndarray],
    grids: np.ndarray,
    *,
    patch_size: int,
    merge: int,
    temporal_patch_size: int,
    name: Callable[[int], str],
) -> np.ndarray:
    """The ``(sum(gh*gw), C*T*p*p)`` patches of ``images`` (see the module docstring), image by
    image; ``grids[i]`` is image ``i``'s ``(t, gh, gw)``. An image whose size is not its grid's,
    a grid that is not one frame of whole ``merge x merge`` windows, or images of a batch that
    differ in channels or dtype are a ``PatchLayoutError`` naming the image by ``name(i)``."""
    p, m, frames = patch_size, merge, temporal_patch_size
    grids = np.asarray(grids, dtype=np.int64).reshape(-1, 3)
    if len(grids) != len(images):
        raise PatchLayoutError(
            f"{len(images)} images but {len(grids)} patch grids (image_grid_thw): tokenize them "
            "with patch_size= so that each image has its grid"
        )
    if not len(images):
        return np.empty((0, EMPTY_CHANNELS * frames * p * p), dtype=np.float32)
    for image in images:
        image_size(image)  # a decoded image, or a TypeError saying what it is
    planes = [channels_first(image) for image in images]
    channels, dtype = planes[0].shape[0], planes[0].dtype
    for i, (plane, (t, gh, gw)) in enumerate(zip(planes, grids.tolist(), strict=True)):
        if plane.shape[0] != channels or plane.dtype != dtype:
            raise PatchLayoutError(
                f"{name(i)} has {plane.shape[0]} channel(s) of {plane.dtype}, the batch's first "
                f"image {channels} of {dtype}: every image of a batch must be alike to be cut into "
                "rows of one width (decode all as RGB; normalize all or none)"
            )
        if t != 1 or gh % m or gw % m or gh < 1 or gw < 1:
            raise PatchLayoutError(
                f"{name(i)} has the patch grid (t, h, w) = {(t, gh, gw)}, not one frame of whole "
                f"{m} x {m} windows: pass the patch_size= and merge= the tokenizer was given"
            )
        height, width = plane.shape[1:]
        if (height, width) != (gh * p, gw * p):
            raise PatchLayoutError(
                f"{name(i)} is {height} x {width} pixels, but its {gh} x {gw} grid of "
                f"{p}-pixel patches covers {gh * p} x {gw * p}: the tokenizer rounds a side up to "
                f"whole {p * m}-pixel windows. Resize or crop images to multiples of "
                f"patch_size * merge = {p * m} before tokenizing (center_crop, "
                "random_resized_crop), and pass the patch_size= the tokenizer was given"
            )
    counts = grids[:, 1] * grids[:, 2]
    out = np.empty((int(counts.sum()), channels * frames * p * p), dtype=dtype)
    at = 0
    for plane, (_, gh, gw), count in zip(planes, grids.tolist(), counts.tolist(), strict=True):
        # (C, H, W) -> (window row, window column, row in window, column in window, C, py, px)
        windows = plane.reshape(channels, gh // m, m, p, gw // m, m, p).transpose(
            1, 4, 2, 5, 0, 3, 6
        )
        rows = out[at : at + count].reshape(gh // m, gw // m, m, m, channels, frames, p, p)
        rows[...] = windows[:, :, :, :, :, None]  # one copy, the frame broadcast T times
        at += count
    return out
