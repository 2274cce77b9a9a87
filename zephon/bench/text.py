"""The text pipeline: Parquet documents -> tokenize (a local BPE) -> pack to 2048 -> batch 8,
against baselines run in the same process.

- the corpus: the Python standard library's ``.py`` files, one document per file cut at blank
  lines into pieces of at least ``PIECE_CHARS`` characters, written to Parquet (row groups of
  1,024) under a cache directory, with an 8k byte-level BPE trained on it by HF ``tokenizers``;
- end to end: the pipeline's tokens/s against the bare limit, ``pyarrow`` reading the same row
  groups and ``Tokenizer.encode_batch`` on each (no records, no packing), and against Grain
  doing the same work (``grain_text_pipeline``: the same reads, tokenizer calls and packing
  budget);
- fill at 2048: ``pack_sequences(2048)`` on the corpus' token counts, as packed rows deliver;
  and on a second corpus of the same files left whole, one document per file
  (``file_payloads``), where almost half the documents are longer than a row;
- lanes: two process lanes against one inline lane (tokenizer threads off, and on), time, first
  batch and memory (PSS of the loader and every worker process), each run in a fresh process;
- restore: at steps across the run, as after a preemption (a new pipeline, ``iter(state)`` +
  the first ``next()``), inline and with process lanes, and Grain's restore of the same work
  (in its process, and with ``mp_prefetch`` workers).

Functions only; ``zephon bench`` (``report.py``) and the asv suite call them.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

import zephon
from zephon.ops import batch, fetch, pack_sequences, tokenize
from zephon.sources.arrow import ArrowSource

__all__ = [
    "SEQ_LEN",
    "STEADY_FROM",
    "alternating_runs",
    "bare_limit",
    "corpus",
    "end_to_end",
    "file_payloads",
    "fill_versus_grain",
    "grain_text_pipeline",
    "grain_tokens",
    "load_tokenizer",
    "measure_in_fresh_process",
    "median_runs",
    "run_pipeline",
    "text_pipeline",
    "token_payloads",
    "versus_grain",
]

SEQ_LEN = 2048
BATCH = 8
VOCAB = 8192
PIECE_CHARS = 2000
ROW_GROUP = 1024


def _cache_dir() -> Path:
    where = Path(os.environ.get("ZEPHON_BENCH_CACHE", Path(tempfile.gettempdir()) / "zephon-bench"))
    where.mkdir(parents=True, exist_ok=True)
    return where


def _source_files(limit_bytes: int) -> list[str]:
    """The standard library's ``.py`` files, whole, in sorted path order, until ``limit_bytes``
    of them are read."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    total = 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        texts.append(text)
        total += len(text.encode())
        if total >= limit_bytes:
            break
    return texts


def _documents(limit_bytes: int) -> list[str]:
    """The corpus' documents: each of ``_source_files`` cut at blank lines into pieces of at least
    ``PIECE_CHARS`` characters (the last piece of a file may be shorter)."""
    docs: list[str] = []
    for text in _source_files(limit_bytes):
        piece: list[str] = []
        size = 0
        for block in text.split("\n\n"):
            piece.append(block)
            size += len(block) + 2
            if size >= PIECE_CHARS:
                docs.append("\n\n".join(piece))
                piece, size = [], 0
        if piece:
            docs.append("\n\n".join(piece))
    return docs


