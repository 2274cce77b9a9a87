"""Compiler directives are stated once, in ``setup.py``: no kernel sets its own, so that a debug
build (``ZEPHON_CYTHON_DEBUG=1``) checks bounds, negative indices and initialization in every
kernel, not only in those that leave the directives alone."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[2] / "zephon" / "_core"
SOURCES = sorted([*CORE.glob("*.pyx"), *CORE.glob("*.pxd")])

#: A directive set in a kernel (decorator, ``with`` block or header comment) or a compile-time
#: constant (``DEF``, deprecated in Cython 3).
OVERRIDE = re.compile(
    r"cython\.(boundscheck|wraparound|initializedcheck|cdivision)\b"
    r"|^#\s*cython\s*:"
    r"|^\s*DEF\s",
    re.MULTILINE,
)


def test_the_kernel_sources_are_there():
    assert len([p for p in SOURCES if p.suffix == ".pyx"]) >= 10, SOURCES


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_no_kernel_overrides_the_directives_of_the_build(source: Path):
    found = [m.group(0).strip() for m in OVERRIDE.finditer(source.read_text())]
    assert not found, f"{source.name} sets its own directives: {found}"


def test_the_debug_switch_turns_every_check_on():
    setup = (CORE.parents[1] / "setup.py").read_text()
    for check in ("boundscheck", "wraparound", "initializedcheck"):
        assert re.search(rf'"{check}": DEBUG,', setup), f"{check} does not follow the debug switch"
