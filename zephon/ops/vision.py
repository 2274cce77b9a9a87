"""Images inside token sequences: how many tokens a vision encoder makes of an image, the span
of ids that stands for it, and ``tokenize_interleaved`` for plain image-text documents.

An image becomes ``[image_start_id] + [image_token_id] * n + [image_end_id]`` (the start and end
ids only when given), ``n`` from the image's height and width as they are when tokenized (after
``decode_images`` and any resize or crop):

- ``patch_size=p, merge=m``: the encoder cuts the image into ``p x p`` patches and merges
  ``m x m`` neighbouring patches into one token, padding the patch grid up to a multiple of ``m``:
  ``n = ceil(h / (p*m)) * ceil(w / (p*m))``, and the grid it reports is ``(1, m*ceil(h / (p*m)),
  m*ceil(w / (p*m)))`` patches (``image_grid_thw``). For images whose sides are multiples of
  ``p*m`` (what Qwen2-VL's own resizing makes) that is exactly Qwen2-VL's ``h*w / (p*m)**2``;
- ``image_tokens=fn``: ``n = fn(h, w)``, for any other scheme (no grid is reported then).

Every record tokenized with images carries ``image_spans``, an ``int32 (k, 2)`` array of the
``[start, end)`` token positions of its images' spans (start and end ids included), in the order of
its images, and with ``patch_size`` ``image_grid_thw`` (``int32 (k, 3)``). The packers keep each
span whole and carry the images with it; ``training_collate`` never trains on a span's tokens.
Token counts (``component_token_counts``) include the image tokens: a mixture by tokens balances
what the model sees.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from zephon._core.records import counted_meta
from zephon.errors import PlanError
from zephon.identity import identify
from zephon.ops.base import Operator, OpTraits, record_error
from zephon.ops.tokenize import (
    ByteTokenizer,
    Tokenize,
    _refuse_batch_padding,
    _refuse_truncation,
    backend_digest,
    find_eos,
    find_pad,
)
from zephon.types import SampleRecord
from zephon.validation import check_int

__all__ = [
    "IMAGE_GRID_FIELD",
    "IMAGE_SPANS_FIELD",
    "ImageTokenCounter",
    "TokenizeInterleaved",
    "image_token_counter",
    "tokenize_interleaved",
]

#: The field of a tokenized or packed record holding its images' ``[start, end)`` token spans.
IMAGE_SPANS_FIELD = "image_spans"
#: The field holding each image's ``(t, h, w)`` patch grid (with ``patch_size``).
IMAGE_GRID_FIELD = "image_grid_thw"


def channels_first(image: np.ndarray) -> np.ndarray:
    """A ``(C, H, W)`` view of a decoded image: float images are ``(C, H, W)`` already (as
    ``normalize`` makes them), ``uint8`` ``(H, W, C)`` / ``(H, W)`` ones (as ``decode_images``
    makes them) are transposed."""
    if image.ndim == 2:
        return image[None]
    return image if image.dtype.kind == "f" else image.transpose(2, 0, 1)


def image_size(image: Any) -> tuple[int, int]:
    """``(height, width)`` of a decoded image (see ``channels_first``)."""
    if not isinstance(image, np.ndarray) or image.ndim not in (2, 3):
        raise TypeError(
            f"an image must be a decoded array (decode_images first), got "
            f"{type(image).__name__} {getattr(image, 'shape', '')}"
        )
    _, height, width = channels_first(image).shape
    return int(height), int(width)


def _token_id(value: Any, name: str, owner: str) -> int:
    return check_int(value, name, owner, minimum=0, maximum=2**31 - 1)


class ImageTokens:
    """How images become token spans (see the module docstring); one instance per tokenizer."""

    def __init__(
        self,
        owner: str,
        image_token_id: int,
        patch_size: int | None,
        merge: int,
        image_tokens: Callable[[int, int], int] | None,
        image_start_id: int | None,
        image_end_id: int | None,
    ):
        ids = {"image_start_id": image_start_id, "image_end_id": image_end_id}
        ids = {k: v if v is None else _token_id(v, k, owner) for k, v in ids.items()}
        self.image_token_id = _token_id(image_token_id, "image_token_id", owner)
        self.start_id, self.end_id = ids["image_start_id"], ids["image_end_id"]
        if (patch_size is None) == (image_tokens is None):
            raise ValueError(
                f"{owner}: pass patch_size= (and merge=) or image_tokens=(h, w) -> int, one of "
                "them, to say how many tokens an image becomes"
            )
        if image_tokens is not None and not callable(image_tokens):
            raise TypeError(f"{owner}: image_tokens must be a function (h, w) -> int")
        self.patch_size = (
            None if patch_size is None else check_int(patch_size, "patch_size", owner, minimum=1)
        )
        self.merge = check_int(merge, "merge", owner, minimum=1)
        self.image_tokens = image_tokens

    def identity(self) -> dict[str, Any]:
        """What the pipeline fingerprint takes of it."""
        return {
            "image_token_id": self.image_token_id,
            "image_start_id": self.start_id,
            "image_end_id": self.end_id,
            "patch_size": self.patch_size,
            "merge": self.merge,
            "image_tokens": self.image_tokens,
        }

    @property
    def has_grid(self) -> bool:
        """Whether records get ``image_grid_thw`` (the patch scheme)."""
        return self.patch_size is not None

    def _cells(self, h: int, w: int) -> tuple[int, int]:
        side = self.patch_size * self.merge  # type: ignore[operator]
        return math.ceil(h / side), math.ceil(w / side)

    def count(self, image: Any) -> int:
        """How many image tokens ``image`` becomes."""
        return self.count_size(*image_size(image))

    def count_size(self, h: int, w: int) -> int:
        """How many image tokens an image of height ``h`` and width ``w`` becomes."""
        if self.image_tokens is None:
            gh, gw = self._cells(h, w)
            return gh * gw
        n = self.image_tokens(h, w)
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"image_tokens({h}, {w}) gave {n!r}, not a token count >= 1")
        return int(n)

    def expand(
        self, ids: np.ndarray, mask: np.ndarray | None, at: Sequence[int], images: Sequence[Any]
    ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray | None]:
        """``ids`` (and ``mask``) with the placeholder token at each index of ``at`` (ascending)
        replaced by its image's span; the new ids, mask (0 on every span), spans and grids."""
        pieces: list[np.ndarray] = []
        masks: list[np.ndarray] = []
        spans = np.empty((len(at), 2), dtype=np.int32)
        grids = np.empty((len(at), 3), dtype=np.int32) if self.has_grid else None
        before = 0  # in ids
        length = 0  # of the output so far
        for k, (j, image) in enumerate(zip(at, images, strict=True)):
            n = self.count(image)
            span = np.full(n + (self.start_id is not None) + (self.end_id is not None),
                           self.image_token_id, dtype=np.int32)  # fmt: skip
            if self.start_id is not None:
                span[0] = self.start_id
            if self.end_id is not None:
                span[-1] = self.end_id
            pieces += (ids[before:j], span)
            if mask is not None:
                masks += (mask[before:j], np.zeros(len(span), dtype=np.int32))
            length += j - before
            spans[k] = (length, length + len(span))
            length += len(span)
            if grids is not None:
                gh, gw = self._cells(*image_size(image))
                grids[k] = (1, gh * self.merge, gw * self.merge)
            before = j + 1
        pieces.append(ids[before:])
        new_ids = np.concatenate(pieces).astype(np.int32, copy=False)
        new_mask = None
        if mask is not None:
            masks.append(mask[before:])
            new_mask = np.concatenate(masks).astype(np.int32, copy=False)
        return new_ids, new_mask, spans, grids

    def fields(self, spans: np.ndarray, grids: np.ndarray | None) -> dict[str, np.ndarray]:
        """The payload fields a tokenized record gets for its images."""
        out = {IMAGE_SPANS_FIELD: spans}
        if grids is not None:
            out[IMAGE_GRID_FIELD] = grids
        return out

    def facts(self, token_field: str, image_field: str, source: str) -> dict[str, Any]:
        """The plan-time fact that tells a packer of ``token_field`` to carry the images."""
        return {"image_fields": {"field": token_field, "images": image_field, "source": source}}