def corpus(megabytes: float = 32.0) -> tuple[str, str]:
    """Paths of the Parquet corpus (about ``megabytes`` MB of text) and of its BPE tokenizer,
    built once and cached (``ZEPHON_BENCH_CACHE``, else a temporary directory)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tag = f"stdlib-{megabytes:g}mb"
    where = _cache_dir()
    data, tok = where / f"{tag}.parquet", where / f"{tag}-bpe{VOCAB}.json"
    if not data.exists() or not tok.exists():
        docs = _documents(int(megabytes * 1e6))
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        bpe = Tokenizer(models.BPE(unk_token=None))
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=VOCAB,
            special_tokens=["<|endoftext|>", "<pad>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        bpe.train_from_iterator(docs[: max(1, len(docs) // 4)], trainer)
        tmp = tok.with_suffix(".tmp")
        bpe.save(str(tmp))
        os.replace(tmp, tok)
        tmp = data.with_suffix(".tmp")
        pq.write_table(pa.table({"text": docs}), tmp, row_group_size=ROW_GROUP)
        os.replace(tmp, data)
    return str(data), str(tok)


def load_tokenizer(path: str) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


def text_pipeline(
    data: str,
    tokenizer: Any,
    *,
    lanes: int = 1,
    workers: str = "inline",
    micro_batch: int | None = None,
) -> zephon.Pipeline:
    """``fetch -> tokenize -> pack_sequences(2048) -> batch(8)`` over the Parquet corpus (the
    pipeline's default ``micro_batch`` unless given)."""
    options: dict[str, Any] = {} if micro_batch is None else {"micro_batch": micro_batch}
    return zephon.Pipeline(
        ArrowSource(data, columns=["text"], chunk_size=ROW_GROUP),
        [fetch(), tokenize(tokenizer), pack_sequences(SEQ_LEN), batch(BATCH)],
        lanes=lanes,
        workers=workers,
        **options,
    )


def bare_limit(data: str, tokenizer: Any) -> int:
    """The limit: read every row group with pyarrow and ``encode_batch`` it (``_fast``, without
    offsets, where the tokenizer has it); the token count."""
    import pyarrow.parquet as pq

    n = 0
    with pq.ParquetFile(data) as f:
        for g in range(f.num_row_groups):
            texts = f.read_row_group(g, columns=["text"]).column(0).to_pylist()
            encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
            n += sum(len(e.ids) + 1 for e in encode(texts))  # + the eos
    return n


def end_to_end(data: str, tokenizer: str, rounds: int) -> dict[str, Any]:
    """The pipeline on one inline lane against ``bare_limit``, ``rounds`` rounds in turns in this
    process (both on one tokenizer, loaded from ``tokenizer``, and so on one thread pool): each
    round's tokens/s of the bare loop, of the pipeline with the bare loop's call size
    (``micro_batch=ROW_GROUP``: the tokenizer gets as many texts a call) and with the default
    ``micro_batch`` (``rounds``: bare, ours, default), their medians, and the median of each
    round's ratio to that round's bare loop (paired: the machine's speed drifts between rounds
    more than the gap between the two)."""
    tok = load_tokenizer(tokenizer)
    runs = []
    for _ in range(rounds):
        start = time.perf_counter()
        n_tokens = bare_limit(data, tok)
        bare = n_tokens / (time.perf_counter() - start)
        rates = [
            run["tokens"] / run["seconds"]
            for run in (
                run_pipeline(text_pipeline(data, tok, micro_batch=ROW_GROUP)),
                run_pipeline(text_pipeline(data, tok)),
            )
        ]
        runs.append((bare, *rates))
    bare, ours, default = (statistics.median(side) for side in zip(*runs))
    return {
        "bare": bare,
        "ours": ours,
        "ratio": statistics.median(o / b for b, o, _ in runs),
        "default": default,
        "default_ratio": statistics.median(d / b for b, _, d in runs),
        "rounds": runs,
    }


def run_pipeline(pipeline: zephon.Pipeline, *, state: Any = None) -> dict[str, float]:
    """Deliver everything: seconds to the first batch and in all, batches, tokens and fill."""
    start = time.perf_counter()
    loader = pipeline.iter(state=state)
    first = None
    rows = tokens = 0
    with loader:
        for b in loader:
            if first is None:
                first = time.perf_counter() - start
            seg = b.payload["segment_ids"]
            rows += len(seg)
            tokens += int((seg > 0).sum())
    total = time.perf_counter() - start
    return {
        "seconds": total,
        "first_batch": first or total,
        "rows": rows,
        "tokens": tokens,
        "fill": tokens / (rows * SEQ_LEN) if rows else 0.0,
    }


#: The batch from which a run counts as started (``steady_seconds``): workers, the fork server and
#: the first reads are behind it.
STEADY_FROM = 50


def _pss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _descendants(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            continue
        for kid in kids:
            out.append(kid)
            out.extend(_descendants(kid))
    return out


def _child(config: dict[str, Any]) -> None:
    """In a fresh interpreter: run one configuration, print seconds, first batch and (with
    ``config["memory"]``) memory."""
    data, tok = config["data"], config["tokenizer"]
    pipeline = text_pipeline(
        data, load_tokenizer(tok), lanes=config["lanes"], workers=config["workers"]
    )
    result: dict[str, Any] = {}
    if config.get("restore_steps"):
        result.update(_restores(pipeline, config))
    else:
        peak = peak_loader = 0

        def sample() -> None:
            nonlocal peak, peak_loader
            me = os.getpid()
            loader = _pss_bytes(me)
            total = loader + sum(_pss_bytes(p) for p in _descendants(me))
            if total > peak:
                peak, peak_loader = total, loader

        memory = config.get("memory", True)
        # The modules, the tokenizer: nothing read yet.
        before = _pss_bytes(os.getpid()) if memory else 0
        start = time.perf_counter()
        loader = pipeline.iter()
        first = None
        steady_from = None
        count = 0
        with loader:
            for _ in loader:
                if first is None:
                    first = time.perf_counter() - start
                count += 1
                if count == STEADY_FROM:
                    steady_from = time.perf_counter()
                # Reading every process's PSS takes the loader tens of milliseconds with
                # workers: only in runs whose memory is reported.
                if memory and count % 64 == 1:
                    sample()
        end = time.perf_counter()
        result.update(
            seconds=end - start,
            first_batch=first,
            after_first=end - start - (first or 0.0),
            steady_seconds=end - (steady_from or start),
            pss=peak,
            pss_loader=peak_loader,
            pss_before=before,
        )
    print(json.dumps(result))


def _restores(pipeline: zephon.Pipeline, config: dict[str, Any]) -> dict[str, Any]:
    """One uninterrupted run, its state taken at each of ``restore_steps`` (and the seconds it
    took to get there); then, per state, a restart as after a preemption: a new pipeline (the
    tokenizer loaded again) and ``iter(state)`` + the first ``next()``, checked against the
    batch the uninterrupted run delivered next."""
    import numpy as np

    steps = sorted(config["restore_steps"])
    with pipeline.iter() as loader:
        reach, states, expected = _run_to_steps(
            loader,
            steps,
            lambda: json.loads(json.dumps(loader.state_dict())),
            lambda b: b.payload["tokens"],
        )
    restore = []
    for state, want in zip(states, expected, strict=True):
        start = time.perf_counter()
        again = text_pipeline(
            config["data"],
            load_tokenizer(config["tokenizer"]),
            lanes=config["lanes"],
            workers=config["workers"],
        )
        with again.iter(state=state) as resumed:
            got = next(resumed).payload["tokens"]
            restore.append(time.perf_counter() - start)
        if not np.array_equal(got, want):
            raise AssertionError("the restored run did not deliver the batch the run delivered")
    return {"steps": steps, "reach": reach, "restore": restore}


def _run_to_steps(
    loader: Any, steps: list[int], state: Any, tokens: Any
) -> tuple[list[float], list[Any], list[Any]]:
    """Batches up to the last of ``steps``: at each, the seconds since the start, ``state()``
    and the tokens of the batch that comes next."""
    reach, states, expected = [], [], []
    start = time.perf_counter()
    for step, b in enumerate(loader):
        if step in steps:  # ``step`` batches were delivered before this one
            expected.append(tokens(b))
        if step + 1 in steps:
            reach.append(time.perf_counter() - start)
            states.append(state())
        if step + 1 > steps[-1] and len(expected) == len(steps):
            break
    return reach, states, expected


def _grain_child(config: dict[str, Any]) -> None:
    """``_restores`` for Grain on the same work: the corpus' rows (read lazily by row group),
    ``map`` tokenizing each document, ``BestFitPackIterDataset`` (64 bins of 2048), ``batch(8)``;
    in this process (``workers=0``) or ``mp_prefetch`` with ``workers`` processes."""
    import grain
    import numpy as np
    from grain.experimental import BestFitPackIterDataset, FlatMapIterDataset

    def build() -> Any:
        options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
        ds = grain.MapDataset.source(_ParquetRows(config["data"])).to_iter_dataset(options)
        ds = FlatMapIterDataset(ds.map(_GrainTokenize(config["tokenizer"])), _GrainSplit())
        ds = BestFitPackIterDataset(
            ds, length_struct={"tokens": SEQ_LEN}, num_packing_bins=64, shuffle_bins=False
        ).batch(BATCH)
        if config["workers"]:
            ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=config["workers"]))
        return ds

    steps = sorted(config["restore_steps"])
    loader = iter(build())
    reach, states, expected = _run_to_steps(loader, steps, loader.get_state, lambda b: b["tokens"])
    del loader
    restore = []
    for state, want in zip(states, expected, strict=True):
        start = time.perf_counter()
        resumed = iter(build())
        resumed.set_state(state)
        got = next(resumed)["tokens"]
        restore.append(time.perf_counter() - start)
        del resumed
        if not np.array_equal(got, want):
            raise AssertionError("Grain's restored run did not deliver the batch it delivered")
    print(json.dumps({"steps": steps, "reach": reach, "restore": restore}))


