"""``tokenize_chat``: tokens and a loss mask that is 1 exactly on the trained roles' content and
end-of-turn tokens, checked against a message-by-message reference (tests/chat_kit.py) for both
kinds of template, through packing with splits and wraps, truncation and splitting by turn."""

from __future__ import annotations

import copy
import json
import pickle
from collections import Counter
from typing import Any

import numpy as np
import pytest
from chat_kit import (
    BOS,
    EOT,
    HEADERS,
    JINJA,
    OURS,
    PAD,
    ROLES,
    as_lists,
    bpe,
    chat_records,
    conversations,
    fast_tokenizer,
    reference,
    spelled_conversations,
    spelled_reference,
    token_id,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, trainers

import zephon
from zephon.errors import OperatorError, PlanError
from zephon.ops import ByteTokenizer, ChatTemplate, fetch, pack_flat, pack_sequences, tokenize_chat
from zephon.sources.memory import ListSource
from zephon.testing import check_operator

train_ons = st.lists(st.sampled_from(ROLES), min_size=1, max_size=3, unique=True).map(tuple)


def chat_op(kind: str, **kw: Any) -> Any:
    if kind == "ours":
        return tokenize_chat(bpe(), template=OURS, **kw)
    return tokenize_chat(fast_tokenizer(), **kw)


@pytest.mark.parametrize("kind", ["ours", "jinja"])
@settings(max_examples=60)
@given(convs=st.lists(conversations, min_size=1, max_size=4), train_on=train_ons)
def test_the_mask_is_one_exactly_on_trained_content_and_end_of_turn(kind, convs, train_on):
    out = chat_op(kind, train_on=train_on).process_many(chat_records(convs))
    assert len(out) == len(convs)
    for i, (rec, conv) in enumerate(zip(out, convs)):
        assert as_lists(rec) == reference(kind, conv, train_on)
        assert rec.payload["messages"] == conv and rec.payload["id"] == i
        assert rec.meta.component_token_counts == {"chat": len(rec.payload["tokens"])}


def test_the_payloads_other_fields_are_kept():
    (rec,) = chat_op("ours").process_many(chat_records([[{"role": "user", "content": "hi"}]]))
    assert rec.payload["id"] == 0 and rec.payload["messages"][0]["content"] == "hi"


def test_both_templates_of_the_same_format_give_the_same_tokens_and_mask():
    conv = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello world"},
        {"role": "assistant", "content": " I am fine, thanks!"},
    ]
    (ours,) = chat_op("ours").process_many(chat_records([conv]))
    (theirs,) = chat_op("jinja").process_many(chat_records([conv]))
    assert as_lists(ours) == as_lists(theirs)
    tok = bpe()
    trained = [t for t, m in zip(*as_lists(ours)) if m]
    assert tok.decode(trained[:-1]) == " I am fine, thanks!"
    assert tok.id_to_token(trained[-1]) == EOT


# ------------------------------------------------------------------ content spelling special tokens
INJECTED = [
    {"role": "user", "content": "u1 <|assistant|> u1"},
    {"role": "assistant", "content": "a1 <|end|> a1"},
]


@pytest.mark.parametrize("kind", ["ours", "jinja"])
def test_special_token_strings_in_content_are_plain_text_by_default(kind):
    (rec,) = chat_op(kind).process_many(chat_records([INJECTED]))
    tokens, mask = as_lists(rec)
    assert (tokens, mask) == spelled_reference(INJECTED, ("assistant",), "text")
    # Exactly one end of turn per message and one assistant header: none comes from content.
    assert tokens.count(token_id(EOT)) == 2
    assert tokens.count(token_id(HEADERS["assistant"])) == 1
    trained = [t for t, m in zip(tokens, mask) if m]
    assert bpe().decode(trained[:-1]) == "a1 <|end|> a1" and trained[-1] == token_id(EOT)


@pytest.mark.parametrize("kind", ["ours", "jinja"])
def test_content_specials_special_keeps_them_special_tokens(kind):
    (rec,) = chat_op(kind, content_specials="special").process_many(chat_records([INJECTED]))
    tokens, mask = as_lists(rec)
    assert (tokens, mask) == spelled_reference(INJECTED, ("assistant",), "special")
    assert tokens.count(token_id(EOT)) == 3
    text_mask = as_lists(chat_op(kind).process_many(chat_records([INJECTED]))[0])[1]
    assert sum(mask) == 7 and sum(text_mask) == 12  # "<|end|>" is 1 token, or 6 of text


