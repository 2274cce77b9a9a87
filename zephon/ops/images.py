"""Images as samples: ``decode_images`` turns encoded bytes (or a path, or a URI) into ``uint8``
HWC arrays, and the augmentations resize, crop, flip and normalize them.

Every random choice is drawn from the operator's ``seed`` and the record's cursor (its chunk id,
which counts passes, its offset and its lineage), never from a lane, a worker or a clock: a
sample gets the same pixels on any lane count, worker kind and world size, after a resume and
after a re-lane. A field holds one image or a list of images (an interleaved document); each
image of a list gets its own draw.

The augmentations right after ``decode_images`` on its field run inside it, one image at a time
(``ImageTransform.use_previous_operator``): a decoded photo goes to the first of them as Pillow
made it, with no array of it in between, and is freed before the next image is decoded, instead
of a micro-batch of full-size decodes being held between two operators. The pixels are the same.

Pillow does the decoding and resampling (``pip install "zephon-loader[images]"``); it is imported
when the first image is decoded, never by ``import zephon``.
"""

from __future__ import annotations

import functools
import io
import math
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from zephon._core.pixels import rgb_of_rgbx
from zephon.errors import FetchError, OperatorError
from zephon.ops.base import Operator, OpTraits, record_error
from zephon.ops.children import tombstones_for_record
from zephon.sources.image_values import RawImage
from zephon.sources.locations import UriFilesystems
from zephon.sources.remote import RetryPolicy, with_retries
from zephon.types import SampleCursor, SampleRecord
from zephon.validation import check_int

__all__ = [
    "CenterCrop",
    "DecodeImages",
    "ImageTransform",
    "Normalize",
    "RandomFlip",
    "RandomResizedCrop",
    "ResizeImages",
    "center_crop",
    "decode_images",
    "normalize",
    "random_flip",
    "random_resized_crop",
    "resize_images",
]

_MODES = ("RGB", "RGBA", "L")
_RESAMPLE = ("nearest", "bilinear", "bicubic", "lanczos")


def _pil() -> Any:
    try:
        from PIL import Image
    except ImportError:
        raise ImportError(
            'image operators need Pillow: pip install "zephon-loader[images]"'
        ) from None
    return Image


#: The transposition that makes an image upright, by its EXIF orientation (2 to 8; 1 is upright),
#: as ``PIL.ImageOps.exif_transpose`` applies it.
_EXIF_TURNS = {
    2: "FLIP_LEFT_RIGHT",
    3: "ROTATE_180",
    4: "FLIP_TOP_BOTTOM",
    5: "TRANSPOSE",
    6: "ROTATE_270",
    7: "TRANSVERSE",
    8: "ROTATE_90",
}


def _exif_turn(image: Any) -> Any:
    """The ``Image.Transpose`` that shows ``image`` upright, as viewers (and Hugging Face
    ``datasets``) do with a photo's EXIF orientation; None for an upright one, and for EXIF
    that cannot be read (a damaged tag never fails the image)."""
    try:
        orientation = image.getexif().get(0x0112)
    except Exception:
        return None
    name = _EXIF_TURNS.get(orientation) if isinstance(orientation, int) else None
    return None if name is None else getattr(_pil().Transpose, name)


def _eight_bit(image: Any) -> Any:
    """``image``, or for a 16-bit grayscale one (``I;16``: a 16-bit PNG or TIFF) the 8-bit ``L``
    image of its high bytes, what a viewer shows of it: Pillow's own conversion to ``L`` or
    ``RGB`` clips every value above 255 to white instead."""
    if not image.mode.startswith("I;16"):
        return image
    high = (np.asarray(image) >> 8).astype(np.uint8)
    return _pil().fromarray(high)  # a 2-D uint8 array is an L image


def pixels_of(image: Any) -> np.ndarray:
    """The pixels of a Pillow image as a new, writable ``uint8`` array: ``(H, W, C)``, or
    ``(H, W)`` for one band. An RGB image's are packed straight from Pillow's memory (which holds
    four bytes a pixel) where Pillow exports it as Arrow (Pillow 11.2 on, an image in one block of
    memory); any other goes through ``numpy.asarray``, a pass and a copy more. Both give the same
    array."""
    if image.mode == "RGB" and hasattr(image, "__arrow_c_array__"):
        import pyarrow as pa

        try:
            exported = pa.array(image)  # no copy: a view of Pillow's pixels, four bytes each
        except ValueError:  # the image's rows are not in one block of memory
            pass
        else:
            if exported.offset == 0 and exported.values.offset == 0:
                values = np.frombuffer(exported.buffers()[-1], np.uint8)
                return rgb_of_rgbx(values, image.height, image.width)
    return np.asarray(image, dtype=np.uint8).copy()


