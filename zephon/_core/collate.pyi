"""The default collate's per-batch loop (compiled); ``zephon.ops.batching`` holds the rule."""

from collections.abc import Callable
from typing import Any

UNDECIDED: object

def collate_dicts(payloads: list[Any], rule: Callable[[Any, tuple[Any, ...]], Any]) -> Any: ...
