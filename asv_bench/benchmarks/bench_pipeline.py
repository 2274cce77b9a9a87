"""Whole pipelines: throughput, the engine's overhead per record, restore and memory.

- ``Throughput``: ``fetch -> map_transform -> batch`` and ``fetch -> tokenize -> pack_sequences ->
  batch`` with 1 and 2 process lanes (and one inline lane);
- ``Overhead``: the map pipeline on one inline lane against a bare generator chain doing the same
  work, with batches and with records one by one; the target is at most 1 µs per record more
  (``track_overhead_per_record``);
- ``Restore``: ``pipeline.iter(state=...)`` + the first ``next()`` at different steps, on the
  monotone and the epoch path; ``state_dict()`` and its size (target: ≤ 16 KiB per lane);
- ``PeakMemory``: peak RSS of long runs (target: flat, ≤ 10 % more at 5M records than at 1M);
- ``TextPipeline``: the text pipeline on 8 MB of standard-library text (see its docstring);
- ``FillAt2048``: fill at 2048 on that text, its pieces and its files whole, against Grain.

The workloads are ``zephon.bench.pipeline``'s, the ones ``zephon bench`` prints.
"""

from __future__ import annotations

from typing import Any

import zephon
from zephon.bench import pipeline as pb
from zephon.ops import batch, fetch
from zephon.sources.memory import RangeSource


class Throughput:
    """Deliver every batch of the map pipeline (200k records) or the packing pipeline (20k
    documents) on one inline lane, one process lane or two process lanes."""

    params = (["map", "pack"], ["inline-1", "process-1", "process-2"])
    param_names = ["pipeline", "lanes"]
    number = 1
    repeat = (1, 5, 60.0)
    timeout = 300

    def setup(self, pipeline: str, lanes: str) -> None:
        workers, count = lanes.split("-")
        if pipeline == "map":
            self.pipeline = pb.overhead_pipeline(200_000, lanes=int(count), workers=workers)
        else:
            self.pipeline = pb.pack_pipeline(20_000, lanes=int(count), workers=workers)
        if workers == "process":  # the fork server starts once, before anything is timed
            pb.drain(iter(pb.overhead_pipeline(16, workers="process")))

    def time_deliver_all(self, pipeline: str, lanes: str) -> None:
        pb.drain(iter(self.pipeline))


class Overhead:
    """The map pipeline (1M records, one inline lane) against the bare generator chain."""

    n = 1_000_000
    number = 1
    repeat = (1, 5, 60.0)
    timeout = 300

    def time_pipeline(self) -> None:
        pb.drain(iter(pb.overhead_pipeline(self.n)))

    def time_bare_chain(self) -> None:
        pb.drain(pb.bare_chain(self.n))

    def track_overhead_per_record(self) -> float:
        """Microseconds per record over the bare chain (median of paired runs); target: ≤ 1."""
        return pb.measure_overhead(200_000, repeats=5)["overhead"] * 1e6

    track_overhead_per_record.unit = "µs"  # type: ignore[attr-defined]

    def track_large_batch_over_bare(self) -> float:
        """The same with batches of ``LARGE_BATCH`` (four reads each), over the bare chain with
        batches of that size; target: ≤ 2."""
        o = pb.measure_overhead(200_000, repeats=5, batch_size=pb.LARGE_BATCH)
        return o["ours"] / o["bare"]

    track_large_batch_over_bare.unit = "x"  # type: ignore[attr-defined]

    def track_records_over_bare(self) -> float:
        """Without ``batch``: the records handed over one by one, over the bare chain yielding
        each mapped payload."""
        o = pb.measure_overhead(200_000, repeats=5, batch_size=None)
        return o["ours"] / o["bare"]

    track_records_over_bare.unit = "x"  # type: ignore[attr-defined]

    def track_speedup_over_grain(self) -> float:
        """Records/s over Grain's checkpointable map-and-batch; target: ≥ 5 (0 without grain)."""
        result = pb.measure_grain(50_000, repeats=3)
        return result["grain"] / result["ours"] if result else 0.0

    track_speedup_over_grain.unit = "x"  # type: ignore[attr-defined]


class Restore:
    """Restore at step 1,000 and at the step nearest 100k and 1M at the same place in its epoch
    (so the same records are replayed): the time must not grow with the step."""

    params = (["monotone", "epoch"], ["1k", "100k", "1M"])
    param_names = ["path", "step"]
    timeout = 600

    def setup_cache(self) -> dict[str, Any]:
        per_epoch = pb.CHUNK_SIZE * 8
        steps = {"1k": 1_000}
        for label, goal in (("100k", 100_000), ("1M", 1_000_000)):
            steps[label] = 1_000 + round((goal - 1_000) / per_epoch) * per_epoch
        return {
            f"{kind}/{label}": pb.checkpoint_at(pb.restore_pipeline(kind), step)
            for kind in ("monotone", "epoch")
            for label, step in steps.items()
        }

    def setup(self, states: dict[str, Any], path: str, step: str) -> None:
        self.pipeline = pb.restore_pipeline(path)
        self.state = states[f"{path}/{step}"]
        self.loader = self.pipeline.iter(state=self.state)
        next(self.loader)  # a live loader one step past the restore, for state_dict()

    def teardown(self, states: dict[str, Any], path: str, step: str) -> None:
        self.loader.close()

    def time_restore_and_first_next(self, states: dict[str, Any], path: str, step: str) -> None:
        loader = self.pipeline.iter(state=self.state)
        next(loader)
        loader.close()

    def time_state_dict(self, states: dict[str, Any], path: str, step: str) -> None:
        self.loader.state_dict()

    def track_state_bytes_per_lane(self, states: dict[str, Any], path: str, step: str) -> float:
        return pb.measure_restore(self.pipeline, self.state, repeats=1)["bytes_per_lane"]

    track_state_bytes_per_lane.unit = "bytes"  # type: ignore[attr-defined]