def record_rng(seed: int, cursor: SampleCursor, purpose: str) -> np.random.Generator:
    """The random generator of one record for one purpose: a pure function of the seed, the
    cursor (chunk id, offset, lineage) and the purpose, equal in every process."""
    tag = zlib.crc32(purpose.encode())
    entropy = [seed & (2**64 - 1), tag, cursor.chunk_id, cursor.chunk_offset, *cursor.lineage]
    return np.random.default_rng(np.random.SeedSequence(entropy))


class _PerImage(Operator):
    """An operator applying one function to each image of ``field`` (one image, or a list)."""

    traits = OpTraits(preserves_cursor_order=True, preserves_indexability=True)
    field: str

    def _each(self, value: Any, fn: Callable[[Any, int], Any]) -> Any:
        if isinstance(value, list):
            return [fn(image, i) for i, image in enumerate(value)]
        return fn(value, 0)

    def _with(self, rec: SampleRecord, value: Any) -> SampleRecord:
        payload = rec.payload
        if not isinstance(payload, dict) or self.field not in payload:
            fields = list(payload) if isinstance(payload, dict) else type(payload).__name__
            raise record_error(
                self, rec, KeyError(f"the payload has no field {self.field!r} (it has {fields})")
            )
        return rec.with_payload({**payload, self.field: value})


