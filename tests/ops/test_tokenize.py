"""``tokenize``: every supported tokenizer shape, an end-of-sequence id that is never a guess,
ids converted once and range-checked, splitting, truncation, heritage."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

import zephon
from zephon.errors import OperatorError, PlanError
from zephon.ops import ByteTokenizer, fetch, tokenize
from zephon.sources import ListSource
from zephon.testing import check_operator
from zephon.types import ContributorRef, SampleCursor, SampleMeta, SampleRecord

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a lazy dog sleeps in the sun",
    "the fox and the dog are friends",
    "packing sequences keeps the accelerator busy",
]


def text_records(
    texts: list[str], *, chunk_id: int = 0, component: Any = "web"
) -> list[SampleRecord]:
    """Fetched-looking records (implicit contributors) with a text field and an extra field."""
    return [
        SampleRecord(
            SampleMeta(SampleCursor(chunk_id, i, (0, 0, i)), lane_id=0, component=component),
            {"text": t, "id": i},
        )
        for i, t in enumerate(texts)
    ]


def word_lengths(text: str) -> list[int]:
    """A plain callable tokenizer: one id per word, the word's length."""
    return [len(w) for w in text.split()]


def word_level_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=["[UNK]", "[EOS]"]))
    return tok


def bpe_tokenizer(special_tokens: tuple[str, ...] = ("[UNK]", "[EOS]")) -> Tokenizer:
    """A byte-pair encoding trained here on ``SENTENCES``; the special tokens take ids 0, 1, ..."""
    tok = Tokenizer(models.BPE(unk_token=special_tokens[0]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=60, special_tokens=list(special_tokens))
    tok.train_from_iterator(SENTENCES, trainer)
    return tok


# ------------------------------------------------------------------------------------ ByteTokenizer
def test_byte_tokenizer_maps_utf8_bytes_to_ids_and_documents_eos_256_and_pad_257():
    tok = ByteTokenizer()
    ids = tok.encode("héllo ☃")
    assert ids.dtype == np.int32
    assert ids.tolist() == list("héllo ☃".encode())
    assert (tok.eos_id, tok.pad_id, tok.vocab_size) == (256, 257, 258)
    assert (tok.eos_token, tok.pad_token) == ("<eos>", "<pad>")
    assert tok.decode([*ids.tolist(), 256, 257]) == "héllo ☃"
    assert [a.tolist() for a in tok.encode_batch(["ab", ""])] == [[97, 98], []]


def test_default_tokenizer_appends_eos_and_keeps_other_fields():
    recs = text_records(["hi", "héllo"])
    out = tokenize().process_many(recs)
    assert [r.payload["tokens"].tolist() for r in out] == [
        [104, 105, 256],
        [*"héllo".encode(), 256],
    ]
    assert all(r.payload["tokens"].dtype == np.int32 for r in out)
    assert [r.payload["text"] for r in out] == ["hi", "héllo"]
    assert [r.payload["id"] for r in out] == [0, 1]
    assert [r.meta.cursor for r in out] == [r.meta.cursor for r in recs]


def test_every_output_carries_its_token_and_sample_counts():
    out = tokenize().process_many(text_records(["abc", "de"], component="books"))
    assert [r.meta.component_token_counts for r in out] == [{"books": 4}, {"books": 3}]
    assert [r.meta.component_sample_counts for r in out] == [{"books": 1}, {"books": 1}]
    assert all(r.meta.component == "books" for r in out)


def test_output_field_and_no_eos():
    out = tokenize(field="body", output_field="ids", append_eos=False).process_many(
        [
            SampleRecord(
                SampleMeta(SampleCursor(0, 0, (0, 0, 0)), component=3), {"body": "ab", "x": 1}
            )
        ]
    )
    assert out[0].payload == {"body": "ab", "x": 1, "ids": out[0].payload["ids"]}
    assert out[0].payload["ids"].tolist() == [97, 98]
    assert out[0].meta.component_token_counts == {3: 2}


# ------------------------------------------------------------------------------------ tokenizers
def test_a_plain_callable_is_a_tokenizer():
    out = tokenize(word_lengths, eos_id=0).process_many(text_records(["aa bbb c"]))
    assert out[0].payload["tokens"].tolist() == [2, 3, 1, 0]


class EncodeOnly:
    """``.encode(str)`` returning ints, with an ``eos_id``."""

    eos_id = 99

    def __init__(self) -> None:
        self.calls = 0

    def encode(self, text: str) -> list[int]:
        self.calls += 1
        return [ord(c) % 50 for c in text]


class EncodingObject:
    def __init__(self, ids: list[int]):
        self.ids = ids


class EncodeWithIds:
    """``.encode(str)`` returning an object with ``.ids``, and ``encode_batch``."""

    def __init__(self) -> None:
        self.single = 0
        self.batches: list[int] = []

    def encode(self, text: str) -> EncodingObject:
        self.single += 1
        return EncodingObject([len(text)])

    def encode_batch(self, texts: list[str]) -> list[EncodingObject]:
        self.batches.append(len(texts))
        return [EncodingObject([len(t)]) for t in texts]


class TransformersLike:
    """The ``transformers`` shape: ``encode``, ``batch_encode_plus`` and ``eos_token_id``."""

    eos_token_id: int | None = 7

    def encode(self, text: str) -> list[int]:
        return [1, len(text)]

    def batch_encode_plus(self, texts: list[str]) -> dict[str, list[list[int]]]:
        return {"input_ids": [[1, len(t)] for t in texts]}


def test_an_encode_method_is_used_and_its_eos_id_wins():
    tok = EncodeOnly()
    out = tokenize(tok).process_many(text_records(["ab", "c"]))
    assert tok.calls == 2
    assert [r.payload["tokens"].tolist() for r in out] == [[47, 48, 99], [49, 99]]


def test_encode_batch_runs_once_per_micro_batch():
    tok = EncodeWithIds()
    op = tokenize(tok, eos_id=9)
    out = op.process_many(text_records(["a", "bb", "ccc"]))
    assert op.tokenizer.batches == [3] and op.tokenizer.single == 0
    assert [r.payload["tokens"].tolist() for r in out] == [[1, 9], [2, 9], [3, 9]]


def test_transformers_style_tokenizers_use_batch_encode_plus_and_eos_token_id():
    op = tokenize(TransformersLike())
    out = op.process_many(text_records(["abc", ""]))
    assert [r.payload["tokens"].tolist() for r in out] == [[1, 3, 7], [1, 0, 7]]
    assert (op.eos_id, op.pad_id) == (7, None)


class SepOnly(TransformersLike):
    """A ``transformers``-style tokenizer with no eos token but a separator and a pad token."""

    eos_token_id = None
    sep_token_id = 5
    pad_token_id = 4


def test_without_eos_token_id_a_transformers_style_tokenizer_ends_with_its_sep_token():
    op = tokenize(SepOnly())
    assert [r.payload["tokens"].tolist() for r in op.process_many(text_records(["ab"]))] == [
        [1, 2, 5]
    ]
    assert (op.eos_id, op.pad_id) == (5, 4)


def fast_transformers_tokenizer(**special: str) -> Any:
    """A real ``transformers`` fast tokenizer around a BPE trained here (no download)."""
    transformers = pytest.importorskip("transformers")
    bpe = bpe_tokenizer(("<unk>", "</s>", "<pad>"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", **special)


def test_a_transformers_fast_tokenizer_ends_with_its_eos_and_publishes_its_pad():
    tok = fast_transformers_tokenizer(eos_token="</s>", pad_token="<pad>")
    op = tokenize(tok)
    texts = ["the lazy fox", "unseen words"]
    out = op.process_many(text_records(texts))
    assert [r.payload["tokens"].tolist() for r in out] == [[*tok.encode(t), 1] for t in texts]
    assert (op.eos_id, op.eos_token, op.pad_id, op.pad_token) == (1, "</s>", 2, "<pad>")


def test_a_transformers_fast_tokenizer_without_eos_token_is_refused():
    with pytest.raises(PlanError, match=r"eos_id=.*append_eos=False"):
        tokenize(fast_transformers_tokenizer())


@pytest.mark.parametrize("build", [word_level_tokenizer, bpe_tokenizer])
@pytest.mark.parametrize("explicit", [False, True], ids=["its-own-eos", "eos_id="])
def test_a_hugging_face_tokenizer_works_as_is(build, explicit):
    tok = build()
    eos = tok.token_to_id("[EOS]")
    texts = ["the lazy fox", "dog friends sun", "unseen words here"]
    op = tokenize(tok, eos_id=eos) if explicit else tokenize(tok)
    out = op.process_many(text_records(texts))
    for rec, text in zip(out, texts, strict=True):
        assert rec.payload["tokens"].tolist() == [*tok.encode(text).ids, eos]
        assert rec.meta.component_token_counts == {"web": len(tok.encode(text).ids) + 1}


def test_a_hugging_face_tokenizer_ends_documents_with_its_own_eos_not_a_byte_id():
    tok = bpe_tokenizer(("<unk>", "<eos>", "<pad>"))
    assert tok.token_to_id("<eos>") == 1 and tok.id_to_token(256) is None
    op = tokenize(tok)
    (rec,) = op.process_many(text_records(["the lazy dog"]))
    assert rec.payload["tokens"].tolist() == [*tok.encode("the lazy dog").ids, 1]
    assert (op.eos_id, op.eos_token, op.pad_id, op.pad_token) == (1, "<eos>", 2, "<pad>")


@pytest.mark.parametrize("name", ["</s>", "<|endoftext|>", "[SEP]"])
def test_each_common_end_of_sequence_token_is_recognized(name):
    tok = bpe_tokenizer(("<unk>", "<s>", name))
    assert tokenize(tok).eos_id == 2


def test_the_eos_of_a_post_processor_template_is_used_once():
    tok = bpe_tokenizer(("<unk>", "<s>", "</s>", "<|endoftext|>"))
    # The template appends '</s>' itself: tokenize must neither add a second one nor pick
    # another end-of-text token of the vocabulary.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    op = tokenize(tok)
    out = op.process_many(text_records(["the fox", ""]))
    assert [r.payload["tokens"].tolist() for r in out] == [tok.encode("the fox").ids, [1, 2]]
    assert out[0].payload["tokens"][-1] == 2 and (op.eos_id, op.eos_token) == (2, "</s>")
    assert not op.appends_eos  # the tokenizer adds it


def test_a_template_that_only_adds_a_beginning_token_gives_no_eos():
    tok = bpe_tokenizer(("<unk>", "<s>"))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    with pytest.raises(PlanError, match="eos_id="):
        tokenize(tok)
    (rec,) = tokenize(tok, eos_id=0).process_many(text_records(["the fox"]))
    assert rec.payload["tokens"].tolist() == [*tok.encode("the fox").ids, 0]


def test_a_tokenizer_without_an_eos_is_refused_at_construction():
    tok = bpe_tokenizer(("[UNK]",))
    with pytest.raises(PlanError, match=r"tokenize: .*eos_id=.*append_eos=False"):
        tokenize(tok)
    with pytest.raises(PlanError, match=r"eos_id=.*append_eos=False"):
        tokenize(word_lengths)
    assert tokenize(tok, append_eos=False).eos_id is None
    (rec,) = tokenize(tok, append_eos=False).process_many(text_records(["the dog"]))
    assert rec.payload["tokens"].tolist() == tok.encode("the dog").ids


def test_a_tokenizer_that_pads_its_batches_is_refused():
    tok = bpe_tokenizer(("<unk>", "</s>", "[PAD]"))
    tok.enable_padding(pad_id=2, pad_token="[PAD]")
    # encode_batch would pad the short text to the long one's length, inside the document
    assert tok.encode_batch(["the", "the lazy dog"])[0].ids[-1] == 2
    with pytest.raises(PlanError, match=r"no_padding\(\).*pad_id=2"):
        tokenize(tok)
    tok.no_padding()
    assert (tokenize(tok).eos_id, tokenize(tok).pad_id) == (1, 2)


def test_a_tokenizer_that_truncates_is_refused():
    # A tokenizer.json saved with truncation (common for encoders) would cut every document at
    # its max_length, silently, even with split_long_samples=True.
    tok = bpe_tokenizer(("<unk>", "</s>"))
    tok.enable_truncation(max_length=2)
    assert len(tok.encode("the quick brown fox").ids) == 2
    with pytest.raises(PlanError, match=r"truncation enabled.*no_truncation\(\).*max_len="):
        tokenize(tok, max_len=4, split_long_samples=True)
    tok.no_truncation()
    tokens = tokenize(tok, max_len=4, split_long_samples=True).process_many(
        text_records(["the quick brown fox"])
    )
    assert (
        sum(len(r.payload["tokens"]) for r in tokens)
        == len(tok.encode("the quick brown fox").ids) + 1
    )


def test_the_chosen_eos_and_pad_are_named_in_the_plan_description():
    tok = bpe_tokenizer(("<unk>", "</s>", "<pad>"))
    plan = zephon.Pipeline(ListSource([{"text": "the dog"}]), [fetch(), tokenize(tok)]).compile()
    assert "tokenize(eos=1 '</s>', pad=2 '<pad>')" in plan.describe()
    plan = zephon.Pipeline(ListSource([{"text": "x"}]), [fetch(), tokenize()]).compile()
    assert "tokenize(eos=256 '<eos>', pad=257 '<pad>')" in plan.describe()
    no_eos = tokenize(tok, append_eos=False)
    assert no_eos.name == "tokenize(append_eos=False, pad=2 '<pad>')"


@pytest.mark.parametrize("bad", [-1, 2**31, 1.0, True, "1"])
def test_an_eos_id_that_is_not_an_int32_token_id_is_refused(bad):
    with pytest.raises(PlanError, match="eos_id"):
        tokenize(eos_id=bad)


@pytest.mark.parametrize(
    "ids",
    [[-1, 2], [2**31], np.array([3, -4]), np.array([2**31], dtype=np.int64)],
    ids=["negative-list", "too-big-list", "negative-array", "too-big-array"],
)
def test_ids_outside_0_to_int32_max_are_refused(ids):
    with pytest.raises(OperatorError, match=r"token ids .* outside \[0, 2\*\*31\)"):
        tokenize(lambda s: ids, eos_id=0).process_many(text_records(["x"]))


def test_each_document_gets_its_own_writable_int32_array_with_the_eos():
    tok = bpe_tokenizer(("<unk>", "</s>"))
    texts = ["the lazy fox", "", "dog " * 50]
    out = tokenize(tok).process_many(text_records(texts))
    for rec, text in zip(out, texts, strict=True):
        tokens = rec.payload["tokens"]
        assert tokens.dtype == np.int32 and tokens.flags.c_contiguous and tokens.flags.writeable
        assert tokens.base is None  # its own buffer: holding one record holds no other
        assert tokens.tolist() == [*tok.encode(text).ids, 1]
    # Truncation keeps only the first max_len tokens, in an array of that size.
    (cut,) = tokenize(tok, max_len=3).process_many(text_records(["dog " * 50]))
    assert cut.payload["tokens"].tolist() == tok.encode("dog " * 50).ids[:3]
    assert cut.payload["tokens"].base is None


class MixedResults:
    """An ``encode_batch`` whose results are lists of ints, except an array for a text with "#",
    and ids out of range for a text with "!": the records after such a result are made in
    Python, those before it in the compiled pass."""

    def encode_batch(self, texts: list[str]) -> list[Any]:
        out: list[Any] = []
        for t in texts:
            ids = [len(w) for w in t.split()]
            out.append(np.array(ids) if "#" in t else [2**31] if "!" in t else ids)
        return out


def test_a_call_whose_results_change_kind_midway_keeps_every_record_in_order():
    texts = ["a bb", "ccc", "# dd", "e fff", "", "# g"]
    out = tokenize(MixedResults(), eos_id=0).process_many(text_records(texts))
    assert [r.payload["tokens"].tolist() for r in out] == [[*word_lengths(t), 0] for t in texts]
    assert [r.meta.cursor.chunk_offset for r in out] == list(range(len(texts)))
    assert [r.payload["id"] for r in out] == list(range(len(texts)))
    assert [r.meta.component_token_counts for r in out] == [
        {"web": len(word_lengths(t)) + 1} for t in texts
    ]


def test_ids_out_of_range_midway_in_a_call_name_their_own_record():
    texts = ["a", "bb", "c!", "d"]
    with pytest.raises(OperatorError, match=r"SampleCursor\(0, 2, .*outside \[0, 2\*\*31\)"):
        tokenize(MixedResults(), eos_id=0).process_many(text_records(texts))


def test_the_fingerprint_follows_the_vocabulary_of_a_hugging_face_tokenizer():
    a, b = word_level_tokenizer(), bpe_tokenizer()
    assert tokenize(a).describe() == tokenize(word_level_tokenizer()).describe()
    assert tokenize(a).describe() != tokenize(b).describe()


def test_a_tokenizer_returning_non_integers_is_an_error():
    with pytest.raises(OperatorError, match="not integer token ids"):
        tokenize(lambda s: [0.5], eos_id=0).process_many(text_records(["x"]))


def test_a_missing_text_field_names_the_record():
    recs = text_records(["x"])
    with pytest.raises(OperatorError, match=r"SampleCursor\(0, 0"):
        tokenize(field="body").process_many(recs)


def test_an_object_that_cannot_tokenize_is_rejected():
    with pytest.raises(TypeError, match="callable"):
        tokenize(object())


# ------------------------------------------------------------------------------------ splitting
def example_record(n_bytes: int) -> SampleRecord:
    """The example input: chunk 7, offset 2, sample (ds0, sh5, 42)."""
    meta = SampleMeta(SampleCursor(7, 2, (0, 5, 42)), lane_id=1, component="web")
    return SampleRecord(meta, {"text": "x" * n_bytes})


def test_splitting_matches_the_seed_page_diagram():
    # 11 bytes + eos = 12 tokens with max_len 4: three children (0,), (1,), (2,).
    out = tokenize(max_len=4, split_long_samples=True).process_many([example_record(11)])
    assert [r.meta.cursor for r in out] == [
        SampleCursor(7, 2, (0, 5, 42), (0,)),
        SampleCursor(7, 2, (0, 5, 42), (1,)),
        SampleCursor(7, 2, (0, 5, 42), (2,)),
    ]
    assert [r.meta.cursor.base_offset for r in out] == [(7, 2)] * 3
    assert [r.contribution_refs() for r in out] == [
        (ContributorRef(r.meta.cursor, i == 2),) for i, r in enumerate(out)
    ]
    assert [r.payload["tokens"].tolist() for r in out] == [
        [120] * 4,
        [120] * 4,
        [120, 120, 120, 256],
    ]
    assert all(r.meta.lane_id == 1 for r in out)


def test_child_i_holds_tokens_i_times_max_len_onwards_and_counts_its_own_tokens():
    out = tokenize(max_len=5, split_long_samples=True).process_many([example_record(11)])
    assert [len(r.payload["tokens"]) for r in out] == [5, 5, 2]  # ceil(12 / 5) children
    assert [r.meta.component_token_counts for r in out] == [{"web": 5}, {"web": 5}, {"web": 2}]
    assert [r.meta.component_sample_counts for r in out] == [{"web": 1}] * 3
    assert np.concatenate([r.payload["tokens"] for r in out]).tolist() == [120] * 11 + [256]


def test_a_record_that_fits_is_not_split():
    rec = example_record(3)
    (out,) = tokenize(max_len=4, split_long_samples=True).process_many([rec])
    assert out.meta.cursor == rec.meta.cursor
    assert out.meta.contributors is None


def test_without_splitting_long_sequences_are_truncated():
    rec = example_record(11)
    (out,) = tokenize(max_len=4).process_many([rec])
    assert out.payload["tokens"].tolist() == [120] * 4
    assert out.meta.cursor == rec.meta.cursor
    assert out.meta.component_token_counts == {"web": 4}


def test_splitting_needs_max_len():
    with pytest.raises(ValueError, match="max_len"):
        tokenize(split_long_samples=True)
    with pytest.raises(ValueError, match="max_len"):
        tokenize(max_len=0)


def test_traits_order_preserving_stateless_and_indexable_only_when_1_to_1():
    for op in (tokenize(), tokenize(max_len=3)):
        assert op.traits.preserves_cursor_order and not op.traits.stateful
        assert op.traits.preserves_indexability
    split = tokenize(max_len=3, split_long_samples=True, workers=2)
    assert split.traits.preserves_cursor_order and not split.traits.stateful
    assert not split.traits.preserves_indexability
    assert split.traits.workers == 2


@pytest.mark.parametrize(
    "op",
    [
        tokenize(),
        tokenize(max_len=3),
        tokenize(max_len=3, split_long_samples=True),
        tokenize(word_lengths, max_len=2, split_long_samples=True, append_eos=False),
    ],
    ids=["plain", "truncate", "split", "callable-split"],
)
def test_check_operator_passes(op):
    texts = ["", "a", "abcdefgh", "the quick brown fox", "héllo wörld"]
    check_operator(op, text_records(texts, chunk_id=3), lane_id=0)


def test_copies_of_the_operator_share_a_hugging_face_tokenizer_and_copy_any_other():
    # Each lane runs a copy of the operator. A Hugging Face Tokenizer does not change when it
    # encodes, so the copies share it (copying would re-parse its vocabulary per lane); a
    # tokenizer that may keep state is copied with the operator.
    import copy

    hf = tokenize(bpe_tokenizer())
    twin = copy.deepcopy(hf)
    assert twin.tokenizer is hf.tokenizer
    assert twin is not hf and twin.traits == hf.traits and twin.name == hf.name
    texts = text_records(["the lazy fox", "dog " * 9])
    for a, b in zip(twin.process_many(texts), hf.process_many(texts), strict=True):
        np.testing.assert_array_equal(a.payload["tokens"], b.payload["tokens"])
    transformers = pytest.importorskip("transformers")
    transformers_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe_tokenizer(), eos_token="[EOS]"
    )
    for op in (tokenize(ByteTokenizer()), tokenize(transformers_tok)):
        assert copy.deepcopy(op).tokenizer is not op.tokenizer


def test_the_vocabulary_digest_in_the_fingerprint_is_the_one_checkpoints_stored():
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    expected = hashlib.sha256(tok.to_str().encode("utf-8")).hexdigest()
    params = tokenize(tok, append_eos=False).describe()["params"]
    # the digest checkpoints have always stored, taken from the tokenizer's own identity
    assert params["tokenizer_digest"] == params["tokenizer"]["sha256"] == expected
    assert "tokenizer_digest" not in tokenize().describe()["params"]  # no to_str(): none