class PeakMemory:
    """Peak RSS of delivering 1M and 5M records (the map pipeline, and the epoch path with a
    shuffle); asv measures this process, setup included."""

    params = (["monotone", "epoch"], [1_000_000, 5_000_000])
    param_names = ["path", "records"]
    timeout = 600

    def peakmem_deliver(self, path: str, records: int) -> None:
        if path == "monotone":
            pb.drain(iter(pb.overhead_pipeline(records)))
        else:
            from zephon.ops.shuffle import shuffle

            pipeline = zephon.Pipeline(
                RangeSource(records, chunk_size=pb.CHUNK_SIZE),
                [fetch(), shuffle(256, seed=1), batch(pb.BATCH_SIZE)],
            )
            pb.drain(iter(pipeline))


class Lanes:
    """Two process lanes against one on a CPU-heavy pure-Python map; target: ≥ 1.6 on 2 cores.
    ``track_machine_ceiling`` is the same map in two plain processes against one."""

    timeout = 300

    def track_two_lanes_over_one(self) -> float:
        pb.lane_throughput(256, 1)
        return pb.lane_throughput(4096, 2) / pb.lane_throughput(4096, 1)

    track_two_lanes_over_one.unit = "x"  # type: ignore[attr-defined]

    def track_machine_ceiling(self) -> float:
        return pb.process_ceiling(2048)

    track_machine_ceiling.unit = "x"  # type: ignore[attr-defined]


class OverheadRatios:
    """The map pipeline against a bare generator (trivial collate on both; then the default
    collate on ours) and against torchdata.nodes on the same work; targets ≤ 1.5, ≤ 2, ≥ 2.5; and
    the bare chain with the default collate against torchdata, the ceiling of the last."""

    timeout = 300

    def setup_cache(self) -> dict[str, float]:
        return pb.measure_ratios(200_000, repeats=3)

    def track_trivial_collate_over_bare(self, r: dict[str, float]) -> float:
        return r["trivial/bare"]

    track_trivial_collate_over_bare.unit = "x"  # type: ignore[attr-defined]

    def track_default_collate_over_bare(self, r: dict[str, float]) -> float:
        return r["default/bare"]

    track_default_collate_over_bare.unit = "x"  # type: ignore[attr-defined]

    def track_speedup_over_torchdata(self, r: dict[str, float]) -> float:
        return r["torchdata/default"]

    track_speedup_over_torchdata.unit = "x"  # type: ignore[attr-defined]

    def track_bare_chain_over_torchdata(self, r: dict[str, float]) -> float:
        """The ceiling of the row above: a bare generator chain doing the same work."""
        return r["torchdata/bare_default"]

    track_bare_chain_over_torchdata.unit = "x"  # type: ignore[attr-defined]