class _ParquetRows:
    """The corpus' rows by index for Grain (``__len__``/``__getitem__``), each row group read
    when first needed, in whichever process reads."""

    def __init__(self, path: str):
        import pyarrow.parquet as pq

        self.path = path
        self.rows = pq.ParquetFile(path).metadata.num_rows
        self._group: tuple[int, list[str]] = (-1, [])

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, i: int) -> dict[str, str]:
        import pyarrow.parquet as pq

        g, j = divmod(int(i), ROW_GROUP)
        if self._group[0] != g:
            with pq.ParquetFile(self.path) as f:
                self._group = (g, f.read_row_group(g, columns=["text"]).column(0).to_pylist())
        return {"text": self._group[1][j]}

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "rows": self.rows, "_group": (-1, [])}


class _TokenizerAt:
    """A Grain map's tokenizer, by its path: loaded once, in the process that maps, and never
    pickled with the map."""

    def __init__(self, path: str):
        self.path = path
        self._tok: Any = None

    def tokenizer(self) -> Any:
        if self._tok is None:
            self._tok = load_tokenizer(self.path)
        return self._tok

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "_tok": None}


class _GrainTokenize(_TokenizerAt):
    """Grain's map: a document's ids and the eos as ``int32``."""

    def __call__(self, row: dict[str, str]) -> dict[str, Any]:
        import numpy as np

        if self._tok is None:
            self._eos = self.tokenizer().token_to_id("<|endoftext|>")
        ids = self._tok.encode(row["text"]).ids
        return {"tokens": np.array([*ids, self._eos], dtype=np.int32)}


