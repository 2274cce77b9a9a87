"""Where a file source's data lives: paths, URIs, directories and globs resolved to one
filesystem, a sorted list of files and the dataset root their names are relative to.

What a source may be given (one item, or a list of items, all on one filesystem):

- a local path (relative or absolute) or a ``file://`` URI;
- ``s3://bucket/key`` (pyarrow's own ``S3FileSystem``; the endpoint from ``AWS_ENDPOINT_URL_S3``
  or ``AWS_ENDPOINT_URL``, the region from ``AWS_REGION`` or ``AWS_DEFAULT_REGION``, credentials
  the way the AWS SDK finds them), ``gs://`` / ``gcs://`` (pyarrow's ``GcsFileSystem``; a GCS
  emulator from ``STORAGE_EMULATOR_HOST`` or ``CLOUD_STORAGE_EMULATOR_ENDPOINT``, reached without
  credentials, as Google's client libraries do);
- any other ``protocol://`` that fsspec knows, when fsspec is installed;
- with ``filesystem=`` (a ``pyarrow.fs.FileSystem`` or an fsspec filesystem), paths on it, with
  or without their scheme.

Each item is a file, a directory (every file below it, at any depth, whose name ends with one of
the source's suffixes, skipping names that start with ``.`` or ``_``), or a glob (``*`` and ``?``
within a name, ``[...]``, ``**`` for any number of directories). A directory's or a glob's files
are sorted by their path; a list keeps its order, each item expanded in place; a file met twice
is refused.

The dataset root is the directory given, the glob's base (the directories before its first
wildcard), or for a file its directory; for a list, the deepest directory holding every item's
root. A file's *name* is its path relative to that root, with ``/`` separators: what the pipeline
fingerprint records, so the same files under another mount point or in a bucket copy keep their
identity.

Construction only parses: nothing is listed or opened until ``resolve`` is called (a source calls
it on first need of its metadata).

Deadlines. A source's filesystem made here gives up on a request after ``timeout`` seconds and
makes no retries of its own (``S3FileSystem``: its connect and request timeouts, one attempt;
GCS: its client retries for ``timeout`` seconds at most): the source's retry loop owns the
retries (``zephon.sources.remote``), so the two never multiply. A filesystem passed in keeps its
own; so does one made for ``filesystem_and_path``, which has no retry loop above it.
"""

from __future__ import annotations

import os
import posixpath
import re
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from zephon.errors import FetchError

if TYPE_CHECKING:
    pass

__all__ = [
    "VERSION_KEYS",
    "DataFile",
    "Locations",
    "UriFilesystems",
    "default_cache_dir",
    "parse_locations",
]

_GLOB_CHARS = re.compile(r"[*?\[]")
#: Names a directory listing or a glob never yields: hidden files, ``_SUCCESS``-style markers,
#: and the sidecars Zephon writes itself.
_SIDECAR_SUFFIXES = (".zsum", ".zidx")
#: What names one version of a stored object, as pyarrow's S3 and fsspec's S3/GCS filesystems
#: call it, the most precise first: a version id (a versioned bucket) or a generation changes on
#: every write, an ETag with the content.
VERSION_KEYS = ("VersionId", "generation", "ETag", "etag")


