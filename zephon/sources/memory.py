"""In-memory sources: a range of integers and a Python sequence."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from zephon.identity import identify
from zephon.sources.base import IndexedSource
from zephon.validation import check_int

__all__ = ["ListSource", "RangeSource"]

#: How many items from each end of a ListSource enter its content fingerprint.
FINGERPRINT_EDGE = 8


class RangeSource(IndexedSource):
    """The samples ``0..n-1``; the payload of sample ``idx`` is ``make(idx)``, or ``{"idx": idx}``.

    Holds no data, so any ``n`` (up to 2**62) costs nothing until chunks are read.
    """

    def __init__(
        self,
        n: int,
        *,
        dataset_id: int = 0,
        make: Callable[[int], Any] | None = None,
        chunk_size: int = 1024,
        shuffle: bool = False,
        seed: int = 0,
        passes: int | None = 1,
    ) -> None:
        n = check_int(n, "n", "RangeSource", minimum=0)
        if make is not None and not callable(make):
            raise TypeError(f"RangeSource: make must be callable or None, got {make!r}")
        self._n = int(n)
        self.make = make
        super().__init__(
            dataset_id=dataset_id, chunk_size=chunk_size, shuffle=shuffle, seed=seed, passes=passes
        )

    def num_samples(self) -> int:
        """``n``: the samples per pass."""
        return self._n

    def read(self, pointers: np.ndarray) -> list[Any]:
        """``make(idx)`` (or ``{"idx": idx}``) for each row's sample_idx, in row order."""
        if self.make is None:
            return self._sample_index_list(pointers, "idx")
        make = self.make
        return [make(i) for i in self._sample_index_list(pointers)]

    def describe(self) -> dict[str, Any]:
        """Class, size, chunking/shuffle parameters and the identity of ``make`` (its code,
        defaults and closure; see ``zephon.identity``)."""
        out = self._describe_base()
        out["make"] = identify(self.make, where="source RangeSource parameter 'make'")
        return out


class ListSource(IndexedSource):
    """An in-memory sequence; the payload of sample ``idx`` is ``items[idx]``.

    The sequence is held by reference (not copied) and must not change while the source is in use:
    its fingerprint is taken once, at construction, and an item the fingerprint cannot identify
    (see ``content_fingerprint``) is a ``PlanError`` then.
    """

    def __init__(
        self,
        items: Iterable[Any],
        *,
        dataset_id: int = 0,
        chunk_size: int = 1024,
        shuffle: bool = False,
        seed: int = 0,
        passes: int | None = 1,
    ) -> None:
        seq: Any = items
        if isinstance(seq, (str, bytes)) or not (
            hasattr(seq, "__len__") and hasattr(seq, "__getitem__")
        ):
            seq = list(seq)
        self.items: Any = seq
        self._n = len(seq)
        super().__init__(
            dataset_id=dataset_id, chunk_size=chunk_size, shuffle=shuffle, seed=seed, passes=passes
        )
        self._fingerprint = content_fingerprint(seq)

    def num_samples(self) -> int:
        """``len(items)``: the samples per pass."""
        return self._n

    def read(self, pointers: np.ndarray) -> list[Any]:
        """``items[idx]`` for each row's sample_idx, in row order."""
        items = self.items
        if type(items) is list:  # in one compiled pass with the pointers' check
            return self._own_list_items(pointers, items)
        return [items[i] for i in self._sample_index_list(pointers)]

    def describe(self) -> dict[str, Any]:
        """Class, length, chunking/shuffle parameters and a content fingerprint (see
        ``content_fingerprint``)."""
        out = self._describe_base()
        out["len"] = self._n
        out["fingerprint"] = self._fingerprint
        return out


def content_fingerprint(items: Sequence[Any], edge: int = FINGERPRINT_EDGE) -> str:
    """A cheap, process-independent sha256 of a sequence: its length and the identity
    (``zephon.identity.identify``) of its first and last ``edge`` items. Changes in the middle of
    a long sequence are not seen -- cheapness over completeness; a different length or different
    ends always give a different fingerprint. An item that cannot be identified (an object with
    hidden state) raises ``PlanError`` naming its index."""
    n = len(items)
    picked = range(n) if n <= 2 * edge else [*range(edge), *range(n - edge, n)]
    h = hashlib.sha256(f"len={n}".encode())
    for i in picked:
        h.update(b"\x00")
        identity = identify(items[i], where=f"source ListSource item {i}")
        h.update(json.dumps(identity, sort_keys=True, separators=(",", ":")).encode())
    return h.hexdigest()