def _cut_to_rows(tokens: Any) -> list[dict[str, Any]]:
    """A document's tokens cut into rows of at most ``SEQ_LEN`` (Grain's packers refuse longer
    ones), as ``pack_sequences`` cuts it."""
    return [{"tokens": tokens[i : i + SEQ_LEN]} for i in range(0, len(tokens), SEQ_LEN)]


class _GrainSplit:
    """Grain's flat map cutting a document into rows (``_cut_to_rows``)."""

    max_fan_out = 4096

    def flat_map(self, element: dict[str, Any]) -> list[dict[str, Any]]:
        return _cut_to_rows(element["tokens"])


class _GrainEncodeMany(_TokenizerAt):
    """Grain's map on a batch of rows: each document's ids and the eos as ``int32``, from one
    batch call (``_token_arrays``)."""

    def __call__(self, rows: list[dict[str, str]]) -> list[Any]:
        return _token_arrays(self.tokenizer(), [row["text"] for row in rows])


class _GrainSplitMany:
    """``_GrainSplit`` for a batch of documents: every document's rows, in order."""

    max_fan_out = 1 << 20

    def flat_map(self, documents: list[Any]) -> list[dict[str, Any]]:
        return [row for tokens in documents for row in _cut_to_rows(tokens)]


def grain_text_pipeline(data: str, tokenizer: str, *, batched: bool = True) -> Any:
    """Grain on the end-to-end work, in this process and its thread (``_ParquetRows`` keeps one
    row group for the thread that reads it): the corpus' rows, tokenized a row group at a time
    (``batch(ROW_GROUP)`` then one ``encode_batch_fast`` call, as the bare limit calls it) or
    one document at a time (``batched=False``), cut into rows of at most ``SEQ_LEN``,
    ``BestFitPackIterDataset`` (64 bins of ``SEQ_LEN``), ``batch(BATCH)``."""
    import grain
    from grain.experimental import BestFitPackIterDataset, FlatMapIterDataset

    options = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    rows = grain.MapDataset.source(_ParquetRows(data))
    if batched:
        ds = rows.batch(ROW_GROUP, batch_fn=list).map(_GrainEncodeMany(tokenizer))
        docs = FlatMapIterDataset(ds.to_iter_dataset(options), _GrainSplitMany())
    else:
        ds = rows.to_iter_dataset(options).map(_GrainTokenize(tokenizer))
        docs = FlatMapIterDataset(ds, _GrainSplit())
    return BestFitPackIterDataset(
        docs, length_struct={"tokens": SEQ_LEN}, num_packing_bins=64, shuffle_bins=False
    ).batch(BATCH)


