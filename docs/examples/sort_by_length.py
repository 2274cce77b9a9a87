from zephon.ops import Operator, OpTraits


class SortByLength(Operator):
    """Buffers `window` records and emits them shortest first (length bucketing)."""

    traits = OpTraits(preserves_cursor_order=False, stateful=True)

    def __init__(self, window=64, field="tokens"):
        self.window = window  # public attributes are parameters: they enter the fingerprint
        self.field = field
        self._buf = []  # private state does not

    def process_many(self, records):
        self._buf.extend(records)
        return self.flush() if len(self._buf) >= self.window else []

    def flush(self):
        buf, self._buf = self._buf, []
        # Ties broken by cursor, so the order never depends on anything but the input.
        return sorted(buf, key=lambda r: (len(r.payload[self.field]), r.cursor))
