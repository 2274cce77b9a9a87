"""Running plans: lane runners, delivery bookkeeping, the replay filter and checkpoint state."""
