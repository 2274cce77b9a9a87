"""From a lane's item lists to batches: replay, bookkeeping, skips, the final batcher."""