class ImageTokenCounter:
    """See ``image_token_counter``: the image tokens of a raw record, from its images' sizes."""

    def __init__(
        self,
        sizes_field: str,
        patch_size: int | None,
        merge: int,
        image_tokens: Callable[[int, int], int] | None,
        image_start_id: int | None,
        image_end_id: int | None,
    ):
        owner = "image_token_counter"
        self.sizes_field = sizes_field
        # the id itself never enters a count: any valid one will do
        self._images = ImageTokens(
            owner, 0, patch_size, merge, image_tokens, image_start_id, image_end_id
        )
        self._ends = (image_start_id is not None) + (image_end_id is not None)

    def __call__(self, payload: Any) -> int:
        """The tokens of every image span of ``payload``, start and end ids included."""
        sizes = payload.get(self.sizes_field) if isinstance(payload, Mapping) else None
        if sizes is None:
            return 0
        total = 0
        for size in sizes:
            h, w = (int(v) for v in size)
            total += self._images.count_size(h, w) + self._ends
        return total

    def describe(self) -> dict[str, Any]:
        """What the pipeline fingerprint takes of it (through the mixture's estimate)."""
        scheme = self._images.identity()
        del scheme["image_token_id"]
        scheme["image_tokens"] = identify(
            scheme["image_tokens"], where="image_token_counter parameter 'image_tokens'"
        )
        return {"sizes_field": self.sizes_field, **scheme}


