"""The packed records of finished bins (compiled); ``zephon.ops.packing`` uses it."""

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from zephon._core.records import SampleMeta, SampleRecord

def packed_records(
    blocks: list[npt.NDArray[np.int32]],
    bin_records: list[list[SampleRecord]],
    frags: npt.NDArray[np.int64],
    lane_id: int,
    sides: tuple[tuple[str, bool], ...],
    spread: Callable[[SampleMeta, int, int, int, dict[Any, int], dict[Any, int] | None], None],
) -> list[SampleRecord]:
    """One packed ``SampleRecord`` per bin ``BinFill.take`` handed over: payload row views of its
    block, primary cursor, contributors (closing only where a fragment ends its input) and the
    mixture heritage counts; ``spread`` counts a fragment of an input of several components."""
