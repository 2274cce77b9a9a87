"""``pack_sequences`` and ``pack_flat``: nothing lost or invented, unique primary cursors, closing
contributors only at the end of an input, component heritage, fill, and a padding id that is
``pad_id=`` or the upstream tokenizer's, never silently a real token.

Tests that pack hand-made tokens pass ``pad_id=`` themselves."""

from __future__ import annotations

import copy
import itertools
from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import zephon
from zephon.ops import ByteTokenizer, fetch, pack_flat, pack_sequences, tokenize
from zephon.ops.packing import PackFlat, PackSequences
from zephon.sources.memory import ListSource
from zephon.testing import check_operator
from zephon.types import ContributorRef, SampleCursor, SampleMeta, SampleRecord

STRIDE = 1 << 16  # token value = input index * STRIDE + position in the input


def token_records(
    lengths: list[int],
    *,
    components: list[Any] | None = None,
    counts: bool = True,
    chunk_size: int = 1000,
) -> list[SampleRecord]:
    """Tokenized-looking records whose tokens say which input and which position they are."""
    out = []
    for i, n in enumerate(lengths):
        comp = components[i] if components else "web"
        meta = SampleMeta(
            SampleCursor(i // chunk_size, i % chunk_size, (0, 0, i)),
            component=comp,
            component_sample_counts={comp: 1} if counts else None,
            component_token_counts={comp: n} if counts else None,
        )
        tokens = (i * STRIDE + np.arange(n)).astype(np.int32)
        out.append(SampleRecord(meta, {"tokens": tokens, "text": f"doc {i}"}))
    return out


def run(op: Any, records: list[SampleRecord], micro: int = 7, flush_every: int | None = None):
    """The operator as the lane runner drives it: micro-batches, a flush per epoch."""
    op = copy.deepcopy(op)
    op.start_epoch(0, 0)
    out: list[SampleRecord] = []
    epoch = flush_every or max(len(records), 1)
    for e, lo in enumerate(range(0, len(records), epoch)):
        part = records[lo : lo + epoch]
        if e:
            op.start_epoch(0, e)
        for m in range(0, len(part), micro):
            out += op.process_many(part[m : m + micro])
        out += op.flush()
    return out


def fragments(out: list[SampleRecord]) -> list[tuple[int, int, list[int]]]:
    """(input index, start in the input, tokens) of every non-empty fragment, from the payload."""
    frags = []
    for rec in out:
        p = rec.payload
        tokens, seg, pos = p["tokens"], p["segment_ids"], p["positions"]
        assert tokens.dtype == seg.dtype == pos.dtype == np.int32
        n_seg = int(seg.max()) if len(seg) else 0
        assert sorted(set(seg.tolist()) - {0}) == list(range(1, n_seg + 1))
        for s in range(1, n_seg + 1):
            where = np.flatnonzero(seg == s)
            assert (np.diff(where) == 1).all(), "a segment is contiguous"
            assert pos[where].tolist() == list(range(len(where))), "positions restart per fragment"
            values = tokens[where]
            item = int(values[0]) // STRIDE
            start = int(values[0]) % STRIDE
            assert (values // STRIDE == item).all()
            frags.append((item, start, (values % STRIDE).tolist()))
    return frags


def assert_every_input_recovered_once(lengths: list[int], out: list[SampleRecord]) -> None:
    by_input: dict[int, list[tuple[int, list[int]]]] = {}
    for item, start, values in fragments(out):
        by_input.setdefault(item, []).append((start, values))
    for i, n in enumerate(lengths):
        pieces = sorted(by_input.pop(i, []))
        joined = [v for _, values in pieces for v in values]
        assert joined == list(range(n)), f"input {i} ({n} tokens) not recovered exactly once"
    assert not by_input, "tokens that belong to no input"
    # Every input's closing contributor reaches the output exactly once (empty ones too).
    closing = Counter(
        ref.cursor for rec in out for ref in rec.contribution_refs() if ref.is_last_child
    )
    assert sorted(closing.values()) == [1] * len(lengths)


# ------------------------------------------------------------------------------------ properties
@settings(max_examples=80)
@given(
    seq_len=st.integers(1, 24),
    lengths=st.lists(st.integers(0, 70), max_size=40),
    open_bins=st.integers(1, 5),
    strategy=st.sampled_from(["best_fit", "first_fit"]),
    micro=st.integers(1, 9),
    flush_every=st.sampled_from([None, 3, 10]),
    cut=st.booleans(),
)
def test_pack_sequences_loses_and_invents_no_token(
    seq_len, lengths, open_bins, strategy, micro, flush_every, cut
):
    op = pack_sequences(seq_len, open_bins=open_bins, strategy=strategy, pad_id=0, cut_to_fill=cut)
    out = run(op, token_records(lengths), micro, flush_every)
    assert_every_input_recovered_once(lengths, out)
    assert all(len(r.payload["tokens"]) == seq_len for r in out)
    assert len({r.meta.cursor for r in out}) == len(out), "primary cursors are unique"


@settings(max_examples=80)
@given(
    seq_len=st.integers(1, 24),
    lengths=st.lists(st.integers(0, 70), max_size=40),
    micro=st.integers(1, 9),
    flush_every=st.sampled_from([None, 4]),
)
def test_pack_flat_is_the_concatenated_stream_cut_every_seq_len(
    seq_len, lengths, micro, flush_every
):
    records = token_records(lengths)
    out = run(pack_flat(seq_len, pad_id=0), records, micro, flush_every)
    assert_every_input_recovered_once(lengths, out)
    packed = [t for r in out for t in r.payload["tokens"][r.payload["segment_ids"] > 0].tolist()]
    assert packed == [t for r in records for t in r.payload["tokens"].tolist()]
    assert len({r.meta.cursor for r in out}) == len(out)
    cursors = [r.meta.cursor for r in out]
    assert cursors == sorted(cursors), "pack_flat preserves cursor order"


# ------------------------------------------------------------------------------------ cursors
@pytest.mark.parametrize(
    "op", [pack_sequences(8, open_bins=2, pad_id=0), pack_flat(8, pad_id=0)], ids=["seq", "flat"]
)
def test_one_long_input_leads_several_bins_with_distinct_primary_cursors(op):
    records = token_records([3, 43, 5])
    out = run(op, records)
    long_cursor = records[1].meta.cursor
    led = [r.meta.cursor for r in out if r.meta.cursor.base_offset == long_cursor.base_offset]
    assert len(led) == 5
    assert len(set(led)) == len(led)
    assert all(c in {long_cursor.child(s) for s in range(43)} for c in led)
    check_operator(op, records)


def test_the_primary_cursor_is_the_first_fragments_input_cursor_child_of_its_start():
    records = token_records([20])
    out = run(pack_sequences(8, pad_id=0), records)
    assert [r.meta.cursor for r in out] == [records[0].meta.cursor.child(s) for s in (0, 8, 16)]


@pytest.mark.parametrize(
    "op", [pack_sequences(8, pad_id=0), pack_flat(8, pad_id=0)], ids=["seq", "flat"]
)
def test_only_the_fragment_that_ends_an_input_closes_it(op):
    records = token_records([20, 3])
    out = run(op, records)
    refs = [ref for r in out for ref in r.contribution_refs() if ref.base_offset == (0, 0)]
    assert [ref.is_last_child for ref in refs] == [False, False, True]
    assert all(ref.cursor == records[0].meta.cursor for ref in refs)


def test_split_children_in_different_bins_keep_their_closing_flags():
    # Children of one sample, the last one closing, that land in bins which leave out of order:
    # the closing flag stays with the last child's fragment even though its bin leaves first.
    parent = SampleCursor(4, 1, (0, 0, 9))
    recs = []
    for i, n in enumerate([6, 8]):
        child = parent.child(i)
        meta = SampleMeta(child, contributors=(ContributorRef(child, i == 1),), component="web")
        recs.append(SampleRecord(meta, {"tokens": np.arange(n, dtype=np.int32)}))
    op = pack_sequences(8, open_bins=4, pad_id=0)
    op.start_epoch(0, 0)
    first = op.process_many(recs)  # child 1 fills a bin of its own at once; child 0's bin stays
    assert len(first) == 1
    assert first[0].contribution_refs() == (ContributorRef(parent.child(1), True),)
    (last,) = op.flush()
    assert last.contribution_refs() == (ContributorRef(parent.child(0), False),)
    check_operator(pack_sequences(8, open_bins=4, pad_id=0), recs)


# ------------------------------------------------------------------------------------ heritage
def test_component_counts_count_fragments_and_tokens_per_component():
    lengths = [5, 12, 3, 7, 9, 0]
    comps = ["a", "b", "a", "b", "a", "b"]
    out = run(pack_sequences(8, open_bins=3, pad_id=0), token_records(lengths, components=comps))
    tokens: Counter = Counter()
    samples: Counter = Counter()
    for rec in out:
        assert rec.meta.component_token_counts is not None
        tokens.update(rec.meta.component_token_counts)
        samples.update(rec.meta.component_sample_counts)
        seg = rec.payload["segment_ids"]
        assert sum(rec.meta.component_token_counts.values()) == int((seg > 0).sum())
    assert tokens == {"a": 5 + 3 + 9, "b": 12 + 7}
    n_fragments = Counter(comps[item] for item, _, _ in fragments(out))
    n_fragments["b"] += 1  # the empty input is a fragment without tokens
    assert samples == n_fragments


def test_packing_before_tokenization_has_no_token_counts():
    out = run(pack_sequences(8, pad_id=0), token_records([5, 6], counts=False))
    assert all(r.meta.component_token_counts is None for r in out)
    assert sum((Counter(r.meta.component_sample_counts) for r in out), Counter()) == {"web": 2}


def test_repacking_a_packed_record_splits_its_counts_by_its_layout():
    meta = SampleMeta(
        SampleCursor(0, 0, (0, 0, 0)),
        component_sample_counts={"a": 1, "b": 2},
        component_token_counts={"a": 6, "b": 4},
    )
    rec = SampleRecord(meta, {"tokens": np.arange(10, dtype=np.int32)})
    out = run(pack_flat(4, pad_id=0), [rec])
    assert [r.meta.component_token_counts for r in out] == [{"a": 4}, {"a": 2, "b": 2}, {"b": 2}]
    assert [r.meta.component_sample_counts for r in out] == [{"a": 1}, {"a": 1, "b": 1}, {"b": 1}]


# ------------------------------------------------------------------------------------ payload
def test_padding_uses_pad_id_and_segment_zero():
    out = run(pack_sequences(6, pad_id=-1), token_records([2, 1]))
    (rec,) = out
    assert rec.payload["tokens"].tolist() == [0, 1, STRIDE, -1, -1, -1]
    assert rec.payload["segment_ids"].tolist() == [1, 1, 2, 0, 0, 0]
    assert rec.payload["positions"].tolist() == [0, 1, 0, 0, 0, 0]


def test_a_missing_field_names_the_record():
    rec = token_records([3])[0]
    with pytest.raises(zephon.OperatorError, match=r"no field 'ids'"):
        pack_sequences(4, field="ids", pad_id=0).process_many([rec])


@pytest.mark.parametrize(
    "tokens",
    [np.array([1, 2**31 + 5], np.int64), [1, -(2**31) - 1], np.array([7, 2**32 - 1], np.uint32)],
    ids=["int64", "list", "uint32"],
)
@pytest.mark.parametrize("packer", [pack_sequences(4, pad_id=0), pack_flat(4, pad_id=0)])
def test_token_ids_outside_int32_name_the_record_instead_of_wrapping(packer, tokens):
    rec = token_records([2])[0]
    rec = SampleRecord(rec.meta, {**rec.payload, "tokens": tokens})
    with pytest.raises(zephon.OperatorError, match=r"SampleCursor\(0, 0.*'tokens' holds .*int32"):
        run(packer, [rec])


def test_bins_never_cross_a_flush_and_a_packer_with_open_bins_cannot_be_copied():
    op = pack_sequences(8, pad_id=0)
    op.start_epoch(0, 0)
    assert op.process_many(token_records([3])) == []
    with pytest.raises(RuntimeError, match="open bins"):
        copy.deepcopy(op)
    assert len(op.flush()) == 1
    assert op.flush() == []
    copy.deepcopy(op)


def test_traits_and_parameters():
    seq = pack_sequences(16, open_bins=3, strategy="first_fit", pad_id=5)
    assert isinstance(seq, PackSequences)
    assert not seq.traits.preserves_cursor_order and seq.traits.stateful
    assert seq.describe()["params"] == {
        "field": "tokens",
        "open_bins": 3,
        "pad_id": 5,
        "seq_len": 16,
        "strategy": "first_fit",
    }
    flat = pack_flat(16, pad_id=0)
    assert isinstance(flat, PackFlat)
    assert flat.traits.preserves_cursor_order and flat.traits.stateful
    with pytest.raises(ValueError, match="strategy"):
        pack_sequences(8, strategy="worst_fit")
    with pytest.raises(ValueError, match="seq_len"):
        pack_flat(0)


@pytest.mark.parametrize(
    "op",
    [
        pack_sequences(8, pad_id=0),
        pack_sequences(8, open_bins=1, strategy="first_fit", pad_id=0),
        pack_sequences(8, open_bins=2, pad_id=0, cut_to_fill=True),
        pack_flat(8, pad_id=0),
    ],
    ids=["best_fit", "first_fit-1", "cut_to_fill", "flat"],
)
def test_each_base_offset_is_closed_exactly_once(op):
    # Tokenized and split records: children of one sample in several bins, empty inputs. A bin
    # closing a split sample may leave before a sibling's bin (fine for a reordering operator).
    texts = ["", "abc", "a" * 30, "hello world", "b" * 17, ""]
    source_records = [
        SampleRecord(SampleMeta(SampleCursor(2, i, (0, 0, i)), component="web"), {"text": t})
        for i, t in enumerate(texts)
    ]
    records = tokenize(max_len=6, split_long_samples=True).process_many(source_records)
    check_operator(op, records)
    check_operator(op, token_records([0, 9, 17, 2, 8, 0]))


# ------------------------------------------------------------------------------------ fill
def fill(strategy: str, cut_to_fill: bool = False) -> float:
    lengths = np.random.default_rng(0).integers(1, 512, size=20_000)
    records = token_records(lengths.tolist(), chunk_size=1024)
    op = pack_sequences(1024, open_bins=64, strategy=strategy, pad_id=0, cut_to_fill=cut_to_fill)
    out = run(op, records, micro=256, flush_every=4096)
    return float(lengths.sum()) / (len(out) * 1024)


def test_best_fit_fills_at_least_98_5_percent():
    assert fill("best_fit") >= 0.985


def test_first_fit_fills_at_least_97_5_percent():
    assert fill("first_fit") >= 0.975


def test_cut_to_fill_fills_better_and_cuts_at_most_once_per_row():
    assert fill("best_fit", cut_to_fill=True) > fill("best_fit") + 0.005
    lengths = np.random.default_rng(1).integers(1, 300, size=3000).tolist()
    records = token_records(lengths, chunk_size=500)
    op = pack_sequences(512, open_bins=8, pad_id=0, cut_to_fill=True)
    op.start_epoch(0, 0)
    during = [r for m in range(0, len(records), 64) for r in op.process_many(records[m : m + 64])]
    at_flush = op.flush()
    assert_every_input_recovered_once(lengths, during + at_flush)
    rows_of_input: Counter[int] = Counter()
    per_row = []
    for rec in during + at_flush:
        items = [item for item, _, _ in fragments([rec])]
        rows_of_input.update(set(items))
        per_row.append(items)
    cut = {item for item, rows in rows_of_input.items() if rows > 1}
    assert cut, "the workload must make cuts"
    # During the epoch a row holds at most one piece of a cut input.
    assert max(sum(item in cut for item in items) for items in per_row[: len(during)]) == 1
    # At the flush every row but the last is full, and each cuts at most one input of its own
    # (the head it ends with; the tail starts a later row).
    assert len(at_flush) == -(-sum(int((r.payload["segment_ids"] > 0).sum()) for r in at_flush)
                              // 512)  # fmt: skip
    assert all((r.payload["segment_ids"] > 0).all() for r in at_flush[:-1])
    heads = [
        sum(1 for item, start, tokens in fragments([rec]) if start + len(tokens) < lengths[item])
        for rec in at_flush
    ]
    assert max(heads) <= 1


@settings(max_examples=60)
@given(
    seq_len=st.integers(1, 24),
    lengths=st.lists(st.integers(0, 70), max_size=40),
    open_bins=st.integers(1, 6),
    micro=st.integers(1, 9),
)
def test_a_cut_to_fill_flush_leaves_at_most_one_bin_not_full(seq_len, lengths, open_bins, micro):
    op = pack_sequences(seq_len, open_bins=open_bins, pad_id=0, cut_to_fill=True)
    op.start_epoch(0, 0)
    records = token_records(lengths)
    during = [
        r for m in range(0, len(records), micro) for r in op.process_many(records[m : m + micro])
    ]
    at_flush = op.flush()
    assert_every_input_recovered_once(lengths, during + at_flush)
    held = sum(int((r.payload["segment_ids"] > 0).sum()) for r in at_flush)
    assert len(at_flush) <= max(1, -(-held // seq_len))
    assert len({r.meta.cursor for r in during + at_flush}) == len(during + at_flush)


# ------------------------------------------------------------------------------------ pipeline
def test_through_a_pipeline_the_delivered_fragments_are_the_tokenized_children():
    texts = [("x" * (i * 7 % 40)) + str(i) for i in range(60)]
    pipeline = zephon.Pipeline(
        ListSource([{"text": t} for t in texts], chunk_size=8),
        [fetch(), tokenize(max_len=16, split_long_samples=True), pack_sequences(32, open_bins=4)],
        epoch_chunks=2,
        strict=True,
    )
    loader = iter(pipeline)
    got = sorted(
        tuple(rec.payload["tokens"][rec.payload["segment_ids"] == s].tolist())
        for rec in loader
        for s in range(1, int(rec.payload["segment_ids"].max()) + 1)
    )
    children = []
    for t in texts:
        ids = [*t.encode(), 256]
        children += [tuple(ids[i : i + 16]) for i in range(0, len(ids), 16)]
    assert got == sorted(children)
    stats = loader.stats()
    assert stats["violations"] == 0
    assert stats["mixture"] == {0: 1.0}
    assert stats["inflight_chunks"] == 0


# ------------------------------------------------------------------------------------ pad id
def text_pipeline(ops: list[Any], **kw: Any) -> zephon.Pipeline:
    texts = [{"text": "ab" * (i % 9)} for i in range(40)]
    return zephon.Pipeline(ListSource(texts, chunk_size=8), [fetch(), *ops], **kw)


def padding_values(pipeline: zephon.Pipeline) -> set[int]:
    """Every token value delivered where ``segment_ids == 0`` (the padding positions)."""
    with pipeline.iter() as loader:
        return {
            int(v) for rec in loader for v in rec.payload["tokens"][rec.payload["segment_ids"] == 0]
        }


def bpe_with(special_tokens: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=special_tokens[0]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=40, special_tokens=special_tokens)
    tok.train_from_iterator(["ab ab abab", "ba ab"], trainer)
    return tok


@pytest.mark.parametrize("packer", [pack_sequences, pack_flat])
def test_without_pad_id_a_packer_pads_with_the_upstream_tokenizers_pad(packer):
    pipeline = text_pipeline([tokenize(), packer(32)], lanes=2, workers="process")
    packed = pipeline.compile().chain[-1]
    assert isinstance(packed, (PackSequences, PackFlat))
    assert packed.pad_id is None and packed.effective_pad_id == 257
    assert padding_values(pipeline) == {ByteTokenizer.pad_id}


def test_a_hugging_face_tokenizers_pad_token_is_the_packers_pad():
    tok = bpe_with(["<unk>", "</s>", "<pad>"])
    pipeline = text_pipeline([tokenize(tok), pack_sequences(32)])
    assert padding_values(pipeline) == {tok.token_to_id("<pad>")} == {2}


def test_an_explicit_pad_id_wins_over_the_tokenizers():
    assert padding_values(text_pipeline([tokenize(), pack_sequences(32, pad_id=-1)])) == {-1}


def test_a_packer_after_hand_made_tokens_without_pad_id_is_a_plan_error():
    rows = [{"tokens": np.arange(n, dtype=np.int32)} for n in (3, 5, 8)]
    pipeline = zephon.Pipeline(ListSource(rows), [fetch(), pack_sequences(8)])
    with pytest.raises(zephon.PlanError, match=r"pack_sequences: .*pass pad_id=.*segment_ids == 0"):
        pipeline.compile()
    with pytest.raises(zephon.PlanError, match="pack_flat"):
        iter(zephon.Pipeline(ListSource(rows), [fetch(), pack_flat(8)]))
    assert zephon.Pipeline(ListSource(rows), [fetch(), pack_flat(8, pad_id=0)]).compile()


def test_a_tokenizer_without_a_pad_token_makes_the_packer_ask_for_pad_id():
    tok = bpe_with(["<unk>", "</s>"])
    with pytest.raises(zephon.PlanError, match=r"pack_flat: .*tokenize\(eos=1 '</s>'\).*pad_id="):
        text_pipeline([tokenize(tok), pack_flat(16)]).compile()


def test_a_packer_reading_another_field_does_not_take_that_tokenizers_pad():
    pipeline = text_pipeline([tokenize(output_field="ids"), pack_sequences(16)])
    with pytest.raises(zephon.PlanError, match=r"reads 'tokens'.*writes 'ids'"):
        pipeline.compile()
    ok = text_pipeline([tokenize(output_field="ids"), pack_sequences(16, field="ids")])
    packed = ok.compile().chain[-1]
    assert isinstance(packed, PackSequences) and packed.effective_pad_id == 257


def test_a_packer_used_alone_without_pad_id_says_to_pass_it():
    with pytest.raises(zephon.PlanError, match=r"pack_sequences: .*pad_id="):
        pack_sequences(8).process_many(token_records([3]))


def test_taking_the_upstream_pad_leaves_the_fingerprint_as_it_was():
    pipeline = text_pipeline([tokenize(), pack_sequences(32)])
    before = pipeline.fingerprint
    assert pipeline.compile().fingerprint == before == pipeline.fingerprint


# ------------------------------------------------------------------------------------ side fields
def with_sides(records: list[SampleRecord]) -> list[SampleRecord]:
    """Each record gets a loss mask (odd tokens) and float weights derived from its tokens, so
    every side value says which token it belongs to."""
    out = []
    for rec in records:
        tokens = rec.payload["tokens"]
        mask = (tokens % 2).astype(np.int32)
        weights = (tokens % STRIDE / 4.0 + 1).astype(np.float32)
        out.append(rec.with_payload({**rec.payload, "loss_mask": mask, "weights": weights}))
    return out


SIDES = {"loss_mask": -7, "weights": 0.5}


@settings(max_examples=80)
@given(
    seq_len=st.integers(1, 24),
    lengths=st.lists(st.integers(0, 70), max_size=30),
    packer=st.sampled_from(["best_fit", "first_fit", "flat"]),
    micro=st.integers(1, 9),
)
def test_side_fields_stay_aligned_with_their_tokens_across_splits_and_wraps(
    seq_len, lengths, packer, micro
):
    op = (
        pack_flat(seq_len, pad_id=0, extra_fields=SIDES)
        if packer == "flat"
        else pack_sequences(seq_len, open_bins=3, strategy=packer, pad_id=0, extra_fields=SIDES)
    )
    out = run(op, with_sides(token_records(lengths)), micro)
    assert_every_input_recovered_once(lengths, out)
    for rec in out:
        p = rec.payload
        assert p["loss_mask"].dtype == np.int32 and p["weights"].dtype == np.float32
        assert len(p["loss_mask"]) == len(p["weights"]) == seq_len
        real = p["segment_ids"] > 0
        assert p["loss_mask"][real].tolist() == (p["tokens"][real] % 2).tolist()
        assert p["weights"][real].tolist() == (p["tokens"][real] % STRIDE / 4.0 + 1).tolist()
        assert (p["loss_mask"][~real] == -7).all() and (p["weights"][~real] == 0.5).all()


def test_side_fields_as_lists_or_other_int_dtypes_are_converted():
    rec = token_records([3])[0]
    rec = rec.with_payload({**rec.payload, "loss_mask": [True, False, True], "w": [1, 2, 3]})
    (out,) = run(pack_flat(4, pad_id=0, extra_fields={"loss_mask": 0, "w": 0.0}), [rec])
    assert out.payload["loss_mask"].tolist() == [1, 0, 1, 0]
    assert out.payload["w"].tolist() == [1.0, 2.0, 3.0, 0.0]


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (None, "no extra field 'loss_mask'"),
        (np.ones(2, np.int32), r"shape \(2,\), but 'tokens' has 3 tokens"),
        (np.ones((3, 1), np.int32), r"shape \(3, 1\)"),
        (np.array([0.5, 1, 1]), "holds float64, not int32"),
        (np.array([0, 2**40, 1]), "not int32"),
        (np.array(["a", "b", "c"]), "not int32"),
    ],
)
def test_a_bad_side_field_names_the_record(value, match):
    rec = token_records([3])[0]
    payload = dict(rec.payload)
    if value is not None:
        payload["loss_mask"] = value
    with pytest.raises(zephon.OperatorError, match=rf"cursor.*{match}|{match}") as info:
        run(pack_sequences(8, pad_id=0, extra_fields={"loss_mask": 0}), [rec.with_payload(payload)])
    assert "pack_sequences" in str(info.value) and "sample_id" in str(info.value)


@pytest.mark.parametrize(
    ("extra", "error", "match"),
    [
        ({"tokens": 0}, ValueError, "cannot carry 'tokens'"),
        ({"segment_ids": 0}, ValueError, "cannot carry"),
        ({"loss_mask": True}, TypeError, "must be an int"),
        ({"loss_mask": "0"}, TypeError, "must be an int"),
        ({"loss_mask": 2**31}, ValueError, "extra_fields"),
        ({1: 0}, TypeError, "names must be str"),
        (["loss_mask"], TypeError, "must map field names"),
    ],
)
def test_bad_extra_fields_are_refused_at_construction(extra, error, match):
    with pytest.raises(error, match=match):
        pack_sequences(8, pad_id=0, extra_fields=extra)
    with pytest.raises(error, match=match):
        pack_flat(8, pad_id=0, extra_fields=extra)


def test_extra_fields_change_the_fingerprint_only_when_given():
    plain = pack_sequences(16, pad_id=5).describe()["params"]
    assert "extra_fields" not in plain
    sided = pack_sequences(16, pad_id=5, extra_fields={"loss_mask": 0}).describe()["params"]
    assert sided["extra_fields"] == {"loss_mask": 0}


@pytest.mark.parametrize("packer", ["best_fit", "flat"])
def test_check_operator_passes_with_side_fields(packer):
    op = (
        pack_flat(8, pad_id=0, extra_fields=SIDES)
        if packer == "flat"
        else pack_sequences(8, pad_id=0, extra_fields=SIDES)
    )
    check_operator(op, with_sides(token_records([0, 9, 17, 2, 8, 0])))


def test_batches_of_packed_rows_held_together_keep_their_values_and_share_no_memory():
    # Packed rows are written into arenas that are reused once no batch views them: batches a
    # training loop keeps must not change, whatever is packed after them.
    rng = np.random.default_rng(7)
    docs = [
        {"tokens": rng.integers(0, 1000, int(n), dtype=np.int32)}
        for n in rng.integers(1, 300, 3000)
    ]

    def pipeline() -> zephon.Pipeline:
        ops = [fetch(), pack_sequences(256, pad_id=0, extra_fields=None), zephon.ops.batch(8)]
        return zephon.Pipeline(ListSource(docs, chunk_size=128), ops)

    copied = [{k: np.array(v, copy=True) for k, v in b.payload.items()} for b in pipeline()]
    held = [b.payload for b in pipeline()]
    assert len(held) == len(copied) > 100
    assert sum(isinstance(p["tokens"].base, type(None)) for p in held) < len(held)  # views
    for got, want in zip(held, copied):
        assert got.keys() == want.keys()
        assert all(np.array_equal(got[k], want[k]) for k in want)
    arrays = [p["tokens"] for p in held]
    for a, b in itertools.pairwise(arrays):
        assert not np.shares_memory(a, b)


# ------------------------------------------------------------------------------ images
IMAGE_ID = 2**31 - 1  # the image token of the records below, never a text token of theirs


def image_records(docs: list[list[int]]) -> list[SampleRecord]:
    """Records whose tokens alternate text runs and image spans: ``[text, span, text, span,
    ...]`` lengths; each span is ``IMAGE_ID`` tokens and its image's pixels name (doc, image)."""
    out = []
    for rec, parts in zip(token_records([sum(d) for d in docs]), docs):
        tokens = rec.payload["tokens"].copy()
        spans: list[tuple[int, int]] = []
        images: list[np.ndarray] = []
        at = 0
        for k, n in enumerate(parts):
            if k % 2:
                tokens[at : at + n] = IMAGE_ID
                spans.append((at, at + n))
                images.append(np.array([[rec.meta.cursor.chunk_offset, len(images)]], np.int32))
            at += n
        payload = {**rec.payload, "tokens": tokens, "images": images}
        payload["image_spans"] = np.array(spans, np.int32).reshape(-1, 2)
        out.append(SampleRecord(rec.meta, payload))
    return out


def image_rows(out: list[SampleRecord]) -> list[tuple]:
    return [
        (
            r.payload["tokens"].tolist(),
            r.payload["image_spans"].tolist(),
            [image.tolist() for image in r.payload["images"]],
            r.payload["image_sources"].tolist(),
        )
        for r in out
    ]


def test_a_packer_with_images_restores_its_held_bins_and_continues_the_same_rows():
    docs = [[3, 4, 2], [9], [1, 5], [2, 3, 1, 6], [5, 2, 5], [4], [2, 7, 2], [1, 1, 1, 1, 1]] * 4
    records = image_records(docs)
    packer = PackSequences(16, pad_id=0, open_bins=3, cut_to_fill=True, images="images")
    whole = run(packer, records)
    head_op = copy.deepcopy(packer)
    head_op.start_epoch(0, 0)
    head = head_op.process_many(records[:13])
    held, state = head_op.holdings()
    assert held, "the test needs bins held at the cut"
    tail_op = copy.deepcopy(packer)
    tail_op.start_epoch(0, 0)
    tail_op.restore_holdings(held, state)
    tail = tail_op.process_many(records[13:]) + tail_op.flush()
    assert image_rows(head + tail) == image_rows(whole)
    for row in whole:  # every span whole, at the positions it says
        for lo, hi in row.payload["image_spans"].tolist():
            assert set(row.payload["tokens"][lo:hi].tolist()) == {IMAGE_ID}
        assert np.count_nonzero(row.payload["tokens"] == IMAGE_ID) == sum(
            hi - lo for lo, hi in row.payload["image_spans"].tolist()
        )


def test_check_operator_passes_with_images():
    check_operator(
        pack_sequences(8, pad_id=0, cut_to_fill=True, images="images"),
        image_records([[2, 3, 1], [8], [1, 6, 1, 1], [4, 2]]),
    )


def test_images_change_the_fingerprint_only_when_given():
    assert "images" not in pack_sequences(8).describe()["params"]
    assert pack_sequences(8, images="images").describe()["params"]["images"] == "images"


@settings(max_examples=80)
@given(
    seq_len=st.integers(1, 24),
    lengths=st.lists(st.integers(0, 70), max_size=30),
    packer=st.sampled_from(["best_fit", "first_fit", "flat", "grouped"]),
    micro=st.integers(1, 9),
    retired=st.sets(st.integers(0, 29)),
)
def test_rows_leave_retired_inputs_out_and_keep_every_other_token_once(
    seq_len, lengths, packer, micro, retired
):
    op: zephon.ops.Operator
    if packer == "flat":
        op = pack_flat(seq_len, pad_id=0, extra_fields=SIDES)
    else:
        op = pack_sequences(
            seq_len,
            open_bins=3,
            strategy="best_fit" if packer == "grouped" else packer,
            pad_id=0,
            extra_fields=SIDES,
            group_by=(lambda p: len(p["tokens"]) % 2) if packer == "grouped" else None,
        )
    op = copy.deepcopy(op)
    assert op.leave_out(lambda ids: np.isin(ids[:, 2], sorted(retired)))
    out = run(op, with_sides(token_records(lengths)), micro)
    rows = [r for r in out if not r.is_tombstone]
    gone = [
        r for r in rows if all(ref.cursor.sample_id[2] in retired for ref in r.contribution_refs())
    ]
    kept = [r for r in rows if r not in gone]
    # rows that mix are made without the retired inputs, whose tokens only rows of their own hold
    assert not any(
        ref.cursor.sample_id[2] in retired for r in kept for ref in r.contribution_refs()
    )
    by_input: dict[int, list[tuple[int, list[int]]]] = {}
    for item, start, values in fragments(kept):
        by_input.setdefault(item, []).append((start, values))
    for i, n in enumerate(lengths):
        joined = [v for _, values in sorted(by_input.pop(i, [])) for v in values]
        if i not in retired:
            assert joined == list(range(n)), f"input {i} ({n} tokens) not delivered exactly once"
    assert not by_input
    # every input still closes exactly once: in a row, or by a tombstone for a left-out part
    closing = Counter(ref.cursor for r in out for ref in r.contribution_refs() if ref.is_last_child)
    assert sorted(closing.values()) == [1] * len(lengths)
    assert len({r.meta.cursor for r in rows}) == len(rows)
    for rec in kept:
        p = rec.payload
        real = p["segment_ids"] > 0
        assert p["loss_mask"][real].tolist() == (p["tokens"][real] % 2).tolist()
        assert p["weights"][real].tolist() == (p["tokens"][real] % STRIDE / 4.0 + 1).tolist()
        assert (p["loss_mask"][~real] == -7).all() and (p["weights"][~real] == 0.5).all()
        assert not p["tokens"][~real].any() and not p["positions"][~real].any()


@pytest.mark.parametrize("retired", [{1}, {3, 6}, {0, 2, 4}])
def test_rows_that_leave_a_retired_input_out_keep_the_other_inputs_images(retired):
    docs = [[3, 4, 2], [9], [1, 5], [2, 3, 1, 6], [5, 2, 5], [4], [2, 7, 2], [1, 1, 1, 1, 1]] * 2
    packer = PackSequences(16, pad_id=0, open_bins=3, cut_to_fill=True, images="images")
    op = copy.deepcopy(packer)
    assert op.leave_out(lambda ids: np.isin(ids[:, 2], sorted(retired)))
    rows = [r for r in run(op, image_records(docs)) if not r.is_tombstone]
    mixed = [
        r
        for r in rows
        if not all(ref.cursor.sample_id[2] in retired for ref in r.contribution_refs())
    ]
    seen = Counter(
        tuple(map(tuple, image.tolist()[0:1])) for r in mixed for image in r.payload["images"]
    )
    wanted = Counter(
        ((i, k),)
        for i, parts in enumerate(docs)
        if i not in retired
        for k in range(len(parts) // 2)
    )
    assert seen == wanted  # every image of an input that is not retired, once; none retired
    for row in mixed:  # each span whole, at the place it says, after the retired parts left
        tokens = row.payload["tokens"]
        for lo, hi in row.payload["image_spans"].tolist():
            assert set(tokens[lo:hi].tolist()) == {IMAGE_ID}
        spans = row.payload["image_spans"].tolist()
        assert np.count_nonzero(tokens == IMAGE_ID) == sum(hi - lo for lo, hi in spans)