class TextPipeline:
    """Parquet -> tokenize (8k BPE) -> pack_sequences(2048) -> batch(8) on 8 MB of standard
    library text (``zephon.bench.text``): end to end against the pyarrow + encode_batch limit,
    fill, two process lanes against one inline lane (tokenizer threads off) with the machine's
    two-process ceiling, memory, and restore (worst of several steps, as after a preemption)
    against Grain's and, with process lanes, against inline lanes."""

    timeout = 900

    def setup_cache(self) -> dict[str, float]:
        import time

        from zephon.bench import text as tb

        data, tok_path = tb.corpus(8.0)
        tok = tb.load_tokenizer(tok_path)
        start = time.perf_counter()
        n = tb.bare_limit(data, tok)
        limit = n / (time.perf_counter() - start)
        run = tb.run_pipeline(tb.text_pipeline(data, tok, micro_batch=tb.ROW_GROUP))
        common = {"data": data, "tokenizer": tok_path, "threads": False}
        one = tb.measure_in_fresh_process(lanes=1, workers="inline", **common)
        two = tb.measure_in_fresh_process(lanes=2, workers="process", **common)
        steps = [1, 10, 60, 120]
        restore = {
            (workers, lanes): max(
                tb.measure_in_fresh_process(
                    lanes=lanes, workers=workers, restore_steps=steps, **common
                )["restore"]
            )
            for workers, lanes in (("inline", 1), ("inline", 2), ("process", 2))
        }
        grain = max(
            tb.measure_in_fresh_process(
                lanes=1, workers="inline", restore_steps=steps, grain_workers=0, **common
            )["restore"]
        )
        return {
            "e2e": run["tokens"] / run["seconds"] / limit,
            "fill": run["fill"],
            "lanes": one["seconds"] / two["seconds"],
            "lanes_steady": one["steady_seconds"] / two["steady_seconds"],
            "first_batch": two["first_batch"] / one["first_batch"],
            "memory": two["pss"] / one["pss"],
            "memory_over_bound": two["pss"] / tb.memory_bound(one, 2)[0],
            "ceiling": pb.process_ceiling(2048),
            "restore_inline": restore[("inline", 1)],
            "restore_inline_over_grain": restore[("inline", 1)] / grain,
            "restore_process_minus_inline": restore[("process", 2)] - restore[("inline", 2)],
        }

    def track_end_to_end_over_limit(self, r: dict[str, float]) -> float:
        return r["e2e"]

    track_end_to_end_over_limit.unit = "x"  # type: ignore[attr-defined]

    def track_fill_at_2048(self, r: dict[str, float]) -> float:
        return r["fill"]

    track_fill_at_2048.unit = "fill"  # type: ignore[attr-defined]

    def track_two_process_lanes_over_inline(self, r: dict[str, float]) -> float:
        return r["lanes"]

    track_two_process_lanes_over_inline.unit = "x"  # type: ignore[attr-defined]

    def track_two_process_lanes_over_inline_after_start(self, r: dict[str, float]) -> float:
        return r["lanes_steady"]

    track_two_process_lanes_over_inline_after_start.unit = "x"  # type: ignore[attr-defined]

    def track_machine_ceiling(self, r: dict[str, float]) -> float:
        return r["ceiling"]

    track_machine_ceiling.unit = "x"  # type: ignore[attr-defined]

    def track_first_batch_process_over_inline(self, r: dict[str, float]) -> float:
        return r["first_batch"]

    track_first_batch_process_over_inline.unit = "x"  # type: ignore[attr-defined]

    def track_memory_process_over_inline(self, r: dict[str, float]) -> float:
        return r["memory"]

    track_memory_process_over_inline.unit = "x"  # type: ignore[attr-defined]

    def track_memory_process_over_bound(self, r: dict[str, float]) -> float:
        return r["memory_over_bound"]

    track_memory_process_over_bound.unit = "x"  # type: ignore[attr-defined]

    def track_restore_worst_step_inline(self, r: dict[str, float]) -> float:
        return r["restore_inline"]

    track_restore_worst_step_inline.unit = "s"  # type: ignore[attr-defined]

    def track_restore_inline_over_grain(self, r: dict[str, float]) -> float:
        return r["restore_inline_over_grain"]

    track_restore_inline_over_grain.unit = "x"  # type: ignore[attr-defined]

    def track_restore_process_minus_inline(self, r: dict[str, float]) -> float:
        return r["restore_process_minus_inline"]

    track_restore_process_minus_inline.unit = "s"  # type: ignore[attr-defined]


def _track_corpus(key: str, unit: str) -> Any:
    """An asv ``track_`` method returning number ``key`` of the benchmark's corpus."""

    def track(self: Any, r: dict[str, dict[str, float]], corpus: str) -> float:
        return r[corpus][key]

    track.unit = unit  # type: ignore[attr-defined]
    return track


class FillAt2048:
    """``pack_sequences(2048)`` best fit with 64 open bins on 8 MB of standard-library text
    tokenized by the text pipeline's BPE: the corpus' pieces, and its files left whole (one
    document per file, almost half of them longer than a row). Fill with documents whole against
    Grain's best fit on the same tokens, and with ``cut_to_fill=True`` (target: ≥ 0.99 at ≥ 10×
    Grain's tokens/s)."""

    params = (["pieces", "files"],)
    param_names = ["corpus"]
    timeout = 600

    def setup_cache(self) -> dict[str, dict[str, float]]:
        from zephon.bench import text as tb

        data, tok_path = tb.corpus(8.0)
        tok = tb.load_tokenizer(tok_path)
        out = {}
        for corpus, payloads in (
            ("pieces", tb.token_payloads(data, tok)),
            ("files", tb.file_payloads(8.0, tok)),
        ):
            m = tb.fill_versus_grain(payloads)
            grain = m["grain"] or {"fill": float("nan"), "tokens_per_s": float("nan")}
            out[corpus] = {
                "whole": m["whole"]["fill"],
                "whole_minus_grain": m["whole"]["fill"] - grain["fill"],
                "cut": m["cut"]["fill"],
                "cut_over_grain": m["cut"]["tokens_per_s"] / grain["tokens_per_s"],
            }
        return out

    track_fill_documents_whole = _track_corpus("whole", "fill")
    track_fill_documents_whole_minus_grain = _track_corpus("whole_minus_grain", "fill")
    track_fill_cut_to_fill = _track_corpus("cut", "fill")
    track_cut_to_fill_speedup_over_grain = _track_corpus("cut_over_grain", "x")
