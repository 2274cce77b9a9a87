"""The identity of a pipeline parameter: one JSON-able description per value, equal in every
process for the same definition and different when the value could make the pipeline behave
differently. Operators (``Operator.describe``) and sources describe every parameter with it, and
the pipeline fingerprint digests those descriptions, so a checkpoint only loads into a pipeline
whose parameters have the same identity.

One rule, applied recursively (``identify``):

- **Plain data** as is: ``None``, ``bool``, ``int``, ``float``, ``str``. Lists and tuples become
  lists, mappings dicts with their keys as ``str`` and sorted, sets sorted lists; ``bytes`` and
  ``complex`` by value; numpy scalars by dtype and value; numpy arrays by dtype, shape and a sha256
  of their bytes in C order (arrays of objects by their elements).
- **Functions and lambdas**: module and qualified name plus a digest of the code object (its
  bytecode, constants, nested code objects, names, local names and argument counts), their
  defaults and keyword-only defaults, and the values their closure cells hold, by this same rule.
  Globals a function reads enter by name only. A closure over a value that cannot be identified
  is refused. **Bound methods**: the function and the identity of the instance.
  ``functools.partial``: the function, its arguments and keywords. **Builtins and C functions**
  (no ``__code__``): module and qualified name, which are stable (plus the instance of a bound
  builtin method, e.g. ``{}.get``). **Classes** and **modules**: their qualified name.
- **Objects**, in this order:

  1. *The identity protocol*: a ``describe()`` method returning JSON data (``None``, ``bool``,
     ``int``, ``float``, ``str``, lists and dicts) that covers everything that changes what the
     object does. Zephon's operators and sources have one; give one to any class of yours that
     the rules below cannot identify.
  2. *Known tokenizers*: a Hugging Face ``tokenizers.Tokenizer`` by a sha256 of ``to_str()``; a
     ``transformers`` tokenizer by its backend's ``to_str()`` when it is fast, else by its
     vocabulary (``get_vocab()``), its special tokens and its class.
  3. *Known value types* without a ``__dict__``: paths, enum members, compiled regular
     expressions, ``range``, ``slice``, ``datetime``, ``Decimal`` and the ``operator`` getters.
  4. *Plain objects* (dataclasses and other instances of Python classes): their class and their
     state (``__getstate__()`` when the class defines one, else ``__dict__`` and slots), when
     that state is identifiable, at most ``MAX_DEPTH`` levels deep and ``MAX_VALUES`` values in
     all. The code of the class's methods is not part of it (classes go by name).

  Anything else -- an object with state the rule cannot see (locks, random generators, open
  files, iterators, compiled objects) -- raises ``PlanError`` naming the parameter and the path
  to the value, and saying how to fix it. Nothing falls back to a class name.

Stability: nothing here reads ``id()``, ``hash()``, memory addresses or set order, so identities
are equal across processes and runs. Bytecode (``co_code``) differs between Python minor
versions, so the identity of a function -- and the fingerprint of a pipeline holding one -- is
stable for one Python minor version, not across versions: a checkpoint of a pipeline with a
lambda taken under Python 3.11 is refused under 3.12.
"""

from __future__ import annotations

import copyreg
import dataclasses
import datetime
import decimal
import enum
import functools
import hashlib
import json
import operator
import pathlib
import re
import struct
import types
from collections.abc import Mapping
from typing import Any

import numpy as np

from zephon.errors import PlanError

__all__ = ["MAX_DEPTH", "MAX_VALUES", "identify"]

#: Deepest nesting of values (containers, objects, closures) the rule follows.
MAX_DEPTH = 64
#: Most values one identification visits; beyond it a parameter needs a ``describe()``.
MAX_VALUES = 1_000_000

_HOW_TO_FIX = (
    "give its class a describe() method returning JSON data (dicts, lists, str, int, float, bool, "
    "None) that covers everything that changes what it does"
)

# Callables implemented in C: they have no code object, and their names are stable.
_C_CALLABLES: tuple[type, ...] = (
    types.BuiltinFunctionType,
    types.MethodDescriptorType,
    types.WrapperDescriptorType,
    types.MethodWrapperType,
    types.ClassMethodDescriptorType,
    np.ufunc,
)

# Value types without a __dict__ whose pickle reduction (constructor and arguments) is plain
# data and says all they hold.
_REDUCIBLE_VALUES: tuple[type, ...] = (
    range,
    slice,
    re.Pattern,
    datetime.date,
    datetime.time,
    datetime.timedelta,
    datetime.timezone,
    decimal.Decimal,
    operator.itemgetter,
    operator.attrgetter,
    operator.methodcaller,
)

_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class defined in Python (or built like one)
_POINTER = struct.calcsize("P")
_NOT_SLOTS = ("__dict__", "__weakref__")
_DEFAULT_GETSTATE = getattr(object, "__getstate__", None)  # object's own, since Python 3.11


