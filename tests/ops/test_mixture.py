"""``ensure_mixture``: the deficit rule, tombstones for what it drops, the flush
tolerance, totals that survive epochs, and the realized mixture at delivery."""

from __future__ import annotations

import copy
import json
from collections import Counter
from collections.abc import Iterable, Iterator
from itertools import islice
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import zephon
from zephon.errors import CheckpointCorruptError, OperatorError
from zephon.ops import (
    MIXTURE_DROP_TAG,
    batch,
    ensure_mixture,
    fetch,
    pack_sequences,
    tokenize,
)
from zephon.runtime.checkpoint.format import seal
from zephon.sources.memory import RangeSource
from zephon.sources.mixture import MixtureSource
from zephon.testing import check_operator
from zephon.types import ContributorRef, SampleBatch, SampleCursor, SampleMeta, SampleRecord

# These inputs are far from their weights on purpose, so most tests drop a lot; the warning that
# says so has tests of its own (pytest.warns takes precedence over this filter).
pytestmark = pytest.mark.filterwarnings("ignore::zephon.errors.MixtureDropWarning")


def recs(spec: list[tuple[Any, int]], *, counts: bool = True, chunk: int = 0) -> list[SampleRecord]:
    """Records of (component, n tokens), tokenized-looking when ``counts``."""
    out = []
    for i, (comp, n) in enumerate(spec):
        meta = SampleMeta(
            SampleCursor(chunk, i, (0, 0, i)),
            component=comp,
            component_sample_counts={comp: 1} if counts else None,
            component_token_counts={comp: n} if counts else None,
        )
        out.append(SampleRecord(meta, {"tokens": np.zeros(n, dtype=np.int32), "i": i}))
    return out


def run(op: Any, records: list[SampleRecord], micro: int = 16) -> list[SampleRecord]:
    op.start_epoch(0, op.epoch)
    out: list[SampleRecord] = []
    for lo in range(0, len(records), micro):
        out += op.process_many(records[lo : lo + micro])
    return out + op.flush()


def real(out: list[SampleRecord]) -> list[SampleRecord]:
    return [r for r in out if not r.is_tombstone]


def shares(out: list[SampleRecord], key: str = "component_token_counts") -> dict[Any, float]:
    total: Counter = Counter()
    for r in real(out):
        total.update(getattr(r.meta, key))
    n = sum(total.values())
    return {c: v / n for c, v in total.items()}


# ------------------------------------------------------------------------------------ the rule
def test_tokens_are_balanced_by_dropping_the_longer_component():
    spec = [("a", 10), ("b", 30)] * 300
    out = run(ensure_mixture({"a": 0.5, "b": 0.5}, buffer_size=32), recs(spec))
    s = shares(out)
    assert abs(s["a"] - 0.5) < 0.02
    emitted = Counter(r.meta.component for r in real(out))
    assert emitted["a"] == 300  # the under-represented component is never dropped
    assert 80 <= emitted["b"] <= 120


def test_by_samples_counts_samples_not_tokens():
    spec = [("a", 10)] * 300 + [("b", 30)] * 100
    order = [spec[i] for i in np.random.default_rng(0).permutation(len(spec))]
    out = run(ensure_mixture({"a": 0.5, "b": 0.5}, by="samples", buffer_size=64), recs(order))
    s = shares(out, "component_sample_counts")
    assert abs(s["a"] - 0.5) < 0.02


def test_every_dropped_record_leaves_one_tagged_tombstone_first():
    spec = [("a", 10), ("b", 30)] * 50
    out = run(ensure_mixture({"a": 0.5, "b": 0.5}, buffer_size=8), recs(spec))
    tombs = [r for r in out if r.is_tombstone]
    assert tombs and all(MIXTURE_DROP_TAG in t.meta.tags for t in tombs)
    assert len(real(out)) + len(tombs) == 100
    assert all(t.payload is None for t in tombs)
    closed = {ref.base_offset for t in tombs for ref in t.contribution_refs() if ref.is_last_child}
    assert len(closed) == len(tombs)


def test_nothing_is_dropped_at_the_start_of_a_stream():
    # The deficit rule makes progress: equal deficits at T = 0 emit the earliest record.
    out = run(ensure_mixture({"a": 0.9, "b": 0.1}, buffer_size=1), recs([("b", 5), ("a", 5)]))
    assert [r.meta.component for r in out] == ["b", "a"]