def image_token_counter(
    sizes_field: str = "image_sizes",
    *,
    patch_size: int | None = None,
    merge: int = 1,
    image_tokens: Callable[[int, int], int] | None = None,
    image_start_id: int | None = None,
    image_end_id: int | None = None,
) -> ImageTokenCounter:
    """A function of a raw record giving the image tokens ``tokenize_interleaved`` or
    ``tokenize_chat`` will make of its images, for ``MixtureSource(by="tokens",
    image_tokens=...)``: ``payload[sizes_field]`` lists each image's ``(height, width)`` as it
    will be tokenized (after any resize or crop; absent or None for no images), and the scheme
    arguments are the tokenizer's. Nothing is decoded."""
    return ImageTokenCounter(
        sizes_field, patch_size, merge, image_tokens, image_start_id, image_end_id
    )


def images_of(payload: Any, field: str, expected: int) -> list[Any]:
    """The ``expected`` images of a record, from ``payload[field]`` (a list, or one image; the
    field may be left out when there are none). A count that differs is an error: an image no
    placeholder stands for would be dropped."""
    value = payload.get(field) if isinstance(payload, Mapping) else None
    if value is None:
        if expected:
            fields = list(payload) if isinstance(payload, Mapping) else type(payload).__name__
            raise KeyError(
                f"it places {expected} image(s) but the payload has no field {field!r} ({fields})"
            )
        return []
    images = list(value) if isinstance(value, (list, tuple)) else [value]
    if len(images) != expected:
        raise ValueError(
            f"it places {expected} image(s) but field {field!r} holds {len(images)}; each image "
            "needs its placeholder, in order"
        )
    return images


def _is_image_item(item: Any) -> bool:
    return item is None or (isinstance(item, Mapping) and item.get("type") == "image")