@pytest.mark.parametrize("kind", ["ours", "jinja"])
@pytest.mark.parametrize("content_specials", ["text", "special"])
@settings(max_examples=40)
@given(
    convs=st.lists(spelled_conversations, min_size=1, max_size=3),
    train_on=st.lists(st.sampled_from(ROLES), min_size=1, max_size=3, unique=True).map(tuple),
)
def test_the_mask_is_exact_whatever_the_content_spells(kind, content_specials, convs, train_on):
    op = chat_op(kind, train_on=train_on, content_specials=content_specials)
    out = op.process_many(chat_records(convs))
    for rec, conv in zip(out, convs, strict=True):
        assert as_lists(rec) == spelled_reference(conv, train_on, content_specials)


def test_content_is_encoded_as_the_tokenizer_encodes_it_where_it_stands_in_the_text():
    # Metaspace(prepend_scheme="first") marks the first word of the text only, not the first word
    # after a special token: content re-encoded alone must not gain a marker. The reference is
    # the same tokenizer without "<|user|>" as an added token, on the whole text.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    specials = [BOS, HEADERS["assistant"], EOT, HEADERS["user"]]
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(["hello world, hello there"] * 10, trainer)
    config = json.loads(tok.to_str())
    config["added_tokens"] = [t for t in config["added_tokens"] if t["content"] != HEADERS["user"]]
    without = Tokenizer.from_str(json.dumps(config))
    template = ChatTemplate(roles={"assistant": HEADERS["assistant"]}, end_of_turn=EOT, bos=BOS)
    conv = [{"role": "assistant", "content": "hello <|user|> world"}]
    (rec,) = tokenize_chat(tok, template=template).process_many(chat_records([conv]))
    text, ((lo, hi),) = template.render(conv)
    expected = without.encode(text, add_special_tokens=False)
    assert not expected.tokens[2].startswith("▁"), "the first content word has no marker here"
    mask = [
        int((lo <= s and e <= hi) or t == EOT)
        for (s, e), t in zip(expected.offsets, expected.tokens)
    ]
    assert as_lists(rec) == (expected.ids, mask)


def test_a_special_token_matched_in_normalized_text_is_found_too():
    # "<|end|>" matched after lowercasing: the content "<|END|>" spells it without holding it.
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=[BOS, HEADERS["assistant"]], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(["hello world"] * 5, trainer)
    tok.add_special_tokens([AddedToken(EOT, special=True, normalized=True)])
    content = "a1 <|END|> a1"
    assert EOT in tok.encode(content, add_special_tokens=False).tokens
    template = ChatTemplate(roles={"assistant": HEADERS["assistant"]}, end_of_turn=EOT, bos=BOS)
    conv = [{"role": "assistant", "content": content}]
    (rec,) = tokenize_chat(tok, template=template).process_many(chat_records([conv]))
    plain = Tokenizer.from_str(tok.to_str())
    plain.encode_special_tokens = True
    text_ids = plain.encode(content, add_special_tokens=False).ids
    eot, header, bos = (tok.token_to_id(t) for t in (EOT, HEADERS["assistant"], BOS))
    assert as_lists(rec) == ([bos, header, *text_ids, eot], [0, 0] + [1] * (len(text_ids) + 1))


def test_content_specials_is_checked_and_part_of_the_identity():
    for bad, error in (("plain", ValueError), ("", ValueError), (None, TypeError), (1, TypeError)):
        with pytest.raises(error, match=r"content_specials must be 'text' or 'special'"):
            chat_op("ours", content_specials=bad)
    text, special = (
        chat_op("jinja").describe(),
        chat_op("jinja", content_specials="special").describe(),
    )
    assert text["params"]["content_specials"] == "text"
    assert special["params"]["content_specials"] == "special" and text != special


def test_plain_text_encoding_survives_pickling_for_worker_processes():
    op = chat_op("jinja")
    (before,) = op.process_many(chat_records([INJECTED]))
    again = pickle.loads(pickle.dumps(op))
    (after,) = again.process_many(chat_records([INJECTED]))
    assert as_lists(after) == as_lists(before)


# ------------------------------------------------------------------------------ through packing
def origin_field(records: list[Any]) -> list[Any]:
    """Each token's origin (record * 4096 + position) as a side field, to find it after packing."""
    out = []
    for i, r in enumerate(records):
        origin = (i * 4096 + np.arange(len(r.payload["tokens"]))).astype(np.int32)
        out.append(r.with_payload({**r.payload, "origin": origin}))
    return out


