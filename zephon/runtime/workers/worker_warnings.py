"""Warnings raised in a worker process, raised again in the training process.

A worker shows nothing itself: it keeps each distinct warning (category, text, place) once and
sends it to the loader ahead of its next item list. The loader raises it again through
``warnings.warn_explicit``, with the registry of the module it came from, so the training
script's filters decide (``"ignore"``, ``"error"``, ``pytest.warns``, ...) and a warning the
loader's process already showed (read there before the worker took over) is not shown twice.
"""

from __future__ import annotations

import sys
import threading
import warnings
from typing import Any

#: Distinct warnings a worker remembers having sent; past this it forgets them all (and may
#: send one again, which the loader's registry then usually hides).
MAX_REMEMBERED = 4096

# Reentrant: a warning raised while one is kept (from a finalizer a garbage collection runs
# there) is kept in the same thread.
_lock = threading.RLock()
_pending: list[tuple[Any, ...]] = []
_sent: set[tuple[Any, ...]] = set()
_modules: dict[str, str | None] = {}
_registry: dict[Any, Any] = {}  # for warnings of modules the loader's process does not have


def forward_warnings() -> None:
    """In a worker process: keep every warning for the loader instead of showing it here."""
    warnings.simplefilter("always")  # the training process's filters decide, not ours
    warnings.showwarning = _keep


def _keep(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: Any = None,
    line: str | None = None,
) -> None:
    # The category travels by name: a class of the script is ``__mp_main__``'s in a worker.
    kind = (_main(category.__module__), category.__qualname__)
    key = (*kind, str(message), filename, lineno)
    module = _module_of(filename)  # not under the lock: a module's own lookup may warn too
    with _lock:
        if key in _sent:
            return
        if len(_sent) >= MAX_REMEMBERED:
            _sent.clear()
        _sent.add(key)
        _pending.append((*key, module))


def _main(module: str) -> str:
    return "__main__" if module == "__mp_main__" else module


def _module_of(filename: str) -> str | None:
    """The name of the loaded module whose file is ``filename`` (filters match on it)."""
    if filename not in _modules:
        _modules[filename] = None  # while looking: a warning raised by a lookup finds none
        _modules[filename] = next(
            (
                name
                for name, module in list(sys.modules.items())
                if getattr(module, "__file__", None) == filename and name != "__mp_main__"
            ),
            None,
        )
    return _modules[filename]


def take_warnings() -> list[tuple[Any, ...]]:
    """The warnings kept since the last call, in the order they were raised."""
    with _lock:
        taken = _pending[:]
        _pending.clear()
    return taken


def reraise(found: list[tuple[Any, ...]]) -> None:
    """In the training process: raise each warning a worker sent, as if raised here."""
    for module_name, qualname, text, filename, lineno, module in found:
        category = _category(module_name, qualname)
        if not _made_from_text(category, text):  # its __init__ takes more than the text
            category = UserWarning
        if category is UserWarning and qualname != "UserWarning":
            text = f"{qualname}: {text}"  # a category this process does not have
        # A worker that has no module of the file (a Ray actor, whose ``__main__`` is Ray's own,
        # running an operator of the training script) leaves it to this process to name one.
        module = module or _module_of(filename)
        loaded = sys.modules.get(module) if module else None
        registry = vars(loaded).setdefault("__warningregistry__", {}) if loaded else _registry
        if module:
            warnings.warn_explicit(text, category, filename, lineno, module, registry)
        else:  # module=None would make warnings drop it: name none (it takes the file's name)
            warnings.warn_explicit(text, category, filename, lineno, registry=registry)


def _made_from_text(category: type[Warning], text: str) -> bool:
    """Whether ``category(text)`` can be made, as ``warnings`` makes the warning it raises."""
    try:
        category(text)
    except Exception:
        return False
    return True


def _category(module_name: str, qualname: str) -> type[Warning]:
    found: Any = sys.modules.get(module_name)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if isinstance(found, type) and issubclass(found, Warning):
        return found
    return UserWarning
