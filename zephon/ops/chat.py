"""``tokenize_chat``: a conversation (a list of ``{"role", "content"}`` messages) to ``int32``
tokens and a loss mask that is 1 exactly on the chosen roles' content tokens and the end-of-turn
token after each of them.

Boundaries come from the template's own rendering, never from tokenizing pieces separately and
hoping they join up: the whole conversation is rendered to one string with the character span of
every message's content known, that string is tokenized once with character offsets, and a token
is trained on when its span lies inside a trained span. Two kinds of template:

- the tokenizer's own (a ``transformers`` fast tokenizer with a ``chat_template``): the
  conversation is rendered once with each content replaced by a unique placeholder, which finds
  where the template puts every content, and once as it is; the two must agree (a template that
  rewrites content, e.g. with ``| trim``, is refused for that record rather than guessed at). The
  end-of-turn token is the special token the template puts right after a trained message's
  content;
- ``ChatTemplate``, ours, for a plain ``tokenizers.Tokenizer`` (or any fast tokenizer): per-role
  header strings, one end-of-turn token, an optional start and separator.

Message content is text: a special token's string inside it (``"<|end|>"`` typed by a user, or
scraped) is encoded as the plain text it is, never as that special token, so content cannot end a
turn or open a header (``content_specials="special"`` keeps the tokenizer's matching instead).
The tokenizer matches special tokens anywhere in the rendered text, so a record whose content it
matched one in is encoded again where it did: the text between the template's own special tokens
around it, by a copy of the tokenizer that leaves special tokens unmatched. Records whose content
holds none (the usual case) are encoded once, as described above.

A token that covers both a header and content (possible only when the template puts no special
token between them) is not trained on: it is partly header. Padding ids are never guessed: the
tokenizer's padding token, when it has one, is published at plan time for the packers, with the
mask field, which a packer must carry (``extra_fields``) or planning fails.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from zephon._core.records import counted_meta
from zephon.errors import PlanError
from zephon.identity import identify
from zephon.ops.base import Operator, OpTraits, record_error
from zephon.ops.children import spawn_child
from zephon.ops.tokenize import _refuse_batch_padding, backend_digest, find_pad
from zephon.ops.vision import ImageTokens, images_of
from zephon.types import SampleRecord
from zephon.validation import check_int

__all__ = ["ChatTemplate", "TokenizeChat", "tokenize_chat"]

# Placeholder brackets for message i's content while locating it in a template's rendering:
# private-use characters, which templates and role names do not contain; the first pair that no
# content of the conversation contains either is used.
_HOLE_BRACKETS = (("\ue000", "\ue001"), ("\U000f0000", "\U000f0001"), ("\U00100000", "\U00100001"))

# What a special token's string inside message content is encoded as: its plain text, or the
# special token itself.
_CONTENT_SPECIALS = ("text", "special")


def _hole_format(messages: list[Mapping[str, Any]]) -> str:
    for opening, closing in _HOLE_BRACKETS:
        if not any(opening in m["content"] or closing in m["content"] for m in messages):
            return opening + "{}" + closing
    raise ValueError(
        "the messages contain every private-use placeholder character tokenize_chat could use "
        "to locate content in the template's rendering"
    )


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """Zephon's chat format, for tokenizers without a chat template of their own.

    A conversation renders as ``bos``, then per message ``roles[role] + content + end_of_turn +
    separator``. ``end_of_turn`` must be one token of the vocabulary (an added special token, such
    as ``"<|end|>"``), so it can never merge with the content before it, and so must ``bos`` when
    given (the tokenizer's start-of-sequence token, such as ``"<s>"``); headers are best special
    tokens too (``"<|assistant|>"``). Trained on: content and ``end_of_turn`` of the chosen roles.
    """

    roles: Mapping[str, str]
    end_of_turn: str
    bos: str = ""
    separator: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.roles, Mapping) or not self.roles:
            raise TypeError("ChatTemplate: roles must map each role to its header string")
        for role, header in self.roles.items():
            if not isinstance(role, str) or not isinstance(header, str):
                raise TypeError(
                    f"ChatTemplate: roles must map str to str, got {role!r}: {header!r}"
                )
        for name in ("end_of_turn", "bos", "separator"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"ChatTemplate: {name} must be a str")
        if not self.end_of_turn:
            raise ValueError("ChatTemplate: end_of_turn must be a token's text, e.g. '<|end|>'")
        object.__setattr__(self, "roles", dict(self.roles))

    def render(self, messages: Sequence[Mapping[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and, per message, the character span of its content."""
        parts = [self.bos]
        at = len(self.bos)
        spans = []
        for i, message in enumerate(messages):
            role, content = message["role"], message["content"]
            header = self.roles.get(role)
            if header is None:
                raise ValueError(
                    f"message {i} has role {role!r}, which the template does not know "
                    f"(it has {sorted(self.roles)})"
                )
            at += len(header)
            spans.append((at, at + len(content)))
            at += len(content) + len(self.end_of_turn) + len(self.separator)
            parts += (header, content, self.end_of_turn, self.separator)
        return "".join(parts), spans


def _is_hf(tokenizer: Any) -> bool:
    return all(callable(getattr(tokenizer, n, None)) for n in ("token_to_id", "encode_batch"))


def _is_fast_transformers(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "is_fast", False)) and callable(
        getattr(tokenizer, "apply_chat_template", None)
    )


