"""Parameter identity: callables by their code, arrays by content, objects by an explicit
description, a known tokenizer's vocabulary or their plain state; anything else is refused."""

from __future__ import annotations

import dataclasses
import datetime
import enum
import functools
import json
import math
import operator
import os
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import zephon
from zephon.errors import CheckpointMismatchError, PlanError
from zephon.ops import ByteTokenizer, tokenize
from zephon.ops.base import Operator, OpTraits, describe_value
from zephon.ops.basic import fetch, map_transform
from zephon.sources.memory import RangeSource

REPO = Path(zephon.__file__).resolve().parent.parent


def same(a: Any, b: Any) -> bool:
    """Two values have one identity (compared as the JSON the fingerprint digests)."""
    return json.dumps(describe_value(a), sort_keys=True) == json.dumps(
        describe_value(b), sort_keys=True
    )


# ------------------------------------------------------------------------------------- functions
def test_two_lambdas_with_different_bodies_differ():
    assert not same(lambda p: p, lambda p: {"idx": -1})
    assert not same(lambda p: p + 1, lambda p: p + 2)
    assert not same(lambda p: p.get("a"), lambda p: p.get("b"))


def test_a_lambda_with_the_same_body_has_the_same_identity():
    assert same(lambda p: {**p, "x": 1}, lambda p: {**p, "x": 1})


def test_defaults_and_keyword_only_defaults_are_part_of_a_functions_identity():
    def scale(p, factor=2):
        return p * factor

    def scale_more(p, factor=3):
        return p * factor

    def clip(p, *, top=1):
        return min(p, top)

    def clip_higher(p, *, top=9):
        return min(p, top)

    # Same qualname would be needed for a collision; the code and the defaults tell them apart.
    assert not same(scale, scale_more)
    assert not same(clip, clip_higher)


def test_closures_over_different_ints_differ_and_over_equal_ints_agree():
    def adder(n):
        return lambda p: p + n

    assert not same(adder(1), adder(2))
    assert same(adder(5), adder(5))


def test_closures_over_containers_and_arrays_are_identified_by_content():
    def lookup(table):
        return lambda p: table[p]

    assert not same(lookup({"a": 1}), lookup({"a": 2}))
    assert not same(lookup(np.arange(4)), lookup(np.arange(1, 5)))
    assert same(lookup([1, (2, 3)]), lookup([1, (2, 3)]))


def test_nested_code_objects_enter_the_identity():
    def outer_a(p):
        return [q * 2 for q in p]

    def outer_b(p):
        return [q * 3 for q in p]

    outer_b.__qualname__ = outer_a.__qualname__
    assert not same(outer_a, outer_b)


def test_a_function_keeps_its_identity_after_running_many_times():
    # CPython specializes bytecode in place as it runs; the identity must not see that.
    def hot(p):
        return p["a"] + p["b"] if p else 0

    before = json.dumps(describe_value(hot), sort_keys=True)
    for i in range(5000):
        hot({"a": i, "b": 1})
    assert json.dumps(describe_value(hot), sort_keys=True) == before


def test_a_recursive_closure_is_identified_without_looping():
    def make():
        def walk(p):
            return p if not isinstance(p, list) else [walk(q) for q in p]

        return walk

    assert same(make(), make())


def test_a_closure_over_something_unidentifiable_raises_naming_the_variable():
    rng = np.random.default_rng(0)
    op = map_transform(lambda p: {**p, "r": rng.random()}, name="noisy")
    with pytest.raises(PlanError, match=r"operator 'noisy' parameter 'fn'.*rng.*describe\(\)"):
        op.describe()


# --------------------------------------------------------------------- partials, methods, builtins
def base_scale(p, factor, *, offset=0):
    return p * factor + offset


def test_partials_are_identified_by_function_arguments_and_keywords():
    p2 = functools.partial(base_scale, factor=2)
    assert same(p2, functools.partial(base_scale, factor=2))
    assert not same(p2, functools.partial(base_scale, factor=3))
    assert not same(p2, functools.partial(base_scale, factor=2, offset=1))
    assert not same(functools.partial(base_scale, 1), functools.partial(base_scale, 2))
    assert not same(p2, functools.partial(lambda p, factor: p, factor=2))


@dataclasses.dataclass
class Scaler:
    factor: int

    def apply(self, p):
        return p * self.factor


def test_bound_methods_are_identified_by_their_function_and_their_instance():
    assert same(Scaler(2).apply, Scaler(2).apply)
    assert not same(Scaler(2).apply, Scaler(3).apply)


