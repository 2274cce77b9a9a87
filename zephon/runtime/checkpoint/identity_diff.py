"""Where two pipeline descriptions differ: the first field, named the way a user knows it.

A checkpoint keeps the ``describe()`` trees of the source and of every operator next to their
digests; when a pipeline does not match, ``first_difference`` walks both trees and names the first
place they part: the operator (by position and name) and its parameter, or the source's field, and
for a file source the file by its name relative to the dataset root, plus what changed (its
size, rows, footer) or that a file was added or removed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["first_difference", "operator_differences"]

_SHOWN = 80  # characters of a value quoted in a message


def first_difference(saved: Any, current: Any) -> str | None:
    """The first difference between a checkpoint's described pipeline and the current one, as
    ``"where: checkpoint X, pipeline Y"``; None when they are equal or a side is missing."""
    if not isinstance(saved, dict) or not isinstance(current, dict):
        return None
    if saved.get("source") != current.get("source"):
        return _walk(saved.get("source"), current.get("source"), "source")
    ops_a, ops_b = saved.get("operators"), current.get("operators")
    if ops_a == ops_b:
        return None
    if not isinstance(ops_a, list) or not isinstance(ops_b, list):
        return f"operators: checkpoint {_show(ops_a)}, pipeline {_show(ops_b)}"
    for k, (a, b) in enumerate(zip(ops_a, ops_b, strict=False)):
        if a != b:
            return _walk(a, b, f"operators: operator #{k} ({_op_name(b)})")
    if len(ops_a) != len(ops_b):
        return f"operators: checkpoint has {len(ops_a)}, pipeline has {len(ops_b)}"
    return None


def operator_differences(saved: Any, current: Any, limit: int = 20) -> list[str]:
    """Every parameter (or other field) that differs between the operators of a checkpoint's
    described pipeline and the current one, each as ``"operator #k (name) parameter 'p': ..."``
    in chain order (at most ``limit``); ``[]`` when the operators are equal or a side is
    missing."""
    if not isinstance(saved, dict) or not isinstance(current, dict):
        return []
    ops_a, ops_b = saved.get("operators"), current.get("operators")
    if ops_a == ops_b or not isinstance(ops_a, list) or not isinstance(ops_b, list):
        return []
    out: list[str] = []
    for k, (a, b) in enumerate(zip(ops_a, ops_b, strict=False)):
        if a == b:
            continue
        where = f"operator #{k} ({_op_name(b)})"
        if not isinstance(a, dict) or not isinstance(b, dict):
            out.append(_walk(a, b, where))
            continue
        found = _field_differences(a.get("params"), b.get("params"), where, "parameter")
        # The name follows the parameters (``map_transform(fn)``): named only when alone.
        found += _field_differences(
            {k: v for k, v in a.items() if k not in ("params", "name")},
            {k: v for k, v in b.items() if k not in ("params", "name")},
            where,
            "field",
        )
        out += found or [_walk(a, b, where)]
    if len(ops_a) != len(ops_b):
        out.append(f"operators: checkpoint has {len(ops_a)}, pipeline has {len(ops_b)}")
    return out[:limit]


def _field_differences(a: Any, b: Any, where: str, label: str) -> list[str]:
    """One difference per key of two dicts that differs there."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return [] if a == b else [_walk(a, b, where, label)]
    return [
        _walk({key: a[key]} if key in a else {}, {key: b[key]} if key in b else {}, where, label)
        for key in [*a, *(k for k in b if k not in a)]
        if a.get(key, _MISSING) != b.get(key, _MISSING)
    ]


_MISSING = object()


def _op_name(desc: Any) -> str:
    if isinstance(desc, dict):
        return str(desc.get("name") or desc.get("class") or "?")
    return "?"


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def _walk(a: Any, b: Any, where: str, label: str = "field") -> str:
    # ``label``: what the keys of a dict here are called ("parameter" inside an op's params).
    if isinstance(a, dict) and isinstance(b, dict):
        for key in [*a, *(k for k in b if k not in a)]:
            if key not in b:
                return f"{where}: {label} {key!r} only in the checkpoint"
            if key not in a:
                return f"{where}: {label} {key!r} only in the pipeline"
            if a[key] != b[key]:
                if key == "files" and isinstance(a[key], list) and isinstance(b[key], list):
                    return _files(a[key], b[key], where)
                if key == "params" and label == "field":
                    return _walk(a[key], b[key], where, "parameter")
                return _walk(a[key], b[key], f"{where} {label} {key!r}")
        return f"{where}: differs"
    if isinstance(a, list) and isinstance(b, list):
        for k, (x, y) in enumerate(zip(a, b, strict=False)):
            if x != y:
                return _walk(x, y, f"{where}[{k}]")
        return f"{where}: checkpoint has {len(a)} items, pipeline has {len(b)}"
    return f"{where}: checkpoint {_show(a)}, pipeline {_show(b)}"


def _files(a: list[Any], b: list[Any], where: str) -> str:
    # Files are matched by name, so a file added or removed is named as such, not as a shift.
    def names(items: list[Any]) -> list[Any]:
        return [f.get("name") if isinstance(f, dict) else None for f in items]

    na, nb = names(a), names(b)
    if None in na or None in nb:
        return _walk(a, b, where)
    removed = [n for n in na if n not in nb]
    added = [n for n in nb if n not in na]
    if removed:
        return f"{where}: file {removed[0]!r} is in the checkpoint but not in the pipeline"
    if added:
        return f"{where}: file {added[0]!r} is in the pipeline but not in the checkpoint"
    if na != nb:
        return f"{where}: the same files in another order (checkpoint {_show(na)})"
    order = ("rows", "lines", "size", "groups", "format", "footer", "content_sha256")
    for x, y in zip(a, b, strict=True):
        if x != y:
            keys = sorted({*x, *y}, key=lambda k: (order.index(k) if k in order else len(order), k))
            changes = [
                f"{'footer (its content or row groups)' if k == 'footer' else k} "
                f"{_show(x.get(k))} -> {_show(y.get(k))}"
                for k in keys
                if x.get(k) != y.get(k)
            ]
            return f"{where}: file {x['name']!r} changed (checkpoint -> pipeline): " + ", ".join(
                changes
            )
    return f"{where}: differs"