def test_components_with_weight_zero_are_always_dropped():
    out = run(ensure_mixture({"a": 1.0, "z": 0.0}), recs([("z", 3), ("a", 2), ("z", 1)]))
    assert [r.meta.component for r in real(out)] == ["a"]
    assert sum(r.is_tombstone for r in out) == 2


def test_at_a_flush_what_stays_within_tolerance_is_emitted_and_the_rest_dropped():
    # 40 samples of a then 40 of b, buffer larger than the input: everything is decided at flush.
    records = recs([("a", 10)] * 40 + [("b", 10)] * 10)
    op = ensure_mixture({"a": 0.5, "b": 0.5}, buffer_size=1000, tolerance=0.05)
    out = run(op, records)
    emitted = Counter(r.meta.component for r in real(out))
    assert emitted["b"] == 10
    # 10 b give 100 tokens: a may reach 0.55 of the total -> 12 a (120 / 220 = 0.545).
    assert emitted["a"] == 12
    assert sum(r.is_tombstone for r in out) == 28


def test_a_dropped_child_that_owes_no_closing_tombstone_still_leaves_a_tagged_one():
    parent = SampleCursor(0, 0, (0, 0, 0))
    child = parent.child(0)
    meta = SampleMeta(
        child,
        contributors=(ContributorRef(child, False),),
        component="z",
        component_sample_counts={"z": 1},
        component_token_counts={"z": 3},
    )
    out = run(ensure_mixture({"a": 1, "z": 0}), [SampleRecord(meta, {"tokens": [1, 2, 3]})])
    (tomb,) = out
    assert tomb.is_tombstone and MIXTURE_DROP_TAG in tomb.meta.tags
    assert tomb.contribution_refs() == (ContributorRef(child, False),)


def test_a_closing_child_dropped_while_its_sibling_is_buffered_leaves_its_closing_tombstone():
    # On the epoch path a tombstone may close an offset before a sibling leaves; the sibling keeps
    # its (non-closing) ref, so the offset is closed exactly once.
    parent = SampleCursor(0, 0, (0, 0, 0))
    children = []
    for i, comp in enumerate(["a", "z"]):
        c = parent.child(i)
        meta = SampleMeta(
            c,
            contributors=(ContributorRef(c, i == 1),),
            component=comp,
            component_sample_counts={comp: 1},
            component_token_counts={comp: 2},
        )
        children.append(SampleRecord(meta, {"tokens": [0, 0]}))
    op = ensure_mixture({"a": 1, "z": 0}, buffer_size=4)
    check_operator(op, children)
    out = run(op, children)
    assert [(r.is_tombstone, r.contribution_refs()) for r in out] == [
        (True, (ContributorRef(parent.child(1), True),)),
        (False, (ContributorRef(parent.child(0), False),)),
    ]


def test_plain_records_are_measured_by_their_token_field():
    # No counts on the meta: one sample of meta.component with len(payload[field]) tokens.
    spec = [("a", 10), ("b", 30)] * 200
    out = run(ensure_mixture({"a": 0.5, "b": 0.5}, buffer_size=16), recs(spec, counts=False))
    total: Counter = Counter()
    for r in real(out):
        total[r.meta.component] += len(r.payload["tokens"])
    assert abs(total["a"] / (total["a"] + total["b"]) - 0.5) < 0.03


def test_packed_records_without_token_counts_split_tokens_by_sample_counts():
    op = ensure_mixture({"a": 0.5, "b": 0.5})
    meta = SampleMeta(SampleCursor(0, 0, (0, 0, 0)), component_sample_counts={"a": 1, "b": 3})
    rec = SampleRecord(meta, {"tokens": np.zeros(8, dtype=np.int32)})
    assert op._measure(rec) == {"a": 2, "b": 6}


def test_a_component_without_weight_is_an_error_naming_the_record():
    with pytest.raises(OperatorError, match=r"component 'c' has no weight"):
        run(ensure_mixture({"a": 1}), recs([("c", 1)]))


def test_parameters_are_checked():
    with pytest.raises(ValueError, match="weights"):
        ensure_mixture({})
    with pytest.raises(ValueError, match="at least one weight"):
        ensure_mixture({"a": 0})
    with pytest.raises(ValueError, match="by"):
        ensure_mixture({"a": 1}, by="bytes")
    with pytest.raises(ValueError, match="buffer_size"):
        ensure_mixture({"a": 1}, buffer_size=0)
    op = ensure_mixture({"a": 1, 2: 3}, by="samples", buffer_size=5, tolerance=0.1)
    assert not op.traits.preserves_cursor_order and op.traits.stateful
    assert op.describe()["params"]["weights"] == {"2": 3.0, "a": 1.0}


