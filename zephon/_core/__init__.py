"""Compiled kernels: the cursor, the records, the per-lane chunk table, delivery bookkeeping, the
bin-fill loops, the collate, token ids and pointer-row checks.

There is no pure-Python fallback. If the extension modules were not built, importing any of them
fails with an error that says how to build them instead of a bare ImportError.
"""

import importlib

_MODULES = (
    "cursor",
    "records",
    "chunk_table",
    "delivery",
    "binfill",
    "packfill",
    "collate",
    "tokens",
    "pointers",
)


def check_build() -> None:
    for name in _MODULES:
        try:
            importlib.import_module(f"{__name__}.{name}")
        except ImportError as exc:
            raise ImportError(
                f"zephon's compiled core is not built (zephon._core.{name}: {exc}). "
                "From a source checkout run `make build` (or `pip install -e .`); "
                "installed wheels ship it compiled."
            ) from exc
