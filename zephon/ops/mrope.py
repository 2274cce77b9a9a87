"""M-RoPE position ids: the ``(3, B, L)`` temporal / height / width positions of packed
vision-language rows, as Qwen2-VL and the open VLMs after it take them.

Within each packed segment (positions restart at 0 at every segment, like the 1-D ones):

- a text token (an image's start and end tokens included) has one position ``p`` on all three
  components, and the next token gets ``p + 1``;
- an image whose patch grid is ``(t, gh, gw)`` and whose ``m x m`` patches are merged into one
  token is ``t * (gh/m) * (gw/m)`` image tokens in ``t``, row, column order; the token at
  ``(ti, hi, wi)`` of an image starting where the next text position would be ``s`` gets
  ``(s + ti, s + hi, s + wi)``, and the text after it continues at the largest of them plus one,
  ``s + max(t, gh/m, gw/m)``.

Padding keeps its 1-D position on all three components.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from zephon.types import SampleCursor

__all__ = ["mrope_positions"]


def _image_block(
    tokens: np.ndarray,
    lo: int,
    hi: int,
    grid: Sequence[int],
    merge: int,
    image_token_id: int,
    where: str,
) -> tuple[int, int, int, int]:
    """``(first, t, h, w)``: where the image tokens of span ``[lo, hi)`` start and the merged grid
    they are laid out on; the span may hold one start and one end token around them."""
    t, gh, gw = (int(v) for v in grid)
    if t < 1 or gh < 1 or gw < 1 or gh % merge or gw % merge:
        raise ValueError(
            f"{where}: image_grid_thw {[t, gh, gw]} is not a grid of whole {merge} x {merge} "
            f"merges (pass the merge= the tokenizer used)"
        )
    h, w = gh // merge, gw // merge
    n = t * h * w
    first = lo if tokens[lo] == image_token_id else lo + 1
    run = tokens[first : first + n]
    if hi - first - n not in (0, 1) or len(run) != n or np.any(run != image_token_id):
        raise ValueError(
            f"{where}: span [{lo}, {hi}) does not hold the {n} image tokens "
            f"(id {image_token_id}) of grid {[t, gh, gw]} merged {merge} x {merge}, between at "
            f"most one start and one end token (pass the image_token_id= and merge= the "
            f"tokenizer used)"
        )
    return first, t, h, w


def mrope_positions(
    tokens: np.ndarray,
    segments: np.ndarray,
    positions: np.ndarray,
    spans: Sequence[np.ndarray | None],
    grids: Sequence[np.ndarray | None],
    cursors: Sequence[SampleCursor],
    *,
    merge: int,
    image_token_id: int,
) -> np.ndarray:
    """The ``(3, B, L)`` int64 M-RoPE positions of ``B`` packed rows of ``L`` tokens (see the
    module docstring): ``tokens``, ``segments`` and ``positions`` are the rows' ``(B, L)`` token
    ids, segment ids and 1-D positions; ``spans[r]`` / ``grids[r]`` row ``r``'s image spans
    ``(k, 2)`` and patch grids ``(k, 3)`` (``None`` for a row without images); ``cursors[r]``
    names row ``r`` in errors."""
    out = np.repeat(positions.astype(np.int64)[None], 3, axis=0)
    length = tokens.shape[1]
    for r, (row_spans, row_grids) in enumerate(zip(spans, grids, strict=True)):
        if row_spans is None or not len(row_spans):
            continue
        where = f"training_collate: record {cursors[r]!r}"
        pairs = np.asarray(row_spans).reshape(-1, 2).tolist()
        if row_grids is None or len(np.asarray(row_grids).reshape(-1, 3)) != len(pairs):
            raise ValueError(
                f"{where}: M-RoPE positions need each image's patch grid (image_grid_thw), and "
                f"the row has {len(pairs)} image spans but "
                f"{0 if row_grids is None else len(row_grids)} grids (tokenize with patch_size=)"
            )
        row_segments = segments[r]
        # Where each segment ends: an image's shift reaches to the end of its own segment only.
        changes = np.flatnonzero(row_segments[1:] != row_segments[:-1]) + 1
        for (lo, hi), grid in zip(pairs, np.asarray(row_grids).reshape(-1, 3).tolist()):
            first, t, h, w = _image_block(tokens[r], lo, hi, grid, merge, image_token_id, where)
            n = t * h * w
            after = first + n
            end = changes[np.searchsorted(changes, first, side="right") :]
            segment_end = int(end[0]) if len(end) else length
            start = out[0, r, first]  # the text position the image's first token would have
            ti, hi_, wi = np.unravel_index(np.arange(n), (t, h, w))
            out[0, r, first:after] = start + ti
            out[1, r, first:after] = start + hi_
            out[2, r, first:after] = start + wi
            # The 1-D positions after the image advance by n; M-RoPE ones by max(t, h, w).
            out[:, r, after:segment_end] += max(t, h, w) - n
    return out
