"""The sides the pipeline ratios time (``zephon.bench.pipeline.ratio_sides``) do the same work."""

from __future__ import annotations

import pytest

from zephon.bench import pipeline as pb


def test_every_side_delivers_the_same_batches_of_the_same_records():
    n = 1000  # not a multiple of the batch size: the last batch is short on every side
    sides = pb.ratio_sides(n)
    trivial = list(sides["trivial"]())
    bare = list(sides["bare"]())
    assert [b.payload for b in trivial] == bare == [32] * (n // 32) + [n % 32]
    default = [b.payload for b in sides["default"]()]
    bare_default = list(sides["bare_default"]())
    assert len(default) == len(bare_default) == len(bare)
    for ours, theirs in zip(default, bare_default, strict=True):
        assert ours.keys() == theirs.keys() == {"idx", "square"}
        assert (ours["idx"] == theirs["idx"]).all() and (ours["square"] == theirs["square"]).all()


def test_without_batch_both_sides_give_the_same_payloads_one_by_one():
    n = 1000
    ours = [r.payload for r in pb.overhead_pipeline(n, batch_size=None)]
    assert ours == list(pb.bare_chain(n, batch_size=None))
    assert ours == [{"idx": i, "square": i * i} for i in range(n)]


def test_run_side_names_a_side_it_does_not_know():
    with pytest.raises(KeyError):
        pb.run_side("no such side", 10)


def test_the_map_pipeline_against_the_pypi_zephon_counts_every_record_of_ours():
    from zephon.bench import pypi_pipeline

    rate, delivered = pypi_pipeline.ours_records_per_second(1000)
    assert delivered == 1000 and rate > 0


def test_the_pypi_zephon_runs_only_the_runners_its_rows_name():
    from zephon.bench import pypi_pipeline

    with pytest.raises(ValueError, match="runner must be one of"):
        pypi_pipeline.pypi_records_per_second(1024, "python", "threads")


def test_without_the_pypi_interpreter_its_rows_say_they_were_not_measured(monkeypatch):
    from zephon.bench import report

    monkeypatch.delenv("ZEPHON_PYPI_PYTHON", raising=False)
    (row,) = report.pypi_rows(quick=True)
    assert row.passed is None and "not measured" in row.baseline


def test_the_text_pipeline_against_the_pypi_zephon_delivers_every_token_of_ours():
    from zephon.bench import pypi_text
    from zephon.ops import ByteTokenizer

    texts = [f"document {i} " * (1 + i % 700) for i in range(2048)]
    rate, delivered = pypi_text.ours_tokens_per_second(texts, ByteTokenizer())
    # Every byte and one end-of-sequence id per document; some are longer than a row of 2048.
    assert delivered == sum(len(t.encode()) + 1 for t in texts) and rate > 0


def test_the_pypi_zephon_gets_whole_chunks_of_the_corpus(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from zephon.bench import pypi_text

    texts = [f"text {i}" for i in range(2500)]
    pq.write_table(pa.table({"text": texts}), tmp_path / "corpus.parquet")
    assert pypi_text.corpus_documents(str(tmp_path / "corpus.parquet")) == texts[:2048]


def test_grains_text_maps_cut_every_document_into_rows_in_order():
    import numpy as np

    from zephon.bench import text as tb

    docs = [np.arange(n, dtype=np.int32) for n in (1, tb.SEQ_LEN, tb.SEQ_LEN + 1, 5000)]
    rows = [r["tokens"] for r in tb._GrainSplitMany().flat_map(docs)]
    assert [len(r) for r in rows] == [1, 2048, 2048, 1, 2048, 2048, 904]
    assert np.array_equal(np.concatenate(rows), np.concatenate(docs))


def test_grains_text_maps_tokenize_as_many_tokens_as_the_pipeline_delivers(tmp_path, monkeypatch):
    from zephon.bench import text as tb

    monkeypatch.setenv("ZEPHON_BENCH_CACHE", str(tmp_path))
    data, tok_path = tb.corpus(0.25)
    rows = tb._ParquetRows(data)
    encode = tb._GrainEncodeMany(tok_path)
    pieces = [
        piece["tokens"]
        for start in range(0, len(rows), tb.ROW_GROUP)
        for piece in tb._GrainSplitMany().flat_map(
            encode([rows[i] for i in range(start, min(start + tb.ROW_GROUP, len(rows)))])
        )
    ]
    ours = tb.run_pipeline(tb.text_pipeline(data, tb.load_tokenizer(tok_path)))
    assert all(0 < len(p) <= tb.SEQ_LEN for p in pieces)
    assert sum(len(p) for p in pieces) == ours["tokens"] > 0


def test_two_lanes_are_judged_only_where_the_machine_has_two_free_cores():
    from zephon.bench import report

    assert report._two_core_verdict(1.7, ceiling=1.95) is True
    assert report._two_core_verdict(1.5, ceiling=1.95) is False
    # The machine's own two processes reached 1.46x one: its second core was busy.
    assert report._two_core_verdict(1.49, ceiling=1.46) is None
    assert report._two_core_verdict(1.7, ceiling=1.46) is None