class TokenizeInterleaved(Operator):
    """See ``tokenize_interleaved``."""

    name = "tokenize_interleaved"

    def __init__(
        self,
        tokenizer: Any,
        *,
        image_token_id: int,
        field: str,
        image_field: str,
        output_field: str,
        mask_field: str,
        patch_size: int | None,
        merge: int,
        image_tokens: Callable[[int, int], int] | None,
        image_start_id: int | None,
        image_end_id: int | None,
        append_eos: bool,
        eos_id: int | None,
        workers: int | None,
    ):
        if output_field == mask_field:
            raise ValueError("tokenize_interleaved: output_field and mask_field must differ")
        self._images = ImageTokens(
            self.name, image_token_id, patch_size, merge, image_tokens, image_start_id, image_end_id
        )
        self.tokenizer = tokenizer
        self.field = field
        self.image_field = image_field
        self.output_field = output_field
        self.mask_field = mask_field
        self.append_eos = bool(append_eos)
        _refuse_batch_padding(tokenizer)
        _refuse_truncation(tokenizer, self.name, "the packer cuts what is longer than a row")
        # Text items are encoded without the tokenizer's own special tokens (a BOS or EOS per
        # item would land between a text and its image); other tokenizers through tokenize's.
        self._plain = all(
            callable(getattr(tokenizer, n, None)) for n in ("token_to_id", "encode_batch")
        )
        self._transformers = not self._plain and callable(
            getattr(tokenizer, "convert_ids_to_tokens", None)
        )
        self._text = (
            None if self._plain or self._transformers else Tokenize(tokenizer, append_eos=False)
        )
        self._specials: np.ndarray | None = None  # _special_ids
        self._spelling: Any = None  # _as_text's copy of a tokenizers.Tokenizer
        eos = find_eos(tokenizer, eos_id) if self.append_eos else None
        if self.append_eos and eos is None:
            raise PlanError(
                "tokenize_interleaved: the tokenizer has no end-of-sequence token; pass eos_id= "
                "or append_eos=False"
            )
        self.eos_id = eos.id if eos else None
        pad = find_pad(tokenizer)
        self.pad_id = pad.id if pad else None
        self._pad_token = pad.token if pad else None
        self.traits = OpTraits(
            preserves_cursor_order=True, preserves_indexability=True, workers=workers
        )

    def describe(self) -> dict[str, Any]:
        """As ``Operator.describe``, plus the image scheme and the vocabulary's digest."""
        out = super().describe()
        where = f"operator {self.name!r} parameter"
        for key, value in self._images.identity().items():
            out["params"][key] = identify(value, where=f"{where} {key!r}")
        digest = backend_digest(self.tokenizer, out["params"]["tokenizer"])
        if digest is not None:
            out["params"]["tokenizer_digest"] = digest
        return out

    def provides(self) -> dict[str, Any]:
        """Plan-time facts: the token field, eos and padding ids, the loss mask a packer must
        carry and the images it must keep with their rows."""
        return {
            "token_field": self.output_field,
            "eos_id": self.eos_id,
            "eos_token": None,
            "pad_id": self.pad_id,
            "pad_token": self._pad_token,
            "pad_from": self.name,
            "token_side_fields": {
                "field": self.output_field,
                "fields": [self.mask_field],
                "source": self.name,
            },
            **self._images.facts(self.output_field, self.image_field, self.name),
        }

    def _encode(self, texts: list[str]) -> list[np.ndarray]:
        if not texts:
            return []
        tok = self.tokenizer
        if self._plain:
            out = [
                np.asarray(e.ids, dtype=np.int32)
                for e in tok.encode_batch(texts, add_special_tokens=False)
            ]
        elif self._transformers:
            ids = tok(texts, add_special_tokens=False)["input_ids"]
            out = [np.asarray(i, dtype=np.int32) for i in ids]
        else:
            assert self._text is not None
            return self._text.encode_texts(texts)
        # A text that spells a special token ("<|image|>" or "<|end|>" on a scraped page) is
        # encoded again with such strings as text: an image token without its image, or an end
        # of document inside one, must not reach the model.
        specials = self._special_ids()
        for k, ids in enumerate(out):
            if len(specials) and np.isin(ids, specials).any():
                out[k] = self._as_text(texts[k])
        return out

    def _special_ids(self) -> np.ndarray:
        """The ids of the tokenizer's special tokens (looked up once)."""
        if self._specials is None:
            tok = self.tokenizer
            decoder = getattr(tok, "added_tokens_decoder", None)
            if decoder is None:
                get = getattr(tok, "get_added_tokens_decoder", None)
                decoder = get() if callable(get) else {}
            ids = [int(i) for i, t in decoder.items() if getattr(t, "special", False)]
            self._specials = np.array(sorted(ids), dtype=np.int32)
        return self._specials

    def _as_text(self, text: str) -> np.ndarray:
        """The ids of ``text`` with special tokens' strings encoded as the text they are."""
        tok = self.tokenizer
        if self._transformers:
            ids = tok([text], add_special_tokens=False, split_special_tokens=True)["input_ids"][0]
            return np.asarray(ids, dtype=np.int32)
        if self._spelling is None:
            try:
                copy = type(tok).from_str(tok.to_str())
                copy.encode_special_tokens = True
            except Exception as exc:
                raise ValueError(
                    f"the text spells a special token of the tokenizer, which cannot be copied to "
                    f"encode it as text ({type(exc).__name__}: {exc})"
                ) from exc
            self._spelling = copy
        encoding = self._spelling.encode(text, add_special_tokens=False)
        return np.asarray(encoding.ids, dtype=np.int32)

    def __getstate__(self) -> dict[str, Any]:
        # The copy that encodes special tokens' strings as text is made again where needed.
        return {**self.__dict__, "_spelling": None}

    def _items(self, rec: SampleRecord) -> list[Any]:
        payload = rec.payload
        try:
            items = payload[self.field]
        except (KeyError, TypeError, IndexError):
            fields = list(payload) if isinstance(payload, dict) else type(payload).__name__
            raise KeyError(f"the payload has no field {self.field!r} ({fields})") from None
        if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
            raise TypeError(
                f"field {self.field!r} must be a list of text and image items, got "
                f"{type(items).__name__}"
            )
        out = []
        for i, item in enumerate(items):
            if isinstance(item, Mapping) and item.get("type") == "text":
                item = item.get("text")
                if not isinstance(item, str):  # None would read as the next image
                    raise TypeError(
                        f"item {i} of field {self.field!r} is a text item whose 'text' is "
                        f"{item!r:.60}, not a str"
                    )
            if not (isinstance(item, str) or _is_image_item(item)):
                raise TypeError(
                    f"item {i} of field {self.field!r} is {item!r:.60}: an item is a str, "
                    "{'type': 'text', 'text': ...}, or None / {'type': 'image'} for the next image"
                )
            out.append(item)
        return out

    def process_many(self, records: list[SampleRecord]) -> list[SampleRecord]:
        out = []
        for rec in records:
            try:
                out.append(self._one(rec))
            except Exception as exc:
                raise record_error(self, rec, exc) from exc
        return out

    def _one(self, rec: SampleRecord) -> SampleRecord:
        items = self._items(rec)
        texts = [item for item in items if isinstance(item, str) and item]
        encoded = iter(self._encode(texts))
        pieces: list[np.ndarray] = []
        at: list[int] = []  # where each image's placeholder lands
        length = 0
        for item in items:
            if isinstance(item, str):
                if item:
                    piece = next(encoded)
                    pieces.append(piece)
                    length += len(piece)
            else:
                at.append(length)
                pieces.append(np.array([self._images.image_token_id], dtype=np.int32))
                length += 1
        if self.eos_id is not None:
            pieces.append(np.array([self.eos_id], dtype=np.int32))
        ids = np.concatenate(pieces) if pieces else np.empty(0, dtype=np.int32)
        mask = np.ones(len(ids), dtype=np.int32)
        images = images_of(rec.payload, self.image_field, len(at))
        ids, new_mask, spans, grids = self._images.expand(ids, mask, at, images)
        payload = {
            **rec.payload,
            self.output_field: ids,
            self.mask_field: new_mask,
            **self._images.fields(spans, grids),
        }
        return SampleRecord(counted_meta(rec.meta, len(ids)), payload)


