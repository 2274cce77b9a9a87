from zephon.ops import Operator, OpTraits, spawn_child, tombstones_for_record
from zephon.types import SampleRecord


class SplitParagraphs(Operator):
    """One record per non-empty paragraph of payload["text"]; a text with none is dropped."""

    traits = OpTraits(preserves_cursor_order=True)  # 1 -> N, in order, no state

    def process_many(self, records):
        out = []
        for rec in records:
            parts = [p for p in rec.payload["text"].split("\n\n") if p.strip()]
            if not parts:
                out.extend(tombstones_for_record(rec))  # we drop it, so we owe its tombstones
                continue
            for i, text in enumerate(parts):
                meta = spawn_child(rec.meta, i, is_last_child=i == len(parts) - 1)
                out.append(SampleRecord(meta, {**rec.payload, "text": text}))
        return out
