"""``open_source``: one URI (or a list of paths) to the source that reads it, by its layout.

What decides, in order:

- ``hf://org/dataset[/subset]/split``: a dataset already in the Hugging Face ``datasets`` cache
  (``$HF_DATASETS_CACHE``, else ``$HF_HOME/datasets``, else ``~/.cache/huggingface/datasets``):
  the split's Arrow files under ``org___dataset/subset/<version>/<hash>/`` (subset ``default``
  when not given), read by ``ArrowSource``. The hub is never contacted.
- a directory holding ``index.json``: Mosaic MDS (``MDSSource``) or LitData
  (``LitDataSource``), told apart by the index's keys; ``dataset_info.json`` and ``state.json``:
  a ``datasets`` ``save_to_disk`` directory (its ``state.json`` data files, by ``ArrowSource``);
  a ``.lance`` directory, or one holding ``_versions`` and ``data`` (``LanceSource``);
- otherwise the file names, a directory's files at any depth: ``.parquet`` / ``.pq`` /
  ``.arrow`` / ``.feather`` / ``.ipc`` / ``.arrows`` (``ArrowSource``), ``.jsonl`` / ``.ndjson``
  (``JsonlSource``), ``.idx`` with its ``.bin`` and ``.npy`` (``TokenShardSource``), ``.tar``
  (WebDataset shards, ``WebDatasetSource``).

A layout that is none of these, or mixes two, is a ``PlanError`` listing what was found; so is a
directory holding files the chosen source would read but no format here names (``.json`` beside
``.jsonl``: a metadata file would be read as samples).
"""

from __future__ import annotations

import json
import os
import posixpath
import re
from collections import Counter
from collections.abc import Iterable
from typing import Any

from zephon.errors import PlanError
from zephon.sources.arrow import ArrowSource
from zephon.sources.files import FileSource
from zephon.sources.jsonl import JsonlSource
from zephon.sources.lance import LanceSource
from zephon.sources.litdata import LitDataSource
from zephon.sources.locations import filesystem_and_path
from zephon.sources.mds import MDSSource
from zephon.sources.token_shards import TokenShardSource
from zephon.sources.webdataset import WebDatasetSource

__all__ = ["hf_cache_dir", "open_source"]

#: File name endings and the format they mean.
_FAMILIES = {
    ".parquet": "arrow",
    ".pq": "arrow",
    ".arrow": "arrow",
    ".feather": "arrow",
    ".ipc": "arrow",
    ".arrows": "arrow",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".idx": "tokens",
    ".npy": "tokens",
    ".tar": "webdataset",
}
_SOURCES: dict[str, type[FileSource]] = {
    "arrow": ArrowSource,
    "jsonl": JsonlSource,
    "tokens": TokenShardSource,
    "webdataset": WebDatasetSource,
}
_SIDECARS = (".zsum", ".zidx")
_HF_URI = re.compile(r"^hf://([^/]+)/([^/]+)(?:/([^/]+))?/([^/]+)/?$")


def open_source(uri_or_paths: Any, **kw: Any) -> FileSource:
    """The source that reads ``uri_or_paths`` (a path, a URI, a glob, or a list of files of one
    format), built with ``kw`` (``chunk_size=``, ``shuffle=``, ``columns=``, ``eos_id=``...);
    see the module docstring for how the format is found. PlanError for a layout it cannot read,
    naming what it found."""
    if isinstance(uri_or_paths, (str, os.PathLike)):
        item = os.fspath(uri_or_paths)
        if item.startswith("hf://"):
            return ArrowSource(_hf_cache_files(item), **kw)
        return _open_one(item, kw)
    items = [_megatron_index(os.fspath(p), kw) or os.fspath(p) for p in uri_or_paths]
    if not items:
        raise PlanError("open_source: no paths given")
    families = {_family_of(p) for p in items}
    if len(families) != 1 or None in families:
        found = Counter(_family_of(p) or posixpath.splitext(p)[1] or p for p in items)
        raise PlanError(
            f"open_source: the paths are not of one readable format (found {dict(found)}); give "
            "one source per format"
        )
    (family,) = families
    assert family is not None
    return _SOURCES[family](items, **kw)


