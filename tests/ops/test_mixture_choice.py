"""``ensure_mixture`` finds the best and worst of the buffered records that span several
components (packed rows) with array operations; its decisions must be exactly those of scoring
each record one at a time, which the reference below does."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from zephon.ops.mixture import EnsureMixture, _Entry, _Spanning
from zephon.types import SampleCursor, SampleMeta, SampleRecord

COMPONENTS = ["a", "b", "c"]


class EveryRecord(_Spanning):
    """Every buffered record that spans several components is a candidate: the operator then
    scores each one alone, as the reference for the arrays' narrowing."""

    def near(self, deficits: Any, highest: bool, among: Any = None) -> list[_Entry]:
        return list(self.entries)

    def fitting(self, totals: Any, grand: int, limit: Any, deficits: Any) -> list[_Entry]:
        return list(self.entries)


class OneAtATime(EnsureMixture):
    """The reference: every buffered record scored in Python, one at a time."""

    def __init__(self, weights: dict[str, int], **kw: Any):
        super().__init__(weights, **kw)
        self._multi = EveryRecord(list(self.weights))


amounts = st.dictionaries(st.sampled_from(COMPONENTS), st.integers(0, 6), min_size=1, max_size=3)


def _records(specs: list[dict[str, int]]) -> list[SampleRecord]:
    out = []
    for i, tokens in enumerate(specs):
        cursor = SampleCursor(0, i, (0, 0, i))
        meta = SampleMeta(cursor, component_token_counts=tokens)
        out.append(SampleRecord(meta, None))
    return out


def _decisions(op: EnsureMixture, records: list[SampleRecord], piece: int) -> list[tuple]:
    out = []
    for k in range(0, len(records), piece):
        out += op.process_many(records[k : k + piece])
    out += op.flush()
    return [(r.meta.cursor.chunk_offset, r.meta.is_tombstone) for r in out]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(amounts, max_size=60),
    st.dictionaries(st.sampled_from(COMPONENTS), st.integers(0, 3), min_size=3),
    st.integers(1, 9),
    st.sampled_from([0.0, 0.01, 0.2]),
    st.integers(1, 7),
)
def test_the_choices_are_those_of_scoring_each_record_alone(
    specs: list[dict[str, int]],
    weights: dict[str, int],
    buffer_size: int,
    tolerance: float,
    piece: int,
) -> None:
    if not any(weights.values()):
        weights = {**weights, "a": 1}
    records = _records(specs)
    fast = EnsureMixture(weights, buffer_size=buffer_size, tolerance=tolerance)
    slow = OneAtATime(weights, buffer_size=buffer_size, tolerance=tolerance)
    assert _decisions(fast, records, piece) == _decisions(slow, records, piece)
    assert fast.carry_state() == slow.carry_state()


def _exact(entry: _Entry, deficits: dict[str, float]) -> float:
    return EnsureMixture._score(entry, deficits)


def _fits(entry: _Entry, totals: dict[Any, int], grand: int, limit: dict[Any, float]) -> bool:
    after = grand + entry.total
    return after > 0 and all((totals[c] + a) / after <= limit[c] for c, a in entry.amounts.items())


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(amounts, st.booleans()), min_size=1, max_size=40),
    st.lists(st.integers(-20, 20), min_size=3, max_size=3),
    st.lists(st.integers(0, 30), min_size=3, max_size=3),
    st.lists(st.sampled_from([0.2, 0.34, 0.5, 1.0]), min_size=3, max_size=3),
)
def test_the_spanning_records_found_are_every_best_one_and_fit(
    ops: list[tuple[dict[str, int], bool]],
    deficit_list: list[int],
    total_list: list[int],
    limit_list: list[float],
) -> None:
    spanning = _Spanning(COMPONENTS)
    kept: list[_Entry] = []
    for seq, (tokens, drop_one) in enumerate(ops):
        measure: dict[Hashable, int] = {c: n for c, n in tokens.items()}
        entry = _Entry(seq, _records([tokens])[0], measure)
        spanning.append(entry)
        kept.append(entry)
        if drop_one and len(kept) > 1:  # out of arrival order: slots are reused
            gone = kept.pop(len(kept) // 2)
            spanning.remove(gone)
    assert list(spanning) == kept
    deficits = {c: d / 3 for c, d in zip(COMPONENTS, deficit_list)}
    for highest in (True, False):
        found = spanning.near(deficits, highest)
        pick = max if highest else min
        best = pick(_exact(e, deficits) for e in kept)
        assert {e.seq for e in kept if _exact(e, deficits) == best} <= {e.seq for e in found}
    totals = dict(zip(COMPONENTS, total_list))
    grand = sum(total_list)
    limit = dict(zip(COMPONENTS, limit_list))
    fitting = [e for e in kept if _fits(e, totals, grand, limit)]
    found = spanning.fitting(totals, grand, limit, deficits)
    assert all(_fits(e, totals, grand, limit) or not e.total for e in found)
    if fitting:
        best = max(_exact(e, deficits) for e in fitting)
        assert {e.seq for e in fitting if _exact(e, deficits) == best} <= {e.seq for e in found}
