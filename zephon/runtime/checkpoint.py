"""Checkpoint state: the versioned, self-checking dict a loader saves, and files that hold one."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from zephon.compact import unpack_json
from zephon.errors import CheckpointCorruptError, CheckpointMismatchError
from zephon.plan import digest
from zephon.runtime.identity_diff import first_difference

STATE_FORMAT = "zephon-loader-state"  # one rank's state
JOB_FORMAT = "zephon-job-state"  # every rank's lanes together (``merge_states``)
STATE_VERSION = 3  # 3: lane history (``layout``) and inherited runs per lane; 2 is read too
FILE_FORMAT = "zephon-checkpoint"


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def seal(state: dict[str, Any]) -> dict[str, Any]:
    """The state with a checksum over everything else in it."""
    body = {k: v for k, v in state.items() if k != "checksum"}
    return {**body, "checksum": hashlib.sha256(_canonical(body)).hexdigest()}


def unseal(state: Any, formats: tuple[str, ...] = (STATE_FORMAT,)) -> dict[str, Any]:
    """Check format, version and checksum; ``CheckpointCorruptError`` for anything else."""
    if not isinstance(state, dict):
        raise CheckpointCorruptError(f"a loader state is a dict, got {type(state).__name__}")
    if state.get("format") not in formats:
        raise CheckpointCorruptError(f"not a Zephon loader state (format={state.get('format')!r})")
    if state.get("version") not in (2, STATE_VERSION):
        raise CheckpointCorruptError(
            f"loader state version {state.get('version')!r} is not known to this Zephon "
            f"(it reads versions 2 and {STATE_VERSION})"
        )
    body = {k: v for k, v in state.items() if k != "checksum"}
    try:
        expected = hashlib.sha256(_canonical(body)).hexdigest()
    except (TypeError, ValueError, RecursionError) as exc:
        raise CheckpointCorruptError(f"loader state is not plain JSON data: {exc}") from None
    if state.get("checksum") != expected:
        raise CheckpointCorruptError(
            "loader state checksum does not match: it was altered or damaged"
        )
    if body["version"] == 2:
        body = _from_version_2(body)
    return body


def _from_version_2(body: dict[str, Any]) -> dict[str, Any]:
    """A version 2 state as version 3 says the same: one generation of lanes, no inherited
    runs."""
    lanes = body.get("lane_states")
    return {
        **body,
        "version": STATE_VERSION,
        "layout": [{"lanes": body.get("lanes")}],
        "lane_states": [
            {**lane, "held": None, "run": None, "pending": []} if isinstance(lane, dict) else lane
            for lane in lanes
        ]
        if isinstance(lanes, list)
        else lanes,
    }


def check_identity(state: dict[str, Any], plan: Any, *, relane: bool = False) -> None:
    """``CheckpointMismatchError`` naming each field in which ``state`` and ``plan`` differ;
    with ``relane``, the lane count may differ (the state is re-laned onto the plan's)."""
    saved = state.get("pipeline")
    if not isinstance(saved, dict):
        raise CheckpointCorruptError("loader state field pipeline must be an object")
    parts = plan.fingerprint_parts
    differs = [
        f"{key} (checkpoint {saved.get(key)!r}, pipeline {value!r})"
        if key in ("lanes", "epoch_chunks", "micro_batch")
        else key
        for key, value in parts.items()
        if saved.get(key) != value and key != "described" and not (relane and key == "lanes")
    ]
    differs += [
        f"{key} (checkpoint only)" for key in saved if key not in parts and key != "described"
    ]
    if any(part in ("source", "operators") for part in differs):
        exact = first_difference(_described(saved), _described(parts))
        if exact:
            differs = [exact, *(p for p in differs if p not in ("source", "operators"))]
    lanes = state.get("lanes")
    if type(lanes) is not int or (lanes != plan.lanes and not relane):
        differs.append(f"lanes (checkpoint {lanes!r}, pipeline {plan.lanes!r})")
    if differs:
        hint = ""
        if any(part.startswith("lanes") for part in differs) and plan.lanes != lanes:
            hint = " (Pipeline(relane=True) continues it on the new lane count)"
        raise CheckpointMismatchError(
            "checkpoint was taken from a different pipeline: "
            + "; ".join(differs)
            + " differ"
            + hint
        )
    check_fingerprint(state)


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
    """Write ``state`` to ``path`` atomically (temp file, fsync, rename) with a checksum."""
    target = Path(path)
    data = checkpoint_bytes(state)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and verify a ``save_checkpoint`` file; ``CheckpointCorruptError`` if damaged."""
    return state_from_checkpoint_bytes(Path(path).read_bytes(), str(path))


def state_from_checkpoint_bytes(raw: bytes, path: str) -> dict[str, Any]:
    """The state a checkpoint file's bytes hold, verified; ``path`` names it in errors."""
    try:
        envelope = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CheckpointCorruptError(f"checkpoint {path} is not readable JSON: {exc}") from None
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
