"""Checkpoint state: the versioned, self-checking dict a loader saves, and files that hold one."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import warnings
from pathlib import Path
from typing import Any

from zephon.compact import unpack_json
from zephon.errors import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    UnverifiedContentWarning,
)
from zephon.identity import identify
from zephon.plan import digest
from zephon.runtime.checkpoint.identity_diff import first_difference, operator_differences
from zephon.runtime.checkpoint.schema import JOB_FORMAT, STATE_FORMAT, check_version, upgrade

FILE_FORMAT = "zephon-checkpoint"


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def seal(state: dict[str, Any]) -> dict[str, Any]:
    """The state with a checksum over everything else in it."""
    body = {k: v for k, v in state.items() if k != "checksum"}
    return {**body, "checksum": hashlib.sha256(_canonical(body)).hexdigest()}


def unseal(state: Any, formats: tuple[str, ...] = (STATE_FORMAT,)) -> dict[str, Any]:
    """Check format, version and checksum; ``CheckpointCorruptError`` for anything else. The
    body is returned in the current version (``schema.upgrade``)."""
    if not isinstance(state, dict):
        hint = ""
        if isinstance(state, (str, os.PathLike)):
            hint = ": zephon.load_checkpoint(path) reads the state a save_checkpoint file holds"
        raise CheckpointCorruptError(f"a loader state is a dict, got {type(state).__name__}{hint}")
    if state.get("format") == FILE_FORMAT:
        raise CheckpointCorruptError(
            "this is what a save_checkpoint file holds (format 'zephon-checkpoint'), not a "
            "loader state: zephon.load_checkpoint(path) returns the state in it"
        )
    check_version(state, formats)
    body = {k: v for k, v in state.items() if k != "checksum"}
    try:
        expected = hashlib.sha256(_canonical(body)).hexdigest()
    except (TypeError, ValueError, RecursionError) as exc:
        raise CheckpointCorruptError(f"loader state is not plain JSON data: {exc}") from None
    if state.get("checksum") != expected:
        raise CheckpointCorruptError(
            "loader state checksum does not match: it was altered or damaged"
        )
    return upgrade(body)


def check_identity(
    state: dict[str, Any], plan: Any, *, relane: bool = False, allow_changes: bool = False
) -> list[str]:
    """``CheckpointMismatchError`` naming each field in which ``state`` and ``plan`` differ;
    with ``relane``, the lane count may differ (the state is re-laned onto the plan's); with
    ``allow_changes``, the operators may differ: the changes are returned, each changed
    parameter named with its operator (``[]`` when the operators are the same)."""
    saved = state.get("pipeline")
    if not isinstance(saved, dict):
        raise CheckpointCorruptError("loader state field pipeline must be an object")
    parts = plan.fingerprint_parts
    if saved.get("source") not in (None, parts.get("source")) and saved["source"] == _footer_only(
        plan
    ):
        warnings.warn(
            "this checkpoint was taken before file contents were part of the pipeline's "
            "identity: its files have the same names, sizes, row counts and footers, but "
            "whether their contents are the ones it was taken on cannot be checked. Checkpoints "
            "taken from now on are checked",
            UnverifiedContentWarning,
            stacklevel=4,
        )
        parts = {**parts, "source": saved["source"]}
    changed = saved.get("operators") != parts.get("operators")
    differs = [
        f"{key} (checkpoint {saved.get(key)!r}, pipeline {value!r})"
        if key in ("lanes", "epoch_chunks", "micro_batch")
        else key
        for key, value in parts.items()
        if saved.get(key) != value
        and key != "described"
        and not (relane and key == "lanes")
        and not (allow_changes and key == "operators")
    ]
    differs += [
        f"{key} (checkpoint only)" for key in saved if key not in parts and key != "described"
    ]
    if any(part in ("source", "operators") for part in differs):
        exact = first_difference(_described(saved), _described(parts))
        if exact and not (allow_changes and exact.startswith("operators")):
            differs = [exact, *(p for p in differs if p not in ("source", "operators"))]
    lanes = state.get("lanes")
    if type(lanes) is not int or (lanes != plan.lanes and not relane):
        differs.append(f"lanes (checkpoint {lanes!r}, pipeline {plan.lanes!r})")
    if differs:
        hint = ""
        if any(part.startswith("lanes") for part in differs) and plan.lanes != lanes:
            hint = " (Pipeline(relane=True) continues it on the new lane count)"
        elif changed and all(p.startswith("operators") for p in differs):
            hint = (
                ". If the operators were changed on purpose (a fixed bug, a new threshold), "
                "pipeline.iter(state=..., allow_changes=True) resumes with them: what was "
                "delivered stays delivered, the rest comes from the new operators"
            )
        raise CheckpointMismatchError(
            "checkpoint was taken from a different pipeline: "
            + "; ".join(differs)
            + " differ"
            + hint
        )
    check_fingerprint(state)
    if not changed:
        return []
    _check_same_chain(_described(saved), _described(parts))
    return operator_differences(_described(saved), _described(parts)) or [
        f"operators (digest {saved.get('operators')!s:.12} -> {parts.get('operators')!s:.12})"
    ]


def check_fingerprint(state: dict[str, Any]) -> None:
    """The state's fingerprint is the digest of its own pipeline description (its ``pipeline``,
    an object), and that description's lane count is the state's."""
    saved = state.get("pipeline")
    if not isinstance(saved, dict):
        raise CheckpointCorruptError("loader state field pipeline must be an object")
    identity = {k: v for k, v in saved.items() if k != "described"}
    if saved.get("lanes") != state.get("lanes") or state.get("fingerprint") != digest(identity):
        raise CheckpointCorruptError(
            "loader state fingerprint does not match its own pipeline description: it was edited"
        )


def _footer_only(plan: Any) -> str | None:
    """The source digest the plan had before each file's ``content_sha256`` entered its
    description (beside its ``footer``): what checkpoints taken then recorded; None when the
    source holds no such file."""
    try:
        described = identify(plan.source.describe(), where="the source's describe()")
    except Exception:
        return None
    older, found = _without_content(described)
    return digest(older) if found else None


def _without_content(value: Any) -> tuple[Any, bool]:
    if isinstance(value, list):
        items = [_without_content(v) for v in value]
        return [v for v, _ in items], any(f for _, f in items)
    if not isinstance(value, dict):
        return value, False
    found = "footer" in value and "content_sha256" in value
    out = {}
    for key, v in value.items():
        if found and key == "content_sha256":
            continue
        out[key], deeper = _without_content(v)
        found = found or deeper
    return out, found


def _check_same_chain(saved: Any, current: Any) -> None:
    """Changed operators resume only in place: each operator's carry state and holdings go to
    the operator at its position, so the chain must keep its length and each operator's class
    (unknown when a side is not described: then the carry states' length is still checked)."""
    if not isinstance(saved, dict) or not isinstance(current, dict):
        return
    ops_a, ops_b = saved.get("operators"), current.get("operators")
    if not isinstance(ops_a, list) or not isinstance(ops_b, list):
        return
    classes_a = [op.get("class") if isinstance(op, dict) else None for op in ops_a]
    classes_b = [op.get("class") if isinstance(op, dict) else None for op in ops_b]
    if classes_a == classes_b:
        return
    if len(classes_a) != len(classes_b):
        what = f"the checkpoint has {len(classes_a)} operators, the pipeline {len(classes_b)}"
    else:
        k = next(i for i, (a, b) in enumerate(zip(classes_a, classes_b)) if a != b)
        what = f"operator #{k} is {classes_a[k]} in the checkpoint and {classes_b[k]} here"
    raise CheckpointMismatchError(
        f"allow_changes=True resumes operators whose code or parameters changed, not operators "
        f"added, removed or replaced: {what} (each operator's carry state goes to the operator "
        "at its position). Resume with the checkpoint's chain of operators"
    )


def _described(parts: dict[str, Any]) -> Any:
    """The described source and operators a fingerprint's parts carry (None when absent)."""
    try:
        return unpack_json(parts.get("described")) if "described" in parts else None
    except ValueError:
        return None


def checkpoint_bytes(state: dict[str, Any]) -> bytes:
    """``state`` as the bytes of a checkpoint file: JSON with a checksum over the state."""
    envelope = {
        "format": FILE_FORMAT,
        "version": 1,
        "sha256": hashlib.sha256(_canonical(state)).hexdigest(),
        "state": state,
    }
    return _canonical(envelope)


def save_checkpoint(path: str | os.PathLike[str], state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` atomically (temp file, fsync, rename) with a checksum;
    ``path`` may name an object in storage (``s3://``, ``gs://``, any fsspec protocol), which
    appears whole when written."""
    data = checkpoint_bytes(state)
    fs, where = _where(path, "save_checkpoint")
    if fs is not None:
        with fs.open_output_stream(str(where)) as out:
            out.write(data)
        return
    target = Path(where)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _new_file_beside(target)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _sync_directory(target.parent)


def _sync_directory(directory: Path) -> None:
    """Make the rename into ``directory`` durable. Some network and FUSE filesystems refuse an
    fsync of a directory (EINVAL, EOPNOTSUPP, EACCES): the file is whole and in place by then,
    and its own fsync succeeded, so the save stands."""
    try:
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.EACCES, errno.EBADF):
            raise


def _new_file_beside(target: Path) -> tuple[int, str]:
    """A new temporary file in ``target``'s directory, opened for writing, with the permissions
    of any new file (``0o666`` less the umask, as ``open`` gives; ``tempfile.mkstemp`` would
    make it ``0o600``, and other users of a shared directory could not read the checkpoint)."""
    tmp = target.parent / f".{target.name}.{secrets.token_hex(8)}.tmp"
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), str(tmp)


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and verify a ``save_checkpoint`` file (a local path or a URI of object storage);
    ``CheckpointCorruptError`` if damaged."""
    fs, where = _where(path, "load_checkpoint")
    if fs is None:
        return state_from_checkpoint_bytes(Path(where).read_bytes(), str(path))
    with fs.open_input_stream(str(where)) as f:
        return state_from_checkpoint_bytes(f.read(), str(path))


def _where(path: str | os.PathLike[str], owner: str) -> tuple[Any, str | os.PathLike[str]]:
    """``(None, local path)`` for a local path or a ``file://`` URI; ``(filesystem, path on
    it)`` for a URI of object storage (``s3://...``, which taken for a local path would become a
    directory named ``s3:``)."""
    from zephon.sources.locations import UriFilesystems, filesystem_and_path, refuse_collapsed_uri

    text = os.fspath(path)
    refuse_collapsed_uri(text, owner)
    if not re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:/", text):  # a plain local path
        return None, path
    fs, where = filesystem_and_path(text, None, owner)
    return (fs, where) if UriFilesystems.is_uri(text) else (None, where)


def state_from_checkpoint_bytes(raw: bytes, path: str) -> dict[str, Any]:
    """The state a checkpoint file's bytes hold, verified; ``path`` names it in errors."""
    if raw.startswith((b"PK\x03\x04", b"\x80")):
        raise CheckpointCorruptError(
            f"{path} looks like a torch.save file, not a save_checkpoint file: torch.load it "
            "and pass the loader state in it to pipeline.iter(state=...)"
        )
    try:
        envelope = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CheckpointCorruptError(f"checkpoint {path} is not readable JSON: {exc}") from None
    if isinstance(envelope, dict) and envelope.get("format") in (STATE_FORMAT, JOB_FORMAT):
        raise CheckpointCorruptError(
            f"{path} holds a loader state itself, not a save_checkpoint file: json.load it and "
            "pass it to pipeline.iter(state=...)"
        )
    if not isinstance(envelope, dict) or envelope.get("format") != FILE_FORMAT:
        raise CheckpointCorruptError(f"{path} is not a Zephon checkpoint file")
    if envelope.get("version") != 1:
        raise CheckpointCorruptError(
            f"checkpoint {path} has file version {envelope.get('version')!r}; this Zephon reads 1"
        )
    state = envelope.get("state")
    if not isinstance(state, dict):
        raise CheckpointCorruptError(f"checkpoint {path} holds no state")
    if hashlib.sha256(_canonical(state)).hexdigest() != envelope.get("sha256"):
        raise CheckpointCorruptError(f"checkpoint {path} fails its checksum: it is damaged")
    return state