def grain_tokens(dataset: Any) -> dict[str, float]:
    """Every batch of a Grain text pipeline: the seconds and the real tokens it packed."""
    start = time.perf_counter()
    tokens = sum(int((b["tokens_segment_ids"] > 0).sum()) for b in dataset)
    return {"seconds": time.perf_counter() - start, "tokens": tokens}


def versus_grain(data: str, tokenizer: str, rounds: int) -> dict[str, Any] | None:
    """The pipeline on one inline lane (``micro_batch=ROW_GROUP``) against
    ``grain_text_pipeline`` (row groups batched, and one document at a time), ``rounds`` rounds
    in turns in this process: each side's median tokens/s, the median of each round's ratio,
    and each side's token count (``tokens``); None without grain."""
    try:
        import grain  # noqa: F401
    except ImportError:
        return None
    tok = load_tokenizer(tokenizer)
    rates: dict[str, list[float]] = {"ours": [], "grain": [], "per_document": []}
    counts: dict[str, int] = {}
    for _ in range(rounds):
        runs = {
            "ours": run_pipeline(text_pipeline(data, tok, micro_batch=ROW_GROUP)),
            "grain": grain_tokens(grain_text_pipeline(data, tokenizer)),
            "per_document": grain_tokens(grain_text_pipeline(data, tokenizer, batched=False)),
        }
        for side, run in runs.items():
            rates[side].append(run["tokens"] / run["seconds"])
            counts[side] = int(run["tokens"])
    return {
        **{side: statistics.median(r) for side, r in rates.items()},
        "ratio": statistics.median(o / g for o, g in zip(rates["ours"], rates["grain"])),
        "per_document_ratio": statistics.median(
            o / g for o, g in zip(rates["ours"], rates["per_document"])
        ),
        "tokens": counts,
    }


def measure_in_fresh_process(
    data: str,
    tokenizer: str,
    *,
    lanes: int,
    workers: str,
    threads: bool,
    restore_steps: list[int] | None = None,
    grain_workers: int | None = None,
    memory: bool = True,
) -> dict[str, Any]:
    """One configuration in a fresh interpreter (so each starts its own fork server and nothing
    of an earlier run is in its memory). ``threads=False`` sets ``TOKENIZERS_PARALLELISM=false``
    for the whole run; ``True`` leaves the tokenizer's thread pool to zephon's sizing. With
    ``restore_steps``, restore times instead (``_restores``); with ``grain_workers`` as well,
    Grain's (``_grain_child``). ``memory=False`` leaves memory unsampled (``pss`` 0)."""
    # The directory holding this copy of zephon: the child imports the same one.
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    config = {
        "data": data,
        "tokenizer": tokenizer,
        "lanes": lanes,
        "workers": grain_workers if grain_workers is not None else workers,
        "restore_steps": restore_steps or [],
        "memory": memory,
    }
    entry = "_grain_child" if grain_workers is not None else "_child"
    code = (
        f"import sys; sys.path.insert(0, {here!r}); "
        f"from zephon.bench.text import {entry}; {entry}({config!r})"
    )
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    env.pop("TOKENIZERS_PARALLELISM", None)
    if not threads:
        env["TOKENIZERS_PARALLELISM"] = "false"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def memory_bound(inline: dict[str, Any], workers: int) -> tuple[float, float]:
    """The memory ``workers`` process lanes may take, from an inline run's ``_child`` result:
    1.5× what that run held before its first read (modules, the tokenizer), plus one lane's data
    (its peak less that) for each worker, as each holds a whole lane's working set. The bound and
    the lane's data, in bytes."""
    data = inline["pss"] - inline["pss_before"]
    return 1.5 * inline["pss_before"] + workers * data, data


def median_runs(repeats: int, **kwargs: Any) -> dict[str, Any]:
    """Medians over ``repeats`` fresh-process runs of one configuration (per step, for lists)."""
    return _medians([measure_in_fresh_process(**kwargs) for _ in range(repeats)])


#: The times of a run (``_child``) that ``alternating_runs`` compares round by round.
TIMES = ("seconds", "first_batch", "after_first", "steady_seconds")


def alternating_runs(
    repeats: int, first: dict[str, Any], second: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any], dict[str, float]]:
    """``repeats`` rounds of two configurations in turns (fresh processes, ``first`` then
    ``second``), so that both see the machine as it was that round: the medians of each
    (``median_runs``) and, per time of ``TIMES``, the median of the rounds' ``first[time] /
    second[time]`` (above 1 where ``second`` took less)."""
    pairs = [
        (measure_in_fresh_process(**first), measure_in_fresh_process(**second))
        for _ in range(repeats)
    ]
    ratios = {
        time: statistics.median(a[time] / b[time] for a, b in pairs)
        for time in TIMES
        if time in pairs[0][0]
    }
    return _medians([a for a, _ in pairs]), _medians([b for _, b in pairs]), ratios


