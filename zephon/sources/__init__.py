"""Sources (SPEC §1.4): deterministic, random-access sequences of chunks of sample pointers."""

from zephon.sources.base import IndexedSource, WorkSource
from zephon.sources.memory import ListSource, RangeSource
from zephon.sources.mixture import MixtureSource

__all__ = ["IndexedSource", "ListSource", "MixtureSource", "RangeSource", "WorkSource"]
