"""Compiled kernels: the cursor, the records, the per-lane chunk table, delivery bookkeeping, the
bin-fill loops, the collate, token ids and pointer-row checks.

There is no pure-Python fallback. If the extension modules were not built, importing any of them
fails with an error that says how to build them instead of a bare ImportError.
"""

import importlib
from pathlib import Path

# Every kernel ships a stub beside it (source checkouts and wheels alike): the stubs name them.
_MODULES = tuple(sorted(p.stem for p in Path(__file__).parent.glob("*.pyi")))


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