class DecodeImages(_PerImage):
    """Encoded images (bytes, a Hugging Face ``Image`` dict with ``bytes``/``path``, a path, or a
    URI such as ``s3://bucket/key``), or raw pixels (a ``RawImage``, as MDS and LitData sources
    give a ``pil`` column), to ``uint8`` arrays of shape ``(H, W, C)`` (``(H, W)`` for
    ``mode="L"``). A URI is read through the storage layer the sources use, with their retries
    and deadlines."""

    retry = RetryPolicy()

    def __init__(
        self,
        field: str = "image",
        *,
        mode: str = "RGB",
        max_pixels: int | None = None,
        on_error: str = "raise",
    ):
        if mode not in _MODES:
            raise ValueError(f"decode_images: mode must be one of {_MODES}, got {mode!r}")
        if on_error not in ("raise", "drop"):
            raise ValueError(f"decode_images: on_error must be 'raise' or 'drop', got {on_error!r}")
        if max_pixels is not None:
            max_pixels = check_int(max_pixels, "max_pixels", "decode_images", minimum=1)
        self.field = field
        self.mode = mode
        self.max_pixels = max_pixels
        self.on_error = on_error
        self.name = f"decode_images({field})"
        drops = on_error == "drop"
        self.traits = OpTraits(preserves_cursor_order=True, preserves_indexability=not drops)
        self._storage = UriFilesystems(self.name)
        # Set on a lane's copy as its run starts: the augmentations right after this operator on
        # its field, which it applies to each image it decodes (``ImageTransform``'s
        # ``use_previous_operator``).
        self._then: list[ImageTransform] = []

    def use_previous_operator(self, before: Operator | None) -> None:
        self._then = []  # the augmentations after it join again (their own calls come next)

    def process_many(self, records: list[SampleRecord]) -> list[SampleRecord]:
        out: list[SampleRecord] = []
        for rec in records:
            try:
                value = rec.payload[self.field] if isinstance(rec.payload, dict) else None
                if value is None:
                    raise KeyError(f"the payload has no field {self.field!r}")
                decoded = self._each(value, functools.partial(self._decode, rec))
            except _AugmentationFailed as failed:  # not this operator's: never dropped here
                raise failed.error from failed.__cause__
            except Exception as exc:
                if self.on_error == "drop":
                    out.extend(tombstones_for_record(rec))
                    continue
                if isinstance(exc, _Undecodable):
                    about = exc.which(self.field, isinstance(value, list))
                    raise record_error(self, rec, exc.error, about=about) from exc.error
                raise record_error(self, rec, exc) from exc
            out.append(self._with(rec, decoded))
        return out

    def _decode(self, rec: SampleRecord, value: Any, i: int) -> Any:
        try:
            return self._decoded(rec, value, i)
        except _AugmentationFailed:
            raise
        except Exception as exc:
            raise _Undecodable(value, i, exc) from exc

    def _decoded(self, rec: SampleRecord, value: Any, i: int) -> Any:
        Image = _pil()
        if isinstance(value, dict):  # a Hugging Face Image feature
            value = value.get("bytes") or value.get("path")
        if isinstance(value, RawImage):  # raw pixels: no file to open, no EXIF
            opened = Image.frombytes(value.mode, value.size, value.pixels)
        elif isinstance(value, (bytes, bytearray, memoryview)):
            opened = Image.open(io.BytesIO(value))
        elif isinstance(value, str):
            source = io.BytesIO(self._read_uri(value)) if self._storage.is_uri(value) else value
            opened = Image.open(source)
        else:
            raise TypeError(
                "an image is encoded bytes, a path or a RawImage, got " + type(value).__name__
            )
        with opened:
            turn = _exif_turn(opened)
            image = _eight_bit(opened)
            if self.max_pixels is not None and image.width * image.height > self.max_pixels:
                scale = math.sqrt(self.max_pixels / (image.width * image.height))
                size = (max(1, int(image.width * scale)), max(1, int(image.height * scale)))
                image.draft(self.mode, size)  # JPEG decodes at a reduced scale directly
                image = image.convert(self.mode).resize(size, Image.Resampling.BILINEAR)
            elif image.mode != self.mode:
                image = image.convert(self.mode)
            else:  # already in the mode: converting would only copy it
                image.load()
            if turn is not None:  # after any scaling down: a turn is exact at any size
                image = image.transpose(turn)
            if not self._then:
                return pixels_of(image)
            return self._augmented(image, rec, i)

    def _augmented(self, image: Any, rec: SampleRecord, i: int) -> Any:
        """The decoded Pillow ``image`` (the ``i``-th of ``rec``'s field) through the
        augmentations this operator applies: the first takes it as it is where it can
        (``ImageTransform.takes_pillow``), the others what the one before made. A failure is
        that augmentation's, named as it would name it."""
        first = self._then[0]
        value = image if first.takes_pillow else pixels_of(image)
        for transform in self._then:
            try:
                value = transform.apply_to(rec, value, i)
            except Exception as exc:
                error = record_error(transform, rec, exc)
                error.add_context(operator=transform.name)  # kept as the error leaves the lane
                raise _AugmentationFailed(error) from exc
        return value

    def _read_uri(self, uri: str) -> bytes:
        """The bytes of the object at ``uri``; a missing one is a FetchError naming it."""
        fs, path = self._storage.resolve(uri)

        def read() -> bytes:
            with fs.open_input_stream(path) as stream:
                return bytes(stream.read())

        try:
            return with_retries(read, lambda: f"{self.name} reading {uri!r}", self.retry)
        except FetchError:
            raise
        except OSError as exc:
            missing = isinstance(exc, FileNotFoundError) or "does not exist" in str(exc)
            why = "does not exist" if missing else f"cannot be read ({exc})"
            raise FetchError(
                f"{self.name}: the image {uri!r} {why}; check the URI in field {self.field!r}, "
                "or drop such samples with on_error='drop'"
            ) from exc


def decode_images(
    field: str = "image",
    *,
    mode: str = "RGB",
    max_pixels: int | None = None,
    on_error: str = "raise",
) -> DecodeImages:
    """Decode the image(s) in ``payload[field]`` (JPEG, PNG, WebP, ... bytes; a Hugging Face
    ``Image`` dict; a file path; a URI: ``s3://``, ``gs://`` or any fsspec protocol, read with
    the sources' retries; raw pixels, a ``zephon.sources.RawImage``) into ``uint8`` arrays in
    ``mode``; an image of more than ``max_pixels`` pixels is scaled down to fit, keeping its
    aspect. A corrupt image is an ``OperatorError`` naming the sample, or with
    ``on_error="drop"`` its record is dropped (with its tombstones)."""
    return DecodeImages(field, mode=mode, max_pixels=max_pixels, on_error=on_error)


class _Undecodable(Exception):
    """Image ``i`` of a record's field (``value``, as the field holds it) could not be read or
    decoded: ``error``, which the record's ``OperatorError`` names it with (``which``)."""

    def __init__(self, value: Any, i: int, error: Exception):
        super().__init__(str(error))
        self.value, self.i, self.error = value, i, error

    def which(self, field: str, listed: bool) -> str | None:
        """The image's place in a list of ``field`` and its path or URI, as far as known:
        Pillow's errors name neither."""
        value = self.value
        path = value.get("path") if isinstance(value, dict) else value
        named = f"{path!r}" if isinstance(path, str) and path else None
        if isinstance(self.error, FetchError):
            named = None  # its message names the URI
        if not listed:
            return None if named is None else f"image {named}"
        return f"image {self.i} of field {field!r}" + ("" if named is None else f" ({named})")


