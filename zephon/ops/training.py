"""``training_collate``: packed rows to what a training step takes: inputs, shifted labels,
positions and the ``cu_seqlens`` / ``max_seqlen`` of variable-length attention kernels.

Numpy out; ``zephon.integrations.torch`` turns the arrays into tensors (``as_torch_dataset``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from zephon.types import SampleRecord
from zephon.validation import check_int

__all__ = ["TrainingCollate", "training_collate"]

_ROW_FIELDS = ("tokens", "segment_ids", "positions")


class TrainingCollate:
    """A ``batch(n, collate=...)`` collate for packed rows (``pack_sequences`` / ``pack_flat``
    payloads). Per row of ``L`` tokens:

    - ``input_ids``: the tokens (int64, ``(B, L)``);
    - ``labels``: already shifted, ``labels[t]`` is the token at ``t + 1``, the target of the
      prediction made at ``t``; ``ignore_index`` where ``t + 1`` is padding, starts another
      segment (a document's first token is never predicted from the one before), or has
      ``mask == 0``, and at the last position (int64; use a loss that does not shift again);
    - ``position_ids``: positions restarting at 0 per segment (int64);
    - ``segment_ids``: as packed (int32);
    - ``cu_seqlens``: the starts of the segments of the flattened ``(B * L,)`` batch plus its end
      (int32): a new segment at every row start and every change of segment id, padding runs
      counting as segments of their own (their labels are all ignored), so
      ``cu_seqlens[-1] == B * L``; ``max_seqlen``: the longest of them (an int).
    """

    def __init__(self, mask_field: str | None = "loss_mask", ignore_index: int = -100):
        if mask_field is not None and not isinstance(mask_field, str):
            raise TypeError(
                f"training_collate: mask_field must be a str or None, got {mask_field!r}"
            )
        self.mask_field = mask_field
        self.ignore_index = check_int(
            ignore_index, "ignore_index", "training_collate", minimum=-(2**63), maximum=2**63 - 1
        )

    def _column(self, records: Sequence[SampleRecord], name: str) -> np.ndarray:
        rows = []
        for rec in records:
            payload = rec.payload
            value = payload.get(name) if isinstance(payload, dict) else None
            if value is None:
                fields = list(payload) if isinstance(payload, dict) else type(payload).__name__
                hint = (
                    " (pass mask_field=None to train on every token)"
                    if name == self.mask_field
                    else " (training_collate takes packed rows: pack_sequences or pack_flat)"
                )
                raise ValueError(
                    f"training_collate: record {rec.meta.cursor!r} has no field {name!r} "
                    f"(it has {fields}){hint}"
                )
            rows.append(np.asarray(value))
        lengths = {r.shape for r in rows}
        if len(lengths) != 1 or rows[0].ndim != 1:
            raise ValueError(
                f"training_collate: field {name!r} must be 1-D rows of one length, got shapes "
                f"{sorted(lengths)}"
            )
        return np.stack(rows)

    def __call__(self, records: Sequence[SampleRecord]) -> dict[str, Any]:
        if not records:
            raise ValueError("training_collate: an empty batch")
        tokens = self._column(records, "tokens")
        segments = self._column(records, "segment_ids")
        positions = self._column(records, "positions")
        if not tokens.shape == segments.shape == positions.shape:
            raise ValueError(
                f"training_collate: tokens {tokens.shape}, segment_ids {segments.shape} and "
                f"positions {positions.shape} differ in shape"
            )
        n_rows, length = tokens.shape
        # The target of position t is token t + 1 of the same (real) segment, when trained on.
        target = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] != 0)
        if self.mask_field is not None:
            mask = self._column(records, self.mask_field)
            if mask.shape != tokens.shape:
                raise ValueError(
                    f"training_collate: {self.mask_field!r} has shape {mask.shape}, tokens "
                    f"{tokens.shape}"
                )
            target &= mask[:, 1:] != 0
        labels = np.full((n_rows, length), self.ignore_index, dtype=np.int64)
        labels[:, :-1] = np.where(target, tokens[:, 1:], self.ignore_index)
        # Segment starts in the flattened batch: every row start and every change of segment id.
        flat = segments.reshape(-1)
        starts = np.ones(flat.shape, dtype=bool)
        starts[1:] = flat[1:] != flat[:-1]
        starts[::length] = True
        cu_seqlens = np.append(np.flatnonzero(starts), flat.size).astype(np.int32)
        return {
            "input_ids": tokens.astype(np.int64),
            "labels": labels,
            "position_ids": positions.astype(np.int64),
            "segment_ids": segments.astype(np.int32, copy=False),
            "cu_seqlens": cu_seqlens,
            "max_seqlen": int(np.diff(cu_seqlens).max()),
        }

    def __repr__(self) -> str:
        return f"training_collate(mask_field={self.mask_field!r}, ignore_index={self.ignore_index})"


def training_collate(
    *, mask_field: str | None = "loss_mask", ignore_index: int = -100
) -> TrainingCollate:
    """A collate for ``batch(n, collate=training_collate())`` after a packer: per packed row
    ``input_ids``, shifted ``labels`` (``ignore_index`` on padding, segment boundaries and where
    ``payload[mask_field] == 0``; ``mask_field=None`` trains on every real token),
    ``position_ids``, ``segment_ids``, and the batch's ``cu_seqlens`` / ``max_seqlen`` (see
    ``TrainingCollate``). Numpy arrays; ``as_torch_dataset`` yields them as tensors."""
    return TrainingCollate(mask_field=mask_field, ignore_index=ignore_index)