@dataclasses.dataclass
class _Conversation:
    """A conversation with each message's content as one string: a structured content's text
    parts joined, each image part replaced by the image token's text (``images``: where, per
    message, as character offsets into its content; ``texts``: its text parts alone)."""

    messages: list[Mapping[str, Any]]
    images: list[list[int]]
    texts: list[str]


def _checked_messages(messages: Any, image_text: str | None) -> _Conversation:
    """The messages of a conversation, or a TypeError saying which one is malformed. Content is
    a str or a list of parts ``{"type": "text", "text": ...}`` / ``{"type": "image"}`` (images
    need ``image_text``, the image token's text)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(
            f"the conversation must be a list of {{'role', 'content'}} messages, got "
            f"{type(messages).__name__}"
        )
    out = _Conversation([], [], [])
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"message {i} is {type(message).__name__}, not a dict")
        role, content = message.get("role"), message.get("content")
        images: list[int] = []
        if isinstance(content, list) and isinstance(role, str):
            texts, parts = [], []
            at = 0
            for k, part in enumerate(content):
                kind = part.get("type") if isinstance(part, Mapping) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    piece = part["text"]
                    texts.append(piece)
                elif kind == "image":
                    if image_text is None:
                        raise TypeError(
                            f"message {i} holds an image (part {k}); pass image_token_id= (and "
                            "patch_size= or image_tokens=) to tokenize_chat"
                        )
                    images.append(at)
                    piece = image_text
                else:
                    raise TypeError(
                        f"message {i} part {k} is {part!r:.60}, not {{'type': 'text', 'text': "
                        "str} or {'type': 'image'}"
                    )
                parts.append(piece)
                at += len(piece)
            message = {**message, "content": "".join(parts)}
            text = "".join(texts)
        elif not isinstance(role, str) or not isinstance(content, str):
            raise TypeError(
                f"message {i} needs a str 'role' and a str 'content' (or a list of parts), got "
                f"role={role!r} and content of type {type(content).__name__}"
            )
        else:
            text = content
        out.messages.append(message)
        out.images.append(images)
        out.texts.append(text)
    return out


def _without(spans: list[tuple[int, int]], holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The character spans ``spans`` with the (sorted, inside them) ranges ``holes`` taken out."""
    if not holes:
        return spans
    out = []
    it = iter(holes)
    hole = next(it, None)
    for lo, hi in spans:
        while hole is not None and hole[0] < hi:
            if hole[0] > lo:
                out.append((lo, hole[0]))
            lo = hole[1]
            hole = next(it, None)
        if hi > lo:
            out.append((lo, hi))
    return out


