from collections.abc import Iterable, Sequence
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from typing_extensions import Self, disjoint_base

_Int64Array = npt.NDArray[np.int64]
_Int32Array = npt.NDArray[np.int32]

def token_lengths(arrays: list[_Int32Array]) -> _Int64Array:
    """Lengths of 1-D, C-contiguous, native-order int32 arrays; TypeError naming a bad one."""

def field_lengths(
    arrays: list[npt.NDArray[Any]], dtype: Literal["int32", "float32"]
) -> _Int64Array:
    """Lengths of 1-D, C-contiguous, native-order ``dtype`` arrays; TypeError naming a bad one."""

def payload_fields(
    records: list[Any], field: str, sides: tuple[tuple[str, Literal["int32", "float32"]], ...]
) -> tuple[list[_Int32Array], _Int64Array, list[list[npt.NDArray[Any]]]] | None:
    """A packer's token arrays, their lengths and its side fields' arrays, read from dict payloads
    already in shape (1-D, C-contiguous, native, of the right dtype and length); None otherwise."""

def warm_arena_bytes() -> int:
    """Bytes of the arenas this process keeps for its next fills (64 MiB at most)."""

def release_warm_arenas() -> int:
    """Drop the arenas kept for the process's next fills; the bytes they held."""

@disjoint_base
class RowArena:
    """Memory that ``BinFill.take`` writes bins into one after another, field by field: the base
    of every block and row view it hands over (a batch of rows back to back is a view of it)."""

def held_arena_bytes(fills: Iterable[BinFill]) -> int:
    """Bytes of the arenas ``fills`` hold for their rows (the one each writes and those views held
    when last checked), arenas fills share counted once."""

@disjoint_base
class RowArenas:
    """The arenas a ``BinFill`` writes bins into, shared by the fills made with ``arenas_of``."""

@disjoint_base
class BinFill:
    """Fragment lists of a packer's open bins, from placement rows, and their payload blocks.

    ``write`` adds the fragments of a micro-batch's placement rows to their bins, holding the items'
    arrays; ``take`` hands finished bins over as ``(3 + n_side, seq_len)`` int32 blocks (tokens,
    segment_ids, positions, then one row per side field: an int padding value makes an int32 row, a
    float a float32 row stored as its bits), padded, copying the tokens without the GIL into the
    next rows of a ``RowArena``: of its own ``RowArenas``, or those of ``arenas_of`` (a fill of
    the same ``seq_len`` and number of side fields).
    """

    def __new__(
        cls,
        seq_len: int,
        pad_id: int = 0,
        side_pads: Sequence[int | float] = (),
        arenas_of: BinFill | None = None,
    ) -> Self: ...
    @property
    def seq_len(self) -> int: ...
    @property
    def pad_id(self) -> int: ...
    @property
    def side_pads(self) -> tuple[int | float, ...]: ...
    @property
    def side_dtypes(self) -> tuple[Literal["int32", "float32"], ...]: ...
    @property
    def n_open(self) -> int: ...
    def open_bin_ids(self) -> _Int64Array: ...
    def used(self, bin_id: int) -> int: ...
    def contents(self) -> tuple[_Int64Array, list[Any]]: ...
    def write(
        self,
        placements: _Int64Array,
        arrays: list[_Int32Array],
        items: list[Any],
        sides: Sequence[Sequence[npt.NDArray[Any]]] = (),
    ) -> None: ...
    def take(
        self, bin_ids: _Int64Array
    ) -> tuple[list[_Int32Array], list[list[Any]], _Int64Array]: ...
    def clear(self) -> None: ...