def _family_of(path: str) -> str | None:
    return _FAMILIES.get(posixpath.splitext(path.rstrip("/"))[1].lower())


def _megatron_index(item: str, kw: dict[str, Any]) -> str | None:
    """The ``.idx`` of a Megatron ``.bin`` file (or of a glob of them) when it is one, without
    ``dtype=`` (which reads ``.bin`` files as raw tokens); None otherwise."""
    if not item.endswith(".bin") or kw.get("dtype") is not None:
        return None
    import pyarrow.fs as pafs

    idx = item[: -len(".bin")] + ".idx"
    fs, path = filesystem_and_path(idx, kw.get("filesystem"), "open_source")
    if re.search(r"[*?\[]", path) or fs.get_file_info(path).type == pafs.FileType.File:
        return idx
    return None


def _open_one(item: str, kw: dict[str, Any]) -> FileSource:
    import pyarrow.fs as pafs

    idx = _megatron_index(item, kw)
    if idx is not None:
        return TokenShardSource(idx, **kw)
    fs, path = filesystem_and_path(item, kw.get("filesystem"), "open_source")
    if re.search(r"[*?\[]", path):
        family = _family_of(path)
        if family is None:
            raise PlanError(
                f"open_source: cannot tell the format of the glob {item!r} from its suffix; "
                "build the source yourself (ArrowSource, JsonlSource, TokenShardSource, "
                "WebDatasetSource)"
            )
        return _SOURCES[family](item, **kw)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        raise PlanError(f"open_source: {item!r} does not exist")
    if info.type == pafs.FileType.File:
        if posixpath.basename(path) == "index.json":
            return _open_one(posixpath.dirname(item) or ".", kw)
        family = _family_of(path)
        if family is None:
            raise PlanError(
                f"open_source: cannot tell the format of {item!r} from its name; readable: "
                f"{', '.join(sorted(_FAMILIES))}, Megatron .bin/.idx pairs"
            )
        return _SOURCES[family](item, **kw)
    return _open_directory(fs, path, item, kw)


def _open_directory(fs: Any, path: str, item: str, kw: dict[str, Any]) -> FileSource:
    import pyarrow.fs as pafs

    if path.rstrip("/").endswith(".lance"):
        return LanceSource(item, **kw)
    top = {
        posixpath.basename(i.path): i
        for i in fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    }
    if "index.json" in top:
        kind = _index_kind(fs, posixpath.join(path, "index.json"))
        if kind == "LitData":
            return LitDataSource(item, **kw)
        return MDSSource(item, **kw)
    if "dataset_info.json" in top and "state.json" in top:
        return ArrowSource(_saved_dataset_files(fs, path, item), **kw)
    if "_versions" in top and "data" in top:
        return LanceSource(item, **kw)
    files = [
        i.path
        for i in fs.get_file_info(pafs.FileSelector(path, recursive=True))
        if i.type == pafs.FileType.File and not _hidden(posixpath.relpath(i.path, path))
    ]
    families = Counter(_family_of(f) for f in files)
    readable = {f: n for f, n in families.items() if f is not None}
    found = _found(files, path)
    if len(readable) == 1:
        (family,) = readable
        source = _SOURCES[family]
        # Files the source's own listing keeps that name no format here (JsonlSource's .json,
        # often a metadata file): it would read them as samples.
        extra = [f for f in files if _family_of(f) is None and f.endswith(source.SUFFIXES)]
        if not extra:
            return source(item, **kw)
        data = Counter(posixpath.splitext(f)[1] for f in files if _family_of(f) == family)
        glob = posixpath.join(item, "**", "*" + data.most_common(1)[0][0])
        raise PlanError(
            f"open_source: {item!r} mixes formats ({found}); {source.__name__} would read the "
            f"{', '.join(sorted({posixpath.splitext(f)[1] for f in extra}))} files as data too: "
            f"give a glob of the data files (e.g. {glob!r}), or {source.__name__}({item!r}) to "
            "read them all"
        )
    if not readable:
        raise PlanError(
            f"open_source: {item!r} holds no file of a readable format (found {found}); "
            f"readable: {', '.join(sorted(_FAMILIES))}, MDS, LitData, Lance and HF datasets "
            "directories"
        )
    raise PlanError(
        f"open_source: {item!r} mixes formats ({found}); give one source per format, e.g. "
        "a glob per suffix"
    )


