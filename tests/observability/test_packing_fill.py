"""A packer's fill (the share of its rows' tokens that are real tokens) in stats(), as metrics
and in the metrics log, checked against the rows the training loop received."""

from __future__ import annotations

import urllib.request
import warnings
from pathlib import Path

import numpy as np
import pytest

import zephon
from zephon.observability import MetricsLog, read_metrics_log, serve_metrics
from zephon.ops import batch, fetch, pack_sequences, tokenize
from zephon.sources import ListSource

prometheus_parser = pytest.importorskip("prometheus_client.parser")
pytestmark = pytest.mark.usefixtures("no_leftover_workers")

SEQ_LEN = 64


def texts(n: int) -> ListSource:
    return ListSource([{"text": f"doc {i} " + "word " * (i % 41)} for i in range(n)], chunk_size=32)


def drained(loader) -> tuple[int, int]:
    """Rows delivered, and the real tokens in them (segment id not 0)."""
    rows = real = 0
    for b in loader:
        segments = np.asarray(b.payload["segment_ids"])
        assert segments.shape[1] == SEQ_LEN
        rows += segments.shape[0]
        real += int(np.count_nonzero(segments))
    return rows, real


def test_the_fill_in_stats_the_scrape_and_the_log_is_the_delivered_rows_on_process_lanes(
    tmp_path: Path,
):
    pipeline = zephon.Pipeline(
        texts(900),
        [fetch(), tokenize(), pack_sequences(SEQ_LEN), batch(4)],
        lanes=2,
        workers="process",
    )
    log = tmp_path / "run.jsonl"
    with (
        pipeline.iter() as loader,
        serve_metrics(loader) as server,
        MetricsLog(loader, log) as metrics,
    ):
        rows, real = drained(loader)
        packer = loader.stats()["operators"]["pack_sequences"]
        with urllib.request.urlopen(server.url, timeout=30) as reply:
            text = reply.read().decode()
        metrics.write()
    assert 0 < real < rows * SEQ_LEN  # some padding, or the test shows nothing
    assert packer["rows"] == rows
    assert packer["real_tokens"] == real
    assert packer["row_tokens"] == rows * SEQ_LEN
    assert packer["fill"] == real / (rows * SEQ_LEN)
    got = {
        (s.name, s.labels.get("operator")): s.value
        for family in prometheus_parser.text_string_to_metric_families(text)
        for s in family.samples
    }
    assert got["zephon_packing_fill", "pack_sequences"] == packer["fill"]
    assert got["zephon_packed_rows_total", "pack_sequences"] == rows
    assert got["zephon_packed_real_tokens_total", "pack_sequences"] == real
    assert got["zephon_packed_row_tokens_total", "pack_sequences"] == rows * SEQ_LEN
    assert ("zephon_packing_fill", "tokenize(eos=256 '<eos>', pad=257 '<pad>')") not in got
    last = read_metrics_log(log)[-1]["stats"]["operators"]["pack_sequences"]
    assert last["fill"] == packer["fill"]


def test_a_packer_per_group_counts_the_rows_of_every_group():
    pipeline = zephon.Pipeline(
        texts(500),
        [
            fetch(),
            tokenize(),
            pack_sequences(SEQ_LEN, group_by=lambda p: len(p["tokens"]) % 3),
            batch(4),
        ],
        lanes=2,
    )
    with pipeline.iter() as loader:
        rows, real = drained(loader)
        packer = loader.stats()["operators"]["pack_sequences"]
        text = loader.explain()
    assert (packer["rows"], packer["real_tokens"]) == (rows, real)
    assert packer["fill"] == real / (rows * SEQ_LEN)
    assert f"pack_sequences fills {real / (rows * SEQ_LEN):.1%} of its rows' tokens" in text


def test_operators_without_counters_have_no_fill():
    pipeline = zephon.Pipeline(texts(100), [fetch(), tokenize(), batch(4)], lanes=2)
    with pipeline.iter() as loader:
        for _ in loader:
            pass
        (entry,) = loader.stats()["operators"].values()
    assert set(entry) == {"records_in", "items_out", "seconds"}


@pytest.mark.parametrize("lanes", [2, 3])
def test_after_a_restore_the_packer_counts_the_rows_it_replayed_and_the_rows_delivered(lanes):
    def pipeline(n_lanes: int) -> zephon.Pipeline:
        return zephon.Pipeline(
            texts(900),
            [fetch(), tokenize(), pack_sequences(SEQ_LEN), batch(4)],
            lanes=n_lanes,
            relane=True,
        )

    with pipeline(2).iter() as loader:
        for _ in zip(range(25), loader):
            pass
        state = loader.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", zephon.RelaneWarning)  # onto 3 lanes: said, and meant
        resumed = pipeline(lanes).iter(state=state)
    with resumed as loader:
        rows, _ = drained(loader)
        stats = loader.stats()
    packer = stats["operators"]["pack_sequences"]
    # every row the packers made since the restore: swallowed by the replay, or delivered
    assert packer["rows"] == rows + stats["replayed"]
    assert packer["fill"] == packer["real_tokens"] / (packer["rows"] * SEQ_LEN)
