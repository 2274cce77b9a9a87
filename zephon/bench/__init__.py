"""Benchmark workloads shared by ``asv_bench/`` and ``zephon bench``: plain functions that
build a workload, run it and return numbers; nothing here runs at import."""
