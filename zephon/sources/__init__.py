"""Sources (SPEC §1.4): deterministic, random-access sequences of chunks of sample pointers."""

from zephon.sources.arrow import ArrowSource
from zephon.sources.base import IndexedSource, WorkSource
from zephon.sources.jsonl import FileSource, JsonlSource
from zephon.sources.memory import ListSource, RangeSource
from zephon.sources.mixture import MixtureSource

__all__ = [
    "ArrowSource",
    "FileSource",
    "IndexedSource",
    "JsonlSource",
    "ListSource",
    "MixtureSource",
    "RangeSource",
    "WorkSource",
]