def identify(value: Any, where: str = "the value") -> Any:
    """The JSON-able identity of ``value`` by the rule in this module's docstring.

    ``where`` names the value in errors, e.g. ``"operator 'tokenize' parameter 'tokenizer'"``;
    a value that cannot be identified raises ``PlanError`` starting with it.
    """
    return _Walker(where).walk(value, "", 0)


def _qualified(obj: Any) -> str:
    return f"{getattr(obj, '__module__', None)}.{getattr(obj, '__qualname__', None)}"


def _type_name(value: Any) -> str:
    return _qualified(type(value))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


class _Walker:
    """One identification: the name of the parameter, the values visited so far, and the
    containers and objects on the current path (to describe a reference cycle by its depth)."""

    def __init__(self, where: str):
        self.where = where
        self.visited = 0
        # Only to notice that a value contains itself; id() never enters an identity.
        self.on_path: list[int] = []
        self.codes: dict[types.CodeType, str] = {}

    def refuse(self, path: str, why: str) -> PlanError:
        return PlanError(
            f"{self.where}{path} cannot be identified for the pipeline fingerprint: {why}; "
            f"{_HOW_TO_FIX}"
        )

    def walk(self, value: Any, path: str, depth: int) -> Any:
        self.visited += 1
        if self.visited > MAX_VALUES:
            raise self.refuse(path, f"it holds more than {MAX_VALUES} values")
        if value is None or type(value) in (bool, int, float, str):
            return value
        if depth > MAX_DEPTH:
            raise self.refuse(path, f"it is nested too deep (more than {MAX_DEPTH} levels)")
        if isinstance(value, np.generic):
            return self.numpy_scalar(value, path, depth)
        if isinstance(value, (bool, int, float, str)):  # subclasses: IntEnum, str enums, ...
            if isinstance(value, enum.Enum):
                return {"enum": _type_name(value), "name": value.name}
            return value
        if isinstance(value, (bytes, bytearray, memoryview)):
            return {"bytes": _sha256(bytes(value)), "len": len(value)}
        if isinstance(value, complex):
            return {"complex": [value.real, value.imag]}
        if isinstance(value, np.ndarray):
            return self.array(value, path, depth)
        key = id(value)
        if key in self.on_path:
            return {"cycle": self.on_path.index(key)}
        self.on_path.append(key)
        try:
            return self.compound(value, path, depth + 1)
        finally:
            self.on_path.pop()

    def compound(self, value: Any, path: str, depth: int) -> Any:
        if isinstance(value, (list, tuple)):
            return [self.walk(v, f"{path}[{i}]", depth) for i, v in enumerate(value)]
        if isinstance(value, Mapping):
            items = sorted(value.items(), key=lambda kv: str(kv[0]))
            return {str(k): self.walk(v, f"{path}[{k!r}]", depth) for k, v in items}
        if isinstance(value, (set, frozenset)):
            members = [self.walk(v, f"{path}{{…}}", depth) for v in value]
            return {"set": sorted(members, key=_canonical)}
        if isinstance(value, type):
            return {"class": _qualified(value)}
        if isinstance(value, types.ModuleType):
            return {"module": value.__name__}
        if isinstance(value, functools.partial):
            return {
                "partial": self.walk(value.func, f"{path}.func", depth),
                "args": self.walk(list(value.args), f"{path}.args", depth),
                "keywords": self.walk(dict(value.keywords), f"{path}.keywords", depth),
            }
        if isinstance(value, types.MethodType):
            return {
                "method": self.walk(value.__func__, f"{path}.__func__", depth),
                "self": self.walk(value.__self__, f"{path}.__self__", depth),
            }
        if isinstance(value, types.FunctionType):
            return self.function(value, path, depth)
        if isinstance(value, _C_CALLABLES) or type(value).__name__ == "cython_function_or_method":
            return self.c_callable(value, path, depth)
        return self.instance(value, path, depth)

    # ---- values -----------------------------------------------------------------------------

    def numpy_scalar(self, value: np.generic, path: str, depth: int) -> Any:
        dtype = value.dtype
        if dtype.kind in "biuf":
            return {"numpy": dtype.str, "value": value.item()}
        if dtype.kind == "c":
            return {"numpy": dtype.str, "value": [float(value.real), float(value.imag)]}
        if dtype.hasobject:
            return {"numpy": "object", "value": self.walk(value.item(), path, depth + 1)}
        return {"numpy": dtype.str, "bytes": value.tobytes().hex()}

    def array(self, value: np.ndarray, path: str, depth: int) -> Any:
        out: dict[str, Any] = {"ndarray": list(value.shape), "dtype": value.dtype.str}
        if value.dtype.hasobject:
            out["items"] = self.walk(value.ravel(order="C").tolist(), path, depth + 1)
        else:
            out["sha256"] = _sha256(np.ascontiguousarray(value).tobytes())
        return out

    # ---- callables --------------------------------------------------------------------------

    def function(self, fn: types.FunctionType, path: str, depth: int) -> Any:
        code = fn.__code__
        out: dict[str, Any] = {
            "function": _qualified(fn),
            "code": _code_digest(code, self.codes),
        }
        if fn.__defaults__:
            out["defaults"] = self.walk(list(fn.__defaults__), f"{path}.__defaults__", depth)
        if fn.__kwdefaults__:
            out["kwdefaults"] = self.walk(fn.__kwdefaults__, f"{path}.__kwdefaults__", depth)
        if fn.__closure__:
            cells: dict[str, Any] = {}
            for name, cell in zip(code.co_freevars, fn.__closure__, strict=True):
                try:
                    content = cell.cell_contents
                except ValueError:  # a cell not assigned yet
                    cells[name] = {"empty_cell": True}
                    continue
                cells[name] = self.walk(content, f"{path} (closure variable {name!r})", depth)
            out["closure"] = cells
        return out

    def c_callable(self, fn: Any, path: str, depth: int) -> Any:
        qualname = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
        module = getattr(fn, "__module__", None)
        owner = getattr(fn, "__self__", None)
        if module is None:
            holder = getattr(fn, "__objclass__", None) or type(owner)
            module = getattr(holder, "__module__", None) or "builtins"
        out: dict[str, Any] = {"builtin": f"{module}.{qualname}"}
        if owner is not None and not isinstance(owner, (types.ModuleType, type)):
            # A bound builtin method ({}.get, "ab".upper): what it does depends on its instance.
            out["self"] = self.walk(owner, f"{path}.__self__", depth)
        elif isinstance(owner, type):
            out["self"] = {"class": _qualified(owner)}
        return out

    # ---- objects ----------------------------------------------------------------------------

    def instance(self, value: Any, path: str, depth: int) -> Any:
        describe = getattr(value, "describe", None)
        if callable(describe):
            return self.described(value, describe, path)
        known = self.known_tokenizer(value, path, depth)
        if known is not None:
            return known
        if isinstance(value, pathlib.PurePath):
            return {"path": str(value), "class": _type_name(value)}
        if isinstance(value, enum.Enum):
            return {"enum": _type_name(value), "name": value.name}
        if isinstance(value, _REDUCIBLE_VALUES):
            reducer = copyreg.dispatch_table.get(type(value))  # how pickle reduces it
            reduced = reducer(value) if reducer is not None else value.__reduce_ex__(4)
            return {"object": _type_name(value), "reduce": self.walk(reduced, path, depth)}
        return self.plain_object(value, path, depth)

    def described(self, value: Any, describe: Any, path: str) -> Any:
        try:
            result = describe()
        except PlanError:
            raise
        except Exception as exc:
            raise PlanError(
                f"{self.where}{path}: describe() of {_type_name(value)} failed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        bad = _first_non_json(result, "")
        if bad is not None:
            where_in, what = bad
            raise PlanError(
                f"{self.where}{path}: describe() of {_type_name(value)} returned {what} at "
                f"result{where_in}, not JSON data; return only dicts with str keys, lists, str, "
                "int, float, bool and None"
            )
        return {"object": _type_name(value), "describe": result}

    def known_tokenizer(self, value: Any, path: str, depth: int) -> Any:
        cls = type(value)
        package = (cls.__module__ or "").partition(".")[0]
        if package == "tokenizers" and callable(getattr(value, "to_str", None)):
            return {"tokenizer": _qualified(cls), "sha256": self.serialized(value, path)}
        if package != "transformers" or not any(
            c.__name__ == "PreTrainedTokenizerBase" for c in cls.__mro__
        ):
            return None
        out: dict[str, Any] = {"tokenizer": _qualified(cls)}
        fast = getattr(value, "is_fast", False)
        backend = getattr(value, "backend_tokenizer", None) if fast else None
        if backend is not None:
            out["backend_sha256"] = self.serialized(backend, f"{path}.backend_tokenizer")
        else:
            vocab = sorted(value.get_vocab().items())
            out["vocab_sha256"] = _sha256(_canonical(vocab).encode())
        for name in ("special_tokens_map", "model_max_length", "padding_side", "truncation_side"):
            out[name] = self.walk(getattr(value, name, None), f"{path}.{name}", depth)
        return out

    def serialized(self, tokenizer: Any, path: str) -> str:
        text = tokenizer.to_str()
        if not isinstance(text, str):
            raise self.refuse(path, f"to_str() returned {type(text).__name__}, not str")
        return _sha256(text.encode("utf-8"))

    def plain_object(self, value: Any, path: str, depth: int) -> Any:
        cls = type(value)
        compiled = _compiled_layout(cls)
        if compiled is not None:
            raise self.refuse(path, f"{_qualified(cls)} keeps state in compiled code ({compiled})")
        getstate = getattr(cls, "__getstate__", None)
        if getstate is not None and getstate is not _DEFAULT_GETSTATE:
            try:
                state = value.__getstate__()
            except Exception as exc:
                raise PlanError(
                    f"{self.where}{path}: __getstate__() of {_qualified(cls)} failed: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            walked = self.walk(state, f"{path}.__getstate__()", depth)
        else:
            walked = {
                name: self.walk(v, f"{path}.{name}", depth)
                for name, v in sorted(_attributes(value).items())
            }
        kind = "dataclass" if dataclasses.is_dataclass(value) else "object"
        return {kind: _qualified(cls), "state": walked}


def _compiled_layout(cls: type) -> str | None:
    """Why instances of ``cls`` may hold state outside ``__dict__`` and slots (a class or a
    memory layout defined in C, C++ or Rust), or None for a class defined in Python."""
    for c in cls.__mro__:
        if c is not object and not c.__flags__ & _HEAPTYPE:
            return f"it derives from {_qualified(c)}"
    # A Python class's instances hold the object header, one pointer per slot and, when not
    # managed by the interpreter, the __dict__ and __weakref__ pointers; anything more is C state.
    n_slots = sum(1 for c in cls.__mro__ for name in _slot_names(c) if name not in _NOT_SLOTS)
    expected = object.__basicsize__ + _POINTER * n_slots
    expected += _POINTER * ((cls.__dictoffset__ > 0) + (cls.__weakrefoffset__ > 0))
    if cls.__basicsize__ != expected:
        return f"its instances are {cls.__basicsize__} bytes, not the {expected} of a Python class"
    return None


def _slot_names(cls: type) -> tuple[str, ...]:
    slots = cls.__dict__.get("__slots__", ())
    return (slots,) if isinstance(slots, str) else tuple(slots)


def _attributes(value: Any) -> dict[str, Any]:
    """An instance's ``__dict__`` and the slots its classes declare (set ones only)."""
    out = dict(getattr(value, "__dict__", {}))
    for cls in type(value).__mro__:
        for name in _slot_names(cls):
            if name in _NOT_SLOTS:
                continue
            stored = f"_{cls.__name__.lstrip('_')}{name}" if name.startswith("__") else name
            if hasattr(value, stored):
                out[stored] = getattr(value, stored)
    return out


def _first_non_json(value: Any, path: str) -> tuple[str, str] | None:
    """Where ``value`` first holds something that is not JSON data, and what; None if nowhere."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return None
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            bad = _first_non_json(v, f"{path}[{i}]")
            if bad is not None:
                return bad
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                return f"{path}[{k!r}]", f"a {type(k).__name__} key"
            bad = _first_non_json(v, f"{path}[{k!r}]")
            if bad is not None:
                return bad
        return None
    return path, f"a {_type_name(value)}"


def _code_digest(code: types.CodeType, memo: dict[types.CodeType, str]) -> str:
    """A sha256 of what a code object does: bytecode, constants (nested code objects by their
    digest), names, local names and argument counts; not its file, line numbers or address."""
    done = memo.get(code)
    if done is not None:
        return done
    fields = [
        code.co_name,
        code.co_argcount,
        code.co_posonlyargcount,
        code.co_kwonlyargcount,
        code.co_flags,
        # co_code is the unspecialized bytecode, whatever the interpreter did to it at run time.
        code.co_code.hex(),
        [_constant(c, memo) for c in code.co_consts],
        list(code.co_names),
        list(code.co_varnames),
        list(code.co_freevars),
        list(code.co_cellvars),
    ]
    digest = _sha256(_canonical(fields).encode())
    memo[code] = digest
    return digest


def _constant(value: Any, memo: dict[types.CodeType, str]) -> Any:
    """A code object's constant, tagged with its type (1, 1.0, True and "1" stay distinct)."""
    if isinstance(value, types.CodeType):
        return ["code", _code_digest(value, memo)]
    if isinstance(value, tuple):
        return ["tuple", [_constant(v, memo) for v in value]]
    if isinstance(value, frozenset):  # iteration order follows str hashes: sort
        return ["frozenset", sorted((_constant(v, memo) for v in value), key=_canonical)]
    if isinstance(value, bytes):
        return ["bytes", value.hex()]
    if value is None or value is Ellipsis or isinstance(value, (bool, int, float, complex, str)):
        return [type(value).__name__, repr(value)]
    raise PlanError(f"a code object holds a constant of unexpected type {_type_name(value)}")
