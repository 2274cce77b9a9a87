"""Pointer rows checked against their source (compiled); ``zephon.sources.base`` uses it."""

import numpy as np

def first_foreign_row(rows: np.ndarray, dataset_id: int, num_samples: int) -> int: ...
