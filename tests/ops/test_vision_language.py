"""Vision-language data: conversations and image-text documents whose images become spans of
image tokens (tokenize_chat, tokenize_interleaved), packed rows that carry their images and never
cut a span (pack_sequences), and batches with pixel values (training_collate). Real images are
drawn with Pillow into Parquet, tokenized by a real BPE; resumes, re-lanings and worker kinds
deliver every image once, with bitwise equal pixels."""

from __future__ import annotations

import functools
import io
import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from chat_kit import BOS, EOT, HEADERS, OURS, chat_records, fast_tokenizer, vision_bpe
from hypothesis import given, settings
from hypothesis import strategies as st
from pipeline_kit import assert_resumes_at, run
from tokenizers import Tokenizer

import zephon
from zephon.errors import OperatorError, PlanError, RelaneWarning
from zephon.ops import (
    batch,
    decode_images,
    fetch,
    image_token_counter,
    pack_flat,
    pack_sequences,
    random_flip,
    random_resized_crop,
    resize_images,
    tokenize_chat,
    tokenize_interleaved,
    training_collate,
)
from zephon.sources import ArrowSource
from zephon.types import SampleCursor, SampleMeta, SampleRecord

Image = pytest.importorskip("PIL.Image")
ImageDraw = pytest.importorskip("PIL.ImageDraw")
pytestmark = pytest.mark.usefixtures("no_leftover_workers")

IMAGE, START, END = "<|image|>", "<|vision_start|>", "<|vision_end|>"
PATCH, MERGE = 4, 2


def tid(token: str) -> int:
    found = vision_bpe().token_to_id(token)
    assert found is not None
    return found


def image_kw(**kw: Any) -> dict[str, Any]:
    return {
        "image_token_id": tid(IMAGE),
        "image_start_id": tid(START),
        "image_end_id": tid(END),
        "patch_size": PATCH,
        "merge": MERGE,
        **kw,
    }