def default_cache_dir() -> str:
    """Where metadata of data that cannot hold its own sidecars is cached: ``$ZEPHON_CACHE_DIR``,
    else ``$XDG_CACHE_HOME/zephon``, else ``~/.cache/zephon``."""
    explicit = os.environ.get("ZEPHON_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "zephon")


@dataclass(frozen=True)
class DataFile:
    """One resolved file: where it is on the filesystem, what messages call it, its name relative
    to the dataset root, and its size and mtime from the listing."""

    path: str  # on the filesystem
    uri: str  # in messages: the local path, or scheme://path
    name: str  # relative to the dataset root, ``/``-separated
    size: int
    mtime_ns: int | None


class Locations:
    """The items a source was given, parsed onto one filesystem; ``resolve()`` lists them.

    Pickles with its filesystem (pyarrow filesystems and most fsspec ones pickle; an ``s3://``
    one made here, as the settings it was made from), never with a listing: a process that
    receives it gets the resolved files from its owner.
    """

    def __init__(self, items: list[str], filesystem: Any, owner: str, timeout: float) -> None:
        self.owner = owner
        self.items = items
        found, self.scheme, self.paths = _parse(items, filesystem, owner, timeout)
        self._settings = found if isinstance(found, _S3Settings) else None
        self.filesystem = found.build() if isinstance(found, _S3Settings) else found

    @property
    def is_local(self) -> bool:
        """True when the files are on the local filesystem (memory-mapped, sidecars beside)."""
        return self.scheme == ""

    def uri(self, path: str) -> str:
        """How messages name ``path`` of this filesystem."""
        return path if self.is_local else f"{self.scheme}://{path}"

    def resolve(
        self, suffixes: tuple[str, ...], run: Callable[[Callable[[str], Any], list[str]], list[Any]]
    ) -> tuple[str, list[DataFile]]:
        """``(root uri, files)``: every item expanded to its sorted files, named relative to the
        dataset root. ``run(fn, paths)`` maps ``fn`` over paths (in parallel, bounded) to stat
        the explicit files. FetchError naming the item for a missing path or an empty match."""
        import pyarrow.fs as pafs

        fs = self.filesystem
        explicit = [p for p in self.paths if not _GLOB_CHARS.search(p)]
        infos = dict(zip(explicit, run(lambda p: fs.get_file_info(p), explicit), strict=True))
        found: list[list[tuple[str, int, int | None]]] = []
        roots: list[str] = []
        for item, path in zip(self.items, self.paths, strict=True):
            if _GLOB_CHARS.search(path):
                base, matches = _glob(fs, path)
                roots.append(base)
                found.append(matches)
                if not matches:
                    raise FetchError(f"{self.owner}: the glob {item!r} matches no file")
                continue
            info = infos[path]
            if info.type == pafs.FileType.NotFound:
                raise FetchError(
                    f"{self.owner} cannot read {self.uri(path)!r}: FileNotFoundError: no such file"
                )
            if info.type == pafs.FileType.Directory:
                roots.append(path)
                files = _listing(fs, path, lambda name: name.endswith(suffixes))
                if not files:
                    raise FetchError(
                        f"{self.owner}: the directory {item!r} holds no file ending with "
                        f"{' or '.join(suffixes)}"
                    )
                found.append(files)
            else:
                roots.append(posixpath.dirname(path))
                found.append([(path, int(info.size), info.mtime_ns)])
        root = _common_dir(roots)
        out: list[DataFile] = []
        seen: dict[str, str] = {}
        for item, files in zip(self.items, found, strict=True):
            for path, size, mtime in files:
                if path in seen:
                    raise ValueError(
                        f"{self.owner}: {self.uri(path)!r} is given twice (by {seen[path]!r} "
                        f"and {item!r})"
                    )
                seen[path] = item
                name = posixpath.relpath(path, root) if root else path.lstrip("/")
                out.append(DataFile(path, self.uri(path), name, size, mtime))
        return self.uri(root), out

    def version(self, path: str, opened: Any) -> str:
        """What names the version of the object at ``path`` (``opened``: a file just opened on
        it), e.g. ``'ETag "9b2c..."'``: the first of ``VERSION_KEYS`` the store gives, from the
        opened file's metadata (pyarrow's S3 gives it with every open) or from fsspec's ``info``.
        ``""`` for local files and for a store that gives none (its content digests decide)."""
        if self.is_local:
            return ""
        found = {k: v.decode() if isinstance(v, bytes) else v for k, v in opened.metadata().items()}
        handler: Any = getattr(self.filesystem, "handler", None)
        if not found and hasattr(handler, "fs"):  # an fsspec filesystem behind pyarrow's wrapper
            found = handler.fs.info(path)
        for key in VERSION_KEYS:
            if found.get(key):
                return f"{key} {found[key]}"
        return ""

    def open_random(self, path: str) -> Any:
        """``path`` opened for random access: a memory map for local files."""
        if self.is_local:
            import pyarrow as pa

            return pa.memory_map(path, "r")
        return self.filesystem.open_input_file(path)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._settings is not None:
            state["filesystem"] = None  # made again from its settings, see _S3Settings
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self._settings is not None:
            self.filesystem = self._settings.build()


def parse_locations(paths: Any, filesystem: Any, owner: str, timeout: float) -> Locations:
    """``paths`` (one item or an iterable of items) as ``Locations``, whose filesystem (when
    made here) gives up on a request after ``timeout`` seconds; TypeError or ValueError naming
    ``owner`` for anything that is not a path, a URI or a glob."""
    if isinstance(paths, bytes):
        raise TypeError(f"{owner}: paths must be str or os.PathLike, got bytes {paths!r}")
    if isinstance(paths, (str, os.PathLike)):
        items: list[Any] = [paths]
    else:
        try:
            items = list(paths)
        except TypeError:
            raise TypeError(f"{owner}: paths must be a path or an iterable of paths") from None
    out = []
    for p in items:
        if not isinstance(p, (str, os.PathLike)):
            raise TypeError(f"{owner}: every path must be str or os.PathLike, got {p!r}")
        out.append(os.fspath(p))
    if not out:
        raise ValueError(f"{owner}: paths is empty (did a glob match nothing?)")
    return Locations(out, filesystem, owner, timeout)


# ------------------------------------------------------------------------- filesystems


def _scheme_of(item: str) -> str:
    match = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://", item)
    return match.group(1).lower() if match else ""


# A URI whose "//" was collapsed to "/": the scheme takes two letters at least (a drive letter
# takes one), and "file:/path" is a file URI as it stands.
_COLLAPSED_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):/(?!/)")


