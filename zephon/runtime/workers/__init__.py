"""Where a lane runs (the caller's thread, a worker thread, a worker process), how it is fed,
and how its worker is stopped."""