def _hidden(relative: str) -> bool:
    return any(p[:1] in (".", "_") for p in relative.split("/")) or relative.endswith(_SIDECARS)


def _found(files: Iterable[str], root: str) -> str:
    counts = Counter(posixpath.splitext(f)[1] or posixpath.relpath(f, root) for f in files)
    return ", ".join(f"{n} {ext}" for ext, n in sorted(counts.items())) or "nothing"


def _index_kind(fs: Any, path: str) -> str:
    # Mosaic MDS writes {"shards": [{"format": "mds", ...}], "version": 2}; LitData writes
    # {"chunks": [...], "config": {...}}.
    with fs.open_input_stream(path) as fh:
        try:
            index = json.loads(fh.read())
        except ValueError as exc:
            raise PlanError(f"open_source: {path!r} is not valid JSON: {exc}") from None
    if isinstance(index, dict) and "shards" in index:
        return "Mosaic MDS"
    if isinstance(index, dict) and "chunks" in index and "config" in index:
        return "LitData"
    keys = sorted(index) if isinstance(index, dict) else type(index).__name__
    raise PlanError(
        f"open_source: {path!r} is neither a Mosaic MDS nor a LitData index (it holds {keys})"
    )


def _saved_dataset_files(fs: Any, path: str, item: str) -> list[str]:
    # A save_to_disk directory lists its Arrow files in state.json, in order.
    with fs.open_input_stream(posixpath.join(path, "state.json")) as fh:
        state = json.loads(fh.read())
    names = [f.get("filename") for f in state.get("_data_files", [])]
    if not names or not all(isinstance(n, str) for n in names):
        raise PlanError(f"open_source: {item!r}/state.json lists no data files")
    return [posixpath.join(item.rstrip("/"), n) for n in names]


def hf_cache_dir() -> str:
    """Where ``datasets`` caches prepared datasets: ``$HF_DATASETS_CACHE``, else
    ``$HF_HOME/datasets``, else ``~/.cache/huggingface/datasets``."""
    explicit = os.environ.get("HF_DATASETS_CACHE")
    if explicit:
        return explicit
    home = os.environ.get("HF_HOME") or os.path.join(
        os.path.expanduser("~"), ".cache", "huggingface"
    )
    return os.path.join(home, "datasets")


def _hf_cache_files(uri: str) -> list[str]:
    match = _HF_URI.match(uri)
    if match is None:
        raise PlanError(f"open_source: {uri!r} is not hf://org/dataset[/subset]/split")
    org, name, subset, split = match.groups()
    root = os.path.join(hf_cache_dir(), f"{org}___{name}", subset or "default")
    if not os.path.isdir(root):
        raise PlanError(
            f"open_source: {uri!r} is not in the Hugging Face datasets cache (no {root!r}); "
            "load_dataset it once, or point HF_DATASETS_CACHE / HF_HOME at its cache"
        )
    pattern = re.compile(rf"^.+-{re.escape(split)}(?:-\d{{5}}-of-\d{{5}})?\.arrow$")
    builds = sorted(
        os.path.join(root, version, digest)
        for version in os.listdir(root)
        if os.path.isdir(os.path.join(root, version))
        for digest in os.listdir(os.path.join(root, version))
        if os.path.isdir(os.path.join(root, version, digest))
    )
    hits = {b: sorted(f for f in os.listdir(b) if pattern.match(f)) for b in builds}
    hits = {b: f for b, f in hits.items() if f}
    if len(hits) != 1:
        what = "no build holds" if not hits else f"{len(hits)} builds ({sorted(hits)}) hold"
        raise PlanError(
            f"open_source: {uri!r}: {what} Arrow files of split {split!r} under {root!r}; "
            "give the files themselves"
        )
    ((build, names),) = hits.items()
    return [os.path.join(build, n) for n in names]
