"""Zephon: deterministic, checkpointable data pipelines for ML training loops."""