@settings(max_examples=40)
@given(
    convs=st.lists(conversations, min_size=1, max_size=6),
    kind=st.sampled_from(["ours", "jinja"]),
    packer=st.sampled_from(["best_fit", "first_fit", "flat"]),
    seq_len=st.integers(4, 48),
    split=st.sampled_from([None, 12, 40]),
)
def test_packed_rows_keep_the_mask_exact_across_splits_and_wraps(
    convs, kind, packer, seq_len, split
):
    sides = {"loss_mask": -1, "origin": -1}
    op = chat_op(kind, max_len=split, split_long_samples=split is not None)
    records = origin_field(op.process_many(chat_records(convs)))
    pack = (
        pack_flat(seq_len, pad_id=0, extra_fields=sides)
        if packer == "flat"
        else pack_sequences(seq_len, open_bins=3, strategy=packer, pad_id=0, extra_fields=sides)
    )
    pack.start_epoch(0, 0)
    rows = pack.process_many(records) + pack.flush()
    # Every token of every (split) record lands in some row with its own mask value.
    expected = {}
    for i, rec in enumerate(records):
        for pos, (t, m) in enumerate(zip(*as_lists(rec))):
            expected[i * 4096 + pos] = (t, m)
    seen = {}
    for row in rows:
        p = row.payload
        real = p["segment_ids"] > 0
        assert (p["loss_mask"][~real] == -1).all()
        for o, t, m in zip(p["origin"][real], p["tokens"][real], p["loss_mask"][real]):
            seen[int(o)] = (int(t), int(m))
    assert seen == expected
    # And the records' masks, joined again per conversation, are the reference.
    for i, conv in enumerate(convs):
        parts = [r for r in records if r.meta.cursor.chunk_offset == i]
        tokens = [t for r in parts for t in as_lists(r)[0]]
        mask = [m for r in parts for m in as_lists(r)[1]]
        assert (tokens, mask) == reference(kind, conv, ("assistant",))


# ------------------------------------------------------------------------------ long conversations
LONG = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "hello world, how are you today?"},
    {"role": "assistant", "content": "I am fine, thanks! And you?"},
    {"role": "user", "content": "The quick brown fox jumps over the lazy dog."},
    {"role": "assistant", "content": "Packing puts several documents into one row."},
]


def test_max_len_truncates_tokens_and_mask_together():
    (whole,) = chat_op("ours").process_many(chat_records([LONG]))
    (cut,) = chat_op("ours", max_len=20).process_many(chat_records([LONG]))
    assert as_lists(cut) == tuple(x[:20] for x in as_lists(whole))
    assert cut.meta.cursor == whole.meta.cursor


def test_splitting_by_turn_cuts_after_end_of_turn_tokens_and_closes_once():
    (whole,) = chat_op("ours").process_many(chat_records([LONG]))
    tokens, mask = as_lists(whole)
    eot = bpe().token_to_id(EOT)
    turn_ends = [i + 1 for i, (t, m) in enumerate(zip(tokens, mask)) if t == eot and m]
    max_len = turn_ends[0] + 3  # the first turn fits, the two turns together do not
    children = chat_op("ours", max_len=max_len, split_long_samples=True).process_many(
        chat_records([LONG])
    )
    assert len(children) > 1
    assert [t for c in children for t in as_lists(c)[0]] == tokens
    assert [m for c in children for m in as_lists(c)[1]] == mask
    cuts = np.cumsum([len(c.payload["tokens"]) for c in children])[:-1].tolist()
    assert all(len(c.payload["tokens"]) <= max_len for c in children)
    assert set(cuts) <= set(turn_ends) | set(range(0, len(tokens), 1)) and cuts[0] == turn_ends[0]
    assert [c.meta.cursor.lineage for c in children] == [(i,) for i in range(len(children))]
    closing = [ref.is_last_child for c in children for ref in c.contribution_refs()]
    assert closing == [False] * (len(children) - 1) + [True]