def test_builtins_classes_and_c_functions_are_identified_by_name():
    assert same(len, len) and not same(len, abs)
    assert not same(str, bytes)
    assert not same(np.sqrt, np.exp)
    assert same(str.upper, str.upper) and not same(str.upper, str.lower)
    assert not same("ab".upper, "cd".upper)  # a bound builtin method includes its instance
    assert describe_value(math.sqrt) == {"builtin": "math.sqrt"}


def test_the_same_definitions_have_the_same_identity_in_other_processes(tmp_path, monkeypatch):
    # Fresh interpreters with other hash seeds: nothing may hinge on hash(), id() or addresses.
    module = tmp_path / "identity_probe.py"
    module.write_text(
        textwrap.dedent(
            """
            import functools
            import numpy as np

            def scale(payload, factor=3):
                if payload["k"] in {"x", "y", "z", "w"}:  # a frozenset constant
                    return {**payload, "v": payload["v"] * factor}
                return payload

            def closure(n):
                table = {"b": n, "a": [n, 2.5, None], "s": {"q", "r", "t"}}
                return lambda p: table[p]

            class Config:
                def __init__(self):
                    self.vocab = {"x": 1, "y": 2}
                    self.weights = np.linspace(0, 1, 7)

                def __call__(self, p):
                    return p

            def values():
                return [scale, closure(4), functools.partial(scale, factor=2), Config(),
                        Config().__call__, lambda p: p * 2]
            """
        )
    )
    script = (
        "import json, identity_probe\n"
        "from zephon.ops.base import describe_value\n"
        "print(json.dumps(describe_value(identity_probe.values()), sort_keys=True))\n"
    )
    outputs = set()
    for hash_seed in ("1", "2", "3"):
        env = {
            **os.environ,
            "PYTHONHASHSEED": hash_seed,
            "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)]),
        }
        done = subprocess.run(
            [sys.executable, "-c", script],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            cwd=tmp_path,
        )
        outputs.add(done.stdout.strip())
    monkeypatch.syspath_prepend(str(tmp_path))
    import identity_probe

    here = json.dumps(describe_value(identity_probe.values()), sort_keys=True)
    assert outputs == {here}


# ------------------------------------------------------------------------------------------ arrays
def test_arrays_differing_in_one_element_differ():
    a = np.arange(1000, dtype=np.int64)
    b = a.copy()
    b[517] = -1
    assert not same(a, b)
    assert same(a, a.copy())


def test_arrays_differ_by_dtype_and_shape_and_not_by_memory_layout():
    a = np.arange(12, dtype=np.int32).reshape(3, 4)
    assert not same(a, a.astype(np.int64))
    assert not same(a, a.reshape(4, 3))
    assert same(a, np.asfortranarray(a))
    assert same(a[:, ::2], np.ascontiguousarray(a[:, ::2]))


def test_numpy_scalars_and_object_arrays_are_identified_by_value():
    assert not same(np.int64(3), np.int64(4))
    assert not same(np.int64(3), np.float64(3))
    assert not same(np.array([{"a": 1}], dtype=object), np.array([{"a": 2}], dtype=object))


# ----------------------------------------------------------------------------------------- objects
class Described:
    def __init__(self, version: int, secret: Any = None):
        self.version = version
        self._secret = secret  # would be unidentifiable; describe() speaks for the object

    def describe(self) -> dict[str, Any]:
        return {"version": self.version}


def test_a_describe_method_is_the_identity_of_an_object():
    assert same(Described(1, threading.Lock()), Described(1, threading.Lock()))
    assert not same(Described(1), Described(2))


def test_a_describe_method_must_return_json_data():
    class Bad:
        def describe(self):
            return {"when": object}

    with pytest.raises(PlanError, match=r"describe\(\) of .*Bad.*JSON"):
        describe_value(Bad())


@dataclasses.dataclass
class Window:
    size: int
    labels: tuple[str, ...] = ()


class Plain:
    def __init__(self, k: int):
        self.k = k
        self.table = {"a": [k, k + 1]}


def test_plain_objects_and_dataclasses_are_identified_by_their_state():
    assert same(Window(3, ("a",)), Window(3, ("a",)))
    assert not same(Window(3), Window(4))
    assert not same(Plain(1), Plain(2))
    assert not same(Plain(1), Window(1))  # the class is part of it


def test_byte_tokenizer_is_identifiable():
    assert same(ByteTokenizer(), ByteTokenizer())
    assert same(tokenize(), tokenize())


class Color(enum.Enum):
    RED = 1
    BLUE = 2


