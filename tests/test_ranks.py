"""Rank resolution: explicit arguments, then torch.distributed, then a multi-process JAX runtime
(public API only), then RANK/WORLD_SIZE; half an answer is an error, never rank 0 of 1."""

from __future__ import annotations

import sys
import types

import pytest

import zephon
from zephon.errors import PlanError
from zephon.ops.basic import fetch
from zephon.ranks import resolve_rank
from zephon.sources.memory import RangeSource


@pytest.fixture(autouse=True)
def no_ambient_rank(monkeypatch):
    """Each test starts with no RANK/WORLD_SIZE and no JAX runtime in the process."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delitem(sys.modules, "jax", raising=False)


def fake_jax(monkeypatch, *, count=None, index=None, error=None):
    """A stand-in for an imported ``jax`` with only its public process API: no ``jax._src``."""
    jax = types.ModuleType("jax")

    def process_count():
        if error is not None:
            raise error
        return count

    def process_index():
        if error is not None:
            raise error
        return index

    jax.process_count = process_count  # type: ignore[attr-defined]
    jax.process_index = process_index  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "jax", jax)
    return jax


def test_nothing_set_means_rank_0_of_1():
    assert resolve_rank(None, None) == (0, 1)


def test_both_environment_variables_give_the_rank(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert resolve_rank(None, None) == (2, 3)


def test_explicit_arguments_win_over_the_environment_and_jax(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    fake_jax(monkeypatch, count=8, index=5)
    assert resolve_rank(1, 4) == (1, 4)


@pytest.mark.parametrize(("present", "missing"), [("RANK", "WORLD_SIZE"), ("WORLD_SIZE", "RANK")])
def test_one_environment_variable_without_the_other_is_a_plan_error(monkeypatch, present, missing):
    monkeypatch.setenv(present, "1")
    with pytest.raises(PlanError, match=rf"{present} is set .* but {missing} is not.*rank="):
        resolve_rank(None, None)


def test_environment_variables_that_are_not_integers_are_a_plan_error(monkeypatch):
    monkeypatch.setenv("RANK", "first")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(PlanError, match="not integers"):
        resolve_rank(None, None)


def test_half_the_position_given_is_completed_only_by_a_world_that_agrees(monkeypatch):
    # Under torchrun with a 2 x 2 (data x tensor parallel) mesh, global rank 1 is data-parallel
    # rank 0 of 2. Passing only that rank must not take the world size (4) of the whole job:
    # its ranks would run half the lanes and nobody the rest.
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert resolve_rank(1, None) == (1, 4)  # the same world: the other half is known
    assert resolve_rank(None, 4) == (1, 4)
    with pytest.raises(PlanError, match=r"rank=0 .* RANK/WORLD_SIZE .* rank 1 of 4.*world_size="):
        resolve_rank(0, None)
    with pytest.raises(PlanError, match=r"world_size=2 .* RANK/WORLD_SIZE .* rank 1 of 4.*rank="):
        resolve_rank(None, 2)
    fake_jax(monkeypatch, count=8, index=5)
    with pytest.raises(PlanError, match=r"jax .* rank 5 of 8"):
        resolve_rank(2, None)


def test_a_rank_outside_the_world_is_a_plan_error():
    with pytest.raises(PlanError, match=r"rank=3, world_size=3"):
        resolve_rank(3, 3)


def test_a_multi_process_jax_runtime_gives_the_rank_through_its_public_api(monkeypatch):
    fake_jax(monkeypatch, count=4, index=2)
    assert resolve_rank(None, None) == (2, 4)
    plan = zephon.Pipeline(RangeSource(8), [fetch()]).compile()
    assert (plan.rank, plan.world_size) == (2, 4)


def test_jax_is_asked_before_the_environment(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    fake_jax(monkeypatch, count=4, index=3)
    assert resolve_rank(None, None) == (3, 4)


def test_a_single_process_jax_runtime_leaves_the_rank_to_the_environment(monkeypatch):
    fake_jax(monkeypatch, count=1, index=0)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert resolve_rank(None, None) == (1, 2)


def test_a_jax_runtime_that_fails_to_answer_is_a_plan_error_not_rank_0(monkeypatch):
    fake_jax(monkeypatch, error=RuntimeError("backend exploded"))
    with pytest.raises(PlanError, match=r"jax.process_count\(\) failed.*backend exploded.*rank="):
        resolve_rank(None, None)


def test_a_jax_runtime_without_the_public_process_api_is_a_plan_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "jax", types.ModuleType("jax"))
    with pytest.raises(PlanError, match=r"jax.*process_count.*rank="):
        resolve_rank(None, None)


def test_jax_is_never_imported_by_rank_resolution():
    assert resolve_rank(None, None) == (0, 1)
    assert "jax" not in sys.modules


def test_the_planner_resolves_ranks_through_this_module():
    import zephon.planner
    import zephon.ranks

    assert zephon.planner.resolve_rank is zephon.ranks.resolve_rank