def collapsed_uri(path: str) -> str | None:
    """The URI of storage that ``pathlib.Path`` made ``path`` of (``Path("s3://bucket/key")``
    is ``s3:/bucket/key``), or None when ``path`` is not one."""
    match = _COLLAPSED_URI.match(path)
    if match is None or match.group(1).lower() == "file":
        return None
    return f"{match.group(1)}://{path[match.end() :]}"


def refuse_collapsed_uri(path: str, owner: str) -> None:
    """A ValueError for a ``collapsed_uri``: taken as it is, it would be read from or written to
    a directory named ``s3:`` under the working directory."""
    uri = collapsed_uri(path)
    if uri is not None:
        raise ValueError(
            f"{owner}: {path!r} looks like the URI {uri!r} made into a path (pathlib.Path "
            "keeps one slash of '//'); pass the URI as a string"
        )


def local_path(path: str | os.PathLike[str], owner: str, what: str) -> str:
    """``path`` as a string, for what lives on this machine's filesystem only (a cache, a log);
    a ValueError for a URI of storage, as given or made into a ``Path`` (``collapsed_uri``),
    which would otherwise become a local directory named ``s3:``."""
    text = os.fspath(path)
    uri = collapsed_uri(text) or (text if UriFilesystems.is_uri(text) else None)
    if uri is not None:
        raise ValueError(f"{owner}: {what} is on this machine's filesystem, not at {uri!r}")
    return text


def _parse(
    items: list[str], filesystem: Any, owner: str, timeout: float, client_attempts: int = 1
) -> tuple[Any, str, list[str]]:
    # A filesystem made here waits ``timeout`` seconds for a request, and makes
    # ``client_attempts`` of it (more only where no retry loop of ours runs above it).
    import pyarrow.fs as pafs

    if filesystem is not None:
        fs, scheme = _given_filesystem(filesystem, owner)
        paths = []
        for item in items:
            given = _scheme_of(item)
            rest = item.split("://", 1)[1] if given else item
            paths.append(_local_abspath(rest) if scheme == "" else rest.rstrip("/"))
        return fs, scheme, paths
    schemes = {"" if _scheme_of(i) == "file" else _scheme_of(i) for i in items}
    if len(schemes) > 1:
        raise ValueError(
            f"{owner}: paths mix filesystems ({', '.join(sorted(s or 'local' for s in schemes))}); "
            "give one source per filesystem"
        )
    (scheme,) = schemes
    if scheme == "":
        for item in items:
            refuse_collapsed_uri(item, owner)
        paths = [_local_abspath(_from_file_uri(i)) for i in items]
        return pafs.LocalFileSystem(), "", paths
    paths = [i.split("://", 1)[1].rstrip("/") for i in items]
    if scheme == "s3":
        return _S3Settings.from_environment(timeout, client_attempts), scheme, paths
    if scheme in ("gs", "gcs"):
        return _GcsSettings.from_environment(timeout * client_attempts).build(), scheme, paths
    try:
        import fsspec
    except ImportError:
        raise ValueError(
            f"{owner}: {items[0]!r} needs fsspec for its {scheme}:// protocol (pip install "
            "fsspec), or pass filesystem="
        ) from None
    return _wrap_fsspec(fsspec.filesystem(scheme)), scheme, paths


