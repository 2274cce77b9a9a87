"""``training_collate``: packed rows to what a training step takes: inputs, labels, positions,
the ``cu_seqlens`` / ``max_seqlen`` of variable-length attention kernels and the number of tokens
trained on, in the dtypes, layout and names the model takes.

Numpy out; ``zephon.integrations.torch`` turns the arrays into tensors (``as_torch_dataset``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from zephon.errors import PatchLayoutError
from zephon.ops.mrope import mrope_positions
from zephon.ops.patches import image_patches
from zephon.ops.vision import IMAGE_GRID_FIELD, IMAGE_SPANS_FIELD, image_size
from zephon.types import SampleRecord
from zephon.validation import check_int

__all__ = ["TrainingCollate", "training_collate"]

_ROW_FIELDS = ("tokens", "segment_ids", "positions")
_POSITIONS = ("1d", "mrope")
_PIXEL_LAYOUTS = ("images", "patches")


class TrainingCollate:
    """A ``batch(n, collate=...)`` collate for packed rows (``pack_sequences`` / ``pack_flat``
    payloads). Per row of ``L`` tokens:

    - ``input_ids``: the tokens (``(B, L)``);
    - ``labels``: with ``shift_labels=True`` (the default) already shifted, ``labels[t]`` is the
      token at ``t + 1``, the target of the prediction made at ``t``, and ``ignore_index`` at the
      last position (use a loss that does not shift again); with ``shift_labels=False`` the
      targets stay in place, ``labels[t]`` is the token at ``t`` (for models whose loss shifts
      them). Either way a token is a target only when it is real (not padding), is not the
      first of its segment (a document's first token is never predicted from the one before),
      has ``mask != 0``, and, with ``train_on_eos=False``, is not ``eos_id``;
    - ``position_ids``: positions restarting at 0 per segment;
    - ``segment_ids``: as packed (int32);
    - ``cu_seqlens``: the starts of the segments of the flattened ``(B * L,)`` batch plus its end
      (int32): a new segment at every row start and every change of segment id, padding runs
      counting as segments of their own (their labels are all ignored), so
      ``cu_seqlens[-1] == B * L``; ``max_seqlen``: the longest of them (an int);
    - ``num_valid_tokens``: the number of labels that are not ``ignore_index`` (an int), to
      normalize a summed loss by the tokens trained on.

    Rows that carry images (``pack_sequences(..., images=...)``) need ``images="images"`` (the
    rows' image field; without it they are refused rather than batched without their pixels) and
    never train on a token of an image's span, whatever the mask says. The batch then also gets,
    over the images of its rows in row order:

    - ``pixel_values``: the images stacked (``(N, *shape)``) when they all have one shape, else
      every image's pixels flattened in C order and concatenated (1-D; image ``i`` is the next
      ``prod(shape)`` values, its shape from ``image_sizes`` and the channels); a batch without
      images gets an empty 1-D float32 array. With ``pixel_layout="patches"`` (and
      ``patch_size=``, ``merge=``, as given to the tokenizer) they are instead the flattened
      patches a Qwen2-VL-style vision tower takes, ``(sum(gh*gw), C*T*p*p)`` in its image
      processor's layout (``T = temporal_patch_size``; ``zephon.ops.patches``): each image must
      then be exactly its grid's ``gh*p x gw*p`` pixels (``PatchLayoutError`` otherwise), and a
      batch without images gets ``(0, 3*T*p*p)`` float32;
    - ``image_sizes``: ``(N, 2)`` int64 ``(height, width)``;
    - ``image_grid_thw``: ``(N, 3)`` int64, when the rows carry it (``patch_size`` tokenization);
    - ``image_to_row``: ``(N,)`` int64, the batch row of each image.

    With ``positions="mrope"`` (with ``merge=`` and ``image_token_id=``, as given to the
    tokenizer) ``position_ids`` are the M-RoPE positions of Qwen2-VL-style models, ``(3, B, L)``
    (temporal, height, width; ``zephon.ops.mrope``): text advances all three together, an image's
    tokens take their place in its merged grid, and every segment starts at 0 again
    (``(3, 1, B * L)`` with ``layout="flat"``). The 1-D positions are then ``text_position_ids``.

    ``input_ids``, ``labels`` and ``position_ids`` are ``dtype`` (int64 or int32). With
    ``layout="flat"`` every per-token array is ``(1, B * L)`` (one long sequence, as
    variable-length attention takes it) instead of ``(B, L)``. ``rename`` maps output names to
    the names the model takes (``{"input_ids": "tokens"}``).
    """

    _OUTPUTS = (
        "input_ids",
        "labels",
        "position_ids",
        "segment_ids",
        "cu_seqlens",
        "max_seqlen",
        "num_valid_tokens",
        "pixel_values",
        "image_sizes",
        "image_grid_thw",
        "image_to_row",
        "text_position_ids",
    )
    # Options left at these values stay out of the identity, so pipelines made before they
    # existed keep their fingerprint (and their checkpoints).
    _DEFAULTS: dict[str, Any] = {
        "shift_labels": True,
        "train_on_eos": True,
        "eos_id": None,
        "dtype": "int64",
        "layout": "rows",
        "rename": {},
        "images": None,
        "positions": "1d",
        "merge": None,
        "image_token_id": None,
        "pixel_layout": "images",
        "patch_size": None,
        "temporal_patch_size": 2,
    }

    def __init__(
        self,
        mask_field: str | None = "loss_mask",
        ignore_index: int = -100,
        *,
        shift_labels: bool = True,
        train_on_eos: bool = True,
        eos_id: int | None = None,
        dtype: str = "int64",
        layout: str = "rows",
        rename: Mapping[str, str] | None = None,
        images: str | None = None,
        positions: str = "1d",
        merge: int | None = None,
        image_token_id: int | None = None,
        pixel_layout: str = "images",
        patch_size: int | None = None,
        temporal_patch_size: int = 2,
    ):
        where = "training_collate"
        if images is not None and not isinstance(images, str):
            raise TypeError(f"{where}: images must name the rows' image field, got {images!r}")
        if mask_field is not None and not isinstance(mask_field, str):
            raise TypeError(f"{where}: mask_field must be a str or None, got {mask_field!r}")
        self.mask_field = mask_field
        self.ignore_index = check_int(
            ignore_index, "ignore_index", where, minimum=-(2**63), maximum=2**63 - 1
        )
        for name, flag in (("shift_labels", shift_labels), ("train_on_eos", train_on_eos)):
            if not isinstance(flag, bool):
                raise TypeError(f"{where}: {name} must be True or False, got {flag!r}")
        if not train_on_eos and eos_id is None:
            raise ValueError(f"{where}: train_on_eos=False needs eos_id= (the id not to train on)")
        if eos_id is not None:
            eos_id = check_int(eos_id, "eos_id", where, minimum=0, maximum=2**31 - 1)
        if positions not in _POSITIONS:
            raise ValueError(
                f"{where}: positions must be one of {', '.join(map(repr, _POSITIONS))}, got "
                f"{positions!r}"
            )
        if positions == "mrope":
            if merge is None or image_token_id is None:
                raise ValueError(
                    f"{where}: positions='mrope' needs merge= and image_token_id=, the ones the "
                    "tokenizer was given (an image's grid and its tokens are read with them)"
                )
            merge = check_int(merge, "merge", where, minimum=1)
            image_token_id = check_int(
                image_token_id, "image_token_id", where, minimum=0, maximum=2**31 - 1
            )
        elif image_token_id is not None or (merge is not None and pixel_layout != "patches"):
            raise ValueError(
                f"{where}: merge= and image_token_id= go with positions='mrope' (merge= also with "
                "pixel_layout='patches')"
            )
        if pixel_layout not in _PIXEL_LAYOUTS:
            raise ValueError(
                f"{where}: pixel_layout must be one of {', '.join(map(repr, _PIXEL_LAYOUTS))}, "
                f"got {pixel_layout!r}"
            )
        if pixel_layout == "patches":
            if images is None or patch_size is None or merge is None:
                raise ValueError(
                    f"{where}: pixel_layout='patches' needs images= and the patch_size= and merge= "
                    "the tokenizer was given (each image is cut into the patches its tokens stand "
                    "for)"
                )
            patch_size = check_int(patch_size, "patch_size", where, minimum=1)
            merge = check_int(merge, "merge", where, minimum=1)
            temporal_patch_size = check_int(
                temporal_patch_size, "temporal_patch_size", where, minimum=1
            )
        elif patch_size is not None or temporal_patch_size != 2:
            raise ValueError(
                f"{where}: patch_size= and temporal_patch_size= go with pixel_layout='patches'"
            )
        if dtype not in ("int64", "int32"):
            raise ValueError(f"{where}: dtype must be 'int64' or 'int32', got {dtype!r}")
        if dtype == "int32" and not -(2**31) <= self.ignore_index < 2**31:
            raise ValueError(
                f"{where}: ignore_index {self.ignore_index} does not fit dtype='int32' labels; "
                "pass an int32 ignore_index (-100 is the usual one) or dtype='int64'"
            )
        if layout not in ("rows", "flat"):
            raise ValueError(f"{where}: layout must be 'rows' or 'flat', got {layout!r}")
        renamed = dict(rename or {})
        unknown = sorted(set(renamed) - set(self._OUTPUTS))
        names = [renamed.get(k, k) for k in self._OUTPUTS]
        if unknown or not all(isinstance(v, str) for v in renamed.values()):
            raise ValueError(
                f"{where}: rename maps output names ({', '.join(self._OUTPUTS)}) to str, got "
                f"{rename!r}"
            )
        if len(set(names)) != len(names):
            raise ValueError(f"{where}: rename gives two outputs one name: {rename!r}")
        self.shift_labels = shift_labels
        self.train_on_eos = train_on_eos
        self.eos_id = eos_id
        self.dtype = dtype
        self.layout = layout
        self.rename = renamed
        self.images = images
        self.positions = positions
        self.merge = merge
        self.image_token_id = image_token_id
        self.pixel_layout = pixel_layout
        self.patch_size = patch_size
        self.temporal_patch_size = temporal_patch_size

    def __getstate__(self) -> dict[str, Any]:
        return {
            k: v
            for k, v in self.__dict__.items()
            if k not in self._DEFAULTS or v != self._DEFAULTS[k]
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({**self._DEFAULTS, "rename": {}, **state})

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
        # Token t + 1 is a target (of the prediction made at t) when it is real, of the same
        # segment as token t, and trained on.
        target = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] != 0)
        if self.mask_field is not None:
            mask = self._column(records, self.mask_field)
            if mask.shape != tokens.shape:
                raise ValueError(
                    f"training_collate: {self.mask_field!r} has shape {mask.shape}, tokens "
                    f"{tokens.shape}"
                )
            target &= mask[:, 1:] != 0
        if not self.train_on_eos:
            target &= tokens[:, 1:] != self.eos_id
        spans = [rec.payload.get(IMAGE_SPANS_FIELD) for rec in records]
        if any(s is not None and len(s) for s in spans):
            if self.images is None:  # the model would get image tokens without their pixels
                raise ValueError(
                    "training_collate: the rows carry images (image_spans); pass images= (the "
                    "rows' image field, as given to pack_sequences) to batch their pixels"
                )
            in_image = np.zeros(tokens.shape, dtype=bool)
            for r, row_spans in enumerate(spans):
                for lo, hi in (
                    np.asarray(row_spans).reshape(-1, 2).tolist() if row_spans is not None else ()
                ):
                    in_image[r, lo:hi] = True
            target &= ~in_image[:, 1:]
        dtype = np.dtype(self.dtype)
        labels = np.full((n_rows, length), self.ignore_index, dtype=dtype)
        shifted = labels[:, :-1] if self.shift_labels else labels[:, 1:]
        shifted[...] = np.where(target, tokens[:, 1:], self.ignore_index)
        # Segment starts in the flattened batch: every row start and every change of segment id.
        flat = segments.reshape(-1)
        starts = np.ones(flat.shape, dtype=bool)
        starts[1:] = flat[1:] != flat[:-1]
        starts[::length] = True
        cu_seqlens = np.append(np.flatnonzero(starts), flat.size).astype(np.int32)
        shape = (1, n_rows * length) if self.layout == "flat" else (n_rows, length)
        out = {
            "input_ids": tokens.astype(dtype).reshape(shape),
            "labels": labels.reshape(shape),
            "position_ids": self._position_ids(records, tokens, segments, positions, shape),
            "segment_ids": segments.astype(np.int32, copy=False).reshape(shape),
            "cu_seqlens": cu_seqlens,
            "max_seqlen": int(np.diff(cu_seqlens).max()),
            "num_valid_tokens": int(np.count_nonzero(target)),
        }
        if self.positions == "mrope":
            out["text_position_ids"] = positions.astype(dtype).reshape(shape)
        if self.images is not None:
            out.update(self._images(records))
        rename = self.rename
        return {rename.get(k, k): v for k, v in out.items()} if rename else out

    def _position_ids(
        self,
        records: Sequence[SampleRecord],
        tokens: np.ndarray,
        segments: np.ndarray,
        positions: np.ndarray,
        shape: tuple[int, int],
    ) -> np.ndarray:
        """``position_ids``: the 1-D positions, or the M-RoPE ones (``(3, *shape)``)."""
        dtype = np.dtype(self.dtype)
        if self.positions == "1d":
            return positions.astype(dtype).reshape(shape)
        assert self.merge is not None and self.image_token_id is not None
        mrope = mrope_positions(
            tokens,
            segments,
            positions,
            [rec.payload.get(IMAGE_SPANS_FIELD) for rec in records],
            [rec.payload.get(IMAGE_GRID_FIELD) for rec in records],
            [rec.meta.cursor for rec in records],
            merge=self.merge,
            image_token_id=self.image_token_id,
        )
        return mrope.astype(dtype, copy=False).reshape(3, *shape)

    def _images(self, records: Sequence[SampleRecord]) -> dict[str, np.ndarray]:
        """The batch's image outputs (see the class docstring)."""
        images: list[np.ndarray] = []
        rows: list[int] = []
        grids: list[np.ndarray] = []
        has_grid = self.pixel_layout == "patches"
        for r, rec in enumerate(records):
            payload = rec.payload
            if not isinstance(payload, dict) or self.images not in payload:
                raise ValueError(
                    f"training_collate: record {rec.meta.cursor!r} has no field {self.images!r} "
                    "(pack with pack_sequences(..., images=...) so rows carry their images)"
                )
            held = list(payload[self.images])
            images += [np.asarray(image) for image in held]
            rows += [r] * len(held)
            grid = payload.get(IMAGE_GRID_FIELD)
            if grid is not None:
                has_grid = True
                grids.append(np.asarray(grid, dtype=np.int64).reshape(-1, 3))
            if self.pixel_layout == "patches" and len(held) != (
                0 if grid is None else len(grids[-1])
            ):
                raise PatchLayoutError(
                    f"training_collate: record {rec.meta.cursor!r} holds {len(held)} images in "
                    f"{self.images!r} and {0 if grid is None else len(grids[-1])} patch grids "
                    f"({IMAGE_GRID_FIELD}): pixel_layout='patches' cuts each image by its grid "
                    "(tokenize with patch_size=)"
                )
        if self.pixel_layout == "patches":
            pixels = self._patches(records, images, grids, rows)
        elif len({image.shape for image in images}) == 1:
            pixels = np.stack(images)
        elif images:
            pixels = np.concatenate([image.reshape(-1) for image in images])
        else:
            pixels = np.empty(0, dtype=np.float32)
        out = {
            "pixel_values": pixels,
            "image_sizes": np.array(
                [image_size(image) for image in images], dtype=np.int64
            ).reshape(-1, 2),
            "image_to_row": np.array(rows, dtype=np.int64),
        }
        if has_grid:
            out["image_grid_thw"] = np.concatenate(grids) if grids else np.empty((0, 3), np.int64)
        return out

    def _patches(
        self,
        records: Sequence[SampleRecord],
        images: list[np.ndarray],
        grids: list[np.ndarray],
        rows: list[int],
    ) -> np.ndarray:
        """``pixel_values`` with ``pixel_layout="patches"``: ``images`` (of batch rows ``rows``)
        cut by their ``grids``, an image that does not fit named by its record and place."""
        assert self.patch_size is not None and self.merge is not None

        def name(i: int) -> str:
            return (
                f"training_collate: image {i - rows.index(rows[i])} in {self.images!r} of record "
                f"{records[rows[i]].meta.cursor!r} (batch row {rows[i]}, image {i} of the batch)"
            )

        return image_patches(
            images,
            np.concatenate(grids) if grids else np.empty((0, 3), np.int64),
            patch_size=self.patch_size,
            merge=self.merge,
            temporal_patch_size=self.temporal_patch_size,
            name=name,
        )

    def __repr__(self) -> str:
        options = "".join(
            f", {k}={v!r}" for k, v in self.__getstate__().items() if k in self._DEFAULTS
        )
        return (
            f"training_collate(mask_field={self.mask_field!r}, ignore_index={self.ignore_index}"
            f"{options})"
        )


def training_collate(
    *,
    mask_field: str | None = "loss_mask",
    ignore_index: int = -100,
    shift_labels: bool = True,
    train_on_eos: bool = True,
    eos_id: int | None = None,
    dtype: str = "int64",
    layout: str = "rows",
    rename: Mapping[str, str] | None = None,
    images: str | None = None,
    positions: str = "1d",
    merge: int | None = None,
    image_token_id: int | None = None,
    pixel_layout: str = "images",
    patch_size: int | None = None,
    temporal_patch_size: int = 2,
) -> TrainingCollate:
    """A collate for ``batch(n, collate=training_collate())`` after a packer: per packed row
    ``input_ids``, ``labels`` (``ignore_index`` on padding, segment starts and where
    ``payload[mask_field] == 0``; ``mask_field=None`` trains on every real token; shifted by
    one unless ``shift_labels=False``; ``train_on_eos=False`` with ``eos_id=`` also ignores the
    end-of-sequence targets), ``position_ids``, ``segment_ids``, the batch's ``cu_seqlens`` /
    ``max_seqlen`` and ``num_valid_tokens``; ``dtype``, ``layout="flat"`` (``(1, B*L)``) and
    ``rename`` shape them for the model (see ``TrainingCollate``). ``images="images"`` adds the
    rows' images: ``pixel_values``, ``image_sizes``, ``image_grid_thw`` and ``image_to_row``;
    image spans are never trained on (see ``TrainingCollate``). ``positions="mrope"`` with
    ``merge=`` and ``image_token_id=`` (the tokenizer's) makes ``position_ids`` the ``(3, B, L)``
    M-RoPE positions of Qwen2-VL-style models and adds the 1-D ones as ``text_position_ids``.
    ``pixel_layout="patches"`` with ``patch_size=`` and ``merge=`` (the tokenizer's) gives
    ``pixel_values`` as such a model's vision tower takes them: flattened patches in its image
    processor's layout, the frame repeated ``temporal_patch_size`` times (see
    ``zephon.ops.patches``). Numpy arrays; ``as_torch_dataset`` yields them as tensors."""
    return TrainingCollate(
        mask_field=mask_field,
        ignore_index=ignore_index,
        shift_labels=shift_labels,
        train_on_eos=train_on_eos,
        eos_id=eos_id,
        dtype=dtype,
        layout=layout,
        rename=rename,
        images=images,
        positions=positions,
        merge=merge,
        image_token_id=image_token_id,
        pixel_layout=pixel_layout,
        patch_size=patch_size,
        temporal_patch_size=temporal_patch_size,
    )
