"""Real tokenizers with chat formats for the chat tests, built locally (no downloads), and the
reference tokenization of a conversation: each message rendered on its own with the same
template, cut at its special tokens, every piece tokenized separately and the mask set on the
trained roles' content pieces and the end-of-turn token after them."""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from zephon.ops import ChatTemplate

ROLES = ("system", "user", "assistant")
HEADERS = {role: f"<|{role}|>" for role in ROLES}
EOT = "<|end|>"
BOS = "<s>"
PAD = "<pad>"
SPECIALS = [*HEADERS.values(), EOT, PAD, BOS]

OURS = ChatTemplate(roles=HEADERS, end_of_turn=EOT, bos=BOS, separator="\n")
# The same format as a transformers chat template (Jinja).
JINJA = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n"
    "{% endfor %}"
)

CORPUS = [
    "hello world, how are you today?",
    "I am fine, thanks! And you?",
    "The quick brown fox jumps over the lazy dog 0123456789.",
    "Packing puts several documents into one row; masks keep the loss honest.",
    "Ça va très bien, merci. 你好，世界。",
]


@functools.cache
def bpe() -> Tokenizer:
    """A byte-level BPE trained here on a small corpus, with the chat special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    return tok


@functools.cache
def vision_bpe() -> Tokenizer:
    """``bpe()`` with the image tokens of vision-language models added as special tokens."""
    tok = Tokenizer.from_str(bpe().to_str())
    tok.add_special_tokens(["<|image|>", "<|vision_start|>", "<|vision_end|>"])
    return tok


@functools.cache
def fast_tokenizer() -> Any:
    """A transformers fast tokenizer around ``bpe()`` with ``JINJA`` as its chat template."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe(), bos_token=BOS, eos_token=EOT, pad_token=PAD
    )
    tok.chat_template = JINJA
    return tok


# Content: any text without the special tokens' brackets, surrogates or private-use characters.
contents = st.text(
    alphabet=st.characters(
        codec="utf-8", exclude_categories=("Cs", "Co"), exclude_characters="<|>"
    ),
    max_size=40,
)
messages = st.builds(lambda role, content: {"role": role, "content": content},
                     st.sampled_from(ROLES), contents)  # fmt: skip
conversations = st.lists(messages, min_size=1, max_size=8)  # transformers refuses empty ones


_SPECIAL = re.compile("(" + "|".join(re.escape(t) for t in SPECIALS) + ")")


def render_alone(kind: str, message: dict[str, str]) -> str:
    """One message rendered on its own by the template of ``kind`` (``"ours"``/``"jinja"``),
    without the start of the conversation."""
    if kind == "ours":
        text, _ = OURS.render([message])
    else:
        text = fast_tokenizer().apply_chat_template([message], tokenize=False)
    assert text.startswith(BOS)
    return text[len(BOS) :]


def reference(
    kind: str, conversation: Sequence[dict[str, str]], train_on: Sequence[str]
) -> tuple[list[int], list[int]]:
    """(tokens, loss mask) of ``conversation`` built message by message (see the module doc)."""
    tok = bpe()
    tokens: list[int] = [tok.token_to_id(BOS)]  # type: ignore[list-item]
    mask = [0]
    for message in conversation:
        pieces = [p for p in _SPECIAL.split(render_alone(kind, message)) if p]
        # Pieces: header, content (absent when empty), end of turn, separator.
        assert pieces[0] == HEADERS[message["role"]]
        trained = message["role"] in train_on
        content_at = 1 if message["content"] else None
        for k, piece in enumerate(pieces):
            ids = tok.encode(piece, add_special_tokens=False).ids
            on = trained and (k == content_at or piece == EOT)
            tokens += ids
            mask += [int(on)] * len(ids)
    return tokens, mask


def chat_records(conversations_: Sequence[Sequence[dict[str, str]]]) -> list[Any]:
    """Records of the conversations, one base offset each, as fetch would make them."""
    from zephon.types import SampleCursor, SampleMeta, SampleRecord

    return [
        SampleRecord(
            SampleMeta(SampleCursor(0, i, (0, 0, i)), component="chat"),
            {"messages": conv, "id": i},
        )
        for i, conv in enumerate(conversations_)
    ]


def as_lists(record: Any) -> tuple[list[int], list[int]]:
    payload = record.payload
    assert payload["tokens"].dtype == np.int32 and payload["loss_mask"].dtype == np.int32
    return payload["tokens"].tolist(), payload["loss_mask"].tolist()


# Content that spells special tokens: text pieces and the special tokens' strings, joined.
spelled_contents = st.lists(st.one_of(contents, st.sampled_from(SPECIALS)), max_size=5).map("".join)
spelled_conversations = st.lists(
    st.builds(
        lambda role, content: {"role": role, "content": content},
        st.sampled_from(ROLES),
        spelled_contents,
    ),
    min_size=1,
    max_size=6,
)


@functools.cache
def bpe_as_text() -> Tokenizer:
    """``bpe()`` with its special tokens' strings encoded as plain text."""
    tok = Tokenizer.from_str(bpe().to_str())
    tok.encode_special_tokens = True
    return tok


def spelled_reference(
    conversation: Sequence[dict[str, str]], train_on: Sequence[str], content_specials: str
) -> tuple[list[int], list[int]]:
    """(tokens, loss mask) of ``conversation`` in the format of ``OURS``/``JINJA``, built message
    by message: header, content, end of turn and separator tokenized apart, the content as plain
    text (``content_specials="text"``) or with special-token strings as the special tokens."""
    tok = bpe()
    content_tok = bpe_as_text() if content_specials == "text" else tok
    tokens = [token_id(BOS)]
    mask = [0]
    for message in conversation:
        trained = int(message["role"] in train_on)
        content = content_tok.encode(message["content"], add_special_tokens=False).ids
        separator = tok.encode("\n", add_special_tokens=False).ids
        tokens += [token_id(HEADERS[message["role"]]), *content, token_id(EOT), *separator]
        mask += [0] + [trained] * len(content) + [trained] + [0] * len(separator)
    return tokens, mask


def token_id(special: str) -> int:
    """The id of one of ``SPECIALS`` in ``bpe()``."""
    found = bpe().token_to_id(special)
    assert found is not None, special
    return found


def tiny_qwen2_vl_config(
    *,
    vocab_size: int,
    image: int,
    start: int,
    end: int,
    text: dict[str, Any] | None = None,
    vision: dict[str, Any] | None = None,
    **extra: Any,
) -> Any:
    """A transformers ``Qwen2VLConfig`` of one small layer (random weights when built), with
    the image, vision start and end token ids given; ``text`` and ``vision`` add to its text and
    vision configs, ``extra`` to the config itself."""
    import transformers

    return transformers.Qwen2VLConfig(
        text_config={
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "vocab_size": vocab_size,
            "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]},
            **(text or {}),
        },
        vision_config={"depth": 1, "embed_dim": 16, "num_heads": 2, **(vision or {})},
        image_token_id=image,
        vision_start_token_id=start,
        vision_end_token_id=end,
        **extra,
    )