def _given_filesystem(filesystem: Any, owner: str) -> tuple[Any, str]:
    import pyarrow.fs as pafs

    if isinstance(filesystem, pafs.LocalFileSystem):
        return filesystem, ""
    if isinstance(filesystem, pafs.FileSystem):
        return filesystem, filesystem.type_name
    protocol = getattr(filesystem, "protocol", None)
    if protocol is None or not hasattr(filesystem, "open"):
        raise TypeError(
            f"{owner}: filesystem must be a pyarrow.fs.FileSystem or an fsspec filesystem, "
            f"got {filesystem!r}"
        )
    name = protocol if isinstance(protocol, str) else protocol[0]
    if name in ("file", "local"):
        return pafs.LocalFileSystem(), ""
    return _wrap_fsspec(filesystem), name


def _wrap_fsspec(fs: Any) -> Any:
    import pyarrow.fs as pafs

    return pafs.PyFileSystem(pafs.FSSpecHandler(fs))


@dataclass(frozen=True)
class _S3Settings:
    """What an ``s3://`` filesystem made here is made of. It is pickled in the filesystem's
    stead: pyarrow pickles an ``S3FileSystem`` without its retry strategy, so a worker's copy
    would try each request three times again, under each of the source's attempts."""

    endpoint: str | None
    region: str | None
    timeout: float
    attempts: int  # the client's own, per request

    @classmethod
    def from_environment(cls, timeout: float, attempts: int) -> _S3Settings:
        # pyarrow's S3FileSystem does not read the endpoint variables itself (the AWS SDK it
        # bundles ignores them): honour them here, so a MinIO/R2/local endpoint works as for
        # the AWS CLI.
        env = os.environ
        endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
        region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
        return cls(endpoint or None, region or None, timeout, attempts)

    def build(self) -> Any:
        """The filesystem: a request that sends or receives nothing for ``timeout`` seconds
        fails (the client's request timeout, on Linux too), after ``attempts`` of it."""
        import pyarrow.fs as pafs

        return pafs.S3FileSystem(
            endpoint_override=self.endpoint,
            region=self.region,
            connect_timeout=self.timeout,
            request_timeout=self.timeout,
            retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=self.attempts),
        )


@dataclass(frozen=True)
class _GcsSettings:
    """What a ``gs://`` filesystem made here is made of: a GCS emulator's address, when the
    environment names one, and how long the client retries a request."""

    emulator: str | None  # ``http://host:port``
    retry_limit: float  # seconds

    @classmethod
    def from_environment(cls, retry_limit: float) -> _GcsSettings:
        # Google's Python clients read STORAGE_EMULATOR_HOST, its C++ client (pyarrow's)
        # CLOUD_STORAGE_EMULATOR_ENDPOINT; an emulator wants no credentials, and looking for
        # them would wait on a metadata server that is not there.
        env = os.environ
        emulator = env.get("STORAGE_EMULATOR_HOST") or env.get("CLOUD_STORAGE_EMULATOR_ENDPOINT")
        return cls(emulator or None, retry_limit)

    def build(self) -> Any:
        """The filesystem: the emulator without credentials, else Google Cloud Storage with the
        credentials Google's client finds."""
        import pyarrow.fs as pafs

        limit = timedelta(seconds=self.retry_limit)
        if self.emulator is None:
            return pafs.GcsFileSystem(retry_time_limit=limit)
        scheme, _, host = self.emulator.rpartition("://")
        return pafs.GcsFileSystem(
            anonymous=True,
            scheme=scheme or "http",
            endpoint_override=host.rstrip("/"),
            retry_time_limit=limit,
        )


def _from_file_uri(item: str) -> str:
    # file:///path, file://localhost/path, and file:/path (what pathlib.Path makes of the first)
    if _scheme_of(item) != "file" and not item.lower().startswith("file:/"):
        return item
    return urllib.parse.unquote(urllib.parse.urlparse(item).path)


