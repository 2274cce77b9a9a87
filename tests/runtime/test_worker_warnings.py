"""A warning raised by an operator in a worker process reaches the training process through
``warnings``, once, where the script's filters apply; the worker itself prints nothing."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types
import warnings
from pathlib import Path
from typing import Any

import pytest
from pipeline_kit import run_with_timeout
from worker_kit import script_env

import zephon
from zephon.ops import batch, fetch, map_transform
from zephon.sources import ListSource

pytestmark = pytest.mark.usefixtures("no_leftover_workers")


class OddRowWarning(UserWarning):
    """What ``note_odd_rows`` warns with."""


def note_odd_rows(payload: int) -> int:
    """Warns about one row (defined at module level: process lanes pickle it)."""
    if payload == 7:
        warnings.warn("row 7 looks odd", OddRowWarning, stacklevel=2)
    return payload


def pipeline(workers: str = "process") -> zephon.Pipeline:
    source = ListSource(list(range(40)), chunk_size=8)
    return zephon.Pipeline(
        source, [fetch(), map_transform(note_odd_rows), batch(4)], lanes=2, workers=workers
    )


@pytest.mark.parametrize("workers", ["process", "thread", "inline"])
def test_a_worker_warning_is_seen_once_by_the_training_process(workers: str) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert sum(len(b) for b in pipeline(workers)) == 40
    odd = [w for w in caught if issubclass(w.category, OddRowWarning)]
    assert [str(w.message) for w in odd] == ["row 7 looks odd"]


def test_pytest_warns_sees_a_worker_warning() -> None:
    with pytest.warns(OddRowWarning, match="row 7 looks odd"):
        list(pipeline())


def test_an_ignore_filter_silences_a_worker_warning() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=OddRowWarning)
        list(pipeline())
    assert not [w for w in caught if issubclass(w.category, OddRowWarning)]


SCRIPT = """
import sys, warnings
import zephon
from zephon.ops import batch, fetch, map_transform
from zephon.sources import ListSource

def note(payload):
    if payload == 7:
        warnings.warn("row 7 looks odd", UserWarning)
    return payload

if __name__ == "__main__":
    if sys.argv[1] == "ignore":
        warnings.simplefilter("ignore", UserWarning)
    pipeline = zephon.Pipeline(
        ListSource(list(range(40)), chunk_size=8), [fetch(), map_transform(note), batch(4)],
        lanes=2, workers="process",
    )
    print(sum(len(b) for b in pipeline))
"""


@pytest.mark.parametrize("filters", ["default", "ignore"])
def test_the_worker_prints_nothing_itself(tmp_path: Path, filters: str) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    done = subprocess.run(
        [sys.executable, str(script), filters],
        capture_output=True,
        text=True,
        env=script_env(),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "40"
    assert done.stderr.count("UserWarning: row 7 looks odd") == (
        1 if filters == "default" else 0
    ), done.stderr


class LevelWarning(UserWarning):
    """A warning class whose constructor takes more than the text."""

    def __init__(self, text: str, level: int) -> None:
        super().__init__(text)
        self.level = level


def note_odd_rows_with_a_level(payload: int) -> int:
    if payload == 7:
        warnings.warn(LevelWarning("row 7 looks odd", 2), stacklevel=2)
    return payload


def test_a_worker_warning_whose_class_takes_more_than_its_text_still_arrives() -> None:
    # Raised again from its text, it could not be made: the run ended in a TypeError.
    source = ListSource(list(range(40)), chunk_size=8)
    p = zephon.Pipeline(
        source, [fetch(), map_transform(note_odd_rows_with_a_level), batch(4)], workers="process"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert sum(len(b) for b in p) == 40
    assert [str(w.message) for w in caught] == ["LevelWarning: row 7 looks odd"]


def note_odd_rows_from_generated_code(payload: int) -> int:
    """Warns about row 7 from generated code: a file no loaded module has."""
    if payload == 7:
        code = compile("warnings.warn('row 7 looks odd')", "<generated>", "exec")
        exec(code, {"warnings": warnings})
    return payload


def _rows_and_warnings(fn: Any) -> tuple[int, list[str]]:
    source = ListSource(list(range(40)), chunk_size=8)
    p = zephon.Pipeline(source, [fetch(), map_transform(fn), batch(4)], workers="process")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        n = sum(len(b) for b in p)
    return n, [str(w.message) for w in caught]


def test_a_worker_warning_from_code_of_no_module_still_arrives() -> None:
    # Raised again with module=None, which warnings takes as "drop it".
    n, seen = _rows_and_warnings(note_odd_rows_from_generated_code)
    assert n == 40 and seen == ["row 7 looks odd"]


def _warns_on_lookup(name: str) -> None:
    """A module's ``__getattr__`` that warns for any name it lacks (a deprecation shim)."""
    warnings.warn(f"{name} is deprecated", DeprecationWarning, stacklevel=2)
    raise AttributeError(name)


def note_odd_rows_beside_a_shim(payload: int) -> int:
    """``note_odd_rows_from_generated_code`` in a process where a module without a file warns
    on lookups."""
    if "zephon_test_shim" not in sys.modules:
        shim = types.ModuleType("zephon_test_shim")
        shim.__getattr__ = _warns_on_lookup  # type: ignore[method-assign]
        sys.modules["zephon_test_shim"] = shim
    return note_odd_rows_from_generated_code(payload)


def test_a_warning_raised_while_a_worker_keeps_one_does_not_hang_the_worker() -> None:
    # Keeping row 7's warning looks for the module of its file in every module; the shim's
    # lookup warns in turn, inside the keeping of the first, which waited for itself.
    n, seen = run_with_timeout(lambda: _rows_and_warnings(note_odd_rows_beside_a_shim), 30)
    assert n == 40 and "row 7 looks odd" in seen