class _AugmentationFailed(Exception):
    """An augmentation applied inside ``decode_images`` failed: its ``OperatorError``, which
    ``decode_images`` raises as it is (``on_error="drop"`` drops undecodable images only)."""

    def __init__(self, error: OperatorError):
        super().__init__(str(error))
        self.error = error


class ImageTransform(_PerImage):
    """A deterministic function of each decoded image (``transform``), which for a random
    transform (``seed`` given) also gets a generator drawn from the seed, the record's cursor
    and the image's place in its list. Subclasses are the augmentations below.

    Right after ``decode_images`` on the same field (or after another augmentation that is), it
    runs inside ``decode_images``, one image at a time, and passes records on untouched itself
    (so its time counts there): unless its class defines ``process_many`` of its own."""

    seed: int | None = None
    kind = "image_transform"
    #: Set on a lane's copy as its run starts: the ``decode_images`` that applies this operator
    #: to each image it decodes (``use_previous_operator``), None when it runs on its own.
    _applied_by: DecodeImages | None = None
    #: Whether ``transform`` also takes a Pillow image, which ``decode_images`` then hands it
    #: as decoded, without making an array of it first.
    takes_pillow = False

    def _named(self, field: str, seed: int | None = None) -> None:
        self.field = field
        self.name = f"{self.kind}({field})"
        self.seed = None if seed is None else check_int(seed, "seed", self.kind)

    def transform(self, image: np.ndarray, rng: np.random.Generator | None) -> np.ndarray:
        """The transformed image (abstract: each augmentation defines it)."""
        raise NotImplementedError(f"{type(self).__name__} must implement transform (abstract)")

    def use_previous_operator(self, before: Operator | None) -> None:
        """Join the augmentations ``decode_images`` applies when ``before`` is that operator, or
        one of them, on this field; else run on its own."""
        head = None
        if isinstance(before, DecodeImages):
            head = before
        elif isinstance(before, ImageTransform):
            head = before._applied_by
        own = type(self).process_many is not ImageTransform.process_many
        if head is None or own or head.field != self.field:
            self._applied_by = None
            return
        self._applied_by = head
        head._then.append(self)

    def process_many(self, records: list[SampleRecord]) -> list[SampleRecord]:
        if self._applied_by is not None:  # done as each image was decoded
            return records
        out = []
        for rec in records:
            value = rec.payload.get(self.field) if isinstance(rec.payload, dict) else None
            try:
                if value is None:
                    raise KeyError(f"the payload has no field {self.field!r}")
                result = self._each(value, functools.partial(self.apply_to, rec))
            except Exception as exc:
                raise record_error(self, rec, exc) from exc
            out.append(self._with(rec, result))
        return out

    def apply_to(self, rec: SampleRecord, image: Any, i: int) -> np.ndarray:
        """``transform`` of the ``i``-th image of ``rec``'s field, with that image's generator."""
        array = isinstance(image, np.ndarray) and image.dtype == np.uint8 and image.ndim in (2, 3)
        if not (array or (self.takes_pillow and _is_pillow(image))):
            raise TypeError(
                f"{self.name} takes decoded uint8 HWC images (decode_images first), got "
                f"{type(image).__name__} {getattr(image, 'dtype', '')}"
            )
        seed = self.seed
        purpose = f"{self._purpose()}:{i}"
        rng = None if seed is None else record_rng(seed, rec.meta.cursor, purpose)
        return self.transform(image, rng)

    def _purpose(self) -> str:
        """What this transform's draws are for, which with the image's place tags its generator:
        its kind (so the same crop is drawn for two fields with one seed); a transform whose
        options make another augmentation of the same kind says more."""
        return self.kind


def _resample(name: str) -> Any:
    if name not in _RESAMPLE:
        raise ValueError(f"resample must be one of {_RESAMPLE}, got {name!r}")
    return getattr(_pil().Resampling, name.upper())


def _is_pillow(image: Any) -> bool:
    return type(image).__module__.startswith("PIL.") and isinstance(image, _pil().Image)


