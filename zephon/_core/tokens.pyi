"""Token ids into one ``int32`` array (compiled); ``zephon.ops.tokenize`` uses it per document."""

from typing import Any

import numpy as np

UNDECIDED: object

def int32_ids(ids: list[int], eos: int | None, limit: int | None) -> np.ndarray | Any: ...
