"""PyTorch integration: a pipeline as a checkpointable ``IterableDataset``.

This module imports torch; nothing else in Zephon does, so ``import zephon`` stays torch-free.

Use the dataset with ``torch.utils.data.DataLoader`` or
``torchdata.stateful_dataloader.StatefulDataLoader`` with ``batch_size=None`` (batching happens in
the pipeline; the DataLoader's default ``batch_size=1`` would add a dimension and any other value
would stack several batches, which the dataset cannot see: torch does not tell a dataset how it
is batched) and ``num_workers=0`` (lanes already parallelize; torch workers would each run a copy
of the whole pipeline, which the dataset refuses)::

    from torchdata.stateful_dataloader import StatefulDataLoader
    from zephon.integrations.torch import as_torch_dataset

    loader = StatefulDataLoader(as_torch_dataset(pipeline), batch_size=None, num_workers=0)
    state = loader.state_dict()        # with the model checkpoint
    ...
    loader.load_state_dict(state)      # before iterating: continues exactly after that step
"""

from __future__ import annotations

import copy
import sys
import warnings
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from zephon.errors import CheckpointError, MidStepWarning, PlanError, ZephonError
from zephon.planner import Pipeline
from zephon.ranks import rank_from_torch, resolve_rank
from zephon.runtime.checkpoint.dataloader_state import dataset_state_path, with_dataset_state
from zephon.runtime.checkpoint.dataloader_state import unwrapped as _unwrapped
from zephon.runtime.checkpoint.job import items_into_step, merge_states
from zephon.runtime.checkpoint.schema import JOB_FORMAT, STATE_FORMAT
from zephon.runtime.loader import Loader

__all__ = ["ZephonIterableDataset", "as_torch_dataset", "job_state", "to_tensors"]

# What torch.from_numpy takes (by kind and item size): bool, signed and unsigned integers,
# float16/32/64 and complex64/128, not numpy's extended precision (longdouble).
_TENSOR_SIZES = {"b": (1,), "i": (1, 2, 4, 8), "u": (1, 2, 4, 8), "f": (2, 4, 8), "c": (8, 16)}
_TENSOR_DTYPES = frozenset(
    np.dtype(f"{kind}{size}") for kind, sizes in _TENSOR_SIZES.items() for size in sizes
)