def _medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        k: [statistics.median(v) for v in zip(*(r[k] for r in runs))]
        if isinstance(runs[0][k], list)
        else statistics.median(r[k] for r in runs)
        for k in runs[0]
    }


def _token_arrays(tokenizer: Any, texts: list[str]) -> list[Any]:
    """``texts`` encoded by ``tokenizer`` in one batch call (``encode_batch_fast`` where it has
    it: the same ids), each an int32 array of its ids with the eos appended."""
    import numpy as np

    eos = tokenizer.token_to_id("<|endoftext|>")
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    return [np.array([*e.ids, eos], dtype=np.int32) for e in encode(texts)]


def token_payloads(data: str, tokenizer: Any) -> list[dict[str, Any]]:
    """The corpus as ``{"tokens": int32[...]}`` payloads (eos appended), for other packers."""
    import pyarrow.parquet as pq

    out = []
    with pq.ParquetFile(data) as f:
        for g in range(f.num_row_groups):
            texts = f.read_row_group(g, columns=["text"]).column(0).to_pylist()
            out += [{"tokens": a} for a in _token_arrays(tokenizer, texts)]
    return out


def file_payloads(megabytes: float, tokenizer: Any) -> list[dict[str, Any]]:
    """The files of ``corpus(megabytes)`` left whole, one document per file, as ``{"tokens":
    int32[...]}`` payloads (eos appended) of the corpus' tokenizer. The token ids are cached
    beside the corpus (``encode_batch`` on 32 MB of whole files takes several seconds)."""
    import numpy as np

    data, _ = corpus(megabytes)
    cache = Path(data).with_suffix(".files.npz")
    if not cache.exists():
        arrays = _token_arrays(tokenizer, _source_files(int(megabytes * 1e6)))
        tmp = cache.with_suffix(".tmp.npz")
        np.savez(tmp, tokens=np.concatenate(arrays), lengths=np.array(list(map(len, arrays))))
        os.replace(tmp, cache)
    with np.load(cache) as saved:
        tokens, lengths = saved["tokens"], saved["lengths"]
    ends = np.cumsum(lengths)
    return [{"tokens": tokens[end - n : end].copy()} for n, end in zip(lengths.tolist(), ends)]


def _median_by_speed(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median ``tokens_per_s`` (its fill and speed belong together)."""
    return sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]


def fill_versus_grain(payloads: list[dict[str, Any]]) -> dict[str, Any]:
    """``pack_sequences(2048)`` best fit with 64 open bins on ``payloads`` (token arrays), documents
    whole and with ``cut_to_fill=True``, against Grain's best fit on the same tokens; three
    alternating rounds, each the run of median speed (``grain`` None without grain)."""
    from zephon.bench.packing import run_grain_pack, run_zephon_pack

    lengths = [len(p["tokens"]) for p in payloads]
    # Grain refuses documents longer than a row: it gets them cut into rows first, which is
    # what pack_sequences does with them (full rows of their own, then the rest).
    pieces = [row for p in payloads for row in _cut_to_rows(p["tokens"])]
    piece_lengths = [len(p["tokens"]) for p in pieces]
    runs: dict[str, list[Any]] = {"grain": [], "whole": [], "cut": []}
    for _ in range(3):  # alternating rounds: one run of each is easily disturbed
        runs["grain"].append(
            run_grain_pack("best_fit", piece_lengths, SEQ_LEN, 64, payloads=pieces)
        )
        for kind in ("whole", "cut"):
            runs[kind].append(
                run_zephon_pack(  # epochs as long as the text pipeline's: 8 chunks of 1,024
                    "best_fit",
                    lengths,
                    SEQ_LEN,
                    64,
                    payloads=payloads,
                    cut_to_fill=kind == "cut",
                    batch_size=8,
                    epoch_sequences=8 * ROW_GROUP,
                )
            )
    out: dict[str, Any] = {
        kind: _median_by_speed(r) for kind, r in runs.items() if r[0] is not None
    }
    out.setdefault("grain", None)
    out["documents"] = len(payloads)
    out["long"] = sum(n > SEQ_LEN for n in lengths)
    return out