def _height_width(image: Any) -> tuple[int, int]:
    """An array's or a Pillow image's ``(height, width)``."""
    if isinstance(image, np.ndarray):
        return image.shape[0], image.shape[1]
    return image.height, image.width


def _resized(image: Any, size: tuple[int, int], resample: str) -> np.ndarray:
    """``image`` (an array, or a Pillow image) resized to ``(height, width)``, as an array."""
    pillow = not isinstance(image, np.ndarray)
    if _height_width(image) == size:
        return pixels_of(image) if pillow else image
    original = image if pillow else _pil().fromarray(image)
    return pixels_of(original.resize((size[1], size[0]), _resample(resample)))


def _size(size: int | Sequence[int], owner: str) -> tuple[int, int]:
    pair = (size, size) if isinstance(size, int) else tuple(size)
    if len(pair) != 2:
        raise ValueError(f"{owner}: size is an int or (height, width), got {size!r}")
    return check_int(pair[0], "size", owner, minimum=1), check_int(
        pair[1], "size", owner, minimum=1
    )


def _crop(image: np.ndarray, top: int, left: int, height: int, width: int) -> np.ndarray:
    """The ``height`` x ``width`` window at ``(top, left)``; outside the image it is black."""
    out = np.zeros((height, width, *image.shape[2:]), dtype=np.uint8)
    src = image[max(top, 0) : top + height, max(left, 0) : left + width]
    y, x = max(-top, 0), max(-left, 0)
    out[y : y + src.shape[0], x : x + src.shape[1]] = src
    return out


class ResizeImages(ImageTransform):
    """See ``resize_images``."""

    kind = "resize_images"
    takes_pillow = True

    def __init__(self, shortest_edge: int | None, max_size: int | None, field: str, resample: str):
        if shortest_edge is None and max_size is None:
            raise ValueError("resize_images needs shortest_edge=, max_size= or both")
        self.shortest_edge = (
            None
            if shortest_edge is None
            else check_int(shortest_edge, "shortest_edge", self.kind, minimum=1)
        )
        self.max_size = (
            None if max_size is None else check_int(max_size, "max_size", self.kind, minimum=1)
        )
        _resample(resample)
        self.resample = resample
        self._named(field)

    def transform(self, image: Any, rng: np.random.Generator | None) -> np.ndarray:
        h, w = _height_width(image)
        scale = 1.0 if self.shortest_edge is None else self.shortest_edge / min(h, w)
        if self.max_size is not None and max(h, w) * scale > self.max_size:
            scale = self.max_size / max(h, w)
        size = (max(1, round(h * scale)), max(1, round(w * scale)))
        return _resized(image, size, self.resample)


def resize_images(
    shortest_edge: int | None = None,
    *,
    max_size: int | None = None,
    field: str = "image",
    resample: str = "bicubic",
) -> ResizeImages:
    """Resize each image so its shorter edge is ``shortest_edge`` and its longer edge at most
    ``max_size`` (keeping its aspect; either may be left out)."""
    return ResizeImages(shortest_edge, max_size, field, resample)


class CenterCrop(ImageTransform):
    """See ``center_crop``."""

    kind = "center_crop"

    def __init__(self, size: int | Sequence[int], field: str):
        self.size = _size(size, self.kind)
        self._named(field)

    def transform(self, image: np.ndarray, rng: np.random.Generator | None) -> np.ndarray:
        height, width = self.size
        top, left = (image.shape[0] - height) // 2, (image.shape[1] - width) // 2
        return _crop(image, top, left, height, width)


def center_crop(size: int | Sequence[int], *, field: str = "image") -> CenterCrop:
    """Crop the center ``size`` (an int, or ``(height, width)``) of each image; an image smaller
    than that is padded with black around it."""
    return CenterCrop(size, field)