def to_tensors(value: Any) -> Any:
    """``value`` with numpy arrays turned into tensors, recursively through dicts, lists and
    tuples (named tuples keep their type).

    A numeric or bool array becomes ``torch.from_numpy(array)``, sharing its memory; an array torch
    cannot share (read-only, with negative strides or strides that are no multiple of its item
    size, as a field of a record array has) is copied first. A numpy scalar becomes a 0-d tensor.
    Arrays of strings or objects, of a dtype torch has no tensor of (``longdouble``), Python
    scalars, ``str`` and anything else are returned unchanged.
    """
    if isinstance(value, np.ndarray):
        if value.dtype.newbyteorder("=") not in _TENSOR_DTYPES:
            return value
        size = value.itemsize
        if not value.flags.writeable or any(s < 0 or s % size for s in value.strides):
            value = np.array(value)
        if not value.dtype.isnative:
            value = value.astype(value.dtype.newbyteorder("="))
        return torch.from_numpy(value)
    if isinstance(value, np.generic):
        native = value.dtype.newbyteorder("=")
        if native not in _TENSOR_DTYPES:
            return value
        return torch.from_numpy(np.array(value, dtype=native))
    if isinstance(value, dict):
        return {k: to_tensors(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_tensors(v) for v in value]
    if isinstance(value, tuple):
        items = [to_tensors(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value


class ZephonIterableDataset(IterableDataset[Any]):
    """A ``Pipeline`` as a torch ``IterableDataset`` with ``state_dict()`` / ``load_state_dict()``
    (the protocol ``StatefulDataLoader`` uses): it yields the payload of each delivered item — the
    collated batch payload of a ``SampleBatch``, or a ``SampleRecord``'s payload — through
    ``to_tensors``.

    Each ``iter()`` closes the previous loader and starts a new one: from the state given to
    ``load_state_dict`` when there is one (used once), else from the start of the pipeline.
    ``state_dict()`` is the loader's state (the same small JSON-able dict as
    ``Loader.state_dict()``) after the last item yielded; before any iteration it is the loaded
    state (with the samples its ``retire=`` takes out), or the state of a fresh start.
    Invariant: a dataset restored from ``state_dict()`` taken after ``k`` items yields exactly
    the items a single run would have yielded after those ``k``.

    ``allow_changes=True`` resumes loaded states whose operators changed on purpose
    (``Pipeline.iter``); ``load_state_dict(state, allow_changes=True)`` does it for one state.
    """

    def __init__(
        self, pipeline: Pipeline, *, allow_changes: bool = False, end_together: bool | None = None
    ):
        super().__init__()
        if not isinstance(pipeline, Pipeline):
            raise TypeError(f"as_torch_dataset needs a zephon.Pipeline, got {pipeline!r}")
        if end_together is not None and not isinstance(end_together, bool):
            raise TypeError(f"end_together must be True, False or None, got {end_together!r}")
        self.pipeline = pipeline
        self.end_together = end_together
        self._together: _EndTogether | None = None
        self._loader: Loader | None = None
        self._pending: dict[str, Any] | None = None  # from load_state_dict, for the next iter()
        self.allow_changes = allow_changes
        self._pending_changes = allow_changes  # whether the pending state may have other operators
        self._pending_retire: Any = None  # samples the next iter() retires (``Pipeline.iter``)
        self._final: dict[str, Any] | None = None  # state of the last loader once it ended
        self._final_stats: dict[str, Any] | None = None  # its stats

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        if info is not None and info.num_workers > 1:
            raise PlanError(
                f"a Zephon dataset cannot be split over {info.num_workers} torch DataLoader "
                "workers (each would run the whole pipeline): use num_workers=0 and the "
                "pipeline's lanes for parallelism"
            )
        self.close()
        state, self._pending = self._pending, None
        loader = self.pipeline.iter(
            state=state, allow_changes=self._pending_changes, retire=self._pending_retire
        )
        self._pending_changes, self._pending_retire = self.allow_changes, None
        self._loader = loader
        self._final = None
        return self._generate(loader)

    def _generate(self, loader: Loader) -> Iterator[Any]:
        try:
            together = self._end_agreement(loader)
        except BaseException:
            self._retire(loader)  # its lanes stop; the state stays where it was
            raise
        items = loader if together is None else loader.end_together(together.least)
        try:
            for item in items:
                yield to_tensors(item.payload)
        except GeneratorExit:
            self._retire(loader)
            raise
        else:
            self._retire(loader)

    def _end_agreement(self, loader: Loader) -> _EndTogether | None:
        """How this rank ends together with the others, or None: when ``end_together`` is on,
        or left to decide (None) on a job of several ranks whose loader cannot end them at
        the same global step by itself (its item counts are unknown: ``uneven_end='allow'``
        by default, or a re-laned job's lanes running to their ends) and was not told
        ``uneven_end='allow'``."""
        plan = loader.plan
        wanted = self.end_together
        if wanted is None:
            wanted = self.pipeline.uneven_end != "allow" and not loader.ends_evenly
        if not wanted or plan.world_size == 1:
            return None
        if get_worker_info() is not None:  # a forked worker's copy of the group never answers
            raise PlanError(
                f"as_torch_dataset: rank {plan.rank} of {plan.world_size} must end together with "
                "the other ranks (its pipeline cannot end them at the same global step by "
                "itself), which takes an all-reduce over torch.distributed, and a DataLoader "
                "worker process cannot take part in the training process's group: use "
                "num_workers=0 (the pipeline's lanes parallelize), or pass "
                "as_torch_dataset(..., end_together=False) when the ranks' data has no end "
                "(a source with passes=None) or you end them yourself"
            )
        if self._together is None:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                raise ZephonError(
                    f"as_torch_dataset: rank {plan.rank} of {plan.world_size} must end together "
                    "with the other ranks (its pipeline cannot end them at the same global step "
                    "by itself), which takes an all-reduce over torch.distributed, and no "
                    "process group is initialized: call dist.init_process_group first, or pass "
                    "as_torch_dataset(..., end_together=False) and end the ranks yourself "
                    "(loader.end_together with your own all-reduce)"
                )
            self._together = _EndTogether()
        return self._together

    def _retire(self, loader: Loader, _finalizing: Any = sys.is_finalizing) -> None:
        # Keep the state of a loader that ended or was abandoned, then free its lanes. A
        # generator left open when the interpreter exits is closed while modules are torn
        # down (this module's names included, hence the default argument): no one can ask
        # for its state then, and taking it would fail.
        if self._loader is loader:
            if not _finalizing():
                self._final = loader.state_dict()
                self._final_stats = loader.stats()
            self._loader = None
        loader.close()

    def stats(self) -> dict[str, Any]:
        """``Loader.stats()`` of the running loader; before the first item, those of the state
        the next ``iter()`` starts from (a fresh start when none was loaded); after the stream
        ended or was abandoned, the last loader's."""
        if self._loader is not None:
            return self._loader.stats()
        if self._final_stats is not None and self._pending is None:
            return self._final_stats
        with self.pipeline.iter(
            state=self._pending, allow_changes=self._pending_changes
        ) as upcoming:
            return upcoming.stats()

    def state_dict(self) -> dict[str, Any]:
        """The position after the last item yielded (see the class docstring)."""
        if self._pending is not None and self._pending_retire is not None:
            # the samples the next iter() retires are out of the run from the loaded position
            with self.pipeline.iter(
                state=self._pending,
                allow_changes=self._pending_changes,
                retire=self._pending_retire,
            ) as upcoming:
                return upcoming.state_dict()
        if self._pending is not None:
            return self._pending
        if self._loader is not None:
            return self._loader.state_dict()
        if self._final is not None:
            return self._final
        with self.pipeline.iter() as fresh:
            return fresh.state_dict()

    def load_state_dict(
        self, state: dict[str, Any], *, allow_changes: bool | None = None, retire: Any = None
    ) -> None:
        """Make the next ``iter()`` continue from ``state`` (checked against the pipeline then:
        ``CheckpointMismatchError`` / ``CheckpointCorruptError`` when it does not fit). A
        ``StatefulDataLoader``'s state around this dataset's is taken too. ``allow_changes``
        (default: the dataset's) lets the state's operators differ; ``retire`` takes samples out
        of the run from there (``Pipeline.iter``)."""
        if not isinstance(state, dict):
            raise TypeError(f"load_state_dict needs the dict state_dict() returned, got {state!r}")
        self._pending = _unwrapped(state)
        self._pending_changes = self.allow_changes if allow_changes is None else allow_changes
        self._pending_retire = retire
        self._final = None
        self._final_stats = None

    def close(self) -> None:
        """Close the running loader, if any (its worker processes stop); ``state_dict()`` keeps
        returning its position."""
        loader = self._loader
        if loader is not None:
            self._retire(loader)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_loader"] = None  # a running loader does not cross processes
        state["_together"] = None  # nor does a process group
        state["pipeline"] = _placed(self.pipeline)
        return state


def _placed(pipeline: Pipeline) -> Pipeline:
    """``pipeline`` with the rank and world size it leaves to be found taken from this process's
    ``torch.distributed`` group: a DataLoader worker started by ``spawn`` or ``forkserver`` gets a
    pickled copy of the dataset but no process group, and would find itself rank 0 of 1 on every
    rank (each rank then delivering every rank's data)."""
    if (pipeline.rank is not None and pipeline.world_size is not None) or not rank_from_torch():
        return pipeline
    try:
        rank, world_size = resolve_rank(pipeline.rank, pipeline.world_size)
    except PlanError:
        return pipeline  # the copy's own planning raises it, naming both positions
    placed = copy.copy(pipeline)
    placed.rank, placed.world_size = rank, world_size
    return placed


class _EndTogether:
    """The minimum all-reduce of one number that ``Loader.end_together`` asks for, over a gloo
    group of the whole job, so the training's own NCCL group is untouched. Made once, by every
    rank at its first ``iter()``, since creating a group is itself collective."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self._dist = dist
        default_gloo = dist.get_backend() == "gloo"
        self.group = None if default_gloo else dist.new_group(backend="gloo")
        self._flag = torch.zeros(1, dtype=torch.int32)

    def least(self, value: int) -> int:
        """The minimum of ``value`` over the ranks."""
        self._flag[0] = value
        self._dist.all_reduce(self._flag, op=self._dist.ReduceOp.MIN, group=self.group)
        return int(self._flag[0])


def as_torch_dataset(
    pipeline: Pipeline, *, allow_changes: bool = False, end_together: bool | None = None
) -> ZephonIterableDataset:
    """Wrap ``pipeline`` as a checkpointable torch ``IterableDataset`` yielding tensors; use it
    with ``batch_size=None, num_workers=0`` (see ``ZephonIterableDataset``). ``allow_changes``:
    loaded states may come from the same pipeline with changed operators (``Pipeline.iter``).

    ``end_together``: on a job of several ranks, every rank stops at the first global step some
    rank has no item for, so none is left waiting in a collective at the end of the data
    (``Loader.end_together``: one all-reduce of one number per item, over a gloo group; what
    the other ranks still had counts in ``stats()["dropped_at_end"]``). ``None`` (the default)
    turns it on when the pipeline cannot end its ranks together by itself: plans that filter,
    split or pack records, whose ``uneven_end`` defaults to ``"allow"``."""
    return ZephonIterableDataset(pipeline, allow_changes=allow_changes, end_together=end_together)


def job_state(source: Any, *, group: Any = None) -> dict[str, Any]:
    """The job state of the whole job, on every rank: all-gathers each rank's loader state over
    the initialized ``torch.distributed`` process group and merges them (``zephon.merge_states``).

    ``source`` is a ``Loader``, a ``ZephonIterableDataset``, a ``StatefulDataLoader`` wrapping
    one, or a rank's state dict. Call it on every rank at the same global step (it is a
    collective) and save the result with the model checkpoint: any rank of a later run, on any
    world size that divides the job's lanes, resumes from it with ``pipeline.iter(state=...)``
    (or ``dataset.load_state_dict(...)``).

    The result has the shape of ``source``'s state: given a ``StatefulDataLoader`` (or its
    state), it is that loader's state with the job state in place of its dataset's, so
    ``dataloader.load_state_dict(job)`` resumes it: ``job["dataset_state"]`` is the job state
    itself with ``num_workers=0``, ``job["_snapshot"]["_worker_snapshots"]["worker_0"]
    ["dataset_state"]`` with one worker process. Called inside a global step (after a number of
    items that is not a multiple of ``lanes // world_size``), it warns (``MidStepWarning``) and
    the merge raises ``CheckpointError``.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ZephonError(
            "job_state needs an initialized torch.distributed process group "
            "(call dist.init_process_group first), or use zephon.merge_states on saved states"
        )
    state = source if isinstance(source, dict) else source.state_dict()
    inside = items_into_step(_unwrapped(state)) if isinstance(state, dict) else 0
    if inside:
        mine = _unwrapped(state)
        warnings.warn(
            f"job_state() on rank {mine.get('rank')} was called inside a global step: the rank "
            f"had handed over {inside} of its {mine['lanes'] // mine['world_size']} items of "
            "the step, and merging refuses such states. Call it right after an optimizer step",
            MidStepWarning,
            stacklevel=2,
        )
    states: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(states, _unwrapped(state), group=group)
    _check_data_parallel(states, group)
    job = _unmoved(states) or merge_states(states)
    path = dataset_state_path(state)
    return job if path is None else with_dataset_state(state, path, job)


def _check_data_parallel(states: list[Any], group: Any) -> None:
    """``CheckpointError`` when the gathered ``states`` hold a data-parallel rank more than once:
    the group spans the tensor-, pipeline- or context-parallel peers of a rank, which share its
    batches, so only the data-parallel group says how the job's lanes are shared."""
    ranks = Counter(
        s.get("rank") for s in states if isinstance(s, dict) and s.get("format") == STATE_FORMAT
    )
    shared = sorted(r for r, n in ranks.items() if n > 1 and type(r) is int)
    if shared:
        where = "the default process group" if group is None else "the group given"
        raise CheckpointError(
            f"job_state gathered the states of {len(states)} processes over {where}, and "
            f"data-parallel rank(s) {shared} came from several of them: under tensor, pipeline "
            "or context parallelism, gather over the data-parallel peers only, with "
            "job_state(..., group=zephon.ranks.from_device_mesh(mesh, dp_dims).group)"
        )


def _unmoved(states: list[Any]) -> dict[str, Any] | None:
    """The job state every rank holds when all hold the same one, else None: datasets given it
    by ``load_state_dict`` that have not iterated yet are where it says, and it is their job
    state (merging refuses a job state as a rank's)."""
    first = states[0]
    if isinstance(first, dict) and first.get("format") == JOB_FORMAT:
        return first if all(state == first for state in states) else None
    return None