def tokenize_interleaved(
    tokenizer: Any = None,
    *,
    image_token_id: int,
    field: str = "content",
    image_field: str = "images",
    output_field: str = "tokens",
    mask_field: str = "loss_mask",
    patch_size: int | None = None,
    merge: int = 1,
    image_tokens: Callable[[int, int], int] | None = None,
    image_start_id: int | None = None,
    image_end_id: int | None = None,
    append_eos: bool = True,
    eos_id: int | None = None,
    workers: int | None = None,
) -> TokenizeInterleaved:
    """Tokenize an image-text document: ``payload[field]`` is a list of items, each a text
    (``str`` or ``{"type": "text", "text": ...}``) or an image (``None`` or ``{"type":
    "image"}``), whose pixels are the next of ``payload[image_field]`` (decoded, in order).

    Each text is encoded on its own, without the tokenizer's special tokens (a special token's
    string inside a text, ``"<|image|>"`` on a scraped page, is encoded as the plain text it is,
    for a ``tokenizers`` or ``transformers`` fast tokenizer); each image becomes
    its span of ``image_token_id`` (required, never guessed), between ``image_start_id`` and
    ``image_end_id`` when given, as many as ``patch_size``/``merge`` or ``image_tokens(h, w)``
    say (see ``zephon.ops.vision``). With ``append_eos`` the document ends with the
    end-of-sequence id (``eos_id``, else the tokenizer's own; as ``tokenize``).

    Writes ``payload[output_field]`` (int32), ``payload[mask_field]`` (int32: 1 on text tokens and
    the eos, 0 on image spans), ``image_spans`` and, with ``patch_size``, ``image_grid_thw``.
    Pack with ``pack_sequences(..., extra_fields={mask_field: 0}, images=image_field)``.
    """
    return TokenizeInterleaved(
        ByteTokenizer() if tokenizer is None else tokenizer,
        image_token_id=image_token_id,
        field=field,
        image_field=image_field,
        output_field=output_field,
        mask_field=mask_field,
        patch_size=patch_size,
        merge=merge,
        image_tokens=image_tokens,
        image_start_id=image_start_id,
        image_end_id=image_end_id,
        append_eos=append_eos,
        eos_id=eos_id,
        workers=workers,
    )
