"""Operators: the API for writing them, the children helpers, and the built-in factories."""

from zephon.ops.base import Operator, OperatorContext, OpTraits
from zephon.ops.basic import fetch, filter_records, map_batch, map_transform
from zephon.ops.batching import batch
from zephon.ops.chat import ChatTemplate, TokenizeChat, tokenize_chat
from zephon.ops.children import pack_meta, spawn_child, tombstone_meta, tombstones_for_record
from zephon.ops.images import (
    center_crop,
    decode_images,
    normalize,
    random_flip,
    random_resized_crop,
    resize_images,
)
from zephon.ops.mixture import MIXTURE_DROP_TAG, EnsureMixture, ensure_mixture
from zephon.ops.packing import PackFlat, PackSequences, pack_flat, pack_sequences
from zephon.ops.shuffle import Shuffle, shuffle
from zephon.ops.tokenize import ByteTokenizer, Tokenize, tokenize
from zephon.ops.training import TrainingCollate, training_collate
from zephon.ops.vision import (
    ImageTokenCounter,
    TokenizeInterleaved,
    image_token_counter,
    tokenize_interleaved,
)

__all__ = [
    "MIXTURE_DROP_TAG",
    "ByteTokenizer",
    "ChatTemplate",
    "EnsureMixture",
    "ImageTokenCounter",
    "OpTraits",
    "Operator",
    "OperatorContext",
    "PackFlat",
    "PackSequences",
    "Shuffle",
    "Tokenize",
    "TokenizeChat",
    "TokenizeInterleaved",
    "TrainingCollate",
    "batch",
    "center_crop",
    "decode_images",
    "ensure_mixture",
    "fetch",
    "filter_records",
    "image_token_counter",
    "map_batch",
    "map_transform",
    "normalize",
    "pack_flat",
    "pack_meta",
    "pack_sequences",
    "random_flip",
    "random_resized_crop",
    "resize_images",
    "shuffle",
    "spawn_child",
    "tokenize",
    "tokenize_chat",
    "tokenize_interleaved",
    "tombstone_meta",
    "tombstones_for_record",
    "training_collate",
]