def _turn_cuts(n: int, boundaries: list[int], max_len: int) -> list[int]:
    """Cut points ``0 = c0 < c1 < ... = n`` with pieces of at most ``max_len`` tokens, cutting at
    turn ``boundaries`` where a piece can hold whole turns and inside a turn only when one turn
    alone is longer than ``max_len``; greedy, so each piece takes as many turns as fit."""
    cuts = [0]
    passed = 0  # the last boundary reached: a cut that keeps turns whole
    for b in [*boundaries, n]:
        while b - cuts[-1] > max_len:
            cuts.append(passed if passed > cuts[-1] else cuts[-1] + max_len)
        passed = b
    if cuts[-1] < n:
        cuts.append(n)
    return cuts


class TokenizeChat(Operator):
    """Renders ``payload[field]`` through a chat template into ``payload[output_field]`` (int32
    tokens) and ``payload[mask_field]`` (int32, 1 on the trained tokens), other fields kept.

    1 -> 1 (truncated to ``max_len`` when given), or with ``split_long_samples`` 1 -> N by turn
    through ``spawn_child`` (only the last child closes its base offset). Every output carries
    ``component_token_counts`` / ``component_sample_counts`` like ``tokenize``'s (image tokens
    included). With ``image_token_id`` messages may hold images (see ``tokenize_chat``).
    """

    name = "tokenize_chat"

    def __init__(
        self,
        tokenizer: Any,
        *,
        field: str = "messages",
        output_field: str = "tokens",
        mask_field: str = "loss_mask",
        train_on: Sequence[str] = ("assistant",),
        template: ChatTemplate | None = None,
        max_len: int | None = None,
        split_long_samples: bool = False,
        content_specials: str = "text",
        workers: int | None = None,
        image_field: str = "images",
        image_token_id: int | None = None,
        patch_size: int | None = None,
        merge: int = 1,
        image_tokens: Callable[[int, int], int] | None = None,
        image_start_id: int | None = None,
        image_end_id: int | None = None,
    ):
        self._images: ImageTokens | None = None
        if image_token_id is not None:
            if max_len is not None:
                raise ValueError(
                    "tokenize_chat: max_len cannot be combined with images (a cut could fall "
                    "inside an image's tokens); leave long conversations to pack_sequences, "
                    "which never cuts an image's span"
                )
            self._images = ImageTokens(
                self.name,
                image_token_id,
                patch_size,
                merge,
                image_tokens,
                image_start_id,
                image_end_id,
            )
        elif patch_size is not None or image_tokens is not None:
            raise ValueError(
                "tokenize_chat: patch_size= and image_tokens= need image_token_id= (the id an "
                "image's tokens have; it is never guessed)"
            )
        self._image_field = image_field
        if not isinstance(content_specials, str) or content_specials not in _CONTENT_SPECIALS:
            raise (ValueError if isinstance(content_specials, str) else TypeError)(
                "tokenize_chat: content_specials must be 'text' or 'special', got "
                f"{content_specials!r}"
            )
        if max_len is not None:
            max_len = check_int(max_len, "max_len", "tokenize_chat", minimum=1)
        if workers is not None:
            workers = check_int(workers, "workers", "tokenize_chat", minimum=1)
        if split_long_samples and max_len is None:
            raise ValueError("tokenize_chat: split_long_samples=True needs max_len")
        if isinstance(train_on, str):
            train_on = (train_on,)
        train_on = tuple(train_on)
        if not train_on or not all(isinstance(r, str) for r in train_on):
            raise ValueError(f"tokenize_chat: train_on must name roles, got {train_on!r}")
        if output_field == mask_field:
            raise ValueError("tokenize_chat: output_field and mask_field must differ")
        if template is not None and not isinstance(template, ChatTemplate):
            raise TypeError(
                f"tokenize_chat: template must be a ChatTemplate or None, got {template!r}"
            )
        self.tokenizer = tokenizer
        self.field = field
        self.output_field = output_field
        self.mask_field = mask_field
        self.train_on = train_on
        self.template = template
        self.max_len = max_len
        self.split_long_samples = bool(split_long_samples)
        self.content_specials = content_specials
        # Copies of the tokenizer that encode special tokens' strings as text, made when a
        # record first needs one (see _plain_tokenizer), keyed by "at the start of the text".
        self._plain: dict[bool, Any] = {}

        self._transformers = _is_fast_transformers(tokenizer)
        if not (self._transformers or _is_hf(tokenizer)):
            raise TypeError(
                "tokenize_chat needs token offsets: a Hugging Face tokenizers.Tokenizer or a "
                f"transformers fast tokenizer, got {type(tokenizer).__name__}"
            )
        if self._transformers:
            _refuse_batch_padding(getattr(tokenizer, "backend_tokenizer", None))
        else:
            _refuse_batch_padding(tokenizer)
            if getattr(tokenizer, "truncation", None) is not None:
                raise PlanError(
                    "tokenize_chat: the tokenizer has truncation enabled, which would cut "
                    "conversations silently; call tokenizer.no_truncation() and use max_len="
                )
        self.eot_id: int | None = None
        if template is not None:
            unknown = [r for r in train_on if r not in template.roles]
            if unknown:
                raise ValueError(
                    f"tokenize_chat: train_on names {unknown}, which the template has no header "
                    f"for (it has {sorted(template.roles)})"
                )
            self.eot_id = self._single_token(template.end_of_turn, "end_of_turn")
            if template.bos:  # the start of every conversation: a token, never its spelling
                self._single_token(template.bos, "bos")
        elif not self._transformers or not getattr(tokenizer, "chat_template", None):
            raise PlanError(
                "tokenize_chat: the tokenizer has no chat template of its own; pass "
                "template=ChatTemplate(roles={...}, end_of_turn=...)"
            )
        specials = self._special_tokens()
        self._special_ids = frozenset(specials)
        # Content can hold a special token only if it holds its string, unless the tokenizer
        # matches that token in normalized text; then every record's tokens are looked at.
        self._spelled = (
            re.compile("|".join(re.escape(t.content) for t in specials.values()))
            if specials and not any(getattr(t, "normalized", True) for t in specials.values())
            else None
        )
        # is_special[id] for every id, ids above the last special one looked up at the last
        # entry: what _content_as_text checks each record's tokens with.
        self._is_special = np.zeros(max(self._special_ids, default=-1) + 2, dtype=bool)
        self._is_special[list(self._special_ids)] = True
        pad = find_pad(tokenizer)
        self.pad_id = pad.id if pad else None
        self.pad_token = pad.token if pad else None
        self._image_text = None if self._images is None else self._image_token_text()
        self.traits = OpTraits(
            preserves_cursor_order=True,
            preserves_indexability=not self.split_long_samples,
            workers=workers,
        )

    # ------------------------------------------------------------------------- plan time
    def _single_token(self, text: str, name: str) -> int:
        """The id of ``text`` (the template's ``name``) when the tokenizer encodes it as exactly
        one token, else PlanError."""
        ids, _ = self._encode([text])[0]
        if len(ids) != 1:
            raise PlanError(
                f"tokenize_chat: the template's {name} {text!r} is {len(ids)} tokens for this "
                "tokenizer, not one; add it as a special token (tokenizer.add_special_tokens)"
            )
        return int(ids[0])

    def _image_token_text(self) -> str:
        """The text of the image token, which stands for each image in the rendered conversation:
        a special token, so the tokenizer gives its one id wherever the template puts it."""
        assert self._images is not None
        token_id = self._images.image_token_id
        tok = self.tokenizer
        text = (
            tok.convert_ids_to_tokens(token_id) if self._transformers else tok.id_to_token(token_id)
        )
        if not isinstance(text, str) or token_id not in self._special_ids:
            raise PlanError(
                f"tokenize_chat: image_token_id {token_id} ({text!r}) is not a special token of "
                "the tokenizer; add the image token with tokenizer.add_special_tokens and pass "
                "its id"
            )
        return text

    def _special_tokens(self) -> dict[int, Any]:
        """The tokenizer's special (added) tokens by id: what may end a turn."""
        decoder = getattr(self.tokenizer, "added_tokens_decoder", None)
        if decoder is None:
            get = getattr(self.tokenizer, "get_added_tokens_decoder", None)
            decoder = get() if callable(get) else {}
        return {int(i): tok for i, tok in decoder.items() if getattr(tok, "special", False)}

    def provides(self) -> dict[str, Any]:
        """Plan-time facts for the operators after this one: the token field, the tokenizer's
        padding id (``None`` when it has none) and the side field a packer must carry."""
        images = (
            {}
            if self._images is None
            else self._images.facts(self.output_field, self._image_field, self.name)
        )
        return {
            "token_field": self.output_field,
            "eos_id": None,
            "eos_token": None,
            "pad_id": self.pad_id,
            "pad_token": self.pad_token,
            "pad_from": self.name,
            "token_side_fields": {
                "field": self.output_field,
                "fields": [self.mask_field],
                "source": self.name,
            },
            **images,
        }

    def describe(self) -> dict[str, Any]:
        """As ``Operator.describe``, plus a digest of the vocabulary and the chat template."""
        out = super().describe()
        digest = backend_digest(self.tokenizer, out["params"]["tokenizer"])
        if digest is not None:
            out["params"]["tokenizer_digest"] = digest
        if self.template is None:
            out["params"]["chat_template"] = getattr(self.tokenizer, "chat_template", None)
        if self._images is not None:  # only then, so text-only pipelines keep their identity
            where = f"operator {self.name!r} parameter"
            for key, value in {
                "image_field": self._image_field,
                **self._images.identity(),
            }.items():
                out["params"][key] = identify(value, where=f"{where} {key!r}")
        return out

    # ------------------------------------------------------------------------- encoding
    def _encode(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per text: its token ids (int32) and their character offsets (an int64 ``(n, 2)``)."""
        tok = self.tokenizer
        out = []
        if self._transformers:
            enc = tok(texts, add_special_tokens=False, return_offsets_mapping=True)
            for ids, offsets in zip(enc["input_ids"], enc["offset_mapping"], strict=True):
                out.append(
                    (
                        np.asarray(ids, dtype=np.int32),
                        np.asarray(offsets, dtype=np.int64).reshape(-1, 2),
                    )
                )
            return out
        for e in tok.encode_batch(texts, add_special_tokens=False):
            out.append(
                (
                    np.asarray(e.ids, dtype=np.int32),
                    np.asarray(e.offsets, dtype=np.int64).reshape(-1, 2),
                )
            )
        return out

    def _content_as_text(
        self, text: str, spans: list[tuple[int, int]], ids: np.ndarray, offsets: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """``ids``/``offsets`` of ``text`` with every stretch between two of the template's
        special tokens that holds a special token matched inside content encoded again, with
        special tokens' strings as text. Unchanged (the same arrays) when there is none."""
        special = np.flatnonzero(self._is_special[np.minimum(ids, len(self._is_special) - 1)])
        if not len(special) or not spans:
            return ids, offsets
        # A special token [s, e) overlaps content when s lies inside a span (an odd number of
        # span bounds <= s) or a span bound lies inside the token.
        bounds = np.array(spans, dtype=np.int64).ravel()
        below_start = np.searchsorted(bounds, offsets[special, 0], side="right")
        below_end = np.searchsorted(bounds, offsets[special, 1], side="left")
        found = (below_start % 2 == 1) | (below_end > below_start)
        if not found.any():
            return ids, offsets
        template = special[~found]  # the template's own special tokens stay as they are
        n = len(ids)
        stretches = sorted(
            {
                (int(template[j - 1]) if j else -1, int(template[j]) if j < len(template) else n)
                for j in np.searchsorted(template, special[found]).tolist()
            }
        )
        id_parts: list[np.ndarray] = []
        offset_parts: list[np.ndarray] = []
        at = 0
        for before, after in stretches:  # tokens before < t < after are encoded again
            lo = int(offsets[before, 1]) if before >= 0 else 0
            hi = int(offsets[after, 0]) if after < n else len(text)
            encoding = self._plain_tokenizer(lo == 0).encode(text[lo:hi], add_special_tokens=False)
            id_parts += (ids[at : before + 1], np.asarray(encoding.ids, dtype=np.int32))
            offset_parts += (
                offsets[at : before + 1],
                np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2) + lo,
            )
            at = after
        id_parts.append(ids[at:])
        offset_parts.append(offsets[at:])
        return np.concatenate(id_parts), np.concatenate(offset_parts)

    def _plain_tokenizer(self, at_start: bool) -> Any:
        """A copy of the tokenizer (its ``tokenizers.Tokenizer``) that encodes special tokens'
        strings as text. Encoding a stretch of text on its own must give what the tokenizer gives
        it inside the whole text: a ``Metaspace`` that prepends its marker to the text's first
        word only does not, inside, so a copy for stretches not ``at_start`` never prepends."""
        plain = self._plain.get(at_start)
        if plain is not None:
            return plain
        backend = getattr(self.tokenizer, "backend_tokenizer", self.tokenizer)
        try:
            config = json.loads(backend.to_str())
            if not at_start:
                _never_prepend_first(config.get("pre_tokenizer"))
            plain = type(backend).from_str(json.dumps(config))
            plain.encode_special_tokens = True
        except Exception as exc:
            raise ValueError(
                f"content holds a special token's string, and the tokenizer cannot be copied to "
                f"encode it as text ({type(exc).__name__}: {exc}); pass "
                "content_specials='special' to keep such strings special tokens"
            ) from exc
        plain.no_truncation()
        plain.no_padding()
        self._plain[at_start] = plain
        return plain

    def __getstate__(self) -> dict[str, Any]:
        # The plain-text copies are made again where needed, not sent to every worker.
        return {**self.__dict__, "_plain": {}}

    def _render(self, messages: list[Mapping[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text and each message's content span, from the template."""
        if self.template is not None:
            return self.template.render(messages)
        tok = self.tokenizer
        hole_format = _hole_format(messages)
        holes = [{**m, "content": hole_format.format(i)} for i, m in enumerate(messages)]
        shape = tok.apply_chat_template(holes, tokenize=False)
        spans = []
        parts: list[str] = []
        at = 0  # in shape
        shift = 0  # how far the real text is ahead of shape here
        for i, message in enumerate(messages):
            hole = hole_format.format(i)
            where = shape.find(hole, at)
            if where < 0 or shape.count(hole) != 1:
                raise ValueError(
                    f"the chat template renders the content of message {i} "
                    f"({message['role']!r}) {shape.count(hole)} times, not once, so its tokens "
                    "cannot be told apart"
                )
            content = message["content"]
            parts += (shape[at:where], content)
            spans.append((where + shift, where + shift + len(content)))
            shift += len(content) - len(hole)
            at = where + len(hole)
        parts.append(shape[at:])
        text = tok.apply_chat_template(messages, tokenize=False)
        if text != "".join(parts):
            raise ValueError(
                "the chat template changes message content as it renders it (e.g. with | trim), "
                "so content boundaries cannot be found exactly; clean the content before "
                "tokenize_chat (map_transform) or pass template=ChatTemplate(...)"
            )
        return text, spans

    def _mask(
        self,
        messages: list[Mapping[str, Any]],
        spans: list[tuple[int, int]],
        ids: np.ndarray,
        offsets: np.ndarray,
    ) -> tuple[np.ndarray, list[int]]:
        """The loss mask of one tokenized conversation and its turn boundaries (token indices
        after each trained message's end-of-turn token)."""
        starts, ends = offsets[:, 0], offsets[:, 1]
        mask = np.zeros(len(ids), dtype=np.int32)
        boundaries = []
        for i, (message, (lo, hi)) in enumerate(zip(messages, spans)):
            if message["role"] not in self.train_on:
                continue
            # The end-of-turn token: the first token from the content's end on, which must start
            # right there and be the template's end of turn (or, for the tokenizer's own
            # template, a special token).
            j = int(np.searchsorted(starts, hi, side="left"))
            eot_ok = j < len(ids) and starts[j] == hi
            if eot_ok:
                eot = int(ids[j])
                eot_ok = eot == self.eot_id if self.eot_id is not None else eot in self._special_ids
            if not eot_ok:
                raise ValueError(
                    f"message {i} ({message['role']!r}): the template puts no special "
                    "end-of-turn token right after its content, so the end of the turn to train "
                    "on is unknown"
                )
            inside = (starts >= lo) & (ends <= hi) & (ends > starts)
            mask[inside] = 1
            mask[j] = 1
            boundaries.append(j + 1)
        return mask, boundaries

    def process_many(self, records: list[SampleRecord]) -> list[SampleRecord]:
        rendered = []
        for rec in records:
            payload = rec.payload
            try:
                value = payload[self.field]
            except (KeyError, TypeError, IndexError):
                fields = list(payload) if isinstance(payload, dict) else type(payload).__name__
                raise record_error(
                    self, rec, KeyError(f"the payload has no field {self.field!r} ({fields})")
                ) from None
            try:
                conversation = _checked_messages(value, self._image_text)
                rendered.append((conversation, *self._render(conversation.messages)))
            except Exception as exc:
                raise record_error(self, rec, exc) from exc
        try:
            encoded = self._encode([text for _, text, _ in rendered])
        except Exception as exc:
            if len(records) == 1:
                raise record_error(self, records[0], exc) from exc
            raise
        out: list[SampleRecord] = []
        as_text = self.content_specials == "text"
        spelled = self._spelled
        for rec, (conversation, text, spans), (ids, offsets) in zip(records, rendered, encoded):
            messages = conversation.messages
            # Where the image tokens' texts are: not content, for _content_as_text.
            image_len = len(self._image_text or "")
            holes = [
                (lo + at, lo + at + image_len)
                for (lo, _), ats in zip(spans, conversation.images)
                for at in ats
            ]
            try:
                if as_text and (
                    spelled is None or any(spelled.search(t) for t in conversation.texts)
                ):
                    ids, offsets = self._content_as_text(text, _without(spans, holes), ids, offsets)
                mask, boundaries = self._mask(messages, spans, ids, offsets)
                if self._images is not None:
                    images = images_of(rec.payload, self._image_field, len(holes))
                    if images:
                        out.append(self._with_images(rec, holes, images, ids, offsets, mask))
                        continue
            except (ValueError, KeyError, TypeError) as exc:
                raise record_error(self, rec, exc) from exc
            out += self._emit(rec, ids, mask, boundaries)
        return out

    def _with_images(
        self,
        rec: SampleRecord,
        holes: list[tuple[int, int]],
        images: list[Any],
        ids: np.ndarray,
        offsets: np.ndarray,
        mask: np.ndarray,
    ) -> SampleRecord:
        """The record of a conversation with images: each image token the template rendered
        (at the character ranges ``holes``) expanded into its image's span."""
        assert self._images is not None
        starts = offsets[:, 0]
        at = []
        for lo, hi in holes:
            j = int(np.searchsorted(starts, lo, side="left"))
            if not (j < len(ids) and ids[j] == self._images.image_token_id and offsets[j, 1] == hi):
                raise ValueError(
                    f"the image token {self._image_text!r} at character {lo} of the rendered "
                    "conversation was not encoded as its one id"
                )
            at.append(j)
        ids, new_mask, spans, grids = self._images.expand(ids, mask, at, images)
        fields = self._images.fields(spans, grids)
        return self._record(rec.meta, rec.payload, ids, new_mask, fields)

    def _emit(
        self, rec: SampleRecord, ids: np.ndarray, mask: np.ndarray, boundaries: list[int]
    ) -> list[SampleRecord]:
        n = len(ids)
        payload = rec.payload
        max_len = self.max_len
        if max_len is None or n <= max_len:
            return [self._record(rec.meta, payload, ids, mask)]
        if not self.split_long_samples:
            return [self._record(rec.meta, payload, ids[:max_len].copy(), mask[:max_len].copy())]
        cuts = _turn_cuts(n, boundaries, max_len)
        k = len(cuts) - 1
        out = []
        for i in range(k):
            lo, hi = cuts[i], cuts[i + 1]
            child = spawn_child(rec.meta, i, is_last_child=i == k - 1)
            out.append(self._record(child, payload, ids[lo:hi].copy(), mask[lo:hi].copy()))
        return out

    def _record(
        self,
        meta: Any,
        payload: Any,
        ids: np.ndarray,
        mask: np.ndarray | None,
        images: Mapping[str, np.ndarray] | None = None,
    ) -> SampleRecord:
        if images is None and self._images is not None:  # a conversation without images
            images = self._images.fields(
                np.empty((0, 2), dtype=np.int32),
                np.empty((0, 3), dtype=np.int32) if self._images.has_grid else None,
            )
        return SampleRecord(
            counted_meta(meta, len(ids)),
            {**payload, self.output_field: ids, self.mask_field: mask, **(images or {})},
        )


def tokenize_chat(
    tokenizer: Any,
    *,
    field: str = "messages",
    output_field: str = "tokens",
    mask_field: str = "loss_mask",
    train_on: Sequence[str] = ("assistant",),
    template: ChatTemplate | None = None,
    max_len: int | None = None,
    split_long_samples: bool = False,
    content_specials: str = "text",
    workers: int | None = None,
    image_field: str = "images",
    image_token_id: int | None = None,
    patch_size: int | None = None,
    merge: int = 1,
    image_tokens: Callable[[int, int], int] | None = None,
    image_start_id: int | None = None,
    image_end_id: int | None = None,
) -> TokenizeChat:
    """Tokenize the conversation in ``payload[field]`` (``[{"role", "content"}, ...]``) through a
    chat template into ``payload[output_field]`` (int32 ids) and ``payload[mask_field]`` (int32,
    1 exactly on the content tokens of ``train_on`` roles and the end-of-turn token after each).

    ``template=None`` uses the tokenizer's own ``chat_template`` (a ``transformers`` fast
    tokenizer); a ``ChatTemplate`` renders in Zephon's format (needed for a plain
    ``tokenizers.Tokenizer``). ``max_len`` truncates, or with ``split_long_samples=True`` splits
    by turn into children of at most ``max_len`` tokens (a turn ends after a trained message's
    end-of-turn token; a single turn longer than ``max_len`` is cut inside). Pack the result with
    ``extra_fields={mask_field: 0}``.

    ``content_specials``: a special token's string inside message content (``"<|end|>"``) is
    encoded as plain text (``"text"``, the default), so content can never end a turn or start
    one, or as the special token it spells (``"special"``, what the tokenizer does by itself).

    Images (``image_token_id=`` given, never guessed: a special token of the tokenizer): a
    message's content may be a list of parts, ``{"type": "text", "text": ...}`` and ``{"type":
    "image"}``, whose images are ``payload[image_field]`` (decoded, in the order the parts come).
    The parts are joined into one content, each image as the image token's text, which the
    template renders like any content; each image token is then expanded into its image's span:
    ``image_start_id``, as many ``image_token_id`` as ``patch_size``/``merge`` or
    ``image_tokens(h, w)`` say (see ``zephon.ops.vision``), ``image_end_id``. Image spans are never
    trained on; the record gets ``image_spans`` (and with ``patch_size`` ``image_grid_thw``), which
    ``pack_sequences(..., images=image_field)`` carries. Not with ``max_len``.
    """
    return TokenizeChat(
        tokenizer,
        field=field,
        output_field=output_field,
        mask_field=mask_field,
        train_on=train_on,
        template=template,
        max_len=max_len,
        split_long_samples=split_long_samples,
        content_specials=content_specials,
        workers=workers,
        image_field=image_field,
        image_token_id=image_token_id,
        patch_size=patch_size,
        merge=merge,
        image_tokens=image_tokens,
        image_start_id=image_start_id,
        image_end_id=image_end_id,
    )


def _never_prepend_first(pre_tokenizer: Any) -> None:
    """Set every ``Metaspace`` of a tokenizer's pre-tokenizer (JSON) that prepends its marker to
    the first word only to never prepend it."""
    if isinstance(pre_tokenizer, dict):
        if (
            pre_tokenizer.get("type") == "Metaspace"
            and pre_tokenizer.get("prepend_scheme") == "first"
        ):
            pre_tokenizer["prepend_scheme"] = "never"
        for part in pre_tokenizer.get("pretokenizers") or ():
            _never_prepend_first(part)