def n_tokens(image: np.ndarray) -> int:
    h, w = image.shape[:2]
    return -(-h // (PATCH * MERGE)) * -(-w // (PATCH * MERGE))


def span(image: np.ndarray) -> list[int]:
    return [tid(START), *[tid(IMAGE)] * n_tokens(image), tid(END)]


def reference(conv: list[dict[str, Any]], images: list[np.ndarray]) -> tuple[list[int], list[int]]:
    """(tokens, loss mask) in the format of ``OURS``, message by message and part by part: text
    parts encoded on their own and trained on for the assistant, each image its span, never."""
    tok = vision_bpe()
    tokens, mask = [tid(BOS)], [0]
    pictures = iter(images)
    for message in conv:
        trained = int(message["role"] == "assistant")
        tokens.append(tid(HEADERS[message["role"]]))
        mask.append(0)
        for part in message["content"]:
            if part["type"] == "image":
                ids = span(next(pictures))
                tokens += ids
                mask += [0] * len(ids)
            else:
                ids = tok.encode(part["text"], add_special_tokens=False).ids
                tokens += ids
                mask += [trained] * len(ids)
        tokens += [tid(EOT), *tok.encode("\n", add_special_tokens=False).ids]
        mask += [trained, 0]
    return tokens, mask


def picture(i: int, k: int = 0, size: tuple[int, int] | None = None) -> np.ndarray:
    """A drawn RGB picture that differs per (i, k)."""
    w, h = size or (8 + (i * 7 + k * 5) % 30, 8 + (i * 11 + k * 3) % 20)
    image = Image.new("RGB", (w, h), ((i * 37) % 256, (k * 91) % 256, (i * 53) % 256))
    draw = ImageDraw.Draw(image)
    draw.rectangle([i % 5, k % 4, w // 2, h // 2], fill=(255 - i % 256, 20, 200))
    return np.asarray(image)


WORDS = ["what", "is", "in", "the", "picture", "a", "fox", "and", "dog", "jumps", "over"]
WORDS += ["lazy", "brown", "quick", "hello", "world"]


def conversation(rng: random.Random, images: int) -> list[dict[str, Any]]:
    """A user turn with ``images`` images and a question, an assistant turn that may hold an
    image too (the last one), and sometimes a second exchange."""

    def text() -> dict[str, str]:
        return {
            "type": "text",
            "text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6))),
        }

    user = [{"type": "image"} for _ in range(images - (images > 1))] + [text()]
    answer = [text(), *([{"type": "image"}, text()] if images > 1 else [])]
    out = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    if rng.random() < 0.5:
        out += [{"role": "user", "content": [text()]}, {"role": "assistant", "content": [text()]}]
    return out


def records_of(convs: list[list[dict]], images: list[list[np.ndarray]]) -> list[SampleRecord]:
    return [
        SampleRecord(r.meta, {**r.payload, "images": pics})
        for r, pics in zip(chat_records(convs), images)
    ]


# ------------------------------------------------------------------------------- tokenization
def test_each_image_becomes_its_span_and_the_mask_stays_on_assistant_text() -> None:
    rng = random.Random(0)
    convs = [conversation(rng, 1 + i % 3) for i in range(12)]
    pics = [[picture(i, k) for k in range(1 + i % 3)] for i in range(12)]
    op = tokenize_chat(vision_bpe(), template=OURS, **image_kw())
    for rec, conv, images in zip(op.process_many(records_of(convs, pics)), convs, pics):
        tokens, mask = reference(conv, images)
        assert rec.payload["tokens"].tolist() == tokens
        assert rec.payload["loss_mask"].tolist() == mask
        spans = rec.payload["image_spans"].tolist()
        assert [tokens[lo:hi] for lo, hi in spans] == [span(p) for p in images]
        grids = rec.payload["image_grid_thw"].tolist()
        for (t, gh, gw), image in zip(grids, images):
            assert t == 1 and gh * gw // MERGE**2 == n_tokens(image)
        # image tokens count: what a mixture by tokens balances is what the model sees
        assert rec.meta.component_token_counts == {"chat": len(tokens)}


def test_the_tokenizers_own_template_places_images_like_ours() -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=vision_bpe(), bos_token=BOS, eos_token=EOT, pad_token="<pad>"
    )
    fast.chat_template = fast_tokenizer().chat_template
    rng = random.Random(1)
    convs = [conversation(rng, 2) for _ in range(4)]
    pics = [[picture(i, 0), picture(i, 1)] for i in range(4)]
    ours = tokenize_chat(vision_bpe(), template=OURS, **image_kw()).process_many(
        records_of(convs, pics)
    )
    theirs = tokenize_chat(fast, **image_kw()).process_many(records_of(convs, pics))
    for a, b in zip(ours, theirs):
        for field in ("tokens", "loss_mask", "image_spans", "image_grid_thw"):
            assert np.array_equal(a.payload[field], b.payload[field]), field


def test_a_user_typing_the_image_token_gets_text_not_an_image() -> None:
    conv = [
        {"role": "user", "content": [{"type": "text", "text": f"see {IMAGE} here"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "no"}]},
    ]
    (rec,) = tokenize_chat(vision_bpe(), template=OURS, **image_kw()).process_many(
        records_of([conv], [[]])
    )
    assert tid(IMAGE) not in rec.payload["tokens"].tolist()
    assert rec.payload["image_spans"].shape == (0, 2)


def test_interleaved_documents_tokenize_text_on_its_own_and_images_as_spans() -> None:
    tok = vision_bpe()
    images = [picture(3, 0), picture(3, 1)]
    items = ["a quick fox", None, "jumps over", {"type": "image"}, {"type": "text", "text": "!"}]
    rec = SampleRecord(
        SampleMeta(SampleCursor(0, 0, (0, 0, 0)), component="docs"),
        {"content": items, "images": images},
    )
    op = tokenize_interleaved(tok, eos_id=tid(EOT), **image_kw())
    (out,) = op.process_many([rec])
    enc = [tok.encode(t, add_special_tokens=False).ids for t in ("a quick fox", "jumps over", "!")]
    expected = [*enc[0], *span(images[0]), *enc[1], *span(images[1]), *enc[2], tid(EOT)]
    assert out.payload["tokens"].tolist() == expected
    in_span = np.zeros(len(expected), dtype=bool)
    for lo, hi in out.payload["image_spans"].tolist():
        in_span[lo:hi] = True
    assert out.payload["loss_mask"].tolist() == (~in_span).astype(int).tolist()
    assert out.meta.component_token_counts == {"docs": len(expected)}


def test_a_user_function_counts_the_tokens_of_an_image() -> None:
    rec = SampleRecord(
        SampleMeta(SampleCursor(0, 0, (0, 0, 0))),
        {"content": [None, "x"], "images": picture(1, size=(20, 10))},
    )
    op = tokenize_interleaved(
        vision_bpe(), image_token_id=tid(IMAGE), image_tokens=lambda h, w: h + w, append_eos=False
    )
    (out,) = op.process_many([rec])
    assert out.payload["image_spans"].tolist() == [[0, 30]]
    assert "image_grid_thw" not in out.payload


def test_images_and_their_items_must_agree_and_the_image_id_is_never_guessed() -> None:
    rng = random.Random(2)
    op = tokenize_chat(vision_bpe(), template=OURS, **image_kw())
    with pytest.raises(OperatorError, match=r"2 image\(s\) but field 'images' holds 1"):
        op.process_many(records_of([conversation(rng, 2)], [[picture(0)]]))
    text_only = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    with pytest.raises(OperatorError, match=r"places 0 image\(s\) but field 'images' holds 1"):
        op.process_many(records_of([text_only], [[picture(0)]]))  # it would be dropped
    with pytest.raises(OperatorError, match="pass image_token_id="):
        tokenize_chat(vision_bpe(), template=OURS).process_many(
            records_of([conversation(rng, 1)], [[picture(0)]])
        )
    with pytest.raises(ValueError, match="need image_token_id"):
        tokenize_chat(vision_bpe(), template=OURS, patch_size=14)
    with pytest.raises(PlanError, match="not a special token"):
        tokenize_chat(vision_bpe(), template=OURS, **image_kw(image_token_id=40))
    with pytest.raises(ValueError, match="max_len cannot be combined with images"):
        tokenize_chat(vision_bpe(), template=OURS, max_len=64, **image_kw())
    with pytest.raises(ValueError, match=r"patch_size= .* or image_tokens="):
        tokenize_interleaved(vision_bpe(), image_token_id=tid(IMAGE))


@pytest.mark.parametrize("kind", ["tokenizers", "transformers"])
def test_a_document_spelling_a_special_token_gets_text_not_the_token(kind: str) -> None:
    # A scraped page may spell "<|image|>" or "<|end|>": an image token without its image, or an
    # end of document in the middle of one, would reach the model.
    from transformers import PreTrainedTokenizerFast

    tok: Any = vision_bpe()
    if kind == "transformers":
        tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT, pad_token="<pad>")
    text = f"a page on {IMAGE} and {EOT} tokens"
    plain = Tokenizer.from_str(vision_bpe().to_str())
    plain.encode_special_tokens = True
    spelled = plain.encode(text, add_special_tokens=False).ids
    assert tid(IMAGE) not in spelled and tid(EOT) not in spelled
    rec = SampleRecord(
        SampleMeta(SampleCursor(0, 0, (0, 0, 0))),
        {"content": [text, None, "fox"], "images": [picture(0)]},
    )
    (out,) = tokenize_interleaved(tok, eos_id=tid(EOT), **image_kw()).process_many([rec])
    fox = vision_bpe().encode("fox", add_special_tokens=False).ids
    assert out.payload["tokens"].tolist() == [*spelled, *span(picture(0)), *fox, tid(EOT)]


def test_a_text_item_without_its_text_is_an_error_not_an_image() -> None:
    # Read as an image, it would take the next picture, and the pictures after it would shift.
    op = tokenize_interleaved(vision_bpe(), eos_id=tid(EOT), **image_kw())
    for item in ({"type": "text", "text": None}, {"type": "text"}):
        rec = SampleRecord(
            SampleMeta(SampleCursor(0, 0, (0, 0, 0))),
            {"content": ["a fox", item, None], "images": [picture(0), picture(1)]},
        )
        with pytest.raises(OperatorError, match=r"item 1 of field 'content' is a text item"):
            op.process_many([rec])


def test_a_tokenizer_that_truncates_is_refused_for_interleaved_documents() -> None:
    tok = Tokenizer.from_str(vision_bpe().to_str())  # a copy: vision_bpe() is shared
    tok.enable_truncation(max_length=8)
    with pytest.raises(PlanError, match=r"tokenize_interleaved: .*truncation enabled"):
        tokenize_interleaved(tok, eos_id=tid(EOT), **image_kw())


# ------------------------------------------------------------------------------- packing
def interleaved_records(lengths: list[tuple[int, ...]]) -> list[SampleRecord]:
    """Documents of text runs and images: ``(text, image_tokens, text, image_tokens, ...)``,
    text tokens numbered by document; each image's pixels hold (document, index)."""
    out = []
    for i, parts in enumerate(lengths):
        tokens: list[int] = []
        spans: list[tuple[int, int]] = []
        images: list[np.ndarray] = []
        for k, n in enumerate(parts):
            if k % 2:
                spans.append((len(tokens), len(tokens) + n + 2))
                tokens += [tid(START), *[tid(IMAGE)] * n, tid(END)]
                images.append(np.full((2, 2, 3), (i % 256, i // 256, len(images)), np.uint8))
            else:
                tokens += [1000 + i] * n
        payload = {
            "tokens": np.array(tokens, dtype=np.int32),
            "loss_mask": np.ones(len(tokens), dtype=np.int32),
            "image_spans": np.array(spans, dtype=np.int32).reshape(-1, 2),
            "images": images,
        }
        out.append(SampleRecord(SampleMeta(SampleCursor(0, i, (0, 0, i))), payload))
    return out


def check_rows(rows: list[SampleRecord], records: list[SampleRecord], seq_len: int) -> None:
    """Every image arrives once, in a row holding its whole span, at the span's row position."""
    seen = []
    for row in rows:
        tokens = row.payload["tokens"]
        assert len(tokens) == seq_len
        spans = row.payload["image_spans"].tolist()
        assert len(spans) == len(row.payload["images"]) == len(row.payload["image_sources"])
        covered = np.zeros(seq_len, dtype=bool)
        for (lo, hi), image, (segment, k) in zip(
            spans, row.payload["images"], row.payload["image_sources"].tolist()
        ):
            n_image = hi - lo - 2
            assert tokens[lo:hi].tolist() == [tid(START), *[tid(IMAGE)] * n_image, tid(END)]
            assert set(row.payload["segment_ids"][lo:hi].tolist()) == {segment}
            assert image[0, 0, 2] == k
            covered[lo:hi] = True
            seen.append(tuple(image[0, 0].tolist()))
        image_ids = np.isin(tokens, [tid(START), tid(IMAGE), tid(END)])
        assert not np.any(image_ids & ~covered), "an image token outside a whole span"
    expected = [tuple(image[0, 0].tolist()) for rec in records for image in rec.payload["images"]]
    assert Counter(seen) == Counter(expected)


def packed(records: list[SampleRecord], seq_len: int, **kw: Any) -> list[SampleRecord]:
    packer = pack_sequences(seq_len, pad_id=0, extra_fields={"loss_mask": 0}, images="images", **kw)
    out: list[SampleRecord] = []
    for at in range(0, len(records), 5):
        out += packer.process_many(records[at : at + 5])
    return out + packer.flush()


documents = st.lists(
    st.lists(st.integers(0, 9), min_size=1, max_size=7).map(tuple), min_size=1, max_size=30
)


@settings(max_examples=150, deadline=None)
@given(
    lengths=documents,
    seq_len=st.integers(12, 40),
    cut=st.booleans(),
    strategy=st.sampled_from(["best_fit", "first_fit"]),
    open_bins=st.integers(1, 4),
)
def test_packed_rows_never_cut_an_image_span_and_carry_each_image_once(
    lengths: list[tuple[int, ...]], seq_len: int, cut: bool, strategy: str, open_bins: int
) -> None:
    records = interleaved_records(lengths)
    rows = packed(records, seq_len, cut_to_fill=cut, strategy=strategy, open_bins=open_bins)
    check_rows(rows, records, seq_len)
    # and no token is lost or doubled
    got = Counter(t for row in rows for t in row.payload["tokens"][row.payload["segment_ids"] > 0])
    assert got == Counter(t for rec in records for t in rec.payload["tokens"].tolist())


def test_a_long_document_is_cut_before_the_span_a_row_would_split() -> None:
    (rec,) = interleaved_records([(6, 6, 2)])  # 6 text, [START, 6 images, END], 2 text: 16
    rows = packed([rec], 10)
    assert [row.payload["segment_ids"].tolist().count(1) for row in rows] == [6, 10]
    check_rows(rows, [rec], 10)


def test_an_image_span_longer_than_a_row_is_an_error_naming_the_sample() -> None:
    (rec,) = interleaved_records([(2, 12, 1)])
    with pytest.raises(OperatorError, match=r"sample_id=.*image span \[2, 16\) is 14 tokens"):
        packed([rec], 10)


def test_images_without_their_spans_are_an_error_not_dropped() -> None:
    (rec,) = interleaved_records([(3, 2, 1)])
    lost = SampleRecord(rec.meta, {**rec.payload, "image_spans": np.empty((0, 2), np.int32)})
    with pytest.raises(OperatorError, match="holds 0 spans and field 'images' 1 images"):
        packed([lost], 16)


def test_packers_that_would_drop_or_cut_images_are_refused_at_plan_time() -> None:
    source = zephon.sources.ListSource([{"content": ["x"], "images": []}])
    make = functools.partial(tokenize_interleaved, vision_bpe(), eos_id=tid(EOT), **image_kw())
    for packer, hint in (
        (pack_sequences(32, extra_fields={"loss_mask": 0}), "pass images='images'"),
        (pack_flat(32, extra_fields={"loss_mask": 0}), r"use pack_sequences\(\.\.\., images="),
    ):
        with pytest.raises(PlanError, match=hint):
            zephon.Pipeline(source, [fetch(), make(), packer]).compile()
    with pytest.raises(ValueError, match="takes no images"):
        pack_sequences(32, strategy="wrap", images="images")


# ------------------------------------------------------------------------------- collate
def test_collate_stacks_equal_images_and_never_trains_on_a_span() -> None:
    records = interleaved_records([(3, 2, 3), (4,), (1, 1, 1, 3, 1)])
    rows = packed(records, 12, open_bins=1)
    out = training_collate(mask_field=None, images="images")(rows)
    images = [image for row in rows for image in row.payload["images"]]
    assert out["pixel_values"].shape == (len(images), 2, 2, 3)
    assert np.array_equal(out["pixel_values"], np.stack(images))
    assert out["image_sizes"].tolist() == [[2, 2]] * len(images)
    assert out["image_to_row"].tolist() == [
        r for r, row in enumerate(rows) for _ in row.payload["images"]
    ]
    targets = out["input_ids"][:, 1:][out["labels"][:, :-1] != -100]
    assert not np.isin(targets, [tid(START), tid(IMAGE), tid(END)]).any()
    assert out["num_valid_tokens"] > 0


def test_collate_flattens_images_of_different_sizes_in_order() -> None:
    a, b = picture(0, size=(8, 8)), picture(1, size=(12, 8))
    rows = [
        SampleRecord(
            SampleMeta(SampleCursor(0, r, (0, 0, r))),
            {
                "tokens": np.zeros(4, np.int32),
                "segment_ids": np.ones(4, np.int32),
                "positions": np.arange(4, dtype=np.int32),
                "images": [image],
                "image_spans": np.array([[1, 3]], np.int32),
                "image_grid_thw": np.array([[1, 2, 3]], np.int32),
            },
        )
        for r, image in enumerate((a, b))
    ]
    out = training_collate(mask_field=None, images="images")(rows)
    assert np.array_equal(out["pixel_values"], np.concatenate([a.ravel(), b.ravel()]))
    assert out["image_sizes"].tolist() == [[8, 8], [8, 12]]
    assert out["image_grid_thw"].tolist() == [[1, 2, 3], [1, 2, 3]]
    # labels[t] is token t + 1: tokens 1 and 2 are the span, token 3 is text
    assert out["labels"][:, :3].tolist() == [[-100, -100, 0]] * 2


# ------------------------------------------------------------------------------- pipelines
def encoded(image: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def chats(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """120 conversations with 1-3 drawn images each, in Parquet."""
    rng = random.Random(5)
    convs = [conversation(rng, 1 + i % 3) for i in range(120)]
    table = pa.table(
        {
            "id": list(range(120)),
            "messages": [json.dumps(c) for c in convs],
            "images": [[encoded(picture(i, k)) for k in range(1 + i % 3)] for i in range(120)],
        }
    )
    path = tmp_path_factory.mktemp("vlm") / "chats.parquet"
    pq.write_table(table, path, row_group_size=20)
    return path


def parsed(payload: dict) -> dict:
    return {**payload, "messages": json.loads(payload["messages"])}


def vlm(path: Path, *, collate: bool = True, **kw: Any) -> zephon.Pipeline:
    ops = [
        fetch(),
        zephon.ops.map_transform(parsed),
        decode_images("images"),
        resize_images(12, max_size=24, field="images"),
        random_resized_crop(16, scale=(0.5, 1.0), seed=3, field="images"),
        random_flip(seed=3, field="images"),
        tokenize_chat(vision_bpe(), template=OURS, **image_kw()),
        pack_sequences(
            64, open_bins=3, extra_fields={"loss_mask": 0}, images="images", cut_to_fill=True
        ),
        batch(2, collate=training_collate(images="images") if collate else None),
    ]
    source = ArrowSource([str(path)], chunk_size=8, shuffle=True, seed=2)
    return zephon.Pipeline(source, ops, **{"lanes": 2, "epoch_chunks": 2, "micro_batch": 4, **kw})


def test_a_resumed_run_continues_with_bitwise_equal_pixels(chats: Path) -> None:
    pipeline = vlm(chats)
    full = run(iter(pipeline))
    assert len(full) > 10
    assert_resumes_at(pipeline, [1, len(full) // 2, len(full) - 1], full)


def test_the_stream_is_the_same_on_inline_thread_and_process_lanes(chats: Path) -> None:
    full = run(iter(vlm(chats)))
    for workers in ("thread", "process"):
        with iter(vlm(chats, workers=workers)) as loader:
            assert run(loader) == full, workers


def images_of(item: Any) -> list[tuple[Any, int]]:
    """(sample, image index) of every image in a batch of packed rows: a row's contributors are
    its fragments' inputs in segment order (one each: tokenize_chat emits one record per
    conversation)."""
    return [
        (row.meta.contributors[segment - 1].cursor.sample_id, k)
        for row in item
        for segment, k in row.payload["image_sources"].tolist()
    ]


def every_image(pipeline: zephon.Pipeline, state: dict | None = None) -> list[tuple[int, int]]:
    with pipeline.iter(state=state) as loader:
        return [image for item in loader for image in images_of(item)]


@pytest.mark.parametrize(("old", "new"), [(2, 3), (4, 1)])
def test_every_image_arrives_exactly_once_across_a_relaning(
    chats: Path, old: int, new: int
) -> None:
    expected = Counter(every_image(vlm(chats, lanes=old, collate=False)))
    assert sum(expected.values()) == len(expected) == 240  # 1, 2 or 3 images per conversation
    loader = iter(vlm(chats, lanes=old, collate=False))
    before = [image for _ in range(5) for image in images_of(next(loader))]
    state = json.loads(json.dumps(loader.state_dict()))
    loader.close()
    with pytest.warns(RelaneWarning):
        after = every_image(vlm(chats, lanes=new, collate=False), state)
    assert Counter(before) + Counter(after) == expected


def test_every_image_arrives_exactly_once_after_an_elastic_resume(chats: Path) -> None:
    expected = Counter(every_image(vlm(chats, lanes=4, collate=False)))
    assert sum(expected.values()) == len(expected) == 240
    before, states = [], []
    for rank in range(2):
        loader = iter(vlm(chats, lanes=4, collate=False, rank=rank, world_size=2))
        before += [image for _ in range(4) for image in images_of(next(loader))]  # 2 steps
        states.append(json.loads(json.dumps(loader.state_dict())))
        loader.close()
    job = zephon.merge_states(states)
    after = every_image(vlm(chats, lanes=4, collate=False, rank=0, world_size=1), job)
    assert Counter(before) + Counter(after) == expected


def test_text_only_operators_keep_their_identity() -> None:
    assert "images" not in pack_sequences(8).describe()["params"]
    assert "image_token_id" not in tokenize_chat(vision_bpe(), template=OURS).describe()["params"]
    assert "images" not in training_collate().__getstate__()


def test_mixtures_by_tokens_count_what_the_model_sees_image_tokens_included() -> None:
    text_tokens = len(vision_bpe().encode("hello world", add_special_tokens=False).ids)
    per_image = 2 + 4  # start, end and ceil(16 / 8) ** 2 image tokens

    def docs(images: int) -> list[dict[str, Any]]:
        n = text_tokens + images * per_image + 1  # and the eos
        row = {"content": ["hello world"] + [None] * images, "n_tokens": n}
        return [{**row, "images": [np.zeros((16, 16, 3), np.uint8)] * images}] * 300

    weights = {"text": 0.5, "pics": 0.5}

    def stats(**by: Any) -> dict[str, Any]:
        parts = {
            "text": zephon.sources.ListSource(docs(0), chunk_size=8, dataset_id=1),
            "pics": zephon.sources.ListSource(docs(3), chunk_size=8, dataset_id=2),
        }
        ops = [
            fetch(),
            tokenize_interleaved(vision_bpe(), eos_id=tid(EOT), **image_kw()),
            zephon.ops.ensure_mixture(weights, by="tokens", buffer_size=16),
            pack_sequences(64, extra_fields={"loss_mask": 0}, images="images"),
            batch(2),
        ]
        source = zephon.sources.MixtureSource(parts, weights, chunk_size=8, **by)
        with zephon.Pipeline(source, ops).iter() as loader:
            for _ in loader:
                pass
            return loader.stats()["mixture_components"]

    with pytest.warns(zephon.MixtureDropWarning):  # by samples, 'pics' has 7x the tokens
        by_samples = stats()
    for name, images in (("text", 0), ("pics", 3)):
        got = by_samples[name]
        assert got["tokens"] == got["samples"] * (text_tokens + images * per_image + 1)
        assert got["share"] == pytest.approx(0.5, abs=0.05)
    # a source weighed by a length column that counts image tokens leaves far less to trim
    by_tokens = stats(by="tokens", length_column="n_tokens")
    dropped = [sum(c["dropped_tokens"] for c in s.values()) for s in (by_samples, by_tokens)]
    assert dropped[1] < dropped[0] / 4
    for got in by_tokens.values():
        assert got["share"] == pytest.approx(0.5, abs=0.05)


@pytest.fixture(scope="module")
def text_and_pictures(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two Parquet components: 3,000 texts of 8-16 words, and 400 captioned documents of 1-3
    drawn pictures each (up to 80 x 64 pixels, so far more image tokens than caption tokens),
    with each picture's ``(height, width)`` in ``image_sizes``."""
    rng = random.Random(11)
    where = tmp_path_factory.mktemp("text-and-pictures")
    texts = []
    for _ in range(3000):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 16)))
        texts.append({"text": text, "content": [text], "images": []})
    docs = []
    for i in range(400):
        caption = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))
        pics = [
            picture(i, k, size=(16 + (i * 13 + k * 7) % 64, 16 + (i * 5 + k * 11) % 48))
            for k in range(1 + i % 3)
        ]
        docs.append(
            {
                "text": caption,
                "content": [caption] + [None] * len(pics),
                "images": [encoded(p) for p in pics],
                "image_sizes": [list(p.shape[:2]) for p in pics],
            }
        )
    for name, rows in (("text", texts), ("pics", docs)):
        pq.write_table(pa.Table.from_pylist(rows), where / f"{name}.parquet")
    return where


def test_a_mixture_by_tokens_counting_image_tokens_gets_the_model_token_shares(
    text_and_pictures: Path,
) -> None:
    weights = {"pics": 0.5, "text": 0.5}
    counter = image_token_counter(
        "image_sizes",
        patch_size=PATCH,
        merge=MERGE,
        image_start_id=tid(START),
        image_end_id=tid(END),
    )

    def shares(**by: Any) -> dict[str, float]:
        parts = {
            name: ArrowSource([str(text_and_pictures / f"{name}.parquet")], dataset_id=i)
            for i, name in enumerate(sorted(weights))
        }
        source = zephon.sources.MixtureSource(
            parts,
            weights,
            chunk_size=64,
            by="tokens",
            tokenizer=vision_bpe(),
            estimate_size=4096,
            calibration_size=4096,
            **by,
        )
        ops = [
            fetch(),
            decode_images("images"),
            tokenize_interleaved(vision_bpe(), eos_id=tid(EOT), **image_kw()),
            batch(8),
        ]
        with zephon.Pipeline(source, ops).iter() as loader:
            for _ in loader:
                pass
            comps = loader.stats()["mixture_components"]
        assert {c["share_of"] for c in comps.values()} == {"tokens"}
        return {name: c["share"] for name, c in comps.items()}

    counted = shares(image_tokens=counter)
    assert counted["pics"] == pytest.approx(0.5, abs=0.01)
    assert counted["text"] == pytest.approx(0.5, abs=0.01)
    # from its captions alone the picture component looks cheap, and takes most of the tokens
    assert shares()["pics"] > 0.75


@pytest.fixture(scope="module")
def web_documents(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """90 captioned-picture documents in Parquet: texts with None where a picture goes (the
    layout of interleaved web corpora), the pictures in a column of their own."""
    rng = random.Random(7)
    rows = []
    for i in range(90):
        n = 1 + i % 3
        content: list[str | None] = []
        for _ in range(n):
            content += [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8))), None]
        rows.append({"content": content, "images": [encoded(picture(i, k)) for k in range(n)]})
    path = tmp_path_factory.mktemp("docs") / "documents.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=30)
    return path


def interleaved(path: Path, **kw: Any) -> zephon.Pipeline:
    ops = [
        fetch(),
        decode_images("images"),
        random_resized_crop((16, 24), scale=(0.5, 1.0), seed=5, field="images"),
        tokenize_interleaved(vision_bpe(), eos_id=tid(EOT), **image_kw()),
        pack_sequences(48, open_bins=2, extra_fields={"loss_mask": 0}, images="images"),
        batch(2, collate=training_collate(images="images")),
    ]
    source = ArrowSource([str(path)], chunk_size=8, shuffle=True, seed=1)
    return zephon.Pipeline(source, ops, **{"lanes": 2, "epoch_chunks": 2, **kw})


def test_interleaved_documents_resume_exactly_on_any_worker_kind(web_documents: Path) -> None:
    full = run(iter(interleaved(web_documents)))
    assert len(full) > 10
    assert_resumes_at(interleaved(web_documents), [3, len(full) // 2], full)
    with iter(interleaved(web_documents, workers="process")) as loader:
        assert run(loader) == full
    with iter(interleaved(web_documents)) as loader:
        first = next(loader).payload
    assert first["pixel_values"].shape[1:] == (16, 24, 3)  # uint8 HWC, stacked
    assert (first["input_ids"] == tid(IMAGE)).sum() == 6 * len(first["pixel_values"])
