"""Zephon: deterministic, checkpointable data pipelines for ML training loops.

Build a ``Pipeline`` from a source and operators, iterate it, save ``loader.state_dict()`` with
your model, and resume with ``pipeline.iter(state=...)``: the stream continues exactly.
"""

# Before numpy loads (the compiled core loads it): a fork server's BLAS starts no threads.
from zephon._fork_server_env import one_blas_thread_in_fork_server as _one_blas_thread
from zephon._fork_server_env import quiet_fork_warnings_in_fork_server as _quiet_forks

_one_blas_thread()
_quiet_forks()

from zephon._core import check_build as _check_build  # noqa: E402

_check_build()

from zephon.errors import (  # noqa: E402
    CarryStateWarning,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    ContractViolation,
    ContractWarning,
    FetchError,
    MidStepWarning,
    MixtureDropWarning,
    OperatorError,
    PatchLayoutError,
    PipelineChangeWarning,
    PlanError,
    RelaneWarning,
    ReplayDivergenceError,
    RetireWarning,
    UnverifiedContentWarning,
    WorkerLostError,
    ZephonError,
)
from zephon.planner import Pipeline, Plan  # noqa: E402
from zephon.progress import show_progress  # noqa: E402
from zephon.runtime.checkpoint.format import load_checkpoint, save_checkpoint  # noqa: E402
from zephon.runtime.checkpoint.history import skip_steps  # noqa: E402
from zephon.runtime.checkpoint.job import merge_states  # noqa: E402
from zephon.runtime.checkpoint.job_files import load_job_state, save_rank_state  # noqa: E402
from zephon.runtime.loader import Loader  # noqa: E402

__version__ = "0.2.0.dev0"  # the one place the version is stated (pyproject.toml reads it)

__all__ = [
    "CarryStateWarning",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointMismatchError",
    "ContractViolation",
    "ContractWarning",
    "FetchError",
    "Loader",
    "MidStepWarning",
    "MixtureDropWarning",
    "OperatorError",
    "PatchLayoutError",
    "Pipeline",
    "PipelineChangeWarning",
    "Plan",
    "PlanError",
    "RelaneWarning",
    "ReplayDivergenceError",
    "RetireWarning",
    "UnverifiedContentWarning",
    "WorkerLostError",
    "ZephonError",
    "load_checkpoint",
    "load_job_state",
    "merge_states",
    "save_checkpoint",
    "save_rank_state",
    "show_progress",
    "skip_steps",
]
