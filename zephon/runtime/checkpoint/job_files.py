"""A job state through a shared directory, for launchers without ``torch.distributed``: each rank
saves its state as one file, and any process later reads them all back as one job state.

The directory is local (a shared filesystem) or in object storage (``s3://``, ``gs://``, any
fsspec protocol). Each rank writes ``rank-RRRRR-of-WWWWW.json``, the file a
``zephon.save_checkpoint`` would write, so a file is never seen half-written: a local file is
renamed into place, an object appears whole. Use one directory per checkpoint step.
"""

from __future__ import annotations

import re
from typing import Any

from zephon.errors import CheckpointCorruptError, CheckpointError
from zephon.runtime.checkpoint.dataloader_state import unwrapped
from zephon.runtime.checkpoint.format import (
    checkpoint_bytes,
    save_checkpoint,
    state_from_checkpoint_bytes,
    unseal,
)
from zephon.runtime.checkpoint.job import merge_states
from zephon.runtime.checkpoint.retired import RetiredIds
from zephon.runtime.checkpoint.saved_state import check_saved_state
from zephon.runtime.checkpoint.schema import STATE_FORMAT
from zephon.sources.locations import filesystem_and_path

_SHOWN = 8  # missing ranks named in an error
_NAME = re.compile(r"^rank-(\d{5,})-of-(\d{5,})\.json$")


def rank_file_name(rank: int, world_size: int) -> str:
    """The name rank ``rank`` of ``world_size`` saves its state under."""
    return f"rank-{rank:05d}-of-{world_size:05d}.json"


def save_rank_state(where: str, state: dict[str, Any], *, filesystem: Any = None) -> str:
    """Save one rank's ``state`` (``loader.state_dict()``; of a torchdata ``StatefulDataLoader``,
    the state of the Zephon dataset inside) into the directory ``where``, shared by every rank
    of the job; the path written. Every rank calls it at the same global step, with
    the same ``where``; ``load_job_state(where)`` then reads the job state back."""
    state = unwrapped(state)  # a StatefulDataLoader's state: its dataset's
    body = unseal(state, (STATE_FORMAT,))
    name = rank_file_name(body["rank"], body["world_size"])
    fs, directory = filesystem_and_path(str(where), filesystem, "save_rank_state")
    path = f"{directory.rstrip('/')}/{name}"
    if _is_local(fs):
        save_checkpoint(path, state)
    else:
        with fs.open_output_stream(path) as out:  # an object appears whole when it is closed
            out.write(checkpoint_bytes(state))
    return path


def load_job_state(where: str, *, filesystem: Any = None) -> dict[str, Any]:
    """The job state (``zephon.merge_states``) of the rank states saved in the directory
    ``where`` by ``save_rank_state``: it resumes on any world size that divides the job's lanes.

    Raises ``CheckpointError`` naming the directory and the ranks when some rank's file is
    missing, when the directory holds files of more than one world size, or when the merge
    refuses the states (ranks saved at different global steps, from different pipelines).
    """
    import pyarrow.fs as pafs

    fs, directory = filesystem_and_path(str(where), filesystem, "load_job_state")
    found = fs.get_file_info(pafs.FileSelector(directory, allow_not_found=True))
    files: dict[int, dict[int, str]] = {}
    for info in found:
        match = _NAME.match(info.base_name)
        if match and info.type == pafs.FileType.File:
            rank, world = int(match.group(1)), int(match.group(2))
            files.setdefault(world, {})[rank] = info.path
    if not files:
        raise CheckpointError(
            f"load_job_state: {where} holds no rank state (rank-RRRRR-of-WWWWW.json files "
            "written by zephon.save_rank_state)"
        )
    if len(files) > 1:
        sizes = ", ".join(str(w) for w in sorted(files))
        raise CheckpointError(
            f"load_job_state: {where} holds the states of jobs of {sizes} ranks: save each "
            "checkpoint step of a job into a directory of its own"
        )
    ((world, by_rank),) = files.items()
    missing = sorted(set(range(world)) - set(by_rank))
    if missing:
        shown = (  # the first few: a job may have thousands of ranks
            f"{missing}"
            if len(missing) <= _SHOWN
            else f"{missing[: _SHOWN - 1]} and {len(missing) - _SHOWN + 1} more"
        )
        raise CheckpointError(
            f"load_job_state: {where} lacks the state of rank(s) {shown} of {world}: every "
            "rank must call save_rank_state before the job state can be read"
        )
    states = []
    known: dict[str, RetiredIds] = {}  # the retired ids every rank holds, checked once
    for rank in range(world):
        path = by_rank[rank]
        with fs.open_input_stream(path) as f:
            state = state_from_checkpoint_bytes(f.read(), path)
        try:
            body = check_saved_state(unseal(state, (STATE_FORMAT,)), known)
        except CheckpointError as exc:
            raise exc.add_context(file=path) from None
        if (body["rank"], body["world_size"]) != (rank, world):
            raise CheckpointCorruptError(
                f"{path} holds the state of rank {body['rank']} of {body['world_size']}, not "
                f"of rank {rank} of {world}"
            )
        states.append(state)
    try:
        return merge_states(states)
    except CheckpointError as exc:  # it names the ranks: rank r is the file of rank r here
        raise exc.add_context(directory=str(where)) from None


def _is_local(fs: Any) -> bool:
    import pyarrow.fs as pafs

    return isinstance(fs, pafs.LocalFileSystem)
