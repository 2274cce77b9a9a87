"""Sources: deterministic, random-access sequences of chunks of sample pointers."""

from zephon.sources.arrow import ArrowSource
from zephon.sources.base import IndexedSource, WorkSource
from zephon.sources.discover import open_source
from zephon.sources.files import FileOptions, FileSource
from zephon.sources.hf import HFDatasetSource
from zephon.sources.image_values import RawImage
from zephon.sources.jsonl import JsonlSource
from zephon.sources.lance import LanceSource
from zephon.sources.litdata import LitDataSource
from zephon.sources.mds import MDSSource
from zephon.sources.memory import ListSource, RangeSource
from zephon.sources.mixture import MixtureSource
from zephon.sources.shard_cache import ShardCache
from zephon.sources.token_shards import TokenShardSource
from zephon.sources.webdataset import WebDatasetSource

__all__ = [
    "ArrowSource",
    "FileOptions",
    "FileSource",
    "HFDatasetSource",
    "IndexedSource",
    "JsonlSource",
    "LanceSource",
    "ListSource",
    "LitDataSource",
    "MDSSource",
    "MixtureSource",
    "RangeSource",
    "RawImage",
    "ShardCache",
    "TokenShardSource",
    "WebDatasetSource",
    "WorkSource",
    "open_source",
]
