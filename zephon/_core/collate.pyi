"""The default collate's per-batch loop (compiled); ``zephon.ops.batching`` holds the rule."""

from collections.abc import Callable
from typing import Any

from zephon._core.records import RecordRun

UNDECIDED: object

def collate_dicts(payloads: list[Any], rule: Callable[[Any, tuple[Any, ...]], Any]) -> Any: ...
def collate_run(run: RecordRun, rule: Callable[[Any, tuple[Any, ...]], Any]) -> Any: ...