def test_known_value_types_without_a_dict_are_identified_by_value():
    assert same(re.compile("a+"), re.compile("a+"))
    assert not same(re.compile("a+"), re.compile("b+"))
    assert not same(re.compile("a"), re.compile("a", re.IGNORECASE))
    assert not same(operator.itemgetter("a"), operator.itemgetter("b"))
    assert not same(operator.methodcaller("get", k=1), operator.methodcaller("get", k=2))
    assert not same(Path("/data/a"), Path("/data/b"))
    assert same(Color.RED, Color.RED) and not same(Color.RED, Color.BLUE)
    assert not same(datetime.date(2024, 1, 1), datetime.date(2024, 1, 2))
    assert not same(range(3), range(4))


class HoldsALock(Operator):
    name = "holder"
    traits = OpTraits(preserves_cursor_order=True)

    def __init__(self, handle: Any):
        self.handle = handle

    def process_many(self, records):
        return records


@pytest.mark.parametrize(
    "handle",
    [threading.Lock(), np.random.default_rng(0), iter([1, 2])],
    ids=["lock", "generator", "iterator"],
)
def test_an_unidentifiable_object_raises_plan_error_naming_the_parameter(handle):
    with pytest.raises(PlanError, match=r"operator 'holder' parameter 'handle'.*describe\(\)"):
        HoldsALock(handle).describe()
    pipeline = zephon.Pipeline(RangeSource(4), [fetch(), HoldsALock(handle)])
    with pytest.raises(PlanError, match=r"operator 'holder' parameter 'handle'"):
        pipeline.compile()


def test_an_object_with_unidentifiable_state_names_the_attribute_path():
    class Outer:
        def __init__(self):
            self.inner = {"cache": [1, threading.Lock()]}

    with pytest.raises(PlanError, match=r"parameter 'handle'\.inner\['cache'\]\[1\]"):
        HoldsALock(Outer()).describe()


def test_state_beyond_the_depth_bound_is_refused():
    class Node:
        def __init__(self, child):
            self.child = child

    chain: Any = None
    for _ in range(200):
        chain = Node(chain)
    with pytest.raises(PlanError, match="too deep"):
        describe_value(chain)


# -------------------------------------------------------------------------------------- tokenizers
CORPUS_A = ["the quick brown fox", "jumps over the lazy dog", "the dog sleeps"]
CORPUS_B = ["packing sequences keeps", "the accelerator busy", "all day long"]


def bpe(corpus: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=50, special_tokens=["[UNK]"], show_progress=False)
    )
    return tok


def test_a_trained_bpe_tokenizer_changes_identity_when_its_vocab_changes():
    a, a_again, b = bpe(CORPUS_A), bpe(CORPUS_A), bpe(CORPUS_B)
    assert same(a, a_again)
    assert not same(a, b)
    a_again.add_tokens(["zephon"])
    assert not same(a, a_again)

    def fp(tok: Tokenizer) -> str:
        return zephon.Pipeline(RangeSource(4), [fetch(), map_transform(tok.encode)]).fingerprint

    assert fp(a) == fp(bpe(CORPUS_A)) != fp(b)


def test_a_transformers_fast_tokenizer_is_identified_by_its_backend():
    transformers = pytest.importorskip("transformers")
    fast = transformers.PreTrainedTokenizerFast
    a = fast(tokenizer_object=bpe(CORPUS_A), eos_token="[UNK]")
    assert same(a, fast(tokenizer_object=bpe(CORPUS_A), eos_token="[UNK]"))
    assert not same(a, fast(tokenizer_object=bpe(CORPUS_B), eos_token="[UNK]"))


# -------------------------------------------------------------------------------------- end to end
def pipeline_of(fn: Any) -> zephon.Pipeline:
    return zephon.Pipeline(RangeSource(40, chunk_size=8), [fetch(), map_transform(fn)])


def test_a_checkpoint_is_refused_by_the_same_pipeline_with_another_lambda_body():
    with pipeline_of(lambda p: p).iter() as loader:
        for _ in range(5):
            next(loader)
        state = loader.state_dict()
    with pytest.raises(CheckpointMismatchError, match="operators"):
        pipeline_of(lambda p: {"idx": -1}).iter(state)
    with pipeline_of(lambda p: p).iter(state) as resumed:  # the same body resumes
        assert next(resumed).payload == {"idx": 5}


def test_range_source_make_is_identified_by_its_code():
    def src(make: Any) -> str:
        return zephon.Pipeline(RangeSource(4, make=make), [fetch()]).fingerprint

    assert src(lambda i: {"v": i}) == src(lambda i: {"v": i})
    assert src(lambda i: {"v": i}) != src(lambda i: {"v": -i})


def test_a_parameter_too_large_to_identify_by_value_is_refused():
    with pytest.raises(PlanError, match=r"more than 1000000 values.*describe\(\)"):
        describe_value(list(range(1_000_001)))
    assert describe_value(np.arange(2_000_000))["ndarray"] == [2_000_000]  # arrays: by digest
