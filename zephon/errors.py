"""The exception hierarchy of Zephon: every error the library raises on purpose.

Every Zephon error can carry where it happened (lane, operator, cursor, pointer, file, ...). The
runtime adds what it knows as an error crosses it (``add_context``), once, so messages name the
culprit without each raise site formatting it by hand.
"""

from __future__ import annotations

from typing import Any


class ZephonError(Exception):
    """Base class of every error Zephon raises on purpose."""

    context: dict[str, Any]

    def add_context(self, **where: Any) -> ZephonError:
        """Record where the error happened; a field already known is kept, ``None`` is ignored.
        Returns the error itself, for ``raise err.add_context(lane=3)``."""
        context = self.__dict__.setdefault("context", {})
        for key, value in where.items():
            if value is not None:
                context.setdefault(key, value)
        return self

    def __str__(self) -> str:
        text = super().__str__()
        context = self.__dict__.get("context")
        if not context:
            return text
        return f"{text}\n  - at " + ", ".join(f"{k} {v!r}" for k, v in context.items())


class PlanError(ZephonError):
    """A pipeline cannot be planned: the message names the operator and what to change."""


class ContractViolation(ZephonError):
    """An operator broke the bookkeeping contract: early close, missing tombstone, false order."""


class CheckpointError(ZephonError):
    """A checkpoint cannot be used."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint from another pipeline, rank or world size; the message says what differs."""


class CheckpointCorruptError(CheckpointError):
    """The checkpoint is truncated, damaged, or of a format version this Zephon does not know."""


class ReplayDivergenceError(ZephonError):
    """Replaying to a checkpoint's position did not reproduce what was delivered before it."""


class FetchError(ZephonError):
    """A sample could not be read; the message names the pointer and the file."""


class WorkerLostError(ZephonError):
    """A lane's worker died under it (a Ray actor killed, its node lost): the message names the
    lane and where it ran. The lane cannot go on; resume from the last checkpoint."""


class PatchLayoutError(ZephonError, ValueError):
    """An image cannot be cut into the patches its tokens stand for
    (``pixel_layout="patches"`` of ``training_collate``): its size is not its patch grid's, or the
    grid not the tokenizer's. The message names the record, the image and what to change; nothing
    is resized silently."""


class OperatorError(ZephonError):
    """An exception raised inside an operator, naming the operator, the cursor and the sample id."""

    def __init__(self, message: str, *, operator: str | None = None, cursor: object = None):
        super().__init__(message)
        self.operator = operator
        self.cursor = cursor

    def __reduce__(self):  # keep the named fields when the error crosses a process boundary
        return (
            _rebuild_operator_error,
            (type(self), self.args, self.operator, self.cursor),
            {"context": dict(self.__dict__.get("context", {}))},
        )


def _rebuild_operator_error(cls, args, operator, cursor):
    return cls(*args, operator=operator, cursor=cursor)


class ContractWarning(UserWarning):
    """A contract violation tolerated because the pipeline is not strict; counted in stats."""


class CarryStateWarning(UserWarning):
    """An operator's carry state (stored in every checkpoint) grew past the pipeline's
    ``carry_warn_bytes``: checkpoints grow with it, and it is often a sign of state that should
    have been flushed at the epoch marker."""


class RelaneWarning(UserWarning):
    """A checkpoint taken with another lane count was continued on this pipeline's lanes: every
    sample the pipeline delivers is delivered exactly once, but the batches differ from the
    uninterrupted run's, and which samples an operator keeping running totals drops
    (``ensure_mixture``) can differ too. ``Pipeline(relane=False)`` refuses such a checkpoint
    instead."""


class MidStepWarning(UserWarning):
    """A rank's state for a job state (``integrations.torch.job_state``) was taken inside a global
    step, between two of the ``lanes // world_size`` items every rank hands over per step;
    merging refuses it. Take job states right after an optimizer step."""


class PipelineChangeWarning(UserWarning):
    """A checkpoint was resumed with changed operators (``allow_changes=True``): the message names
    each changed operator and parameter. What was delivered before the checkpoint stays
    delivered; everything after it comes from the new operators."""


class RetireWarning(UserWarning):
    """A record that mixes a retired sample with others (a row of a packer that cannot leave
    retired samples out: ``Operator.leave_out``) was taken out whole at delivery, so the other
    samples' parts in it were not delivered. The message names the record's cursor."""


class MixtureDropWarning(UserWarning):
    """``ensure_mixture`` dropped more than a fifth of what it saw to reach its weights: the input
    is far from them, and most of the work upstream is thrown away. The message says what to
    change: weigh the source by tokens (``MixtureSource(by="tokens")``), or, for a source that
    already does, estimate its tokens better, so that the correction only trims residual drift."""


class UnverifiedContentWarning(UserWarning):
    """A checkpoint taken before file contents were part of the pipeline's identity was resumed
    on files with the same layout (names, sizes, row counts, footers): their contents could not
    be compared. Checkpoints taken from then on carry the contents' digests."""
