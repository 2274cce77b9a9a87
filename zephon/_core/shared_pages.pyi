"""Pages of a mapping shared with a worker process (compiled)."""

import mmap

import numpy as np
import numpy.typing as npt
from typing_extensions import Self, disjoint_base

@disjoint_base
class SharedPages:
    """``size`` bytes from ``start`` of a writable mapping, held exported while this lives."""

    def __new__(cls, mapping: mmap.mmap, start: int, size: int) -> Self: ...

def shared_region(mapping: mmap.mmap, start: int, size: int) -> npt.NDArray[np.uint8]:
    """A writable uint8 array of ``size`` bytes from ``start`` of ``mapping``, based on a
    ``SharedPages``."""