def test_check_operator_passes():
    spec = [("a", 3), ("b", 9), ("a", 0), ("b", 4), ("z", 2)] * 12
    check_operator(ensure_mixture({"a": 0.5, "b": 0.5, "z": 0}, buffer_size=6), recs(spec))


# ------------------------------------------------------------------------------------ carry
def test_the_totals_survive_an_epoch_boundary_through_carry_state():
    spec = [("a", 10), ("b", 30)] * 60
    first, second = recs(spec[:60]), recs(spec[60:], chunk=1)
    op = ensure_mixture({"a": 0.5, "b": 0.5}, buffer_size=8)
    run(op, first)
    state = json.loads(json.dumps(op.carry_state()))
    fresh = ensure_mixture({"a": 0.5, "b": 0.5}, buffer_size=8)
    fresh.restore_carry(state)
    continued = copy.deepcopy(op)
    assert fresh.realized() == continued.realized() != {"a": 0.0, "b": 0.0}
    fresh.epoch = continued.epoch = 1
    a, b = run(fresh, second), run(continued, second)
    assert [(r.is_tombstone, r.meta.cursor) for r in a] == [
        (r.is_tombstone, r.meta.cursor) for r in b
    ]
    # Without the carried totals the second epoch decides differently.
    cold = ensure_mixture({"a": 0.5, "b": 0.5}, buffer_size=8)
    cold.epoch = 1
    assert [r.meta.cursor for r in run(cold, second)] != [r.meta.cursor for r in a]


def test_carry_state_is_json_with_int_and_str_components():
    op = ensure_mixture({0: 0.5, "b": 0.5}, by="samples")
    run(op, recs([(0, 1), ("b", 1), (0, 1)]))
    state = json.loads(json.dumps(op.carry_state()))
    fresh = ensure_mixture({0: 0.5, "b": 0.5}, by="samples")
    fresh.restore_carry(state)
    assert fresh.realized() == op.realized()


BAD_CARRIES = [
    ({}, "must be an object with one field, totals"),
    ({"totals": 3}, "must be an object with one field, totals"),
    ({"totals": [["a", 1], ["b", 0]], "more": 1}, "must be an object with one field, totals"),
    ({"totals": [["a"]]}, r"field totals\[0\] must be a \[component, total\] pair"),
    ({"totals": ["a"]}, r"field totals\[0\] must be a \[component, total\] pair"),
    ({"totals": [["z", 1]]}, r"field totals\[0\]\[0\] component 'z' has no weight"),
    ({"totals": [[["a", ["b"]], 1]]}, r"field totals\[0\]\[0\] component .* has no weight"),
    ({"totals": [[{"a": 1}, 1]]}, r"field totals\[0\]\[0\] component .* has no weight"),
    (
        {"totals": [["a", 1], ["a", 2]]},
        r"field totals\[1\]\[0\] component 'a' is carried twice",
    ),
    ({"totals": [["a", -1]]}, r"field totals\[0\]\[1\] must be an integer in \[0, "),
    ({"totals": [["a", "7"]]}, r"field totals\[0\]\[1\] must be an integer"),
    ({"totals": [["a", 1.5]]}, r"field totals\[0\]\[1\] must be an integer"),
    ({"totals": [["a", True]]}, r"field totals\[0\]\[1\] must be an integer"),
    ({"totals": [["a", 2**70]]}, r"field totals\[0\]\[1\] must be an integer"),
    ({"totals": [["a", 1]]}, r"field totals has no total for the components \['b'\]"),
    ({"totals": []}, r"field totals has no total for the components \['a', 'b'\]"),
]


@pytest.mark.parametrize(("state", "message"), BAD_CARRIES)
def test_an_edited_carry_state_is_refused_naming_its_field(state: Any, message: str):
    op = ensure_mixture({"a": 0.5, "b": 0.5})
    with pytest.raises(CheckpointCorruptError, match=f"ensure_mixture: carry state {message}"):
        op.restore_carry(state)
    assert op.realized() == {"a": 0.0, "b": 0.0}  # nothing of it was taken


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=8,
)