@settings(max_examples=60)
@given(convs=st.lists(conversations, min_size=1, max_size=3), max_len=st.integers(1, 30))
def test_split_children_hold_whole_turns_unless_one_turn_is_longer_than_max_len(convs, max_len):
    op = chat_op("ours", max_len=max_len, split_long_samples=True)
    out = op.process_many(chat_records(convs))
    eot = bpe().token_to_id(EOT)
    for i, conv in enumerate(convs):
        children = [r for r in out if r.meta.cursor.chunk_offset == i]
        tokens, mask = reference("ours", conv, ("assistant",))
        assert [t for c in children for t in as_lists(c)[0]] == tokens
        assert [m for c in children for m in as_lists(c)[1]] == mask
        turn_ends = {k + 1 for k, (t, m) in enumerate(zip(tokens, mask)) if t == eot and m}
        at = 0
        for child in children:
            n = len(child.payload["tokens"])
            assert 1 <= n <= max_len or len(tokens) == 0
            at += n
            if at < len(tokens) and at not in turn_ends:
                # A cut inside a turn: only when the turn from the previous cut is too long.
                assert n == max_len
        flags = Counter(ref.is_last_child for c in children for ref in c.contribution_refs())
        assert flags[True] == 1


def test_check_operator_passes_for_both_ways_of_handling_long_conversations():
    check_operator(chat_op("ours", max_len=16), chat_records([LONG, LONG[:2], LONG[1:], []]))
    records = chat_records([LONG, LONG[:2], LONG[1:]])
    check_operator(chat_op("jinja", max_len=16, split_long_samples=True), records)


def test_an_empty_conversation_is_the_template_start_alone():
    (rec,) = chat_op("ours").process_many(chat_records([[]]))
    assert as_lists(rec) == ([bpe().token_to_id(BOS)], [0])


# ------------------------------------------------------------------------------ plan time
def test_the_tokenizers_pad_is_published_and_a_packer_must_carry_the_mask():
    source = ListSource([{"messages": LONG}] * 3, chunk_size=2)
    op = chat_op("jinja")
    assert op.pad_id == fast_tokenizer().pad_token_id
    with pytest.raises(PlanError, match=r"extra_fields=\{'loss_mask': 0\}"):
        zephon.Pipeline(source, [fetch(), op, pack_sequences(32)]).compile()
    pipeline = zephon.Pipeline(
        source, [fetch(), op, pack_sequences(32, extra_fields={"loss_mask": 0})]
    )
    rows = list(pipeline)
    pad = bpe().token_to_id(PAD)
    assert all((r.payload["tokens"][r.payload["segment_ids"] == 0] == pad).all() for r in rows)
    assert sum(int(r.payload["loss_mask"].sum()) for r in rows) == 3 * sum(
        reference("jinja", LONG, ("assistant",))[1]
    )


def test_a_packer_of_another_field_is_not_asked_to_carry_the_mask():
    source = ListSource([{"messages": LONG, "other": [1, 2]}], chunk_size=2)
    ops = [fetch(), chat_op("ours"), pack_flat(8, field="other", pad_id=0)]
    zephon.Pipeline(source, ops).compile()


def test_the_fingerprint_follows_the_chat_template():
    a = chat_op("jinja").describe()
    tok = copy.deepcopy(fast_tokenizer())
    tok.chat_template = JINJA.replace("\n", " ")
    b = tokenize_chat(tok).describe()
    assert a != b and a["params"]["chat_template"] == JINJA


def test_the_operator_pickles_for_worker_processes():
    op = pickle.loads(pickle.dumps(chat_op("jinja")))
    (rec,) = op.process_many(chat_records([LONG]))
    assert as_lists(rec) == reference("jinja", LONG, ("assistant",))


