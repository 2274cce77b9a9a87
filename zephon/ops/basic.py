"""Built-ins: ``fetch`` (pointers to records), ``map_transform``, ``filter_records``."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from zephon._core.records import RecordRun, counted_run, map_payloads, map_run
from zephon.errors import FetchError, OperatorError
from zephon.ops.base import Operator, OpTraits, record_error
from zephon.ops.children import tombstones_for_record
from zephon.sources.base import WorkSource
from zephon.types import SampleRecord
from zephon.validation import check_int

__all__ = [
    "Fetch",
    "FilterRecords",
    "MapBatch",
    "MapTransform",
    "fetch",
    "filter_records",
    "map_batch",
    "map_transform",
    "record_error",
]


class Fetch(Operator):
    """Turns a chunk's pointers into records: cursor ``(chunk_id, i, pointer, ())`` for row i."""

    name = "fetch"
    consumes_pointers = True
    traits = OpTraits(preserves_cursor_order=True, preserves_indexability=True)

    def __init__(self, reader: Callable[[np.ndarray], list] | None = None, *, retries: int = 3):
        retries = check_int(retries, "retries", "fetch", minimum=0)
        self.reader = reader
        self.retries = retries
        self._source: Any = None

    def bind(self, source: Any) -> None:
        """Attach the pipeline's source (its reader is the default, its components are used)."""
        self._source = source
        # A source whose components are its dataset ids leaves them to the run's pointer rows.
        self._ids_are_components = type(source).components is WorkSource.components
        # Pre-tokenized data read by the source itself: each record counts the tokens of this
        # field for its component.
        self._token_field = None if self.reader else getattr(source, "token_field", None)

    def fetch(self, chunk_id: int, pointers: np.ndarray, first_offset: int) -> RecordRun:
        """Records for rows ``first_offset ..`` of chunk ``chunk_id``, as one run; when the
        source is pre-tokenized (its ``token_field``), each counted as one sample of its
        component with as many tokens as that field holds."""
        read = self.reader or self._source.read
        try:
            payloads = read(pointers)
        except FetchError:
            raise
        except OSError as exc:  # perhaps transient: try again
            payloads = self._read_again(read, pointers, exc)
        if len(payloads) != len(pointers):
            raise FetchError(
                f"reader returned {len(payloads)} payloads for {len(pointers)} pointers "
                f"(chunk {chunk_id}, first pointer {pointers[0].tolist()})"
            )
        components = None if self._ids_are_components else self._source.components(pointers)
        run = RecordRun(
            chunk_id,
            pointers,
            payloads if type(payloads) is list else list(payloads),
            self.lane_id,
            components if components is None or type(components) is list else list(components),
            first_offset,
        )
        field = self._token_field
        if field is None:
            return run
        # As tokenize does: the record is one sample of its component, this many tokens long.
        return counted_run(run, field)

    def _read_again(
        self, read: Callable[[np.ndarray], list], pointers: np.ndarray, failed: OSError
    ) -> list:
        # After a first attempt failed: ``retries`` more, backing off between attempts.
        delay = 0.05
        for _ in range(self.retries):
            time.sleep(delay)
            delay *= 2
            try:
                return read(pointers)
            except FetchError:
                raise
            except OSError as exc:
                failed = exc
        raise FetchError(
            f"could not read pointers {pointers[0].tolist()}..{pointers[-1].tolist()} "
            f"after {self.retries + 1} attempts: {failed}"
        ) from failed

    def process_many(self, records: list[SampleRecord]) -> list[SampleRecord]:
        raise TypeError("fetch consumes pointers; the lane runner calls fetch() instead")


def fetch(reader: Callable[[np.ndarray], list] | None = None, *, retries: int = 3) -> Fetch:
    """The first operator of every pipeline: reads payloads for pointers (retrying ``OSError``)."""
    return Fetch(reader, retries=retries)


def _refuse_lazy(fn: Callable[..., Any], where: str, returns: str) -> None:
    """``TypeError`` for a generator or coroutine function given as a function of one payload:
    called, it only makes a generator or coroutine object, which would pass on as it is."""
    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
        kind = "generator"
    elif inspect.iscoroutinefunction(fn):
        kind = "coroutine"
    else:
        return
    name = getattr(fn, "__qualname__", type(fn).__name__)
    raise TypeError(
        f"{where}: {name} is a {kind} function: called on a payload it returns a {kind} object, "
        f"not {returns}. Return the value instead of yielding or awaiting it"
    )


class MapTransform(Operator):
    """``payload -> fn(payload)``; with ``drop_none`` a ``None`` result drops the record."""

    def __init__(
        self,
        fn: Callable[[Any], Any],
        *,
        drop_none: bool = False,
        workers: int | None = None,
        name: str | None = None,
    ):
        if not callable(fn):
            raise TypeError(f"map_transform needs a callable, got {fn!r}")
        _refuse_lazy(fn, "map_transform", "the new payload")
        if workers is not None:
            workers = check_int(workers, "workers", "map_transform", minimum=1)
        self.fn = fn
        self.drop_none = drop_none
        self.name = name or f"map_transform({getattr(fn, '__qualname__', type(fn).__name__)})"
        self.traits = OpTraits(
            preserves_cursor_order=True, preserves_indexability=not drop_none, workers=workers
        )

    @property
    def maps_payloads(self) -> bool:  # type: ignore[override]
        return not self.drop_none  # dropping a record takes its tombstones: process_many

    def map_payloads(self, run: RecordRun) -> list[Any]:
        out, i, exc = map_run(self.fn, run)
        if i < len(out):
            raise self._refused(run[i], exc)
        return out

    def process_many(self, records: list[SampleRecord]) -> list[SampleRecord]:
        # The per-record loop runs in C; it stops at a record that fails or maps to None.
        fn = self.fn
        out: list[SampleRecord] = []
        i, exc = map_payloads(fn, records, 0, out)
        while i < len(records):
            rec = records[i]
            if exc is not None or not self.drop_none:
                raise self._refused(rec, exc)
            out.extend(tombstones_for_record(rec))
            i, exc = map_payloads(fn, records, i + 1, out)
        return out

    def _refused(self, rec: SampleRecord, exc: Exception | None) -> OperatorError:
        """The error for ``rec``: ``fn`` raised ``exc``, or returned None without ``drop_none``."""
        if exc is None:
            return record_error(
                self, rec, ValueError("returned None (pass drop_none=True to drop records)")
            )
        error = record_error(self, rec, exc)
        error.__cause__ = exc
        return error