@settings(max_examples=300)
@given(
    st.one_of(
        _JSON,
        st.builds(lambda totals: {"totals": totals}, _JSON),
        st.builds(
            lambda comp, total: {"totals": [["a", 3], [comp, total]]},
            st.sampled_from(["a", "b", "c"]) | _JSON,
            st.integers() | _JSON,
        ),
    )
)
def test_any_carry_state_restores_or_is_refused_as_corrupt(state: Any):
    op = ensure_mixture({"a": 0.5, "b": 0.5})
    try:
        op.restore_carry(state)
    except CheckpointCorruptError as exc:
        assert str(exc).startswith("ensure_mixture: carry state")
    else:  # what it took is exactly what the state said, components left out at 0
        totals = {comp: total for comp, total in op.carry_state()["totals"]}
        assert sum(totals.values()) == sum(total for _, total in state["totals"])
        assert all(totals[comp] == total for comp, total in state["totals"])


def test_an_edited_carry_state_in_a_checkpoint_is_refused_at_load_naming_lane_and_operator():
    loader = iter(mixture_pipeline(epoch_chunks=1))
    for _ in range(30):
        next(loader)
    state = loader.state_dict()
    loader.close()
    body = copy.deepcopy({k: v for k, v in state.items() if k != "checksum"})
    carry = body["lane_states"][0]["carry"]
    i = next(i for i, part in enumerate(carry) if part is not None)
    carry[i]["totals"][0][1] = -5
    with pytest.raises(
        CheckpointCorruptError,
        match=rf"lane_states\[0\]\.carry\[{i}\]: ensure_mixture: carry state field "
        r"totals\[0\]\[1\] must be an integer",
    ):
        mixture_pipeline(epoch_chunks=1).iter(state=seal(body))


# ------------------------------------------------------------------------------------ pipeline
def _short(idx: int) -> dict:
    return {"text": "a" * (20 + idx % 13)}


def _long(idx: int) -> dict:
    return {"text": "b" * (3 * (20 + idx % 13))}


def mixture_pipeline(epoch_chunks: int = 4) -> zephon.Pipeline:
    source = MixtureSource(
        {
            "a": RangeSource(3000, dataset_id=0, make=_short),
            "b": RangeSource(3000, dataset_id=1, make=_long),
        },
        {"a": 0.5, "b": 0.5},
        chunk_size=128,
    )
    return zephon.Pipeline(
        source,
        [
            fetch(),
            tokenize(),
            ensure_mixture({"a": 0.5, "b": 0.5}, by="tokens", buffer_size=64),
            pack_sequences(256, open_bins=8),
            batch(4),
        ],
        epoch_chunks=epoch_chunks,
        strict=True,
    )


def batches(items: Iterable[Any]) -> Iterator[SampleBatch]:
    for item in items:
        assert isinstance(item, SampleBatch)
        yield item


def seen(items: Iterable[Any]) -> list[tuple]:
    """Cursors and token bytes of each delivered batch."""
    return [
        (tuple(r.meta.cursor for r in b), b.payload["tokens"].tobytes()) for b in batches(items)
    ]


def test_through_a_pipeline_the_delivered_token_shares_follow_the_weights():
    loader = iter(mixture_pipeline())
    tokens: Counter = Counter()
    samples: Counter = Counter()
    n_records = 0
    for b in batches(loader):
        for rec in b:
            n_records += 1
            tokens.update(rec.meta.component_token_counts)
            samples.update(rec.meta.component_sample_counts)
    total = sum(tokens.values())
    realized = {c: v / total for c, v in tokens.items()}
    assert abs(realized["a"] - 0.5) < 0.03 and abs(realized["b"] - 0.5) < 0.03
    stats = loader.stats()
    assert stats["mixture"] == pytest.approx(realized)
    assert stats["delivered"] == n_records
    # Every source sample is either delivered inside a packed record or dropped for the mixture.
    assert stats["mixture_dropped"] > 0
    assert sum(samples.values()) + stats["mixture_dropped"] == 6000
    assert stats["violations"] == 0
    assert stats["inflight_chunks"] == 0


def test_the_mixture_holds_across_many_epochs_and_a_resume():
    pipeline = mixture_pipeline(epoch_chunks=1)
    full = seen(iter(pipeline))
    loader = iter(pipeline)
    head = seen(islice(loader, 300))
    state = json.loads(json.dumps(loader.state_dict()))
    resumed = pipeline.iter(state=state)
    assert head + seen(resumed) == full
    realized = resumed.stats()["mixture"]
    assert abs(realized["a"] - 0.5) < 0.03