class RandomResizedCrop(ImageTransform):
    """See ``random_resized_crop``."""

    kind = "random_resized_crop"
    takes_pillow = True

    def __init__(
        self,
        size: int | Sequence[int],
        scale: Sequence[float],
        ratio: Sequence[float],
        seed: int,
        field: str,
        resample: str,
    ):
        self.size = _size(size, self.kind)
        lo, hi = (float(v) for v in scale)
        r_lo, r_hi = (float(v) for v in ratio)
        if not (0 < lo <= hi <= 1) or not (0 < r_lo <= r_hi):
            raise ValueError(f"{self.kind}: scale {scale} or ratio {ratio} is out of range")
        self.scale = (lo, hi)
        self.ratio = (r_lo, r_hi)
        _resample(resample)
        self.resample = resample
        self._named(field, seed)

    def transform(self, image: Any, rng: np.random.Generator | None) -> np.ndarray:
        assert rng is not None
        h, w = _height_width(image)
        (lo, hi), (r_lo, r_hi) = self.scale, self.ratio
        for _ in range(10):
            target = h * w * rng.uniform(lo, hi)
            aspect = math.exp(rng.uniform(math.log(r_lo), math.log(r_hi)))
            cw, ch = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
            if 0 < cw <= w and 0 < ch <= h:
                top = int(rng.integers(0, h - ch + 1))
                left = int(rng.integers(0, w - cw + 1))
                break
        else:  # the largest centered crop of an aspect within ratio
            aspect = min(max(w / h, r_lo), r_hi)
            cw, ch = min(w, round(h * aspect)), min(h, round(w / aspect))
            top, left = (h - ch) // 2, (w - cw) // 2
        if isinstance(image, np.ndarray):
            window = image[top : top + ch, left : left + cw]
        else:  # the same pixels, copied out by Pillow
            window = image.crop((left, top, left + cw, top + ch))
        return _resized(window, self.size, self.resample)


def random_resized_crop(
    size: int | Sequence[int],
    *,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    seed: int = 0,
    field: str = "image",
    resample: str = "bilinear",
) -> RandomResizedCrop:
    """Crop a random area of each image (a ``scale`` share of it, of an aspect within
    ``ratio``) and resize it to ``size``; the crop is drawn from ``seed`` and the record's
    cursor. After ten draws that do not fit, the largest centered crop of an aspect within
    ``ratio`` is taken."""
    return RandomResizedCrop(size, scale, ratio, seed, field, resample)


class RandomFlip(ImageTransform):
    """See ``random_flip``."""

    kind = "random_flip"

    def __init__(self, p: float, horizontal: bool, seed: int, field: str):
        if isinstance(p, bool) or not 0.0 <= float(p) <= 1.0:
            raise ValueError(f"{self.kind}: p must be in [0, 1], got {p!r}")
        self.p = float(p)
        self.horizontal = bool(horizontal)
        self._named(field, seed)

    def _purpose(self) -> str:
        # A top-bottom flip draws apart from a left-right one of the same seed, which would
        # otherwise flip each image both ways or neither (left-right keeps the draws it had).
        return self.kind if self.horizontal else f"{self.kind}:top-bottom"

    def transform(self, image: np.ndarray, rng: np.random.Generator | None) -> np.ndarray:
        assert rng is not None
        if rng.random() < self.p:
            return np.flip(image, axis=1 if self.horizontal else 0).copy()
        return image


def random_flip(
    p: float = 0.5, *, horizontal: bool = True, seed: int = 0, field: str = "image"
) -> RandomFlip:
    """Flip each image (left-right, or top-bottom with ``horizontal=False``) with probability
    ``p``, drawn from ``seed`` and the record's cursor."""
    return RandomFlip(p, horizontal, seed, field)


class Normalize(ImageTransform):
    """See ``normalize``."""

    kind = "normalize"

    def __init__(self, mean: Sequence[float], std: Sequence[float], field: str):
        m = [float(v) for v in mean]
        s = [float(v) for v in std]
        if len(m) != len(s) or not m or not all(v > 0 for v in s):
            raise ValueError(
                f"{self.kind}: mean {mean} and std {std} need one positive std per channel"
            )
        self.mean, self.std = m, s
        self._named(field)

    def transform(self, image: np.ndarray, rng: np.random.Generator | None) -> np.ndarray:
        chw = (image[None] if image.ndim == 2 else image.transpose(2, 0, 1)).astype(np.float32)
        if chw.shape[0] != len(self.mean):
            raise ValueError(
                f"the image has {chw.shape[0]} channel(s), mean and std {len(self.mean)}"
            )
        m = np.asarray(self.mean, dtype=np.float32).reshape(-1, 1, 1)
        s = np.asarray(self.std, dtype=np.float32).reshape(-1, 1, 1)
        return (chw / np.float32(255.0) - m) / s


def normalize(mean: Sequence[float], std: Sequence[float], *, field: str = "image") -> Normalize:
    """Each ``uint8`` HWC image to a ``float32`` CHW array ``(x / 255 - mean) / std`` per
    channel (the last step before a vision encoder)."""
    return Normalize(mean, std, field)
