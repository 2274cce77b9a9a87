"""The exception hierarchy of Zephon (SPEC §1.6): every error the library raises on purpose."""

from __future__ import annotations


class ZephonError(Exception):
    """Base class of every error Zephon raises on purpose."""


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


class OperatorError(ZephonError):
    """An exception raised inside an operator, naming the operator, the cursor and the sample id."""

    def __init__(self, message: str, *, operator: str | None = None, cursor: object = None):
        super().__init__(message)
        self.operator = operator
        self.cursor = cursor

    def __reduce__(self):  # keep the named fields when the error crosses a process boundary
        return (_rebuild_operator_error, (type(self), self.args, self.operator, self.cursor))


def _rebuild_operator_error(cls, args, operator, cursor):
    err = cls(*args, operator=operator, cursor=cursor)
    return err


class ContractWarning(UserWarning):
    """A contract violation tolerated because the pipeline is not strict; counted in stats."""
