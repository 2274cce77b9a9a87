"""LanceSource: a Lance dataset (a ``.lance`` directory, local or in an object store), read by
``pylance``, which is imported when the dataset is first opened, never with ``zephon``.

Shards are the dataset's fragments, in the order its manifest lists them; ``sample_idx`` is the
global row index across them, as for every ``FileSource`` (deleted rows are not counted: a
fragment's rows are the ones its deletion file keeps). A read asks each fragment only for the
rows of the chunk (``LanceFragment.take``), with the chosen ``columns``.

Versions. The source opens the version it is given (``version=``), else the latest one, once,
and reads that version for its whole life, in every worker process: Lance never changes a
version once written, so an append or an overwrite made while a job runs is not seen by it. The
fingerprint carries the version and, per fragment, its id, row counts, data files (name, size
and a digest of each file's footer, which holds the layout of all its pages) and deletion file.
A checkpoint taken on version ``v`` therefore resumes only on the same content: after the
dataset was appended to or overwritten, the mismatch names both versions; build the source with
``version=v`` (the version the checkpoint's source read, ``source.pinned_version``) to finish
the run on it, as long as
``v`` was not removed by ``cleanup_old_versions``; a version that no longer exists is a
``FetchError`` naming it.

Object stores. The URI is handed to Lance with ``storage_options`` (Lance's own keys); an
``http://`` endpoint (``AWS_ENDPOINT_URL``, or ``endpoint`` in the options) gets
``allow_http``, and the request deadline is the source's ``timeout``.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from zephon.errors import FetchError, PlanError
from zephon.sources.arrow_rows import table_rows
from zephon.sources.files import FileOptions, FileSource, content_digest
from zephon.sources.locations import DataFile
from zephon.sources.remote import is_transient

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["LanceSource"]

#: Bytes at the end of each data file digested for the fingerprint (its footer and page table).
FOOTER_BYTES = 64 << 10


@dataclass(frozen=True)
class _Fragment:
    """What the manifest says of one fragment: the part of its identity a reopened dataset must
    match, without reading any data file."""

    fragment_id: int
    rows: int
    manifest: str  # sha256 of its id, row counts, data files (name, size) and deletion file


class LanceSource(FileSource):
    """A Lance dataset (``path``: its ``.lance`` directory or URI): one sample per row, its
    payload ``{column: value}`` for ``columns`` (all, in schema order, when None), values as
    ``ArrowSource`` gives them (numeric lists as numpy arrays). ``version`` pins the version
    read (None: the latest when first opened); ``storage_options`` go to Lance as they are.
    See the module docstring for versions and identity.

    Invariant: every read comes from the one version ``pinned_version`` names; a fragment that
    no longer matches what the source first saw raises ``FetchError`` naming it.

    Every file source also takes the ``FileOptions`` (``dataset_id``, ``chunk_size``,
    ``shuffle``, ``seed``, ``passes``, ``threads`` and the storage deadlines ``timeout`` and
    ``total_timeout``); Lance reads through its own object store, so ``filesystem`` and the
    shard ``cache`` are refused, and it writes no sidecar (``index_dir`` and ``cache_dir`` are
    unused). The footers digested for the fingerprint are read with the storage settings of the
    environment, as every other file source reads.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        columns: list[str] | None = None,
        version: int | None = None,
        storage_options: dict[str, str] | None = None,
        **options: Unpack[FileOptions],
    ) -> None:
        if options.get("filesystem") is not None:
            raise ValueError(
                "LanceSource reads through Lance's own object store; give storage_options= "
                "instead of filesystem="
            )
        if options.get("cache") is not None:
            raise ValueError(
                "LanceSource reads through Lance's own object store, which a ShardCache cannot "
                "stand in front of; leave out cache="
            )
        super().__init__(path, **options)
        if len(self._locations.paths) != 1:
            raise ValueError("LanceSource: give one Lance dataset (its .lance directory)")
        if columns is not None and (
            isinstance(columns, str) or not all(isinstance(c, str) for c in columns)
        ):
            raise TypeError(f"LanceSource: columns must be a list of str, got {columns!r}")
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
            raise TypeError(f"LanceSource: version must be an int or None, got {version!r}")
        if storage_options is not None and not isinstance(storage_options, dict):
            raise TypeError(
                f"LanceSource: storage_options must be a dict of str, got {storage_options!r}"
            )
        self.columns = None if columns is None else list(columns)
        self.version = version
        self.storage_options = dict(storage_options or {})
        self.pinned_version: int | None = None
        self._fragments: list[_Fragment] = []
        self._identities: list[str] = []
        self._footers: list[list[str]] = []
        self._selected: list[str] = []
        self._dataset: Any = None
        self._checked: dict[int, Any] = {}
        self._open_lock = threading.Lock()

    # --------------------------------------------------------------------- the dataset
    @property
    def uri(self) -> str:
        """The dataset as Lance is given it: a local path or ``scheme://bucket/key``."""
        return self._locations.uri(self._locations.paths[0].rstrip("/"))

    def lance_storage_options(self) -> dict[str, str]:
        """The options Lance opens the dataset with (see the module docstring)."""
        opts = dict(self.storage_options)
        if self.is_local:
            return opts
        endpoint = opts.get("endpoint") or opts.get("aws_endpoint") or ""
        endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL_S3", "")
        endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL", "")
        if endpoint.startswith("http://"):
            opts.setdefault("allow_http", "true")
        opts.setdefault("timeout", f"{self.retry_policy.timeout:g}s")
        return opts

    def _open(self, version: int | None) -> Any:
        import lance

        def attempt() -> Any:
            try:
                return lance.dataset(
                    self.uri, version=version, storage_options=self.lance_storage_options()
                )
            except OSError as exc:
                if not self.is_local and is_transient(exc):
                    raise
                raise self._open_error(version, exc) from exc
            except (ValueError, RuntimeError) as exc:
                raise self._open_error(version, exc) from exc

        return self.with_retries(attempt, lambda: f"LanceSource opening {self.uri!r}")

    def _open_error(self, version: int | None, exc: BaseException) -> FetchError:
        which = "its latest version" if version is None else f"version {version}"
        hint = (
            " (a version removed by cleanup_old_versions cannot be read again; resume from a "
            "checkpoint of a version that still exists)"
            if version is not None
            else ""
        )
        return FetchError(
            f"LanceSource cannot open {which} of {self.uri!r}: {type(exc).__name__}: {exc}{hint}"
        )

    def dataset(self) -> Any:
        """The ``lance.LanceDataset`` at ``pinned_version``, opened once per process."""
        ds = self._dataset
        if ds is None:
            self.file_ends()
            with self._open_lock:
                if self._dataset is None:
                    self._dataset = self._open(self.pinned_version)
                ds = self._dataset
        return ds

    def list_files(self) -> tuple[str, list[DataFile]]:
        """One entry per fragment of the version opened (which it pins), in manifest order."""
        ds = self._open(self.version)
        self.pinned_version = int(ds.version)
        with self._open_lock:
            self._dataset = ds
        root = self._locations.paths[0].rstrip("/")
        files = []
        for frag in ds.get_fragments():
            data = frag.data_files()
            first = posixpath.join(root, "data", data[0].path) if data else root
            size = sum(int(d.file_size_bytes or 0) for d in data)
            fid = int(frag.fragment_id)
            files.append(
                DataFile(first, f"{self.uri}#fragment={fid}", f"fragment-{fid}", size, None)
            )
        if not files:
            raise FetchError(
                f"LanceSource: version {self.pinned_version} of {self.uri!r} holds no fragment"
            )
        return self.uri, files

    # --------------------------------------------------------------------- metadata
    def column_names(self) -> list[str]:
        """Every column of the dataset, in schema order."""
        return list(self.dataset().schema.names)

    def load_metadata(self) -> list[int]:
        """Check the columns, then take each fragment's manifest identity and digest the footer
        of its data files (in parallel for remote data); the row count of each."""
        ds = self._dataset
        names = list(ds.schema.names)
        wanted = self.columns if self.columns is not None else names
        unknown = [c for c in wanted if c not in names]
        if unknown:
            raise PlanError(f"LanceSource: no column {unknown} in {self.uri!r}; it has {names}")
        self._selected = list(wanted)
        fragments = [_describe_fragment(f) for f in ds.get_fragments()]
        self._fragments = [f for f, _ in fragments]
        self._identities = [f.manifest for f in self._fragments]
        footers = self.parallel(self._footer_digests, [files for _, files in fragments])
        self._footers = footers
        return [f.rows for f in self._fragments]

    def _footer_digests(self, files: list[tuple[str, int]]) -> list[str]:
        root = self._locations.paths[0].rstrip("/")

        def one(name: str, size: int) -> str:
            where = posixpath.join(root, "data", name)
            want = min(size, FOOTER_BYTES)
            try:
                with self._locations.open_random(where) as fh:
                    tail = fh.read_at(want, size - want)
            except OSError as exc:
                if not self.is_local and is_transient(exc):
                    raise
                raise FetchError(
                    f"LanceSource cannot read the data file {self._locations.uri(where)!r} of "
                    f"{self.uri!r}: {type(exc).__name__}: {exc}"
                ) from exc
            if len(tail) != want:
                raise FetchError(
                    f"LanceSource: the data file {self._locations.uri(where)!r} holds fewer "
                    f"than the {size} bytes the manifest of version {self.pinned_version} says"
                )
            return f"{content_digest(tail):016x}"

        out: list[str] = self.with_retries(
            lambda: [one(name, size) for name, size in files],
            lambda: f"LanceSource digesting the data files of {self.uri!r}",
        )
        return out

    def _fragment(self, i: int) -> Any:
        # The fragment of the pinned version; after unpickling it must still be the one the
        # source first described (the same version cannot change, but check what we read).
        frag = self._checked.get(i)
        if frag is not None:
            return frag
        ds = self.dataset()
        fid = self._fragments[i].fragment_id
        frag = ds.get_fragment(fid)
        if frag is None or _describe_fragment(frag)[0].manifest != self._identities[i]:
            raise self.fetch_error(
                i,
                f"fragment {fid} of version {self.pinned_version} is not the one this source "
                "described; build a new source (its fingerprint will differ from old checkpoints)",
            )
        with self._open_lock:
            self._checked[i] = frag
        return frag

    # --------------------------------------------------------------------- reading
    def read_file(
        self,
        i: int,
        positions: np.ndarray,
        rows: np.ndarray,
        local: np.ndarray,
        out: list[Any],
    ) -> None:
        idx = local[positions]
        pointer = rows[positions[0]]

        def take() -> Any:
            frag = self._fragment(i)
            try:
                return frag.take(idx.tolist(), columns=self._selected)
            except OSError as exc:
                raise self.os_error(exc, i, pointer) from exc
            except (ValueError, RuntimeError) as exc:
                raise self.fetch_error(i, f"{type(exc).__name__}: {exc}", pointer) from exc

        table = self.read_retried(i, take)
        if table.num_rows != len(idx):
            raise self.fetch_error(
                i, f"asked for {len(idx)} rows, Lance returned {table.num_rows}", pointer
            )
        payloads = table_rows(table, np.arange(len(idx)), self._selected)
        for pos, payload in zip(positions.tolist(), payloads, strict=True):
            out[pos] = payload

    # --------------------------------------------------------------------- identity
    def describe(self) -> dict[str, Any]:
        """Chunking parameters, the columns read, the version, and per fragment its id, rows
        and content identity (manifest entry and data file footers)."""
        out = self.describe_files()
        out["columns"] = list(self._selected)
        # Named so that it sorts before "files": a checkpoint mismatch names the versions first.
        out["dataset_version"] = self.pinned_version
        out["files"] = [
            {
                "name": f.name,
                "samples": frag.rows,
                "content_sha256": _content(frag, footers),
            }
            for f, frag, footers in zip(self.files(), self._fragments, self._footers, strict=True)
        ]
        return out

    def drop_read_caches(self) -> None:
        """Close the dataset handle (its readers' caches); the next read opens it again."""
        with self._open_lock:
            self._dataset = None
            self._checked = {}

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_dataset"] = None
        state["_checked"] = {}
        del state["_open_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._open_lock = threading.Lock()


def _describe_fragment(frag: Any) -> tuple[_Fragment, list[tuple[str, int]]]:
    """The fragment's manifest identity, and its data files as ``(name, size)``."""
    meta = frag.metadata
    files = [(str(d.path), int(d.file_size_bytes or 0)) for d in meta.files]
    deletion = frag.deletion_file()
    entry = {
        "id": int(frag.fragment_id),
        "physical_rows": int(meta.physical_rows),
        "files": [
            [name, size, list(d.fields)] for (name, size), d in zip(files, meta.files, strict=True)
        ],
        "deletion": None if deletion is None else posixpath.basename(str(deletion)),
    }
    manifest = hashlib.sha256(b"zephon lance fragment 1")
    manifest.update(json.dumps(entry, sort_keys=True).encode())
    rows = int(frag.count_rows())
    return _Fragment(int(frag.fragment_id), rows, manifest.hexdigest()), files


def _content(frag: _Fragment, footers: list[str]) -> str:
    h = hashlib.sha256(frag.manifest.encode())
    h.update(str(frag.rows).encode())
    for f in footers:
        h.update(f.encode())
    return h.hexdigest()