def _local_abspath(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


# ------------------------------------------------------------------------- listing


def _hidden(relative: str) -> bool:
    return any(part[:1] in (".", "_") for part in relative.split("/")) or relative.endswith(
        _SIDECAR_SUFFIXES
    )


def _listing(fs: Any, base: str, keep: Callable[[str], bool]) -> list[tuple[str, int, int | None]]:
    import pyarrow.fs as pafs

    selector = pafs.FileSelector(base, recursive=True, allow_not_found=True)
    out = []
    for info in fs.get_file_info(selector):
        if info.type != pafs.FileType.File:
            continue
        relative = posixpath.relpath(info.path, base)
        if _hidden(relative) or not keep(relative):
            continue
        out.append((info.path, int(info.size), info.mtime_ns))
    out.sort()
    return out


def _glob(fs: Any, pattern: str) -> tuple[str, list[tuple[str, int, int | None]]]:
    parts = pattern.split("/")
    first = next(k for k, part in enumerate(parts) if _GLOB_CHARS.search(part))
    base = "/".join(parts[:first]) or ("/" if pattern.startswith("/") else "")
    regex = re.compile(_glob_regex("/".join(parts[first:])))
    return base, _listing(fs, base, lambda relative: regex.fullmatch(relative) is not None)


def _glob_regex(pattern: str) -> str:
    out = []
    k = 0
    while k < len(pattern):
        c = pattern[k]
        if pattern.startswith("**/", k):
            out.append("(?:[^/]+/)*")
            k += 3
        elif pattern.startswith("**", k):
            out.append(".*")
            k += 2
        elif c == "*":
            out.append("[^/]*")
            k += 1
        elif c == "?":
            out.append("[^/]")
            k += 1
        elif c == "[":
            end = pattern.find("]", k + 2)
            if end < 0:
                out.append(re.escape(c))
                k += 1
            else:
                body = pattern[k + 1 : end]
                if body.startswith("!"):
                    body = "^" + body[1:]
                out.append(f"[{body}]")
                k = end + 1
        else:
            out.append(re.escape(c))
            k += 1
    return "".join(out)


def _common_dir(roots: Iterable[str]) -> str:
    split = [r.rstrip("/").split("/") for r in roots]
    common: list[str] = []
    for parts in zip(*split, strict=False):
        if any(p != parts[0] for p in parts):
            break
        common.append(parts[0])
    joined = "/".join(common)
    if not joined and split and split[0][:1] == [""]:
        return "/"
    return joined


def filesystem_and_path(uri: str, filesystem: Any = None, owner: str = "") -> tuple[Any, str]:
    """The pyarrow filesystem ``uri`` lives on (a local path, ``file://``, ``s3://``, ``gs://``,
    or any fsspec protocol; ``filesystem`` when given) and the path of ``uri`` on it. Made here,
    it keeps its client's retries (three attempts of a request), nothing retrying above it."""
    found, _, paths = _parse([uri], filesystem, owner, timeout=60.0, client_attempts=3)
    return (found.build() if isinstance(found, _S3Settings) else found), paths[0]


class UriFilesystems:
    """The filesystems of single objects named by URI (``s3://``, ``gs://``, any fsspec
    protocol; a local path or ``file://`` too), one per scheme and bucket, made on first use in
    the process that reads. ``s3://`` takes its endpoint and region, ``gs://`` its emulator, from
    the environment of the process that made this object, as a source does, so a worker process
    reaches the same endpoint; a copy (pickled for a worker) starts without the filesystems
    made."""

    def __init__(self, owner: str, timeout: float = 60.0, attempts: int = 3) -> None:
        self.owner = owner
        self._s3 = _S3Settings.from_environment(timeout, attempts)
        self._gcs = _GcsSettings.from_environment(timeout * attempts)
        self._made: dict[str, Any] = {}

    @staticmethod
    def is_uri(value: str) -> bool:
        """Whether ``value`` names a remote object (``s3://bucket/key``), not a local path or a
        ``file://`` URI."""
        return _scheme_of(value) not in ("", "file")

    def resolve(self, uri: str) -> tuple[Any, str]:
        """The filesystem ``uri`` lives on and its path there."""
        scheme = _scheme_of(uri)
        key = f"{scheme}://{uri.split('/', 3)[2]}" if scheme else ""
        fs = self._made.get(key)
        if fs is None:
            if scheme == "s3":
                fs = self._s3.build()
            elif scheme in ("gs", "gcs"):
                fs = self._gcs.build()
            else:
                fs = filesystem_and_path(uri, None, self.owner)[0]
            self._made[key] = fs
        return filesystem_and_path(uri, fs, self.owner)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_made": {}}
