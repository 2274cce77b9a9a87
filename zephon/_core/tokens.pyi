"""Token ids into ``int32`` arrays (compiled); ``zephon.ops.tokenize`` uses them per call."""

from typing import Any

import numpy as np

from zephon._core.records import SampleRecord

UNDECIDED: object

def int32_ids(ids: list[int], eos: int | None, limit: int | None) -> np.ndarray | Any: ...
def tokenized_records(
    records: list[SampleRecord], encoded: list[Any], field: str, eos: int | None, limit: int | None
) -> list[SampleRecord]: ...
def document_views(
    out: list[Any],
    positions: np.ndarray,
    block: np.ndarray,
    starts: np.ndarray,
    lengths: np.ndarray,
    field: str,
) -> None: ...