def plain_bpe(specials: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(["hello world"] * 5, trainer)
    return tok


def test_a_template_bos_the_tokenizer_does_not_hold_as_one_token_is_refused():
    # "<|begin_of_text|>" is not in bpe()'s vocabulary: every conversation would start with
    # its characters as ordinary tokens instead of a start-of-sequence token.
    template = ChatTemplate(roles=HEADERS, end_of_turn=EOT, bos="<|begin_of_text|>")
    with pytest.raises(PlanError, match=r"bos '<\|begin_of_text\|>' is \d+ tokens .*not one"):
        tokenize_chat(bpe(), template=template)
    # One token, or none at all, is a start the model can learn.
    header = token_id(HEADERS["assistant"])
    for bos, start in ((BOS, [token_id(BOS), header]), ("", [header])):
        op = tokenize_chat(bpe(), template=ChatTemplate(roles=HEADERS, end_of_turn=EOT, bos=bos))
        (rec,) = op.process_many(chat_records([[{"role": "assistant", "content": "hello"}]]))
        assert as_lists(rec)[0][: len(start)] == start


def test_refusals_at_construction():
    with pytest.raises(PlanError, match="no chat template of its own"):
        tokenize_chat(bpe())
    with pytest.raises(TypeError, match="needs token offsets"):
        tokenize_chat(ByteTokenizer(), template=OURS)
    with pytest.raises(PlanError, match="is 7 tokens for this tokenizer, not one"):
        tokenize_chat(plain_bpe([]), template=ChatTemplate(roles=HEADERS, end_of_turn="<|end|>"))
    with pytest.raises(ValueError, match="no header for"):
        tokenize_chat(bpe(), template=OURS, train_on=("tool",))
    with pytest.raises(ValueError, match="needs max_len"):
        tokenize_chat(bpe(), template=OURS, split_long_samples=True)
    with pytest.raises(ValueError, match="must differ"):
        tokenize_chat(bpe(), template=OURS, mask_field="tokens")
    padded = plain_bpe([EOT, PAD])
    padded.enable_padding(pad_id=1, pad_token=PAD)
    with pytest.raises(PlanError, match="padding enabled"):
        tokenize_chat(padded, template=ChatTemplate(roles=HEADERS, end_of_turn=EOT))
    truncating = plain_bpe([EOT])
    truncating.enable_truncation(8)
    with pytest.raises(PlanError, match="truncation enabled"):
        tokenize_chat(truncating, template=ChatTemplate(roles=HEADERS, end_of_turn=EOT))
    with pytest.raises(TypeError, match="roles must map"):
        ChatTemplate(roles={}, end_of_turn=EOT)


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ("hello", "must be a list"),
        ([{"role": "user"}], "message 0 needs a str 'role' and a str 'content'"),
        ([{"role": "user", "content": "a"}, "b"], "message 1 is str"),
        ([{"role": "tool", "content": "a"}], "role 'tool', which the template does not know"),
    ],
)
def test_a_malformed_conversation_names_the_record(messages, match):
    records = chat_records([messages])
    with pytest.raises(OperatorError, match=rf"sample_id.*{match}"):
        chat_op("ours").process_many(records)


def templated(template: str) -> Any:
    tok = copy.deepcopy(fast_tokenizer())
    tok.chat_template = template
    return tokenize_chat(tok)


def test_a_template_that_rewrites_content_is_refused_for_that_record():
    op = templated(JINJA.replace("m['content']", "m['content'] | trim"))
    (fine,) = op.process_many(chat_records([[{"role": "assistant", "content": "ok"}]]))
    assert as_lists(fine) == reference(
        "jinja", [{"role": "assistant", "content": "ok"}], ("assistant",)
    )
    with pytest.raises(OperatorError, match=r"changes message content.*\| trim"):
        op.process_many(chat_records([[{"role": "assistant", "content": " padded "}]]))


def test_a_template_that_repeats_or_drops_content_is_refused():
    twice = templated(JINJA.replace("{{ m['content'] }}", "{{ m['content'] }}{{ m['content'] }}"))
    with pytest.raises(OperatorError, match=r"message 0 .* 2 times, not once"):
        twice.process_many(chat_records([[{"role": "user", "content": "x"}]]))
    no_system = templated(
        "{{ bos_token }}{% for m in messages if m['role'] != 'system' %}"
        "<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    )
    with pytest.raises(OperatorError, match="0 times"):
        no_system.process_many(chat_records([[{"role": "system", "content": "x"}]]))


def test_a_template_without_an_end_of_turn_token_after_trained_content_is_refused():
    op = templated("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}")
    with pytest.raises(OperatorError, match="no special end-of-turn token"):
        op.process_many(chat_records([[{"role": "assistant", "content": "x"}]]))
    # Untrained roles need none.
    (rec,) = op.process_many(chat_records([[{"role": "user", "content": "x"}]]))
    assert not any(as_lists(rec)[1])


def test_a_token_spanning_header_and_content_is_not_trained_on():
    # A header without a special token: "hel" + content "lo world" renders "hello world", and
    # "hello" (a token of the vocabulary) is partly header.
    tok = bpe()
    template = ChatTemplate(roles={"assistant": "hel"}, end_of_turn=EOT, bos=BOS)
    conv = [{"role": "assistant", "content": "lo world"}]
    (rec,) = tokenize_chat(tok, template=template).process_many(chat_records([conv]))
    text, ((lo, hi),) = template.render(conv)
    enc = tok.encode(text, add_special_tokens=False)
    assert "hello" in enc.tokens, "the vocabulary lost the merge this test relies on"
    expected = [
        int((lo <= s and e <= hi and s < e) or token == EOT)
        for (s, e), token in zip(enc.offsets, enc.tokens)
    ]
    assert as_lists(rec) == (enc.ids, expected)
    assert expected[enc.tokens.index("hello")] == 0 and sum(expected) >= 2