def map_transform(
    fn: Callable[[Any], Any],
    *,
    drop_none: bool = False,
    workers: int | None = None,
    name: str | None = None,
) -> MapTransform:
    """Apply ``fn`` to every payload; 1 -> 1, or 1 -> 0/1 with ``drop_none=True``."""
    return MapTransform(fn, drop_none=drop_none, workers=workers, name=name)


class MapBatch(Operator):
    """``payloads -> fn(payloads)`` once per micro-batch: ``fn`` takes the list of the micro-batch's
    payloads and returns as many new payloads, in the same order (each record keeps its meta)."""

    maps_payloads = True

    def __init__(
        self,
        fn: Callable[[list[Any]], Sequence[Any]],
        *,
        batch_sensitive: bool = False,
        workers: int | None = None,
        name: str | None = None,
    ):
        if not callable(fn):
            raise TypeError(f"map_batch needs a callable, got {fn!r}")
        if not isinstance(batch_sensitive, bool):
            raise TypeError(
                f"map_batch: batch_sensitive must be True or False, got {batch_sensitive!r}"
            )
        if workers is not None:
            workers = check_int(workers, "workers", "map_batch", minimum=1)
        self.fn = fn
        self.batch_sensitive = batch_sensitive
        self.name = name or f"map_batch({getattr(fn, '__qualname__', type(fn).__name__)})"
        # A payload that depends on its neighbours needs micro-batches cut the same way on every
        # run, and a restore that re-runs whole micro-batches rather than skipping at the source.
        self.traits = OpTraits(
            preserves_cursor_order=True,
            batch_sensitive=batch_sensitive,
            preserves_indexability=not batch_sensitive,
            workers=workers,
        )

    def map_payloads(self, run: RecordRun) -> list[Any]:
        return self._mapped(run.payloads, run)

    def process_many(self, records: list[SampleRecord]) -> list[SampleRecord]:
        payloads = self._mapped([r.payload for r in records], records)
        return [r.with_payload(p) for r, p in zip(records, payloads)]

    def _mapped(self, payloads: list[Any], records: Sequence[SampleRecord]) -> list[Any]:
        if not payloads:
            return []
        try:
            out = self.fn(payloads)
        except Exception as exc:
            raise self._refused(records, f"{type(exc).__name__}: {exc}") from exc
        if isinstance(out, (str, bytes, dict)) or not isinstance(out, Sequence):
            raise self._refused(records, f"returned {type(out).__name__}, not a list of payloads")
        if len(out) != len(payloads):
            raise self._refused(
                records, f"returned {len(out)} payloads for {len(payloads)} (one per record needed)"
            )
        return out if type(out) is list else list(out)

    def _refused(self, records: Sequence[SampleRecord], why: str) -> OperatorError:
        first, last = records[0].meta.cursor, records[len(records) - 1].meta.cursor
        return OperatorError(
            f"operator {self.name!r} failed on the micro-batch of {len(records)} records from "
            f"{first!r} (sample_id={first.sample_id}) to {last!r}: {why}",
            operator=self.name,
            cursor=first,
        )


def map_batch(
    fn: Callable[[list[Any]], Sequence[Any]],
    *,
    batch_sensitive: bool = False,
    workers: int | None = None,
    name: str | None = None,
) -> MapBatch:
    """Apply ``fn`` to the list of each micro-batch's payloads (a vectorized transform, a model
    run on many inputs at once); it returns one new payload per input, in order. With
    ``batch_sensitive=True`` a payload may depend on the others in its micro-batch, and
    micro-batches are then cut only by count and at chunk starts, the same on every run."""
    return MapBatch(fn, batch_sensitive=batch_sensitive, workers=workers, name=name)


class FilterRecords(Operator):
    """Keeps records whose payload satisfies ``predicate``; dropped ones leave their tombstones."""

    traits = OpTraits(preserves_cursor_order=True)

    def __init__(self, predicate: Callable[[Any], bool], *, name: str | None = None):
        if not callable(predicate):
            raise TypeError(f"filter_records needs a callable, got {predicate!r}")
        _refuse_lazy(predicate, "filter_records", "a bool (any object is true: it keeps all)")
        self.predicate = predicate
        qual = getattr(predicate, "__qualname__", type(predicate).__name__)
        self.name = name or f"filter_records({qual})"

    def process_many(self, records: list[SampleRecord]) -> list[SampleRecord]:
        keep = self.predicate
        out: list[SampleRecord] = []
        for rec in records:
            try:
                kept = keep(rec.payload)
            except Exception as exc:
                raise record_error(self, rec, exc) from exc
            if kept:
                out.append(rec)
            else:
                out.extend(tombstones_for_record(rec))
        return out


def filter_records(predicate: Callable[[Any], bool], *, name: str | None = None) -> FilterRecords:
    """Keep a record when ``predicate(payload)`` is true; 1 -> 0/1 with automatic tombstones."""
    return FilterRecords(predicate, name=name)
