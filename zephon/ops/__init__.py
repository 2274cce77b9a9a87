"""Operators: the API for writing them, the children helpers, and the built-in factories."""

from zephon.ops.base import OpTraits, Operator
from zephon.ops.basic import fetch, filter_records, map_transform
from zephon.ops.batching import batch
from zephon.ops.children import pack_meta, spawn_child, tombstone_meta, tombstones_for_record

__all__ = [
    "OpTraits",
    "Operator",
    "batch",
    "fetch",
    "filter_records",
    "map_transform",
    "pack_meta",
    "spawn_child",
    "tombstone_meta",
    "tombstones_for_record",
]
